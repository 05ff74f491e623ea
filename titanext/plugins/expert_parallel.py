"""Expert parallelism: the experts of MoE layers split over ranks, tokens sent by all-to-all.

``apply_expert_parallel(model, ep_mesh)`` finds every *experts module* and turns it into an
``ExpertParallel`` module (a ``ParallelStyle`` built on ``distribute_module``): each of its
parameters becomes a DTensor ``Shard(0)`` over ``ep_mesh`` (rank r of W holds experts
``r*E/W .. (r+1)*E/W - 1``) and its call is wrapped in dispatch / combine.

The experts-module protocol (``titanext.models.moe.GroupedExperts`` follows it; so can yours):

- every parameter has the expert index as its first dimension (e.g. w1/w2/w3 of shape
  [num_experts, ...]);
- ``forward(x, num_tokens_per_expert)`` is called with positional arguments: x [N, dim] with
  rows grouped by expert in expert order, ``num_tokens_per_expert`` a LongTensor [experts]
  (rows per expert, summing to N); it returns [N, out_dim] in the same row order, and computes
  as many experts as its parameters' *local* first dimension (use ``p.to_local()`` for DTensor
  parameters). Routing weights are applied by the caller, after the experts module returns.

Dispatch (forward pre-hook), for W = ep ranks and L = E / W local experts:

1. ``all_to_all_single`` of the per-expert counts [E] (equal splits of L): rank r learns how
   many rows every source rank sends to each of its experts;
2. **the one device-to-host sync**: both count vectors are copied to the host at once, since
   ``all_to_all_single`` takes its split sizes as Python lists;
3. ``all_to_all_single`` of the token rows with those uneven splits (the rows arrive in
   (source rank, local expert) order);
4. a local permutation into local-expert order (``repeat_interleave`` with a known output
   size and a stable ``argsort``, on the device: no sync).

Combine (forward hook) is the exact inverse: inverse permutation, then the reverse
``all_to_all_single`` with the two split lists swapped. Backward of each all-to-all is the
all-to-all with swapped splits, and reuses the host lists kept from the forward: the backward
has no sync at all. Where syncs remain: one per dispatch (step 2), once more when activation
checkpointing recomputes the layer, and inside the experts module if it needs host counts
(``GroupedExperts``' per-expert loop does ``tolist()``; its grouped-GEMM path does not).

Under torchrun, with ``ep_mesh`` a 1D DeviceMesh over the ranks that split the experts:

>>> apply_expert_parallel(model, ep_mesh)  # in a process group  # doctest: +SKIP
['layers.1.moe.experts', 'layers.3.moe.experts']

Runnable example with a user's own model: ``examples/expert_parallel.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from titanext._fake_backend import is_fake
from titanext._ranges import EP_ALL_TO_ALL, phase
from titanext.plugins._counting import Counters

__all__ = [
    "ExpertParallel", "apply_expert_parallel", "dispatch_tokens", "combine_tokens", "Route",
    "CommCounter", "count_comm", "is_grouped_experts",
]

# -- communication accounting ----------------------------------------------------------------------


@dataclass
class CommCounter:
    """What this rank sent to *other* ranks in the token all-to-alls (forward and backward)."""

    all_to_alls: int = 0
    rows_sent: int = 0
    bytes_sent: int = 0
    count_exchanges: int = 0
    host_syncs: int = 0


_COUNTERS = Counters(CommCounter)


def count_comm() -> contextlib.AbstractContextManager[CommCounter]:
    """Count EP traffic issued inside the block (tests and ``benchmarks/moe_dispatch.py``)."""
    return _COUNTERS.open()


# -- the differentiable all-to-all -----------------------------------------------------------------


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    with phase(EP_ALL_TO_ALL):  # forward and backward
        dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    if _COUNTERS:
        me = dist.get_rank(group)
        rows = sum(in_splits) - in_splits[me]
        row_bytes = x[0:1].numel() * x.element_size() if x.dim() > 1 else x.element_size()
        for c in _COUNTERS:
            c.all_to_alls += 1
            c.rows_sent += rows
            c.bytes_sent += rows * row_bytes
    return out


class _AllToAll(torch.autograd.Function):
    """Rows ``in_splits[r]`` go to rank r; ``out_splits[r]`` rows come from rank r. The
    backward sends the gradients back with the splits swapped (host lists, no sync)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):  # type: ignore[override]
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(grad, in_splits, out_splits, ctx.group), None, None, None


# -- dispatch / combine ----------------------------------------------------------------------------


@dataclass
class Route:
    """What combine (and both backwards) need from a dispatch: host split lists and the
    device permutation. ``send_splits[r]``: rows this rank sent to ep rank r;
    ``recv_splits[r]``: rows it received from r; ``order``: received-row index of each row of
    the expert input (local-expert order)."""

    send_splits: list[int]
    recv_splits: list[int]
    order: torch.Tensor
    group: dist.ProcessGroup


def _group(ep: DeviceMesh | dist.ProcessGroup) -> dist.ProcessGroup:
    if isinstance(ep, DeviceMesh):
        if ep.ndim != 1:
            raise ValueError(f"expert parallelism needs a 1D ep mesh, got {ep.ndim}D "
                             f"{ep.mesh_dim_names}; pass a flattened view such as dims.ep_mesh")
        return ep.get_group()
    return ep


def dispatch_tokens(x: torch.Tensor, num_tokens_per_expert: torch.Tensor,
                    group: DeviceMesh | dist.ProcessGroup
                    ) -> tuple[torch.Tensor, torch.Tensor, Route]:
    """Send each row of ``x`` (grouped by global expert, in expert order) to the ep rank that
    holds its expert. Returns (rows for this rank's experts in local-expert order, their
    counts per local expert [L], the :class:`Route` for :func:`combine_tokens`).

    Differentiable in ``x``. One device-to-host sync (the split sizes).
    """
    pg = _group(group)
    world = dist.get_world_size(pg)
    counts = num_tokens_per_expert.reshape(-1).to(torch.int64)
    n_exp = counts.numel()
    if n_exp % world:
        raise ValueError(f"{n_exp} experts cannot be split evenly over {world} ep ranks")
    n_local = n_exp // world
    recv = torch.empty_like(counts)
    with phase(EP_ALL_TO_ALL):  # recv[s*L + e]: from s for e
        dist.all_to_all_single(recv, counts.contiguous(), group=pg)
    if is_fake(counts):  # a dry run has no counts: perfectly balanced routing, an estimate
        rows = x.shape[0]
        send_splits = [rows // world + (r < rows % world) for r in range(world)]
        recv_splits = list(send_splits)
    else:
        host = torch.cat([counts, recv]).cpu()  # the one sync
        for c in _COUNTERS:
            c.count_exchanges += 1
            c.host_syncs += 1
        send_splits = host[:n_exp].view(world, n_local).sum(1).tolist()
        recv_splits = host[n_exp:].view(world, n_local).sum(1).tolist()
    if sum(send_splits) != x.shape[0]:
        raise ValueError(f"num_tokens_per_expert sums to {sum(send_splits)} but x has "
                         f"{x.shape[0]} rows")
    received = _AllToAll.apply(x, recv_splits, send_splits, pg)
    # Received rows come as (source rank, local expert) segments; stable-sort them by expert.
    expert_of_segment = torch.arange(n_exp, device=recv.device) % n_local
    labels = torch.repeat_interleave(expert_of_segment, recv, output_size=sum(recv_splits))
    order = torch.argsort(labels, stable=True)
    local_counts = recv.view(world, n_local).sum(0)
    return received.index_select(0, order), local_counts, Route(send_splits, recv_splits, order, pg)


def combine_tokens(y: torch.Tensor, route: Route) -> torch.Tensor:
    """Inverse of :func:`dispatch_tokens`: the expert outputs back to the ranks and row order
    the inputs came from. Differentiable; no sync."""
    inverse = torch.empty_like(route.order)
    inverse[route.order] = torch.arange(route.order.numel(), device=route.order.device)
    back = y.index_select(0, inverse)
    return _AllToAll.apply(back, route.send_splits, route.recv_splits, route.group)


# -- the ParallelStyle -----------------------------------------------------------------------------


class ExpertParallel(ParallelStyle):
    """Shard an experts module's parameters ``Shard(0)`` over a 1D ep mesh and wrap its call in
    :func:`dispatch_tokens` / :func:`combine_tokens`.

    Use it directly with ``parallelize_module(model, ep_mesh, {"layers.*.moe.experts":
    ExpertParallel()})`` or through :func:`apply_expert_parallel`.
    """

    def _partition_fn(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if name:  # distribute_module visits submodules too; the protocol has none with params
            return
        for pname, p in list(module.named_parameters(recurse=False)):
            dist_p = nn.Parameter(distribute_tensor(p, mesh, [Shard(0)]),
                                  requires_grad=p.requires_grad)
            module.register_parameter(pname, dist_p)

    @staticmethod
    def _input_fn(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        if len(inputs) != 2:
            raise TypeError(f"{type(module).__name__} under ExpertParallel must be called as "
                            "experts(x, num_tokens_per_expert) with positional arguments")
        x, counts = inputs
        x_local, local_counts, route = dispatch_tokens(x, counts, mesh)
        module._ep_routes = [*getattr(module, "_ep_routes", []), route]
        return x_local, local_counts

    @staticmethod
    def _output_fn(module: nn.Module, outputs: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        return combine_tokens(outputs, module._ep_routes.pop())

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _group(device_mesh)  # 1D check
        return distribute_module(module, device_mesh, partition_fn=self._partition_fn,
                                 input_fn=self._input_fn, output_fn=self._output_fn)


def is_grouped_experts(name: str, module: nn.Module) -> bool:
    """The default selection: instances of ``titanext.models.moe.GroupedExperts``."""
    try:
        from titanext.models.moe import GroupedExperts
    except ImportError:
        return False
    return isinstance(module, GroupedExperts)


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, *,
                          filter_fn: Callable[[str, nn.Module], bool] | None = None) -> list[str]:
    """Split the experts of every selected experts module over ``ep_mesh``, in place.

    Args:
        model: any module (on the meta device or materialised; a materialised model's expert
            weights are taken from ep rank 0 of each group, as ``distribute_tensor`` does).
        ep_mesh: a 1D mesh; its size must divide every selected module's expert count.
        filter_fn: ``(fqn, module) -> bool`` choosing the experts modules (they must follow
            the protocol in this module's docstring); default :func:`is_grouped_experts`.
            Example: ``filter_fn=lambda fqn, m: isinstance(m, MyExperts)``.

    Returns the FQNs of the modules it converted (nothing happens when ``ep_mesh`` has one
    rank). Apply it after tensor parallelism and before activation checkpointing, compile and
    FSDP. See ``examples/expert_parallel.py``.
    """
    filter_fn = filter_fn or is_grouped_experts
    _group(ep_mesh)
    world = ep_mesh.size()
    chosen = [(fqn, m) for fqn, m in model.named_modules() if filter_fn(fqn, m)]
    for fqn, m in chosen:
        params = list(m.named_parameters(recurse=False))
        if not params or len(params) != len(list(m.parameters())):
            raise ValueError(f"{fqn}: an experts module must hold its expert weights directly "
                             "(parameters with the expert index as dim 0, no submodules with "
                             "parameters)")
        n_exp = {p.shape[0] for _, p in params}
        if len(n_exp) != 1:
            raise ValueError(f"{fqn}: parameters disagree on the expert count (dim 0): "
                             + ", ".join(f"{n} {tuple(p.shape)}" for n, p in params))
        (n,) = n_exp
        if n % world:
            raise ValueError(f"{fqn}: {n} experts cannot be split over ep = {world} ranks; the ep "
                             "degree must divide the number of experts")
    if world == 1:
        return []
    style = ExpertParallel()
    for _, m in chosen:
        style._apply(m, ep_mesh)
    return [fqn for fqn, _ in chosen]
