"""The flat expert-parallel dispatch and combine: every (token, expert) row sent to the ep rank
of its expert by one ``all_to_all_single``, and back (see :mod:`titanext.plugins.expert_parallel`
for the steps and their syncs). Re-exported by ``expert_parallel``; the two-level dispatch
(:mod:`titanext.plugins._ep_two_level`) runs it inside each node."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from titanext._baton_threads import comm_point
from titanext._fake_backend import is_fake
from titanext._profiler_ranges import EP_ALL_TO_ALL, phase
from titanext.plugins._ep_comm import COUNTERS as _COUNTERS
from titanext.plugins._ep_comm import PLAIN, Wire
from titanext.plugins._ep_comm import AllToAll as _AllToAll
from titanext.plugins.expert_replication import ReplicationPlan, dispatch_replicated

__all__ = ["Route", "combine_tokens", "dispatch_tokens", "ep_group"]


@dataclass
class Route:
    """What combine (and both backwards) need from a dispatch: host split lists and the
    device permutation. ``send_splits[r]``: rows this rank sent to ep rank r;
    ``recv_splits[r]``: rows it received from r; ``order``: received-row index of each row of
    the expert input (local-expert order). With replication, ``send_order`` and ``plan`` (see
    :mod:`~titanext.plugins.expert_replication`)."""

    send_splits: list[int]
    recv_splits: list[int]
    order: torch.Tensor
    group: dist.ProcessGroup
    send_order: torch.Tensor | None = None  # with replication: x's rows in sending order
    plan: ReplicationPlan | None = None  # with replication: the copies of this dispatch
    wire: Wire = PLAIN  # node size (counters) and float8 rows of the dispatch


def ep_group(ep: DeviceMesh | dist.ProcessGroup) -> dist.ProcessGroup:
    if isinstance(ep, DeviceMesh):
        if ep.ndim != 1:
            raise ValueError(f"expert parallelism needs a 1D ep mesh, got {ep.ndim}D "
                             f"{ep.mesh_dim_names}; pass a flattened view such as dims.ep_mesh")
        return ep.get_group()
    return ep


def dispatch_tokens(x: torch.Tensor, num_tokens_per_expert: torch.Tensor,
                    group: DeviceMesh | dist.ProcessGroup, replicate_hot_experts: int = 0, *,
                    wire: Wire = PLAIN) -> tuple[torch.Tensor, torch.Tensor, Route]:
    """Send each row of ``x`` (grouped by global expert, in expert order) to the ep rank that
    holds its expert. Returns (rows for this rank's experts in local-expert order, their
    counts per local expert [L], the :class:`Route` for :func:`combine_tokens`).

    Differentiable in ``x``. One device-to-host sync (the split sizes).
    ``replicate_hot_experts`` > 0: up to that many hot experts are copied to the least loaded
    ranks (:mod:`~titanext.plugins.expert_replication`): the counts are all-gathered instead, the
    rows of a copy come after the rank's own experts' (counts [L + copies hosted here]), and
    ``route.plan`` says which weights :func:`~titanext.plugins.expert_replication.copy_experts`
    must fetch. ``wire``: the rows as float8 (``Wire(float8=True)``, see
    :mod:`~titanext.plugins._ep_comm`) and the node size the counters use.
    """
    pg = ep_group(group)
    world = dist.get_world_size(pg)
    counts = num_tokens_per_expert.reshape(-1).to(torch.int64)
    n_exp = counts.numel()
    if n_exp % world:
        raise ValueError(f"{n_exp} experts cannot be split evenly over {world} ep ranks")
    n_local = n_exp // world
    if replicate_hot_experts:
        rows, local, send_order, send, recv_splits, order, plan = dispatch_replicated(
            x, counts, pg, replicate_hot_experts, wire)
        return rows, local, Route(send, recv_splits, order, pg, send_order, plan, wire)
    recv = torch.empty_like(counts)
    counts = counts.contiguous()
    with phase(EP_ALL_TO_ALL):  # recv[s*L + e]: from s for e
        comm_point(lambda async_op: dist.all_to_all_single(recv, counts, group=pg,
                                                           async_op=async_op), hand_over=False)
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
    received = _AllToAll.apply(x, recv_splits, send_splits, pg, "dispatch", wire)
    # Received rows come as (source rank, local expert) segments; stable-sort them by expert.
    expert_of_segment = torch.arange(n_exp, device=recv.device) % n_local
    labels = torch.repeat_interleave(expert_of_segment, recv, output_size=sum(recv_splits))
    order = torch.argsort(labels, stable=True)
    local_counts = recv.view(world, n_local).sum(0)
    return (received.index_select(0, order), local_counts,
            Route(send_splits, recv_splits, order, pg, wire=wire))


def combine_tokens(y: torch.Tensor, route: Route) -> torch.Tensor:
    """Inverse of :func:`dispatch_tokens`: the expert outputs back to the ranks and row order
    the inputs came from. Differentiable; no sync."""
    inverse = torch.empty_like(route.order)
    inverse[route.order] = torch.arange(route.order.numel(), device=route.order.device)
    back = y.index_select(0, inverse)
    out = _AllToAll.apply(back, route.send_splits, route.recv_splits, route.group, "tokens",
                          Wire(route.wire.ranks_per_node))  # the combine is never float8
    if route.send_order is None:
        return out
    unsort = torch.empty_like(route.send_order)
    unsort[route.send_order] = torch.arange(route.send_order.numel(), device=unsort.device)
    return out.index_select(0, unsort)
