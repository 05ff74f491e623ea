"""ZB-V: the zero-bubble paper's V schedule, and a cost-aware re-timing that fills gaps with W.

Placement V: rank r holds stage r (chunk 0, on the way down) and stage 2p-1-r (chunk 1, on the
way back up), so a micro-batch enters and leaves the pipeline on rank 0.

:func:`zbv_construction` is the paper's hand-built order (Qi et al., "Zero Bubble Pipeline
Parallelism", section 6), with ``warmup`` as a knob. Rank r runs

1. ``2(p-r)-1`` chunk-0 forwards (the V's left arm fills);
2. ``r`` pairs (chunk-1 forward, chunk-0 forward);
3. ``p-r`` triples (chunk-1 F, I, W): the bottom of the V starts its backward;
4. the steady state: [chunk-0 F], chunk-0 I, W, chunk-1 F, I, W until every forward ran;
5. the cool-down: ``r`` pairs (chunk-0 I, chunk-1 I) with their W's deferred, ``p-r`` pairs
   (chunk-0 I, W), then the deferred W's.

Each rank then holds at most 2p stage activations (p micro-batches of its two half-size
stages: 1F1B's memory) and, with F = I = W, the pipeline has no bubble once m >= 2p.

With unequal costs the fixed W positions leave gaps (an I waits for the gradient from the next
rank while W's sit later in the list). :func:`fill_gaps` keeps each rank's F/I order and
re-places every W by simulation: a W runs when the next F or I is not ready yet and the W
ends before it could start (or, with ``slack`` < 1, overlaps it by at most
``(1 - slack) x W``), when the memory limit needs one before a forward, or at the end.

>>> order = zbv_construction(4, 8)
>>> " ".join(str(a) for a in order[3][:8])
'3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3'
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from titanext.schedules._torch_ir import F, I, W, action
from titanext.schedules.simulator import Cost, stage_cost


def zbv_construction(pp: int, microbatches: int, *, warmup: Sequence[int] | None = None
                     ) -> dict[int, list]:
    """The zero-bubble paper's ZB-V order (compute actions per rank).

    ``warmup[r]`` replaces rank r's count of leading chunk-0 forwards (default ``2(p-r)-1``);
    fewer warm-up forwards save memory, more hide longer backward chains.
    """
    return {r: _zbv_rank(r, pp, microbatches, 2 * (pp - r) - 1 if warmup is None else warmup[r])
            for r in range(pp)}


def _zbv_rank(r: int, p: int, m: int, first: int) -> list:
    stage = (r, 2 * p - 1 - r)
    n = {(k, c): 0 for k in (F, I, W) for c in (0, 1)}
    ops: list = []

    def emit(*steps: tuple) -> None:
        for kind, chunk in steps:
            j = n[kind, chunk]
            n[kind, chunk] += 1
            if j < m:  # the pattern is laid out for max(m, 2p-1) micro-batches
                ops.append(action(stage[chunk], kind, j))

    emit(*[(F, 0)] * first)
    emit(*[(F, 1), (F, 0)] * r)
    emit(*[(F, 1), (I, 1), (W, 1)] * (p - r))
    total = max(m, 2 * p - 1)
    while n[F, 1] < n[F, 0] or n[F, 0] < total:
        if n[F, 0] < total:
            emit((F, 0))
        emit((I, 0), (W, 0), (F, 1), (I, 1), (W, 1))
    emit(*[(I, 0), (I, 1)] * r)
    while n[I, 0] < n[F, 0]:
        emit((I, 0), (W, 0))
    while n[I, 1] < n[F, 1]:
        emit((I, 1))
    emit(*[(W, 1)] * (n[I, 1] - n[W, 1]))
    emit(*[(W, 0)] * (n[I, 0] - n[W, 0]))
    return ops


def fill_gaps(order: dict[int, list], *, num_stages: int, owner: dict[int, int],
              limits: Sequence[int], f: Cost = 1.0, b: Cost = 1.0,
              w: Cost = 1.0, comm: float = 0.0, slack: float = 1.0) -> dict[int, list]:
    """Keep each rank's F and I order from ``order`` and re-place its W's for these costs (one
    figure for every stage, or one per stage index).

    ``owner`` maps stage -> rank, ``limits[r]`` caps rank r's live stage activations (a W frees
    one). Raises RuntimeError if the F/I order cannot run within the limits.
    """
    skel = {r: [a for a in acts if a.computation_type in (F, I)] for r, acts in order.items()}
    return _fill(skel, num_stages, owner, limits, f, b, w, comm, slack)[0]


def _fill(skel: dict[int, list], num_stages: int, owner: dict[int, int], limits: Sequence[int],
          f: Cost, b: Cost, w: Cost, comm: float, slack: float):
    """fill_gaps on F/I lists: (full lists, makespan, [(rank, index) of F/I that waited])."""
    pp = len(skel)
    done: dict[tuple, float] = {}
    free = [0.0] * pp
    pos = [0] * pp
    live = [0] * pp
    pending: list[deque] = [deque() for _ in range(pp)]
    out: dict[int, list] = {r: [] for r in range(pp)}
    waited: list[tuple[int, int]] = []
    cost = {k: [stage_cost(c, s) for s in range(num_stages)] for k, c in ((F, f), (I, b), (W, w))}
    quickest = min(min(cost[F]), min(cost[I]))
    hop = {s: comm if owner[s] != owner.get(s + 1, owner[s]) else 0.0 for s in owner}

    def ready(a) -> float | None:
        s, j = a.stage_index, a.microbatch_index
        if a.computation_type == F:
            if s == 0:
                return 0.0
            dep = done.get((F, s - 1, j))
            return None if dep is None else dep + hop[s - 1]
        own = done.get((F, s, j))
        if own is None or s == num_stages - 1:
            return own
        dep = done.get((I, s + 1, j))
        return None if dep is None else max(own, dep + hop[s])

    remaining = sum(len(a) for a in skel.values())
    while remaining or any(pending):
        best = None  # (start, is_w, rank, action)
        for r in range(pp):
            if pos[r] == len(skel[r]):
                cand = (free[r], 1, r, None) if pending[r] else None
            else:
                a = skel[r][pos[r]]
                if a.computation_type == F and live[r] >= limits[r]:
                    # memory is full: a W must free some (or an I elsewhere comes first)
                    cand = (free[r], 1, r, None) if pending[r] else None
                else:
                    t = ready(a)
                    # an input not here yet cannot arrive before another rank computes it
                    soon = free[r] + quickest + comm if t is None else max(t, free[r])
                    if pending[r] and soon > free[r] and \
                            soon - free[r] >= slack * cost[W][pending[r][0][0]] - 1e-12:
                        cand = (free[r], 1, r, None)  # a W fills the gap
                    else:
                        cand = None if t is None else (soon, 0, r, a)
            if cand is not None and (best is None or cand[:3] < best[:3]):
                best = cand
        if best is None:
            raise RuntimeError("fill_gaps: the F/I order stalls within these memory limits")
        start, _, r, a = best
        if a is None:
            s, j = pending[r].popleft()
            a = action(s, W, j)
            live[r] -= 1
        else:
            if start > free[r] + 1e-12:
                waited.append((r, pos[r]))
            pos[r] += 1
            remaining -= 1
            if a.computation_type == F:
                live[r] += 1
            else:
                pending[r].append((a.stage_index, a.microbatch_index))
        free[r] = start + cost[a.computation_type][a.stage_index]
        done[(a.computation_type, a.stage_index, a.microbatch_index)] = free[r]
        out[r].append(a)
    return out, max(free), waited


def improve(skel: dict[int, list], *, budget: int, num_stages: int, owner: dict[int, int],
            limits: Sequence[int], f: Cost, b: Cost, w: Cost, comm: float,
            slack: float, reach: int = 4):
    """Local search on F/I lists (first improvement, at most ``budget`` simulations, so every
    rank derives the same lists). Moves, in this order: where a rank waited before an action,
    run one of the next ``reach`` actions there instead; then swap any two neighbouring
    actions of a rank. Returns (full lists, makespan)."""
    args = (num_stages, owner, limits, f, b, w, comm, slack)
    skel = {r: list(a) for r, a in skel.items()}
    out, best, waited = _fill(skel, *args)
    evals = 1

    def moves():
        for r, i in waited:
            for k in range(i + 1, min(i + 1 + reach, len(skel[r]))):
                yield r, skel[r][:i] + [skel[r][k]] + skel[r][i:k] + skel[r][k + 1:]
        for r, acts in skel.items():
            for i in range(len(acts) - 1):
                if acts[i].stage_index != acts[i + 1].stage_index or \
                        acts[i].computation_type != acts[i + 1].computation_type:
                    yield r, acts[:i] + [acts[i + 1], acts[i]] + acts[i + 2:]

    improved = True
    while improved and evals < budget:
        improved = False
        for r, acts in moves():
            if evals >= budget:
                break
            trial = {**skel, r: acts}
            evals += 1
            try:
                t_out, t, t_waited = _fill(trial, *args)
            except RuntimeError:
                continue
            if t < best - 1e-9:
                skel, out, best, waited, improved = trial, t_out, t, t_waited, True
                break
    return out, best


def v_owner(pp: int) -> dict[int, int]:
    """Stage -> rank for the V placement (rank r holds stages r and 2p-1-r)."""
    return {s: min(s, 2 * pp - 1 - s) for s in range(2 * pp)}


def zbv_candidates(pp: int, microbatches: int, *, f: Cost = 1.0, b: Cost = 1.0,
                   w: Cost = 1.0, comm: float = 0.0, budget: int = 0
                   ) -> list[dict[int, list]]:
    """The paper's order, then the same F/I order with W's re-placed for these costs (three
    gap-filling policies), then (``budget`` > 0) a local search on top; all within 2p stage
    activations per rank."""
    base = zbv_construction(pp, microbatches)
    kw = dict(num_stages=2 * pp, owner=v_owner(pp), limits=[2 * pp] * pp, f=f, b=b, w=w,
              comm=comm)
    out = [base]
    skel = {r: [a for a in acts if a.computation_type in (F, I)] for r, acts in base.items()}
    for slack in (1.0, 0.5, 0.0):
        try:
            out.append(_fill(skel, kw["num_stages"], kw["owner"], kw["limits"], f, b, w, comm,
                             slack)[0])
            if budget:
                out.append(improve(skel, budget=budget, slack=slack, **kw)[0])
        except RuntimeError:
            continue
    return out


def v_lower_bound(pp: int, microbatches: int, *, f: float = 1.0, b: float = 1.0, w: float = 1.0,
                  comm: float = 0.0, cap: int | None = None) -> float:
    """A lower bound on the makespan of ANY V-placed schedule whose ranks hold at most ``cap``
    stage activations (default 2pp: 1F1B's memory); costs per stage as in :func:`fill_gaps`.

    Rank p-1 (stages p-1 and p) cannot start before (p-1)(f + comm). Its first backward, the I
    of stage p for micro-batch 0, needs that micro-batch's forwards through stages p..2p-1 and
    its input gradients back down to stage p+1: it cannot start before a window of
    2f + (p-1)(f + b) + 2(p-1)comm has passed. Until then the rank can only run forwards (a W
    needs an I), at most ``cap`` of them, so it idles at least window - cap x f. It then still
    has 2m(f + b + w) of work.

    >>> v_lower_bound(4, 8, f=0.5, b=1.0, w=0.5)   # F=1, I=2, W=1 per rank share
    35.0
    """
    p, m = pp, microbatches
    cap = 2 * p if cap is None else cap
    window = 2 * f + (p - 1) * (f + b) + 2 * (p - 1) * comm
    idle = max(0.0, window - min(cap, 2 * m) * f)
    return (p - 1) * (f + comm) + idle + 2 * m * (f + b + w)
