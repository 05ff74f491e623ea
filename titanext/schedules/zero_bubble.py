"""Pipeline schedules generated as per-rank action lists: 1F1B, ZB-H1, ZB-H2, ZB-V and Auto.

ZB-H1 is a closed-form construction; the others come from one list scheduler, following the
zero-bubble paper's heuristic: each rank, whenever it is free, runs the most useful action
whose inputs have arrived:

1. a backward (I, the input gradient, or a full B): it unblocks the previous stage;
2. a forward, if the rank's in-flight activations stay within its memory limit;
3. a weight gradient W, which nothing waits for, so it fills the gaps.

A micro-batch's activations on a stage are live from its F until its W (or its B). The
schedules differ only in data: the memory limit per rank, whether backward is split, and the
stage placement (loop: stage s on rank s; V: rank r holds stages r and 2p-1-r). The generator
runs on the same costs as the simulator (``f``, ``b`` = I, ``w`` = W, ``comm``), so "Auto" can
search limits for the smallest simulated makespan.

>>> from titanext.schedules.zero_bubble import generate
>>> order = generate(pp=2, microbatches=4, limits=[3, 3])     # ZB-H2 for two ranks
>>> [str(a) for a in order[1]][:4]
['1F0', '1I0', '1F1', '1I1']
"""

from __future__ import annotations

from collections.abc import Sequence

from titanext.schedules._torch_ir import B, F, I, ListRuntime, W, action
from titanext.schedules.simulator import Cost, replay, stage_cost
from titanext.schedules.zbv import zbv_candidates


def stage_ids(placement: str, rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """Stages held by ``rank``: loop (rank, rank + pp, ...) or V (rank, 2pp-1-rank)."""
    if placement == "v":
        if stages_per_rank != 2:
            raise ValueError(f"V placement has 2 stages per rank, got {stages_per_rank}")
        return [rank, 2 * pp - 1 - rank]
    if placement == "loop":
        return [rank + i * pp for i in range(stages_per_rank)]
    raise ValueError(f"placement = {placement!r} is not 'loop' or 'v'")


def generate(*, pp: int, microbatches: int, limits: Sequence[int], split_backward: bool = True,
             placement: str = "loop", stages_per_rank: int = 1, f: Cost = 1.0,
             b: Cost = 1.0, w: Cost = 1.0, comm: float = 0.0,
             prefer: str = "backward", admission: bool = False) -> dict[int, list]:
    """Per-rank compute action lists (torch pipelining actions) for the list-scheduling heuristic.

    ``limits[r]`` caps rank r's live stage activations (at least 1). ``split_backward=False``
    runs B = I + W as one action (1F1B-style). ``f``, ``b``, ``w``: one figure for every
    stage, or one per stage index.
    """
    m = microbatches
    n_stages = pp * stages_per_rank
    owner = {s: r for r in range(pp) for s in stage_ids(placement, r, pp, stages_per_rank)}
    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, mb) -> finish time
    next_mb = {(k, s): 0 for k in "FIW" for s in range(n_stages)}
    free_at = [0.0] * pp
    live = [0] * pp
    inflight = [0] * pp  # micro-batches admitted on each rank and not yet done there
    order: dict[int, list] = {r: [] for r in range(pp)}
    # each stage's cost of each kind; without the split an "I" is the whole backward B = I + W
    cost = {k: [stage_cost(c, s) for s in range(n_stages)] for k, c in (("F", f), ("I", b),
                                                                        ("W", w))}
    if not split_backward:
        cost["I"] = [i + x for i, x in zip(cost["I"], cost["W"], strict=True)]
    total = n_stages * m * (3 if split_backward else 2)
    finished = 0

    def ready_time(kind: str, s: int, j: int) -> float | None:
        """When (kind, stage s, micro-batch j) can start, or None if a dependency is not done."""
        if kind == "F":
            if s == 0:
                return 0.0
            dep = done.get(("F", s - 1, j))
            return None if dep is None else dep + (comm if owner[s - 1] != owner[s] else 0.0)
        if kind == "I":
            if ("F", s, j) not in done:
                return None
            if s == n_stages - 1:
                return done[("F", s, j)]
            dep = done.get(("I", s + 1, j))
            return None if dep is None else dep + (comm if owner[s + 1] != owner[s] else 0.0)
        dep = done.get(("I", s, j))
        return dep

    held = [stage_ids(placement, r, pp, stages_per_rank) for r in range(pp)]
    kinds = ("I", "F", "W") if split_backward else ("I", "F")
    # which of two ready actions goes first: the backward (frees memory, unblocks the stage
    # before) or the forward (feeds the stage after); W always fills gaps
    rank_of = {"I": 0, "F": 1, "W": 2} if prefer == "backward" else {"F": 0, "I": 1, "W": 2}
    while finished < total:
        best = None  # (start time, priority, rank, kind, stage, mb)
        for r in range(pp):
            mine = held[r]
            options = []
            for s in mine:
                for kind in kinds:
                    j = next_mb[(kind, s)]
                    if j >= m:
                        continue
                    # admission: a micro-batch enters the rank at its first stage there and
                    # then needs one activation per stage the rank holds, so count it whole
                    # (otherwise first-stage forwards can fill the memory and deadlock)
                    if kind == "F" and (live[r] >= limits[r] or (
                            admission and s == held[r][0]
                            and inflight[r] * stages_per_rank >= limits[r])):
                        continue
                    t = ready_time(kind, s, j)
                    if t is None:
                        continue
                    # Backward first (deeper stage first), then forward (deeper first), then W.
                    prio = rank_of[kind]
                    options.append((max(t, free_at[r]), prio, -s, r, kind, s, j))
            if options:
                # I and F go first, as soon as they can start; a W fills the wait only when it
                # ends before the earliest I/F could start (it never delays the critical path).
                urgent = [o for o in options if o[1] < 2]
                fill = [o for o in options if o[1] == 2]
                choice = None
                if urgent:
                    start = min(o[0] for o in urgent)
                    choice = min((o for o in urgent if o[0] <= start + 1e-12),
                                 key=lambda o: (o[1], o[2]))
                if fill and (choice is None
                             or fill[0][0] + cost["W"][fill[0][5]] <= choice[0] + 1e-12):
                    choice = min(fill, key=lambda o: (o[0], o[2]))
                if best is None or choice[0] < best[0] - 1e-12:
                    best = choice
        if best is None:
            raise RuntimeError(f"schedule generation stalled (limits {list(limits)} too small for "
                               f"pp={pp}, stages_per_rank={stages_per_rank})")
        start, _, _, r, kind, s, j = best
        free_at[r] = start + cost[kind][s]
        done[(kind, s, j)] = free_at[r]
        next_mb[(kind, s)] += 1
        finished += 1
        if kind == "F":
            live[r] += 1
            inflight[r] += s == held[r][0]
        elif kind == "W" or not split_backward:
            live[r] -= 1
            inflight[r] -= s == held[r][0]
        ir_kind = {"F": F, "I": I if split_backward else B, "W": W}[kind]
        order[r].append(action(s, ir_kind, j))
    return order


def one_f_one_b(pp: int, microbatches: int) -> dict[int, list]:
    """1F1B: rank r runs pp - r - 1 warm-up forwards, then alternates F and full backward B, so
    it holds at most pp - r micro-batches."""
    order: dict[int, list] = {}
    for r in range(pp):
        warmup = min(pp - r - 1, microbatches)
        ops = [action(r, F, j) for j in range(warmup)]
        for k in range(microbatches):
            if warmup + k < microbatches:
                ops.append(action(r, F, warmup + k))
            ops.append(action(r, B, k))
        order[r] = ops
    return order


def zbh1(pp: int, microbatches: int, **costs: float) -> dict[int, list]:
    """ZB-H1: 1F1B's order with each backward split into I and W, and rank r's W of
    micro-batch k moved after its I of micro-batch k + r. Rank r then holds at most pp
    micro-batches (1F1B's peak, on every rank), and with F = I = W the idle time is a third of
    1F1B's: bubble (p-1)/(3m+p-1)."""
    order: dict[int, list] = {}
    for r in range(pp):
        ops, fwd, w_next = [], 0, 0
        warmup = min(pp - r - 1, microbatches)
        for _ in range(warmup):
            ops.append(action(r, F, fwd))
            fwd += 1
        for k in range(microbatches):
            if fwd < microbatches:
                ops.append(action(r, F, fwd))
                fwd += 1
            ops.append(action(r, I, k))
            while w_next <= k - r:
                ops.append(action(r, W, w_next))
                w_next += 1
        ops.extend(action(r, W, j) for j in range(w_next, microbatches))
        order[r] = ops
    return order


def zbh2(pp: int, microbatches: int, **costs: float) -> dict[int, list]:
    """ZB-H2: every rank may keep 2pp - 1 micro-batches in flight, enough warm-up forwards
    (and deferred W's) to leave no bubble when F = I = W and m >= 2pp."""
    return generate(pp=pp, microbatches=microbatches, limits=[2 * pp - 1] * pp, **costs)


def _fastest(orders, pp: int, **costs: float) -> dict[int, list]:
    """The first of ``orders`` with the smallest simulated makespan (V placement)."""

    best, best_time = None, float("inf")
    for order in orders:
        t = replay(order, num_stages=2 * pp, **costs).makespan
        if t < best_time - 1e-9:
            best, best_time = order, t
    return best


def zbv(pp: int, microbatches: int, *, f: Cost = 1.0, b: Cost = 1.0,
        w: Cost = 1.0, comm: float = 0.0) -> dict[int, list]:
    """ZB-V: the zero-bubble paper's V order (two stages per rank, at most 2pp stage
    activations: 1F1B's memory), zero bubble at F = I = W with m >= 2pp. For unequal costs
    the W's are re-placed into the gaps by simulation (:func:`titanext.schedules.zbv.fill_gaps`)
    when that is faster, so it is never slower than the paper's (and torch's) fixed order."""
    costs = dict(f=f, b=b, w=w, comm=comm)
    return _fastest(zbv_candidates(pp, microbatches, **costs), pp, **costs)


def search_budget(pp: int, microbatches: int) -> int:
    """Simulations :func:`auto`'s local search may spend per gap-filling policy: about the same
    time whatever the size (one simulation costs time in proportion to pp x microbatches), and
    at least 40. At pp 2 and 8 micro-batches the search needs 120-200 to reach its best for
    the debug model's measured stage costs (1,902 -> 1,883 ms simulated, 0.05 s); at pp 8 and
    32 micro-batches it stops improving within 40 (1.7 s).

    >>> search_budget(2, 8), search_budget(8, 32)
    (256, 40)
    """
    return max(40, 4096 // (pp * microbatches))


def auto(pp: int, microbatches: int, *, f: Cost = 1.0, b: Cost = 1.0,
         w: Cost = 1.0, comm: float = 0.0, mem_limit: int | None = None,
         budget: int | None = None) -> dict[int, list]:
    """The V-placed schedule with the smallest simulated makespan for these costs.

    Costs are per stage: one figure for every V stage (half a rank's layers), or one per stage
    index (a real model's stages differ: 6 blocks on 4 stages are 2, 2, 1, 1, and the ends
    carry the embedding, the head and the loss). ``mem_limit`` caps every rank's
    live activations in units of a rank's share of the model, i.e. 2 V stages (default: pp,
    1F1B's peak). Candidates:

    - when the limit allows 2pp stage activations, ZB-V's order with its W's re-placed for
      the costs, plus a local search (``budget`` simulations per gap-filling policy; default
      :func:`search_budget`) that runs a later F or I where a rank would wait;
    - the zero-bubble paper's heuristic as a list scheduler: warm up as far as the limit
      allows, then 1F1B-like with W in the gaps; every warm-up depth per rank (uniform, and
      tapering by rank like 1F1B), backward-first and forward-first priorities.

    It keeps the fastest; ties go to the earlier candidate (ZB-V's own order first). The
    search is deterministic, so every rank derives the same lists.
    """

    cap = 2 * (pp if mem_limit is None else mem_limit)
    budget = search_budget(pp, microbatches) if budget is None else budget
    if cap < 2:
        raise ValueError(f"mem_limit = {mem_limit} must be >= 1 micro-batch")
    costs = dict(f=f, b=b, w=w, comm=comm)
    best, best_time = None, float("inf")
    if cap >= 2 * pp:
        best = _fastest(zbv_candidates(pp, microbatches, budget=budget, **costs), pp, **costs)
        best_time = replay(best, num_stages=2 * pp, **costs).makespan
    seen = set()
    # a few warm-up depths spread over [2, cap] (each costs 12 generations + replays)
    tops = sorted({cap, cap - 1, (2 + cap) // 2, 2} if cap > 8 else set(range(2, cap + 1)))
    for top in (t for t in tops if t >= 2):
        for taper in (0, 1, 2):
            limits = tuple(max(2, top - taper * r) for r in range(pp))
            for prefer in ("backward", "forward"):
                for admission in (False, True):
                    if (limits, prefer, admission) in seen:
                        continue
                    seen.add((limits, prefer, admission))
                    try:
                        order = generate(pp=pp, microbatches=microbatches, limits=limits,
                                         placement="v", stages_per_rank=2, prefer=prefer,
                                         admission=admission, **costs)
                    except RuntimeError:
                        continue
                    t = replay(order, num_stages=2 * pp, **costs).makespan
                    if t < best_time - 1e-9:
                        best, best_time = order, t
    if best is None:
        raise ValueError(f"Auto: no schedule fits mem_limit = {mem_limit} at pp = {pp}")
    return best


class GeneratedSchedule(ListRuntime):
    """A schedule whose per-rank action lists come from ``generate(pp, microbatches, **costs)``.

    Constructed like torch's multi-stage schedules: ``cls(stages, n_microbatches, loss_fn=...)``
    with this rank's stages (``stages_per_rank`` of them, placed by ``placement``). The lists
    are generated for ``cls.costs`` (equal F, I, W unless the class came from
    :meth:`with_costs`), the same lists :func:`titanext.schedules.simulate` replays.
    """

    placement = "loop"
    stages_per_rank = 1
    splits_backward = True
    costs: dict = {}

    @staticmethod
    def generate(pp: int, microbatches: int, **stage_costs: float) -> dict[int, list]:
        raise NotImplementedError

    @classmethod
    def with_costs(cls, *, f: Cost = 1.0, b: Cost = 1.0, w: Cost = 1.0,
                   comm: float = 0.0, **extra) -> type:
        """This schedule generated for measured costs: ``f``, ``b`` (input grad I), ``w``
        (weight grad W) per micro-batch through a rank's share of the model (1/pp of it), or
        a tuple of each stage's own, by stage index; ``comm`` per send; Auto also takes
        ``mem_limit`` (micro-batches of a rank's share)."""
        return type(cls.__name__, (cls,), {"costs": dict(f=f, b=b, w=w, comm=comm, **extra)})

    @classmethod
    def order(cls, pp: int, microbatches: int) -> dict[int, list]:
        """The compute lists every rank runs: one figure of ``f``, ``b``, ``w`` is a rank's
        share, so a stage costs 1/stages_per_rank of it; a tuple is each stage's own cost."""
        share = 1.0 / cls.stages_per_rank
        c = {"f": 1.0, "b": 1.0, "w": 1.0, "comm": 0.0, **cls.costs}
        stage_costs = {k: (v * share if k in "fbw" and not isinstance(v, tuple) else v)
                       for k, v in c.items()}
        return cls.generate(pp, microbatches, **stage_costs)

    def __init__(self, stages, n_microbatches: int, loss_fn=None, **kwargs):
        super().__init__(stages=stages, n_microbatches=n_microbatches, loss_fn=loss_fn, **kwargs)
        pp = stages[0].group_size
        mapping = {s: r for r in range(pp)
                   for s in stage_ids(self.placement, r, pp, self.stages_per_rank)}
        self._set_order(type(self).order(pp, n_microbatches), mapping)


class Auto(GeneratedSchedule):
    """The V-placed schedule searched for the smallest simulated makespan at ``costs``
    (see :func:`auto`); build one for measured costs with :func:`auto_schedule_class`."""

    placement = "v"
    stages_per_rank = 2
    measures_costs = True  # the trainer times step 1 and rebuilds it for the measured costs

    @staticmethod
    def generate(pp: int, microbatches: int, **stage_costs: float) -> dict[int, list]:
        return auto(pp, microbatches, **stage_costs)


def auto_schedule_class(*, f: Cost = 1.0, b: Cost = 1.0, w: Cost = 1.0,
                        comm: float = 0.0, mem_limit: int | None = None) -> type:
    """An "Auto" schedule class whose lists are searched for these measured costs.

    ``f``, ``b`` (input grad) and ``w`` (weight grad) are the times of one micro-batch through
    1/pp of the model (a rank's share, as in :func:`titanext.schedules.simulate`), or tuples of
    each of the 2pp stages' own times by stage index (what the trainer measures), ``comm`` the
    latency of one send, ``mem_limit`` the activations a rank may hold, in micro-batches of
    its share (default pp, 1F1B's peak). Placement is V with 2 stages per rank.

    >>> cls = auto_schedule_class(f=1.0, b=1.2, w=0.6, comm=0.05)
    >>> cls.placement, cls.stages_per_rank, sorted(cls.costs)
    ('v', 2, ['b', 'comm', 'f', 'mem_limit', 'w'])
    """
    return Auto.with_costs(f=f, b=b, w=w, comm=comm, mem_limit=mem_limit)
