"""Hot-expert replication: the most loaded experts copied, for one optimizer step, to the least
loaded ep ranks, so that every rank computes about the same number of rows.

Switched on by ``apply_expert_parallel(model, ep_mesh, replicate_hot_experts=N)`` (the
trainer: ``[moe] replicate_hot_experts = N``). In training the copies live for one step:
``with copies_per_step(model_parts, microbatches):`` around the step's forwards and backwards
(the trainer does it; :class:`StepCopies` holds each experts module's state). Then:

1. every dispatch all-gathers the per-expert counts of every ep rank (instead of the counts
   all-to-all: one collective either way) and copies them to the host (the dispatch's one
   sync);
2. the step's first dispatch of a layer chooses the step's copies with :func:`plan_replicas` on
   that ``[ep, experts]`` table. Every rank computes the same plan from the same table, so no
   further round is needed. Greedy: while the busiest rank holds more than ``ceil(mean)`` rows,
   its expert with the most rows still at home gives rows to the least loaded rank (as many as
   bring one of them to the target), each new (expert, rank) pair being one copy, at most N per
   layer. Every dispatch of the step (later micro-batches, recomputes) re-plans its own rows
   over those copies only (``plan_replicas(..., fixed=...)``: same slots, no new copy);
3. every row goes to the rank that computes it: its expert's home rank or a copy's rank (an
   expert's rows are taken in (source rank, row) order: the home keeps the first ones, the
   copies the last ones);
4. the copied experts' weights travel once per step, in one more ``all_to_all_single`` at the
   layer's first dispatch (not taped: a ``keep_all_to_all`` recompute, like any recompute and
   later micro-batch, finds them in the step's cache; weights do not change within a step, the
   cache ends with it, before the optimizer). Each micro-batch reads them through
   ``_StepCopy``, whose backward adds the copies' gradients to the step's fp32 sums; the step's
   last backward of the layer (the ``microbatches``-th: a backward runs once per micro-batch,
   recomputes and split backward included) sends the sums home in one all-to-all and returns
   them as the gradient of the home weights, inside that backward: autograd adds them to the
   home experts' gradient before FSDP's reduce-scatter (or the deferred W) and the optimizer
   see it. A step with other counts raises instead of dropping them.

Outside :func:`copies_per_step` every dispatch plans its own copies and sends their weights with
a differentiable all-to-all (:func:`copy_experts` without ``step``): its backward returns each
copy's gradient to the home rank, where autograd adds it to the home expert's gradient.

The result is exact: every routed row meets the same weights as without replication. Outputs
match bit for bit row by row where the matmul kernel does not depend on the row count, and the
expert weight gradients within fp32 rounding (the home and the copies each sum part of the rows).

Cost: ``N`` experts' weights per layer and step, and their summed gradients once
(``count_comm().weight_bytes_sent``; the planner's and the dry run's "EP expert copies" row;
per dispatch outside a step: in every forward, recompute and backward), plus the copies' rows
computed on the receiving rank instead of the home rank.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from titanext._fake_backend import balanced_counts, is_fake
from titanext._profiler_ranges import EP_ALL_TO_ALL, phase
from titanext.plugins.expert_parallel._comm import (
    COUNTERS,
    PLAIN,
    AllToAll,
    Wire,
    _all_to_all,
    taped,
)
from titanext.plugins.expert_parallel.rules import REPLICATION_SLACK, max_replicas

SLACK = REPLICATION_SLACK  # no new copy while the busiest rank is within 5% of the mean

__all__ = ["Replica", "ReplicationPlan", "plan_replicas", "nominal_plan", "RankRouting",
           "rank_routing", "copy_experts", "exchange_counts",
           "dispatch_replicated", "StepCopies", "copies_per_step", "step_copies"]


@dataclass(frozen=True)
class Replica:
    """One copy: global ``expert`` of ep rank ``home`` runs ``rows`` of its rows on ``rank``."""

    expert: int
    home: int
    rank: int
    rows: int


@dataclass(frozen=True)
class ReplicationPlan:
    """The copies of one dispatch (in planning order) and the rows per ep rank before/after."""

    replicas: tuple[Replica, ...]
    before: tuple[int, ...]
    after: tuple[int, ...]
    counts: tuple[tuple[int, ...], ...] = field(repr=False, default=())  # [ep][experts]

    def hosted(self, rank: int) -> list[Replica]:
        """The copies ``rank`` computes, in slot order (by home rank, then planning order)."""
        return sorted((r for r in self.replicas if r.rank == rank),
                      key=lambda r: (r.home, self.replicas.index(r)))

    def sent(self, rank: int) -> list[Replica]:
        """The copies of ``rank``'s experts, in sending order (by rank, then planning order)."""
        return sorted((r for r in self.replicas if r.home == rank),
                      key=lambda r: (r.rank, self.replicas.index(r)))


def plan_replicas(counts: list[list[int]], max_copies: int, slack: float = SLACK,
                  fixed: tuple[tuple[int, int], ...] | None = None) -> ReplicationPlan:
    """The copies that bring every ep rank's rows to at most ``ceil(mean)`` where ``max_copies``
    copies allow it. ``counts[s][e]``: rows ep rank s routes to global expert e (the experts
    split evenly over the ranks, rank r holding ``r*L .. (r+1)*L - 1``). Deterministic.

    A new copy is made only while the busiest rank holds more than ``mean x (1 + slack)`` rows
    (a copy costs an expert's weights and gradients: not worth it for a few rows); copies already
    made keep taking rows down to ``ceil(mean)``.

    >>> plan = plan_replicas([[6, 0, 1, 1], [6, 2, 0, 0]], max_copies=1)
    >>> plan.replicas, plan.before, plan.after
    ((Replica(expert=0, home=0, rank=1, rows=6),), (14, 2), (8, 8))
    >>> plan_replicas([[6, 0, 1, 1], [6, 2, 0, 0]], max_copies=0).after
    (14, 2)

    ``fixed``: the (expert, rank) copies of the step, made by its first dispatch (no other
    copy is made; each is listed, in this order, even with 0 rows), so that every micro-batch
    finds its copies in the same slots:

    >>> plan_replicas([[1, 0, 1, 1], [2, 2, 0, 0]], 1, fixed=((0, 1),)).replicas
    (Replica(expert=0, home=0, rank=1, rows=1),)
    >>> plan_replicas([[1, 0, 1, 1], [1, 1, 1, 1]], 1, fixed=((0, 1),)).replicas
    (Replica(expert=0, home=0, rank=1, rows=0),)
    """
    world, n_exp = len(counts), len(counts[0])
    n_local = n_exp // world
    load = [sum(c[e] for c in counts) for e in range(n_exp)]
    ranks = [sum(load[r * n_local:(r + 1) * n_local]) for r in range(world)]
    before = tuple(ranks)
    target = -(-sum(ranks) // world)
    bound = max(target, int(sum(ranks) / world * (1 + slack)))
    at_home = list(load)
    moved = {} if fixed is None else dict.fromkeys(fixed, 0)  # (expert, rank) -> rows, in order
    max_copies = max_copies if fixed is None else len(moved)
    while True:
        h = max(range(world), key=lambda r: (ranks[r], -r))
        d = min(range(world), key=lambda r: (ranks[r], r))
        excess, room = ranks[h] - target, target - ranks[d]
        new = len(moved) < max_copies and ranks[h] > bound
        candidates = [e for e in range(h * n_local, (h + 1) * n_local) if at_home[e] > 0
                      and ((e, d) in moved or new)]
        if excess <= 0 or room <= 0 or not candidates:
            break
        e = max(candidates, key=lambda e: (at_home[e], -e))
        n = min(excess, room, at_home[e])
        moved[(e, d)] = moved.get((e, d), 0) + n
        at_home[e] -= n
        ranks[h] -= n
        ranks[d] += n
    replicas = tuple(Replica(e, e // n_local, d, n) for (e, d), n in moved.items())
    return ReplicationPlan(replicas, before, tuple(ranks), tuple(tuple(c) for c in counts))


def nominal_plan(n_exp: int, world: int, copies: int, rows: int) -> ReplicationPlan:
    """A dry run's stand-in (fake tensors have no counts): balanced routing of ``rows`` rows
    per rank, and every rank sending and hosting ``copies`` copies (0 rows each): the most
    weight traffic a rank can see, the planner's figure.

    >>> [(r.expert, r.home, r.rank) for r in nominal_plan(4, 2, 1, rows=8).replicas]
    [(0, 0, 1), (2, 1, 0)]
    """
    n_local = n_exp // world
    counts = [balanced_counts(rows, n_exp) for _ in range(world)]
    reps = tuple(Replica(r * n_local + j % n_local, r, (r + 1 + j // n_local) % world, 0)
                 for r in range(world) for j in range(min(copies, max_replicas(n_exp, world))))
    per_rank = tuple(sum(sum(c[r * n_local:(r + 1) * n_local]) for c in counts)
                     for r in range(world))
    return ReplicationPlan(reps, per_rank, per_rank, tuple(tuple(c) for c in counts))


@dataclass
class RankRouting:
    """One rank's share of a plan, as host lists: ``segments`` (slot key, rows) of its own rows
    in expert order; ``send_splits`` / ``recv_splits`` per ep rank; ``arrivals`` (slot, rows) in
    arrival order; ``slot_counts`` per local slot (home experts, then hosted copies)."""

    segments: list[tuple[int, int]]
    send_splits: list[int]
    recv_splits: list[int]
    arrivals: list[tuple[int, int]]
    slot_counts: list[int]


def _pieces(plan: ReplicationPlan, n_local: int) -> dict[int, list[tuple[int, int, int]]]:
    """Per expert: (start, end, (rank, slot)) ranges of its rows in (source, row) order."""
    world = len(plan.before)
    slot_of = {}
    for d in range(world):
        for i, r in enumerate(plan.hosted(d)):
            slot_of[(r.expert, d)] = n_local + i
    out = {}
    for e in range(len(plan.counts[0])):
        total = sum(c[e] for c in plan.counts)
        copies = [r for r in plan.replicas if r.expert == e]
        start = total - sum(r.rows for r in copies)
        ranges = [(0, start, e // n_local, e % n_local)]
        for r in copies:
            ranges.append((start, start + r.rows, r.rank, slot_of[(e, r.rank)]))
            start += r.rows
        out[e] = ranges
    return out


def rank_routing(plan: ReplicationPlan, me: int) -> RankRouting:
    """Where rank ``me``'s rows go and what it receives, under ``plan`` (host work only)."""
    world, n_exp = len(plan.counts), len(plan.counts[0])
    n_local = n_exp // world
    slots = [n_local + len(plan.hosted(d)) for d in range(world)]
    first = [sum(slots[:d]) for d in range(world)]  # a slot key orders (rank, slot)
    pieces = _pieces(plan, n_local)
    by_source: list[dict[int, int]] = [{} for _ in range(world)]  # source -> {my slot: rows}
    segments, send = [], [0] * world
    for e in range(n_exp):
        offset = 0
        for s, c in enumerate(plan.counts):
            lo, hi = offset, offset + c[e]
            offset = hi
            for start, end, rank, slot in pieces[e]:
                n = max(0, min(hi, end) - max(lo, start))
                if not n:
                    continue
                if s == me:
                    segments.append((first[rank] + slot, n))
                    send[rank] += n
                if rank == me:
                    by_source[s][slot] = by_source[s].get(slot, 0) + n
    arrivals = [(slot, n) for got in by_source for slot, n in sorted(got.items())]
    slot_counts = [0] * slots[me]
    for slot, n in arrivals:
        slot_counts[slot] += n
    return RankRouting(segments, send, [sum(g.values()) for g in by_source], arrivals,
                       slot_counts)


def _splits(plan: ReplicationPlan, me: int) -> tuple[list[Replica], list[int], list[int]]:
    """(the copies ``me`` sends, rows it sends / receives per ep rank) of a weight all-to-all."""
    world = len(plan.before)
    sent, hosted = plan.sent(me), plan.hosted(me)
    return (sent, [sum(r.rank == d for r in sent) for d in range(world)],
            [sum(r.home == s for r in hosted) for s in range(world)])


def _send_rows(rows: dict[str, torch.Tensor], out_rows: int, send: Callable
               ) -> dict[str, torch.Tensor]:
    """Every tensor ``[n, ...]`` of ``rows`` sent by ``send(packed)`` (rows packed side by side:
    one all-to-all per dtype, one when all share it); ``out_rows`` rows of each come back."""
    names = list(rows)
    groups = ([names] if len({rows[n].dtype for n in names}) == 1 else [[n] for n in names])
    out = {}
    for part in groups:
        widths = [math.prod(rows[n].shape[1:]) for n in part]
        packed = torch.cat([rows[n].reshape(rows[n].shape[0], w) for n, w in zip(part, widths)], 1)
        got = send(packed)
        for n, w in zip(part, got.split(widths, 1), strict=True):
            out[n] = w.reshape(out_rows, *rows[n].shape[1:])
    return out


def _sent_index(plan: ReplicationPlan, me: int, device: torch.device) -> torch.Tensor:
    """The local indices of the experts ``me`` sends as copies, in sending order."""
    n_local = len(plan.counts[0]) // len(plan.before)
    return torch.tensor([r.expert - me * n_local for r in plan.sent(me)], dtype=torch.long,
                        device=device)


def _fetch(local: dict[str, torch.Tensor], plan: ReplicationPlan, me: int,
           send: Callable) -> dict[str, torch.Tensor]:
    """The copies hosted by ``me`` per weight name ``[copies, ...]`` (in slot order), fetched by
    ``send(packed, recv_splits, send_splits)``."""
    _, send_splits, recv_splits = _splits(plan, me)
    index = _sent_index(plan, me, next(iter(local.values())).device)
    return _send_rows({n: w.index_select(0, index) for n, w in local.items()}, sum(recv_splits),
                      lambda x: send(x, recv_splits, send_splits))


def copy_experts(local: dict[str, torch.Tensor], plan: ReplicationPlan, me: int,
                 group: dist.ProcessGroup, step: StepCopies | None = None
                 ) -> dict[str, torch.Tensor]:
    """Each local weight ``[L, ...]`` extended to ``[L + copies hosted here, ...]`` with the
    copies' weights. Returns ``local`` unchanged when the plan has no copies (on every rank
    alike).

    Without ``step``: fetched by one differentiable ``all_to_all_single`` (its backward returns
    the copies' gradients to their home rank, summed there into the home expert's gradient).
    With ``step`` (:func:`copies_per_step`): fetched by the step's first call only; every call's
    backward adds the copies' gradients to the step's sum, and the step's last backward sends
    the sum home (one all-to-all), where it joins the home experts' gradients."""
    if not plan.replicas:
        return local
    if step is None:
        got = _fetch(local, plan, me, lambda x, recv, send: AllToAll.apply(
            x, recv, send, group, "weights"))
    else:
        with step.lock:
            if step.weights is None:  # not taped: a recompute finds the copies here
                step.weights = _fetch({n: w.detach() for n, w in local.items()}, plan, me,
                                      lambda x, recv, send: _all_to_all(x, recv, send, group,
                                                                        "weights", PLAIN))
        names = list(local)
        got = dict(zip(names, _StepCopy.apply(step, (plan, me, group, names),
                                              *(local[n] for n in names)), strict=True))
    # cat even with nothing hosted: every rank must run the backward all-to-all
    return {n: torch.cat([w, got[n]]) for n, w in local.items()}


class StepCopies:
    """One experts module's hot-expert copies during one optimizer step of ``microbatches``
    micro-batches (each calling the module once, with a backward): the step's copies
    (``pairs``: (expert, rank), fixed by its first dispatch), their weights (fetched once) and
    the sum of their gradients (sent home by the last backward)."""

    def __init__(self, microbatches: int):
        self.microbatches = microbatches
        self.pairs: tuple[tuple[int, int], ...] | None = None
        self.weights: dict[str, torch.Tensor] | None = None
        self.grads: list[torch.Tensor] | None = None
        self.backwards = 0
        self.lock = threading.Lock()  # DualPipe's overlap runs a backward beside a forward


class _StepCopy(torch.autograd.Function):
    """The step's fetched copies, for one micro-batch: no communication forward; backward adds
    their gradients to the step's sum and, at the step's last backward, sends the sum to the
    home ranks and returns it as the local weights' gradient (so FSDP reduces it with them)."""

    @staticmethod
    def forward(ctx, step, where, *local):  # type: ignore[override]
        ctx.step, ctx.where = step, where
        ctx.like = [(w.shape, w.dtype, w.device) for w in local]
        return tuple(step.weights[n].detach() for n in where[3])  # new tensor objects

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        step = ctx.step
        plan, me, group, names = ctx.where
        with step.lock:
            if step.grads is None:
                step.grads = [torch.zeros(w.shape, dtype=torch.float32, device=w.device)
                              for w in (step.weights[n] for n in names)]
            for acc, g in zip(step.grads, grads, strict=True):
                if g is not None:
                    acc += g
            step.backwards += 1
            if step.backwards > step.microbatches:
                raise RuntimeError(_TOO_MANY.format(n=step.microbatches))
            if step.backwards < step.microbatches:
                return (None, None, *(None for _ in names))
        # the step's one way back: each host's summed gradients to the home ranks, in the
        # weights' dtype (the forward's all-to-all with its splits swapped)
        _, send_splits, recv_splits = _splits(plan, me)
        summed = {n: g.to(step.weights[n].dtype) for n, g in zip(names, step.grads, strict=True)}
        home = _send_rows(summed, sum(send_splits), lambda x: _all_to_all(
            x, send_splits, recv_splits, group, "weights", PLAIN))
        index = _sent_index(plan, me, ctx.like[0][2])
        return (None, None, *(torch.zeros(shape, dtype=dtype, device=device).index_add_(
            0, index, home[n].to(dtype)) for n, (shape, dtype, device) in zip(names, ctx.like,
                                                                             strict=True)))


_TOO_MANY = ("hot-expert copies per step: more backward passes through an experts module than "
             "the step's {n} micro-batches (copies_per_step(..., microbatches) must count the "
             "module's calls with a backward in the step)")


# torch >= 2.12 names it all_gather_single (and deprecates the old name); 2.11 has only the old
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup, copies: int,
                    rows: int, step: StepCopies | None = None) -> ReplicationPlan:
    """All-gather every ep rank's per-expert counts ``[E]`` and plan the copies (the dispatch's
    one device-to-host sync; replayed in a recompute, see
    :class:`~titanext.plugins.expert_parallel._comm.CommTape`). Under the dry run's fake tensors:
    :func:`nominal_plan`. With ``step``: the step's first dispatch chooses its copies, every
    dispatch of the step (this one included) gives rows to those copies only."""
    return taped(("replication plan", tuple(counts.shape), copies, rows),
                 lambda: _exchange_counts(counts, group, copies, rows, step), check=counts)


def _exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup, copies: int,
                     rows: int, step: StepCopies | None) -> ReplicationPlan:
    world = dist.get_world_size(group)
    gathered = counts.new_empty(world * counts.numel())
    with phase(EP_ALL_TO_ALL):
        _all_gather(gathered, counts.contiguous(), group=group)
    if is_fake(counts):
        plan = nominal_plan(counts.numel(), world, copies, rows)
        if step is not None and step.pairs is None:
            step.pairs = tuple((r.expert, r.rank) for r in plan.replicas)
        return plan
    table = gathered.view(world, -1).tolist()  # the one sync
    new = 0
    if step is None:
        plan = plan_replicas(table, copies)
        new = len(plan.replicas)
    else:
        with step.lock:
            if step.pairs is None:
                first = plan_replicas(table, copies)  # the step's copies
                step.pairs = tuple((r.expert, r.rank) for r in first.replicas)
                new = len(step.pairs)
        plan = plan_replicas(table, copies, fixed=step.pairs)
    for c in COUNTERS:
        c.count_exchanges += 1
        c.host_syncs += 1
        c.replicas += new
    return plan


def _expand(keys: list[int], sizes: list[int], total: int, device: torch.device) -> torch.Tensor:
    return torch.repeat_interleave(torch.tensor(keys, dtype=torch.long, device=device),
                                   torch.tensor(sizes, dtype=torch.long, device=device),
                                   output_size=total)


def dispatch_replicated(x: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup,
                        copies: int, wire: Wire = PLAIN, step: StepCopies | None = None):
    """:func:`~titanext.plugins.expert_parallel.dispatch_tokens` with up to ``copies`` hot
    experts copied: returns (rows in local-slot order, rows per slot [L + hosted copies], the
    send order of ``x``'s rows, send splits, receive splits, arrival-to-slot order, the plan).
    ``step``: the step's copies (:func:`copies_per_step`)."""
    me = dist.get_rank(group)
    plan = exchange_counts(counts, group, copies, x.shape[0], step)
    routing = rank_routing(plan, me)
    if sum(routing.send_splits) != x.shape[0]:
        raise ValueError(f"num_tokens_per_expert sums to {sum(routing.send_splits)} but x has "
                         f"{x.shape[0]} rows")
    keys, sizes = zip(*routing.segments, strict=True) if routing.segments else ((), ())
    send_order = torch.argsort(_expand(list(keys), list(sizes), x.shape[0], x.device),
                               stable=True)
    received = AllToAll.apply(x.index_select(0, send_order), routing.recv_splits,
                              routing.send_splits, group, "dispatch", wire)
    slots, sizes = zip(*routing.arrivals, strict=True) if routing.arrivals else ((), ())
    order = torch.argsort(_expand(list(slots), list(sizes), received.shape[0], x.device),
                          stable=True)
    local_counts = torch.tensor(routing.slot_counts, dtype=torch.long, device=x.device)
    return (received.index_select(0, order), local_counts, send_order, routing.send_splits,
            routing.recv_splits, order, plan)


def step_copies(module) -> StepCopies | None:
    """The :class:`StepCopies` of ``module``'s current step (None outside
    :func:`copies_per_step`: copies per dispatch)."""
    return getattr(module, "_ep_step", None)


@contextlib.contextmanager
def copies_per_step(modules: Iterable, microbatches: int) -> Iterator[list]:
    """Inside the block, the hot-expert copies of every replicating experts module among
    ``modules`` (and their submodules; e.g. the trainer's model parts) are planned, sent and
    returned once for the step of ``microbatches`` micro-batches (the calls of each module
    with a backward, recomputes not counted: a DualPipe stage copy sees half the step's
    micro-batches). Yields the modules it found. On exit every module must have had its
    ``microbatches`` backwards (or none: a forward without gradients), else the copies'
    gradients were not returned and it raises."""
    found = [m for root in modules for m in root.modules()
             if getattr(m, "_hot_expert_copies", 0)]
    for m in found:
        m._ep_step = StepCopies(microbatches)
    try:
        yield found
        for m in found:
            st = m._ep_step
            if st.backwards not in (0, st.microbatches):
                raise RuntimeError(
                    f"hot-expert copies per step: {type(m).__name__} ran {st.backwards} backward "
                    f"pass(es) in a step of {st.microbatches} micro-batches: the copies' "
                    "gradients were not returned to their home ranks")
    finally:
        for m in found:
            del m._ep_step
