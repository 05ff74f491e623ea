"""Token dispatch and combine of expert parallelism: flat, and two-level for node-limited
routing. Re-exported by :mod:`titanext.plugins.expert_parallel`, which documents the flat one's
steps and syncs.

**Flat**: every (token, expert) row goes to the ep rank of its expert by one
``all_to_all_single``, and back (:func:`dispatch_tokens`, :func:`combine_tokens`).

**Two-level** (DeepSeek-V3, section 3.2.2; :func:`dispatch_two_level`,
:func:`combine_two_level`):

The ep group of W ranks is split into ``nodes`` x ``ranks_per_node`` (ep rank r is on node
``r // ranks_per_node``, at local index ``r % ranks_per_node``); node b holds the experts
``b * E / nodes .. (b + 1) * E / nodes - 1``. With node-limited routing (``[moe]
num_limited_groups`` groups of ``num_expert_groups``, one group or more per node), a token's
top-k experts sit on at most ``num_limited_groups`` nodes.

Dispatch (``apply_expert_parallel(..., dispatch="two_level", ranks_per_node=N)``):

1. **inter-node**: each token goes *once* to every node that holds one of its experts, to the
   rank of that node with the sender's local index (one ``all_to_all_single`` over the ranks of
   one local index, one per node), with its routing beside it: ``2 k`` fp32 values (the
   node-local expert ids, -1 for the other nodes' slots, and the routing weights);
2. **intra-node**: on arrival, each received token fans out to its experts on that node: the
   flat dispatch (:func:`dispatch_tokens`) inside the node,
   hot-expert replication included (copies stay inside the node).

Combine, the reverse: the experts' rows come back inside the node; each received token's rows
are weighted by their routing weights (by the experts, before w2, when they take row weights:
the weights then travel inside the node beside the rows) and **summed inside the node** (fp32,
sent in the rows' dtype); one row per (token, node) crosses the network back; the sender adds
its nodes' sums.
So a token costs at most ``num_limited_groups`` rows on the network each way, instead of
``top_k``. Every step is differentiable (the weights' gradients come back beside the rows').

Two count exchanges (one per level), hence two device-to-host syncs per dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from titanext._fake_backend import balanced_counts
from titanext.models.layers import sum_rows
from titanext.plugins._mesh import one_dim_group
from titanext.plugins.expert_parallel._comm import PLAIN, AllToAll, Wire, swap_counts
from titanext.plugins.expert_parallel.replication import (
    ReplicationPlan,
    StepCopies,
    dispatch_replicated,
)

__all__ = ["NodeGroups", "Route", "TwoLevelRoute", "combine_tokens", "combine_two_level",
           "dispatch_row_values", "dispatch_tokens", "dispatch_two_level", "ep_group",
           "node_groups"]


# -- flat ------------------------------------------------------------------------------------------


@dataclass
class Route:
    """What combine (and both backwards) need from a dispatch: host split lists and the
    device permutation. ``send_splits[r]``: rows this rank sent to ep rank r;
    ``recv_splits[r]``: rows it received from r; ``order``: received-row index of each row of
    the expert input (local-expert order). With replication, ``send_order`` and ``plan`` (see
    :mod:`~titanext.plugins.expert_parallel.replication`)."""

    send_splits: list[int]
    recv_splits: list[int]
    order: torch.Tensor
    group: dist.ProcessGroup
    send_order: torch.Tensor | None = None  # with replication: x's rows in sending order
    plan: ReplicationPlan | None = None  # with replication: the copies of this dispatch
    wire: Wire = PLAIN  # node size (counters) and float8 rows of the dispatch


def ep_group(ep: DeviceMesh | dist.ProcessGroup) -> dist.ProcessGroup:
    return one_dim_group(ep, "expert parallelism needs a 1D ep mesh, got {ndim}D {names}; pass a "
                             "flattened view such as dims.ep_mesh")


def dispatch_tokens(x: torch.Tensor, num_tokens_per_expert: torch.Tensor,
                    group: DeviceMesh | dist.ProcessGroup, replicate_hot_experts: int = 0, *,
                    wire: Wire = PLAIN, step: StepCopies | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, Route]:
    """Send each row of ``x`` (grouped by global expert, in expert order) to the ep rank that
    holds its expert. Returns (rows for this rank's experts in local-expert order, their
    counts per local expert [L], the :class:`Route` for :func:`combine_tokens`).

    Differentiable in ``x``. One device-to-host sync (the split sizes).
    ``replicate_hot_experts`` > 0: up to that many hot experts are copied to the least loaded
    ranks (:mod:`~titanext.plugins.expert_parallel.replication`): the counts are all-gathered
    instead, the rows of a copy come after the rank's own experts' (counts [L + copies hosted
    here]), and ``route.plan`` says which weights
    :func:`~titanext.plugins.expert_parallel.replication.copy_experts` must fetch. ``wire``: the
    rows as float8 (``Wire(float8=True)``, see :mod:`~titanext.plugins.expert_parallel._comm`)
    and the node size the counters use. ``step``: the step's copies
    (:func:`~titanext.plugins.expert_parallel.replication.copies_per_step`).
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
            x, counts, pg, replicate_hot_experts, wire, step)
        return rows, local, Route(send, recv_splits, order, pg, send_order, plan, wire)
    recv, host = swap_counts(counts.contiguous(), pg)  # recv[s*L + e]: from s for e
    if host is None:  # a dry run has no counts: perfectly balanced routing, an estimate
        rows = x.shape[0]
        send_splits = balanced_counts(rows, world)
        recv_splits = list(send_splits)
    else:  # the one sync, in swap_counts
        send_splits = host[:n_exp].view(world, n_local).sum(1).tolist()
        recv_splits = host[n_exp:].view(world, n_local).sum(1).tolist()
    if sum(send_splits) != x.shape[0]:
        raise ValueError(f"num_tokens_per_expert sums to {sum(send_splits)} but x has "
                         f"{x.shape[0]} rows")
    received = AllToAll.apply(x, recv_splits, send_splits, pg, "dispatch", wire)
    # Received rows come as (source rank, local expert) segments; stable-sort them by expert.
    expert_of_segment = torch.arange(n_exp, device=recv.device) % n_local
    labels = torch.repeat_interleave(expert_of_segment, recv, output_size=sum(recv_splits))
    order = torch.argsort(labels, stable=True)
    local_counts = recv.view(world, n_local).sum(0)
    return (received.index_select(0, order), local_counts,
            Route(send_splits, recv_splits, order, pg, wire=wire))


def dispatch_row_values(values: torch.Tensor, route: Route) -> torch.Tensor:
    """``values`` [N] (one per row of the dispatched ``x``: the routing weights) to where
    :func:`dispatch_tokens` sent the rows, in the expert input's order. One more
    ``all_to_all_single`` of ``4 N`` bytes (counted as routing), differentiable; no sync."""
    if route.send_order is not None:
        values = values.index_select(0, route.send_order)
    got = AllToAll.apply(values.unsqueeze(1), route.recv_splits, route.send_splits, route.group,
                         "routing", Wire(route.wire.ranks_per_node))
    return got.squeeze(1).index_select(0, route.order)


def combine_tokens(y: torch.Tensor, route: Route) -> torch.Tensor:
    """Inverse of :func:`dispatch_tokens`: the expert outputs back to the ranks and row order
    the inputs came from. Differentiable; no sync."""
    inverse = torch.empty_like(route.order)
    inverse[route.order] = torch.arange(route.order.numel(), device=route.order.device)
    back = y.index_select(0, inverse)
    out = AllToAll.apply(back, route.send_splits, route.recv_splits, route.group, "tokens",
                          Wire(route.wire.ranks_per_node))  # the combine is never float8
    if route.send_order is None:
        return out
    unsort = torch.empty_like(route.send_order)
    unsort[route.send_order] = torch.arange(route.send_order.numel(), device=unsort.device)
    return out.index_select(0, unsort)


# -- two-level -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeGroups:
    """An ep group split into nodes: ``inter`` holds this rank's peers of the same local index
    (one per node, in node order), ``intra`` the ranks of this rank's node (in local order)."""

    inter: dist.ProcessGroup
    intra: dist.ProcessGroup
    nodes: int
    ranks_per_node: int


def node_groups(ep_group: dist.ProcessGroup, ranks_per_node: int) -> NodeGroups:
    """The two groups of two-level dispatch for ``ep_group``, whose consecutive runs of
    ``ranks_per_node`` ranks share a node. Only the ep group's ranks take part (local
    synchronization), so each ep group of a larger mesh builds its own."""
    world = dist.get_world_size(ep_group)
    if ranks_per_node < 1 or world % ranks_per_node or world == ranks_per_node:
        raise ValueError(f"two-level dispatch: ep = {world} ranks cannot be split into nodes of "
                         f"ranks_per_node = {ranks_per_node}: it must divide ep and be less than "
                         "it (two nodes or more)")
    ranks = dist.get_process_group_ranks(ep_group)
    node, local = divmod(dist.get_rank(ep_group), ranks_per_node)
    intra = dist.new_group(ranks[node * ranks_per_node:(node + 1) * ranks_per_node],
                           use_local_synchronization=True)
    inter = dist.new_group(ranks[local::ranks_per_node], use_local_synchronization=True)
    return NodeGroups(inter, intra, world // ranks_per_node, ranks_per_node)


@dataclass
class TwoLevelRoute:
    """What the combine (and both backwards) need from a two-level dispatch."""

    token: torch.Tensor  # [P] the source token of each row sent to another node (node-major)
    send_splits: list[int]  # rows to each node (inter group)
    recv_splits: list[int]  # rows from each node
    row: torch.Tensor  # [V] received row of each assignment handed to this node's experts
    weight: torch.Tensor  # [V] its routing weight (fp32, differentiable)
    inner: Route  # the intra-node flat dispatch's
    groups: NodeGroups
    num_tokens: int

    @property
    def plan(self) -> ReplicationPlan | None:
        return self.inner.plan  # hot-expert copies inside the node

    @property
    def group(self) -> dist.ProcessGroup:
        return self.inner.group  # the group the experts' copies move in


def _exchange_counts(x: torch.Tensor, ids: torch.Tensor, groups: NodeGroups, e_node: int
                     ) -> tuple[list[int], list[int], int, torch.Tensor, torch.Tensor]:
    """(rows to each node, rows from each node, assignments received, assignments per
    node-local expert [e_node] on the device, the (token, node) hits [nodes, T])."""
    n, t = groups.nodes, x.shape[0]
    hit = torch.zeros(t, n, dtype=torch.bool, device=x.device)
    hit = hit.scatter_(1, ids // e_node, True).t()  # [nodes, T]
    flat = ids.reshape(-1)  # no bincount: its output shape is data-dependent (the dry run)
    per_expert = torch.zeros(n * e_node, dtype=torch.int64, device=x.device).index_add_(
        0, flat, torch.ones_like(flat)).view(n, e_node)
    send = torch.cat([hit.sum(1, keepdim=True), per_expert], 1).contiguous()  # [nodes, 1 + e]
    recv, host = swap_counts(send, groups.inter)  # recv[s]: rows from node s, then its
    # assignments per expert
    if host is None:  # a dry run has no routing: balanced, each token on min(k, nodes) nodes
        rows = t * min(ids.shape[1], n)
        splits = balanced_counts(rows, n)
        counts = torch.full((e_node,), t * ids.shape[1] // e_node, device=x.device)
        return splits, list(splits), t * ids.shape[1], counts, hit
    host_send, host_recv = host.view(2, n, 1 + e_node)  # the sync, in swap_counts
    return (host_send[:, 0].tolist(), host_recv[:, 0].tolist(), int(host_recv[:, 1:].sum()),
            recv[:, 1:].sum(0), hit)


def dispatch_two_level(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                       groups: NodeGroups, num_experts: int, replicate_hot_experts: int = 0,
                       float8: bool = False, step: StepCopies | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, TwoLevelRoute]:
    """Send each token of ``x`` [T, dim] once to every node holding one of its experts
    (``top_k_index`` [T, k], global expert ids), then to its experts inside the node. Returns
    (rows for this rank's experts in local-expert order, their counts, the
    :class:`TwoLevelRoute` for :func:`combine_two_level`). ``float8``: the rows travel as
    float8 on both levels (:mod:`~titanext.plugins.expert_parallel._comm`)."""
    world = groups.nodes * groups.ranks_per_node
    if num_experts % world:
        raise ValueError(f"{num_experts} experts cannot be split evenly over {world} ep ranks")
    t, k = top_k_index.shape
    if x.shape[0] != t:
        raise ValueError(f"x has {x.shape[0]} rows but top_k_index has {t} tokens")
    e_node = num_experts // groups.nodes
    ids = top_k_index.to(torch.int64)
    send_splits, recv_splits, assigned, counts, hit = _exchange_counts(x, ids, groups, e_node)
    # the (node, token) pairs, node-major: the first sum(send_splits) of a stable sort
    pairs = torch.argsort((~hit.reshape(-1)).to(torch.uint8), stable=True)[:sum(send_splits)]
    dest, token = pairs // t, pairs % t
    on_node = ids.index_select(0, token) // e_node == dest.unsqueeze(1)  # [P, k]
    local_ids = torch.where(on_node, ids.index_select(0, token) - dest.unsqueeze(1) * e_node, -1)
    weights = torch.where(on_node, top_k_weights.float().index_select(0, token), 0.0)
    routing = torch.cat([local_ids.float(), weights], 1)  # ids < 2^24: exact in fp32
    received = AllToAll.apply(x.index_select(0, token), recv_splits, send_splits, groups.inter,
                              "dispatch", Wire(1, float8))
    routing = AllToAll.apply(routing, recv_splits, send_splits, groups.inter, "routing", Wire(1))
    got_ids = routing[:, :k].detach().to(torch.int64)  # [R, k]
    key = torch.where(got_ids >= 0, got_ids, e_node).reshape(-1)
    pick = torch.argsort(key, stable=True)[:assigned]  # this node's assignments, by expert
    row = pick // k
    weight = routing[:, k:].reshape(-1).index_select(0, pick)
    rows, local_counts, inner = dispatch_tokens(
        received.index_select(0, row), counts, groups.intra, replicate_hot_experts,
        wire=Wire(groups.ranks_per_node, float8), step=step)
    route = TwoLevelRoute(token, send_splits, recv_splits, row, weight, inner, groups, t)
    return rows, local_counts, route


def combine_two_level(y: torch.Tensor, route: TwoLevelRoute, weighted: bool = True
                      ) -> torch.Tensor:
    """Inverse of :func:`dispatch_two_level`: ``out[t] = sum_j w[t, j] y[t, j]`` over token
    t's experts (``weighted``; else ``y`` comes weighted already, from experts that took
    :func:`dispatch_row_values` of ``route.weight``), each node's part summed inside the node
    before it crosses back. Returns [T, dim] in ``y``'s dtype (fp32 sums, one rounding per node
    and one at the end). Weighted here, the weights' gradient keeps an fp32 copy of every row."""
    back = combine_tokens(y, route.inner)  # [V, dim]: this node's assignments, by expert
    received = sum(route.recv_splits)
    rows = back.float() * route.weight.unsqueeze(1) if weighted else back
    partial = sum_rows(rows, route.row, received)
    home = AllToAll.apply(partial.to(y.dtype), route.send_splits, route.recv_splits,
                          route.groups.inter, "tokens", Wire(1))
    return sum_rows(home, route.token, route.num_tokens).to(y.dtype)
