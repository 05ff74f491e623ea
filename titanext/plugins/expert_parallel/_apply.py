"""The expert-parallel style and ``apply_expert_parallel`` (the package docstring tells the whole
story: :mod:`titanext.plugins.expert_parallel`)."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from titanext.models.moe import GroupedExperts
from titanext.plugins.expert_parallel._comm import PLAIN, CommCounter, Wire, count_comm
from titanext.plugins.expert_parallel._dispatch import (
    NodeGroups,
    Route,
    TwoLevelRoute,
    combine_tokens,
    combine_two_level,
    dispatch_row_values,
    dispatch_tokens,
    dispatch_two_level,
    node_groups,
)
from titanext.plugins.expert_parallel._dispatch import ep_group as _group
from titanext.plugins.expert_parallel._layouts import follows_experts_protocol
from titanext.plugins.expert_parallel.replication import copy_experts, step_copies
from titanext.plugins.expert_parallel.rules import EP_DISPATCH_MODES, max_replicas_within

__all__ = [
    "ExpertParallel", "apply_expert_parallel", "dispatch_tokens", "combine_tokens", "Route",
    "CommCounter", "count_comm", "is_grouped_experts", "ExpertsLayout", "StackedExperts",
    "ModuleListExperts", "ExpertParallelExperts", "call_experts", "detect_experts_layout",
    "expert_parallel_targets", "EP_DISPATCH_MODES",
]


_NEEDS_ROUTING = ("{} under two-level expert-parallel dispatch sends each token once per node "
                  "and needs its routing: call it as experts(tokens, TokenRouting(top_k_index, "
                  "top_k_weights)) (titanext.models.moe.MoE does when experts.takes_routing is "
                  "set), or use dispatch='flat'")


# -- the ParallelStyle -----------------------------------------------------------------------------


class ExpertParallel(ParallelStyle):
    """Shard an experts module's parameters ``Shard(0)`` over a 1D ep mesh and wrap its call in
    :func:`dispatch_tokens` / :func:`combine_tokens`.

    Use it directly with ``parallelize_module(model, ep_mesh, {"layers.*.moe.experts":
    ExpertParallel()})`` or through :func:`apply_expert_parallel`. ``replicate_hot_experts``:
    see :func:`apply_expert_parallel`; the copies' weights are the module's parameters during
    its forward (``[L + copies, ...]`` local shards, swapped in by the pre-hook and back by the
    post-hook), so its own forward needs no change. ``nodes`` (two-level dispatch) and ``wire``
    (float8 rows, node size): see :func:`apply_expert_parallel`; under two-level dispatch the
    module is called as ``experts(tokens, TokenRouting(ids, weights))`` (the module's
    ``takes_routing`` attribute tells the MoE so) and returns each token's weighted sum.
    """

    def __init__(self, replicate_hot_experts: int = 0, *, nodes: NodeGroups | None = None,
                 wire: Wire = PLAIN):
        super().__init__()
        self.replicate_hot_experts, self.nodes, self.wire = replicate_hot_experts, nodes, wire

    def _partition_fn(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if name:  # distribute_module visits submodules too; the protocol has none with params
            return
        for pname, p in list(module.named_parameters(recurse=False)):
            dist_p = nn.Parameter(distribute_tensor(p, mesh, [Shard(0)]),
                                  requires_grad=p.requires_grad)
            module.register_parameter(pname, dist_p)

    def _input_fn(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        takes_weights = getattr(module, "takes_row_weights", False)
        if len(inputs) != 2 and not (len(inputs) == 3 and takes_weights):
            raise TypeError(f"{type(module).__name__} under ExpertParallel must be called as "
                            "experts(x, num_tokens_per_expert) with positional arguments (and "
                            "row_weights third if its takes_row_weights is set)")
        x, counts = inputs[:2]
        if self.nodes is not None:
            if not hasattr(counts, "weights"):
                raise TypeError(_NEEDS_ROUTING.format(type(module).__name__))
            n_exp = next(module.parameters()).shape[0]
            x_local, local_counts, route = dispatch_two_level(
                x, counts.ids, counts.weights, self.nodes, n_exp, self.replicate_hot_experts,
                self.wire.float8, step=step_copies(module))
        else:
            x_local, local_counts, route = dispatch_tokens(x, counts, mesh,
                                                           self.replicate_hot_experts,
                                                           wire=self.wire,
                                                           step=step_copies(module))
        swapped = {}
        if route.plan is not None and route.plan.replicas:  # the same on every rank
            swapped = dict(module.named_parameters(recurse=False))
            local = copy_experts({n: p.to_local() for n, p in swapped.items()}, route.plan,
                                 dist.get_rank(route.group), route.group, step_copies(module))
            for name, w in local.items():  # a parameter slot holding a tensor, as FSDP2 does
                module._parameters[name] = DTensor.from_local(w, mesh, [Shard(0)],
                                                              run_check=False)
        weights = None  # the rows' routing weights, where the experts apply them
        if self.nodes is not None and takes_weights:
            weights = dispatch_row_values(route.weight, route.inner)
        elif len(inputs) == 3 and inputs[2] is not None:
            weights = dispatch_row_values(inputs[2], route)
        module._ep_routes = [*getattr(module, "_ep_routes", []),
                             (route, swapped, weights is not None)]
        return (x_local, local_counts) if weights is None else (x_local, local_counts, weights)

    @staticmethod
    def _output_fn(module: nn.Module, outputs: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        route, swapped, weighted = module._ep_routes.pop()
        for name, p in swapped.items():  # the parameters again, before FSDP's post-forward
            module._parameters[name] = p
        if isinstance(route, TwoLevelRoute):
            return combine_two_level(outputs, route, weighted=not weighted)
        return combine_tokens(outputs, route)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _group(device_mesh)  # 1D check
        module.takes_routing = self.nodes is not None
        module._hot_expert_copies = self.replicate_hot_experts  # found by copies_per_step
        return distribute_module(module, device_mesh, partition_fn=self._partition_fn,
                                 input_fn=self._input_fn, output_fn=self._output_fn)


# -- experts in other layouts: adapters ------------------------------------------------------------


class ExpertsLayout:
    """How to run one expert of an experts module that does not follow the protocol: which
    stacked weights ``[E, ...]`` it holds (:meth:`weights`) and expert e's function on its rows
    (:meth:`expert`, given that expert's slices). :class:`ExpertParallelExperts` shards the
    stacked weights over ep and calls :meth:`expert` for each local expert."""

    def weights(self, module: nn.Module) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def expert(self, weights: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class StackedExperts(ExpertsLayout):
    """Stacked SwiGLU-style experts: ``down(act(gate(x)) * up(x))`` per expert.

    ``gate``, ``up``, ``down`` name the module's ``[E, ...]`` parameters; ``up=None`` means
    ``gate`` is a fused gate_up weight (its output splits in two halves: gate, then up).
    ``transposed=False``: each expert's weight is ``[out, in]`` (``F.linear``, as
    ``nn.Linear``); ``True``: ``[in, out]`` (``x @ w``); ``"auto"``: decided from the input's
    width (an error if the weight is square).
    """

    def __init__(self, gate: str = "w1", up: str | None = "w3", down: str = "w2", *,
                 transposed: bool | str = "auto", act: Callable | None = None):
        self.names = tuple(n for n in (gate, up, down) if n is not None)
        self.gate, self.up, self.down, self.transposed = gate, up, down, transposed
        self.act = act or torch.nn.functional.silu

    def weights(self, module: nn.Module) -> dict[str, torch.Tensor]:
        return {n: getattr(module, n) for n in self.names}

    def _mm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        t = self.transposed
        if t == "auto":
            if w.shape[0] == w.shape[1]:
                raise ValueError(f"StackedExperts: a square [{w.shape[0]}, {w.shape[1]}] expert "
                                 "weight does not say its orientation; pass transposed=True "
                                 "([E, in, out]) or False ([E, out, in])")
            t = w.shape[0] == x.shape[-1]
        return x @ w if t else torch.nn.functional.linear(x, w)

    def expert(self, weights: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        h = self._mm(x, weights[self.gate])
        gate, up = h.chunk(2, dim=-1) if self.up is None else (h, self._mm(x, weights[self.up]))
        return self._mm(self.act(gate) * up, weights[self.down])

    def __repr__(self) -> str:
        return (f"StackedExperts(gate={self.gate!r}, up={self.up!r}, down={self.down!r}, "
                f"transposed={self.transposed!r})")


class ModuleListExperts(ExpertsLayout):
    """An ``nn.ModuleList`` of per-expert modules of one structure (Mixtral style): their
    parameters are stacked per name (``experts.0.fc1.weight`` ... -> ``experts.fc1.weight``
    ``[E, ...]``) and each expert runs the original module's forward on its slices."""

    def weights(self, module: nn.Module) -> dict[str, torch.Tensor]:
        experts = list(module)
        names = [n for n, _ in experts[0].named_parameters()]
        if any([n for n, _ in e.named_parameters()] != names for e in experts) or any(
                True for e in experts for _ in e.buffers()):
            raise ValueError(f"ModuleListExperts: the experts of {type(module).__name__} must "
                             "share one structure, with parameters and no buffers")
        self.template = copy.deepcopy(experts[0]).to("meta")  # the forward, not the weights
        return {n: nn.Parameter(torch.stack([e.get_parameter(n).detach() for e in experts]),
                                requires_grad=experts[0].get_parameter(n).requires_grad)
                for n in names}

    def expert(self, weights: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(self.template, weights, (x,))


_STACKED_NAMES = (("gate_up_proj", None, "down_proj"), ("w1", "w3", "w2"),
                  ("gate_proj", "up_proj", "down_proj"))


def detect_experts_layout(fqn: str, module: nn.Module) -> ExpertsLayout | str | None:
    """The layout of ``module`` if it is an experts module titanext knows: "protocol" for
    :class:`~titanext.models.moe.GroupedExperts` and any module called as ``forward(x,
    num_tokens_per_expert)`` that holds its stacked expert weights directly (torchtitan's
    ``GroupedExperts``:
    :func:`~titanext.plugins.expert_parallel._layouts.follows_experts_protocol`), a
    :class:`StackedExperts` for 3-D ``gate_up_proj``/``down_proj`` (``is_transposed`` read from
    the module), ``w1``/``w3``/``w2`` or ``gate_proj``/``up_proj``/``down_proj`` weights, a
    :class:`ModuleListExperts` for an ``nn.ModuleList`` named ``experts``; else None."""
    if is_grouped_experts(fqn, module) or follows_experts_protocol(module):
        return "protocol"
    if isinstance(module, ExpertParallelExperts):
        return None
    params = dict(module.named_parameters(recurse=False))
    for gate, up, down in _STACKED_NAMES:
        names = [n for n in (gate, up, down) if n is not None]
        if all(n in params and params[n].dim() == 3 for n in names):
            if getattr(module, "has_bias", False) or any("bias" in n for n in params):
                raise ValueError(f"{fqn}: stacked experts with biases are not supported by the "
                                 "expert-parallel adapters; pass layout=... of your own")
            transposed = getattr(module, "is_transposed", False if gate == "gate_up_proj"
                                 else "auto")
            return StackedExperts(gate, up, down, transposed=transposed,
                                  act=getattr(module, "act_fn", None))
    if (isinstance(module, nn.ModuleList) and fqn.rsplit(".", 1)[-1] == "experts"
            and len(module) > 1 and len({type(m) for m in module}) == 1
            and any(True for _ in module.parameters())):
        return ModuleListExperts()
    return None


class ExpertParallelExperts(nn.Module):
    """An experts module of another layout with its experts split over a 1D ``ep_mesh``.

    Holds ``layout.weights(experts)`` as DTensor ``Shard(0)`` parameters (rank r keeps experts
    r*E/W .. (r+1)*E/W - 1; names kept, a ModuleList's stacked per name) and is called either
    as the protocol, ``experts(x_grouped_by_expert, num_tokens_per_expert)``, or as
    ``experts(tokens [T, H], top_k_index [T, k], top_k_weights [T, k])`` (``transformers``'
    call, returning the weighted sum per token). Rows go to their expert's rank with
    :func:`dispatch_tokens` and come back with :func:`combine_tokens`. Indexing it
    (``experts[e]``) raises: the experts now live on other ranks.
    """

    def __init__(self, experts: nn.Module, layout: ExpertsLayout, ep_mesh: DeviceMesh,
                 replicate_hot_experts: int = 0, *, nodes: NodeGroups | None = None,
                 wire: Wire = PLAIN):
        super().__init__()
        self.layout, self.ep_mesh = layout, ep_mesh
        self.replicate_hot_experts, self.nodes, self.wire = replicate_hot_experts, nodes, wire
        self._hot_expert_copies = replicate_hot_experts  # found by copies_per_step
        stacked = layout.weights(experts)
        self.num_experts = next(iter(stacked.values())).shape[0]
        if self.num_experts % ep_mesh.size():
            raise ValueError(f"{self.num_experts} experts cannot be split over {ep_mesh.size()} "
                             "ep ranks; choose an ep degree that divides the expert count")
        self._names = list(stacked)
        for name, w in stacked.items():
            owner, _, leaf = name.rpartition(".")
            parent = self
            for part in owner.split(".") if owner else ():
                if not hasattr(parent, part):
                    parent.add_module(part, nn.Module())
                parent = getattr(parent, part)
            parent.register_parameter(leaf, nn.Parameter(
                distribute_tensor(w.detach(), ep_mesh, [Shard(0)]), requires_grad=w.requires_grad))

    def __getitem__(self, index):
        raise TypeError("expert parallelism moved these experts across ranks: call the experts "
                        "once, as experts(tokens, top_k_index, top_k_weights) or experts(x, "
                        "num_tokens_per_expert), instead of indexing experts[e] (docs/moe_ep.md)")

    def __iter__(self):
        return self.__getitem__(0)

    def __len__(self) -> int:
        return self.num_experts

    def _local_experts(self, rows: torch.Tensor, local_counts: torch.Tensor,
                       route: Route | TwoLevelRoute) -> torch.Tensor:
        local = {n: self.get_parameter(n).to_local() for n in self._names}
        if route.plan is not None:  # hot-expert copies after the local experts
            local = copy_experts(local, route.plan, dist.get_rank(route.group), route.group,
                                 step_copies(self))
        outs = [self.layout.expert({n: w[e] for n, w in local.items()}, x)
                for e, x in enumerate(torch.split(rows, local_counts.tolist()))]
        return torch.cat(outs)

    def forward(self, x: torch.Tensor, *routing: torch.Tensor) -> torch.Tensor:
        if len(routing) == 1 and hasattr(routing[0], "weights"):  # a TokenRouting
            routing = (routing[0].ids, routing[0].weights)
        if self.nodes is not None:  # two-level: each token once per node, summed there
            if len(routing) != 2:
                raise TypeError(_NEEDS_ROUTING.format(type(self).__name__))
            rows, local_counts, route = dispatch_two_level(
                x, routing[0], routing[1], self.nodes, self.num_experts,
                self.replicate_hot_experts, self.wire.float8, step=step_copies(self))
            return combine_two_level(self._local_experts(rows, local_counts, route),
                                     route).to(x.dtype)
        if len(routing) == 1:  # the protocol: rows grouped by expert
            rows, local_counts, route = dispatch_tokens(x, routing[0], self.ep_mesh,
                                                        self.replicate_hot_experts, wire=self.wire,
                                                        step=step_copies(self))
            return combine_tokens(self._local_experts(rows, local_counts, route), route)
        if len(routing) != 2:
            raise TypeError("ExpertParallelExperts is called as experts(x, num_tokens_per_expert) "
                            "or experts(tokens, top_k_index, top_k_weights)")
        top_k_index, top_k_weights = routing
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)                       # assignment j -> token j // k
        order = torch.argsort(flat, stable=True)             # assignments grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts)
        rows, local_counts, route = dispatch_tokens(x[order // k], counts, self.ep_mesh,
                                                    self.replicate_hot_experts, wire=self.wire,
                                                    step=step_copies(self))
        back = combine_tokens(self._local_experts(rows, local_counts, route), route)
        back = back * top_k_weights.reshape(-1)[order, None].to(back.dtype)
        return torch.zeros_like(x).index_add_(0, order // k, back.to(x.dtype))


def call_experts(experts: nn.Module, x: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
    """``sum_j top_k_weights[t, j] * experts[top_k_index[t, j]](x[t])`` for every token t, for
    an ``nn.ModuleList`` of experts (one process: a loop over the experts) and for its
    expert-parallel replacement (one call: dispatch, local experts, combine). Call this in a
    Mixtral-style MoE's forward instead of looping over ``experts[e]`` yourself.

    >>> experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
    >>> x, idx = torch.randn(5, 4), torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0]])
    >>> call_experts(experts, x, idx, torch.full((5, 2), 0.5)).shape
    torch.Size([5, 4])
    """
    if not isinstance(experts, nn.ModuleList):
        return experts(x, top_k_index, top_k_weights)
    out = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        token, slot = torch.where(top_k_index == e)
        y = expert(x[token]) * top_k_weights[token, slot, None].to(x.dtype)
        out = out.index_add(0, token, y.to(x.dtype))
    return out


def is_grouped_experts(name: str, module: nn.Module) -> bool:
    """The default selection: instances of ``titanext.models.moe.GroupedExperts``."""
    return isinstance(module, GroupedExperts)


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, *,
                          filter_fn: Callable[[str, nn.Module], bool] | None = None,
                          layout: ExpertsLayout | None = None, required: bool = True,
                          replicate_hot_experts: int = 0, dispatch: str = "flat",
                          ranks_per_node: int = 0, float8_dispatch: bool = False) -> list[str]:
    """Split the experts of every selected experts module over ``ep_mesh``, in place.

    Args:
        model: any module (on the meta device or materialised; a materialised model's expert
            weights are taken from ep rank 0 of each group, as ``distribute_tensor`` does).
        ep_mesh: a 1D mesh; its size must divide every selected module's expert count.
        filter_fn: ``(fqn, module) -> bool`` choosing the experts modules; default: every
            module :func:`detect_experts_layout` knows. Example:
            ``filter_fn=lambda fqn, m: isinstance(m, MyExperts)``.
        layout: how the chosen modules compute (an :class:`ExpertsLayout` such as
            ``StackedExperts(gate="wi", up=None, down="wo", transposed=True)``); default: the
            detected one. A module in the protocol (this module's docstring) is wrapped in place
            by :class:`ExpertParallel`; any other is replaced by :class:`ExpertParallelExperts`.
        required: raise when ``ep_mesh`` has more than one rank and no experts are found (a
            pipeline stage may legitimately have none: ``parallelize`` passes False there).
        replicate_hot_experts: N > 0 copies up to N of the most loaded experts to the least
            loaded ranks (chosen once per step inside
            :func:`~titanext.plugins.expert_parallel.replication.copies_per_step`, which the trainer
            uses; else at every dispatch), so that each rank's rows come within
            ``ceil(mean)`` of the mean where N copies allow (exact: the same rows meet the same
            weights; the copies' gradients are summed into the home experts'). At most
            ``num_experts - num_experts / ep``. See
            :mod:`~titanext.plugins.expert_parallel.replication` for the plan and its cost. Under
            two-level dispatch the copies stay inside a node: at most ``num_experts / nodes -
            num_experts / ep``.
        dispatch: ``"flat"`` (every (token, expert) row travels on its own) or ``"two_level"``
            (each token once to every node holding one of its experts, then to the experts
            inside it; the combine sums each node's part there: :mod:`._ep_dispatch`; the
            experts module is then called with the routing, see :class:`ExpertParallel`).
        ranks_per_node: consecutive ep ranks that share a node (NVLink): needed by two-level
            dispatch (it must divide ``ep_mesh.size()`` and be smaller); with flat dispatch it
            only lets ``count_comm()`` tell inter-node bytes apart. 0 = unknown.
        float8_dispatch: the dispatched token rows travel as float8 e4m3 with a power-of-two
            scale per 1 x 128 block (about half the bytes of bf16); the combine and all
            gradients stay in the activations' dtype (:mod:`._ep_comm`).

    Returns the FQNs of the modules it converted (nothing happens when ``ep_mesh`` has one
    rank). Apply it after tensor parallelism and before activation checkpointing, compile and
    FSDP. See ``examples/expert_parallel.py`` and docs/moe_ep.md.
    """
    _group(ep_mesh)
    world = ep_mesh.size()
    if dispatch not in EP_DISPATCH_MODES:
        raise ValueError(f"dispatch = {dispatch!r}: one of {', '.join(EP_DISPATCH_MODES)}")
    if dispatch == "two_level" and not ranks_per_node:
        raise ValueError("dispatch = 'two_level' needs ranks_per_node: the consecutive ep ranks "
                         "that share a node")
    chosen = expert_parallel_targets(model, world, filter_fn=filter_fn, layout=layout,
                                     required=required,
                                     replicate_hot_experts=replicate_hot_experts,
                                     copies_within=ranks_per_node if dispatch == "two_level"
                                     else 0)
    if not chosen or world == 1:
        return []
    wire = Wire(ranks_per_node, float8_dispatch)
    nodes = node_groups(_group(ep_mesh), ranks_per_node) if dispatch == "two_level" else None
    for fqn, m, found in chosen:
        if found == "protocol":
            ExpertParallel(replicate_hot_experts, nodes=nodes, wire=wire)._apply(m, ep_mesh)
        else:
            parent, _, child = fqn.rpartition(".")
            m = ExpertParallelExperts(m, found, ep_mesh, replicate_hot_experts, nodes=nodes,
                                      wire=wire)
            model.get_submodule(parent).register_module(child, m)
    if not dist.is_initialized() or dist.get_rank() == 0:
        logging.getLogger("titanext").warning(
            "expert parallel: %s: %d experts module(s) split over ep = %d%s%s: %s",
            type(model).__name__, len(chosen), world,
            "" if nodes is None else f" ({nodes.nodes} nodes x {ranks_per_node}, two-level "
            "dispatch)",
            (f", up to {replicate_hot_experts} hot expert(s) copied"
             if replicate_hot_experts else "") + (", float8 dispatch" if float8_dispatch else ""),
            ", ".join(f"{fqn} ({_kind(f)})" for fqn, _, f in chosen))
    return [fqn for fqn, _, _ in chosen]


def expert_parallel_targets(model: nn.Module, ep: int, *,
                            filter_fn: Callable[[str, nn.Module], bool] | None = None,
                            layout: ExpertsLayout | None = None, required: bool = True,
                            replicate_hot_experts: int = 0, copies_within: int = 0
                            ) -> list[tuple[str, nn.Module, ExpertsLayout | str]]:
    """The experts modules :func:`apply_expert_parallel` would split over ``ep`` ranks, as
    (fqn, module, layout), found and checked without changing ``model``: it raises the same
    ``ValueError`` (no experts found, an unknown layout, an expert count ``ep`` does not divide,
    too many hot-expert copies), so a recipe can check before it mutates anything.
    ``copies_within``: the ranks a copy can go to (two-level dispatch keeps copies inside a
    node of that many ranks; 0: any ep rank)."""
    if replicate_hot_experts < 0:
        raise ValueError(f"replicate_hot_experts = {replicate_hot_experts} must be >= 0")
    chosen = []
    for fqn, m in model.named_modules():
        if filter_fn is not None and not filter_fn(fqn, m):
            continue
        found = layout or detect_experts_layout(fqn, m)
        if found is None and filter_fn is None:
            continue
        if found is None or found == "protocol":
            found = _check_protocol(fqn, m, ep)
        chosen.append((fqn, m, found))
    if not chosen and ep > 1 and required:
        raise ValueError(_none_found(model, filter_fn))
    for fqn, m, found in chosen if ep > 1 else ():
        n_exp = (next(m.parameters()).shape[0] if found == "protocol" else len(m)
                 if isinstance(found, ModuleListExperts) else
                 next(iter(found.weights(m).values())).shape[0])
        if n_exp % ep:
            raise ValueError(f"{fqn}: {n_exp} experts cannot be split over ep = {ep} ranks; the "
                             "ep degree must divide the number of experts")
        pool = n_exp * (copies_within or ep) // ep  # the experts of the ranks a copy can go to
        most = max_replicas_within(n_exp, ep, copies_within)
        if replicate_hot_experts > most:
            raise ValueError(f"{fqn}: replicate_hot_experts = {replicate_hot_experts} is more than "
                             f"the {most} experts of {pool} a rank can host "
                             f"as copies at ep = {ep}" + (
                                 " (num_experts - num_experts / ep)" if not copies_within else
                                 f" with two-level dispatch over nodes of {copies_within} ranks "
                                 "(num_experts / nodes - num_experts / ep)"))
    return chosen


def _kind(layout: ExpertsLayout | str) -> str:
    return "protocol" if layout == "protocol" else type(layout).__name__


def _check_protocol(fqn: str, m: nn.Module, world: int) -> str:
    params = list(m.named_parameters(recurse=False))
    if not params or len(params) != len(list(m.parameters())):
        raise ValueError(f"{fqn} ({type(m).__name__}): unknown experts layout. Expert "
                         "parallelism takes modules that hold their expert weights directly "
                         "(expert index as dim 0, no submodules with parameters; see the "
                         "protocol in docs/moe_ep.md), stacked gate/up/down weights, or an "
                         "nn.ModuleList named experts; pass layout=StackedExperts(...), "
                         "ModuleListExperts() or your own ExpertsLayout")
    n_exp = {p.shape[0] for _, p in params}
    if len(n_exp) != 1:
        raise ValueError(f"{fqn}: parameters disagree on the expert count (dim 0): "
                         + ", ".join(f"{n} {tuple(p.shape)}" for n, p in params))
    (n,) = n_exp
    if n % world:
        raise ValueError(f"{fqn}: {n} experts cannot be split over ep = {world} ranks; the ep "
                         "degree must divide the number of experts")
    return "protocol"


def _none_found(model: nn.Module, filter_fn) -> str:
    named = [f"{fqn} ({type(m).__name__})" for fqn, m in model.named_modules()
             if "expert" in fqn.rsplit(".", 1)[-1].lower()]
    return (f"apply_expert_parallel: ep > 1 but {type(model).__name__} has no experts module "
            + ("that filter_fn selects" if filter_fn else
               "titanext knows. Looked for GroupedExperts, modules called as forward(x, "
               "num_tokens_per_expert) holding [experts, ...] weights, modules with 3-D stacked "
               + " / ".join("/".join(n for n in names if n) for names in _STACKED_NAMES)
               + " weights, and an nn.ModuleList named experts")
            + (f"; modules named like experts, of an unknown layout: {', '.join(named)}"
               if named else "")
            + ". Fix: pass filter_fn=lambda fqn, m: ... selecting them and layout=StackedExperts"
            "(...) / ModuleListExperts() / your own ExpertsLayout (docs/moe_ep.md), or ep = 1")
