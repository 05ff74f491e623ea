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

from titanext.schedules._torch_ir import B, F, I, W, action


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
             placement: str = "loop", stages_per_rank: int = 1, f: float = 1.0, b: float = 1.0,
             w: float = 1.0, comm: float = 0.0) -> dict[int, list]:
    """Per-rank compute action lists (torch ``_Action``) for the list-scheduling heuristic.

    ``limits[r]`` caps rank r's live stage activations (at least 1). ``split_backward=False``
    runs B = I + W as one action (1F1B-style).
    """
    m = microbatches
    n_stages = pp * stages_per_rank
    owner = {s: r for r in range(pp) for s in stage_ids(placement, r, pp, stages_per_rank)}
    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, mb) -> finish time
    next_mb = {(k, s): 0 for k in "FIW" for s in range(n_stages)}
    free_at = [0.0] * pp
    live = [0] * pp
    order: dict[int, list] = {r: [] for r in range(pp)}
    bw_cost = b if split_backward else b + w
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
                    if kind == "F" and live[r] >= limits[r]:
                        continue
                    t = ready_time(kind, s, j)
                    if t is None:
                        continue
                    # Backward first (deeper stage first), then forward (deeper first), then W.
                    prio = {"I": 0, "F": 1, "W": 2}[kind]
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
                if fill and (choice is None or fill[0][0] + w <= choice[0] + 1e-12):
                    choice = min(fill, key=lambda o: (o[0], o[2]))
                if best is None or choice[0] < best[0] - 1e-12:
                    best = choice
        if best is None:
            raise RuntimeError(f"schedule generation stalled (limits {list(limits)} too small for "
                               f"pp={pp}, stages_per_rank={stages_per_rank})")
        start, _, _, r, kind, s, j = best
        cost = {"F": f, "I": bw_cost, "W": w}[kind]
        free_at[r] = start + cost
        done[(kind, s, j)] = start + cost
        next_mb[(kind, s)] += 1
        finished += 1
        if kind == "F":
            live[r] += 1
        elif kind == "W" or not split_backward:
            live[r] -= 1
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


def zbh1(pp: int, microbatches: int) -> dict[int, list]:
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


def zbv(pp: int, microbatches: int, **costs: float) -> dict[int, list]:
    """ZB-V: two stages per rank in V placement, each rank keeping at most 2pp stage
    activations (the memory of 1F1B's first rank: pp micro-batches of two half-size stages)."""
    return generate(pp=pp, microbatches=microbatches, limits=[2 * pp] * pp, placement="v",
                    stages_per_rank=2, **costs)


def auto(pp: int, microbatches: int, *, f: float = 1.0, b: float = 1.0, w: float = 1.0,
         comm: float = 0.0, memory_limit: int | None = None) -> dict[int, list]:
    """The schedule with the smallest simulated makespan for these costs.

    ``memory_limit`` caps every rank's live micro-batches (default: pp, 1F1B's peak). The
    search runs the list scheduler over per-rank limits between 1F1B's (pp - r) and the
    memory limit, and includes ZB-H1 when it fits, so Auto is never worse than ZB-H1 at 1F1B
    memory.
    """
    from titanext.schedules.simulator import replay

    cap = pp if memory_limit is None else memory_limit
    if cap < 1:
        raise ValueError(f"memory_limit = {memory_limit} must be >= 1 micro-batch")
    costs = dict(f=f, b=b, w=w, comm=comm)
    candidates = [zbh1(pp, microbatches)] if cap >= pp else []
    for extra in range(0, cap):
        limits = [min(cap, pp - r + extra) for r in range(pp)]
        candidates.append(generate(pp=pp, microbatches=microbatches, limits=limits, **costs))
        uniform = [cap] * pp
        if extra == 0:
            candidates.append(generate(pp=pp, microbatches=microbatches, limits=uniform, **costs))
    return min(candidates, key=lambda o: replay(o, num_stages=pp, **costs).makespan)
