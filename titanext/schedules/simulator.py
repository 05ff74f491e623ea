"""Replay per-rank pipeline action lists with costs: makespan, bubble, memory, timeline.

The simulator reads the same compute lists that torch's runtime executes (torch actions per
rank). An action starts when its rank is free and its inputs have arrived: F after the
previous stage's F (+ ``comm`` across ranks), I (or B) after the next stage's I and its own F,
W after its I.

``bubble_ratio`` follows the zero-bubble paper: 1 - busy / C, with C the largest span of any
rank (first action's start to last action's end) and busy that rank's compute time.

Expert-parallel all-to-alls: ``a2a`` is the all-to-all time of one F, I or B chunk (dispatch
and combine of its MoE layers; W has none). Without overlap a chunk's all-to-all is exposed:
the rank waits for it. With ``overlap`` (``[parallelism] expert_parallel_comm_overlap``) the
two chunks of an OVERLAP_F_B pair run interleaved, each side's all-to-all hidden behind the
other side's compute: the pair takes ``cF + cB + max(0, aF - cB) + max(0, aB - cF)``. The
timeline draws the all-to-alls on their own lane under each rank (``comm_events``).

>>> from titanext.schedules import schedule_order
>>> order = schedule_order("DualPipeV", pp=2, microbatches=4)
>>> plain = replay(order, num_stages=4, a2a=0.5)
>>> hidden = replay(order, num_stages=4, a2a=0.5, overlap=True)
>>> hidden.makespan < plain.makespan, sum(hidden.a2a_exposed) < sum(plain.a2a_exposed)
(True, True)
"""

from __future__ import annotations

import gc
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from titanext.schedules._torch_ir import B, F, I, W, leaves

#: the colour and the name of each chunk kind in the timelines (this one and the profiler's)
KIND_COLOURS = {"F": "#4c78a8", "I": "#f58518", "W": "#54a24b", "B": "#e45756"}
KIND_NAMES = {"F": "forward", "I": "input grad", "W": "weight grad", "B": "full backward"}
A2A_COLOUR = "#b279a2"  # the all-to-all lane


@dataclass(slots=True)
class Event:
    rank: int
    stage: int
    kind: str  # "F", "I", "W" or "B"
    microbatch: int
    start: float
    end: float


@dataclass
class SimResult:
    makespan: float
    bubble_ratio: float
    peak_activations: list[int]
    events: list[Event] = field(repr=False)
    #: peak_activations x the stage's share of a rank's layers (1 for one stage per rank, 1/2
    #: for two half-size V stages): activation memory comparable across placements, in units
    #: of one micro-batch through 1/pp of the model.
    peak_memory: list[float] = field(default_factory=list)
    #: the expert-parallel all-to-alls (kind "A"), on their own lane: not compute
    comm_events: list[Event] = field(default_factory=list, repr=False)
    #: per rank: all-to-all time the rank waited for (not hidden behind compute)
    a2a_exposed: list[float] = field(default_factory=list)
    #: the compiled lists replayed: ``events`` come in its steps' order whatever the costs, so
    #: what depends only on that order can be worked out once per program (the planner does)
    program: ReplayProgram | None = field(default=None, repr=False, compare=False)
    #: per rank: seconds of compute (its events' ``end - start``, summed in their order)
    busy: list[float] = field(default_factory=list)

    def timeline(self, width: int = 96) -> str:
        """One text row per rank: each slot shows the kind (F, I, W, B) of what runs there; a
        row under it shows the rank's all-to-alls (A) when there are any."""
        scale = width / self.makespan

        def row(events) -> str:
            line = [" "] * width
            for e in events:
                a, b = int(e.start * scale + 1e-9), max(int(e.start * scale + 1e-9) + 1,
                                                        int(e.end * scale + 1e-9))
                for x in range(a, min(b, width)):
                    line[x] = e.kind if x > a else str(e.microbatch % 10)
            return "".join(line)

        rows = []
        for r in sorted({e.rank for e in self.events}):
            rows.append(f"rank {r} |{row(e for e in self.events if e.rank == r)}|")
            comm = [e for e in self.comm_events if e.rank == r]
            if comm:
                rows.append(f"  a2a  |{row(comm)}|")
        return "\n".join(rows)

    def svg(self, title: str = "") -> str:
        """The timeline as SVG: one row per rank, coloured by kind, labelled by micro-batch."""
        colours = {**KIND_COLOURS, "A": A2A_COLOUR}
        ranks = sorted({e.rank for e in self.events})
        lanes = 2 if self.comm_events else 1  # compute, then the all-to-all lane
        scale, row = 900 / self.makespan, 26
        out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="980" '
               f'height="{70 + row * lanes * len(ranks)}" font-family="sans-serif" '
               'font-size="10">',
               f'<text x="10" y="16" font-size="13">{title}</text>']
        for e in [*self.events, *self.comm_events]:
            lane = ranks.index(e.rank) * lanes + (e.kind == "A")
            x, y = 60 + e.start * scale, 28 + lane * row
            wdt = (e.end - e.start) * scale
            out.append(f'<rect x="{x:.1f}" y="{y}" width="{wdt:.1f}" height="{row - 4}" '
                       f'fill="{colours[e.kind]}" stroke="white"><title>stage {e.stage} '
                       f'{e.kind}{e.microbatch}</title></rect>')
            out.append(f'<text x="{x + wdt / 2:.1f}" y="{y + 15}" text-anchor="middle" '
                       f'fill="white">{e.microbatch}</text>')
        for i, r in enumerate(ranks):
            out.append(f'<text x="8" y="{28 + i * lanes * row + 15}">rank {r}</text>')
            if lanes == 2:
                out.append(f'<text x="8" y="{28 + (i * 2 + 1) * row + 15}">a2a</text>')
        y = 28 + len(ranks) * lanes * row + 12
        names = {**KIND_NAMES, "A": "all-to-all"}
        kinds = [k for k in colours if any(e.kind == k for e in [*self.events,
                                                                 *self.comm_events])]
        for i, k in enumerate(kinds):  # legend
            out.append(f'<rect x="{60 + 130 * i}" y="{y - 10}" width="12" height="12" '
                       f'fill="{colours[k]}"/>'
                       f'<text x="{76 + 130 * i}" y="{y}">{k}: {names[k]}</text>')
        out.append(f'<text x="{60 + 130 * len(kinds)}" y="{y}">number = micro-batch; '
                   f'makespan {self.makespan:g}, bubble {self.bubble_ratio:.3f}</text>')
        out.append("</svg>")
        return "\n".join(out)


_KIND = {F: "F", I: "I", W: "W", B: "B"}


#: a chunk's cost: one figure for every stage, or one per stage index
Cost = float | Mapping[int, float] | Sequence[float]


def stage_cost(c: Cost, stage: int) -> float:
    """Stage ``stage``'s figure of ``c`` (one figure for all stages, or one per stage)."""
    return float(c) if isinstance(c, (int, float)) else float(c[stage])


def replay(order: dict[int, list] | ReplayProgram, *, num_stages: int, f: Cost = 1.0, b: Cost = 1.0,
           w: Cost = 1.0, full_b: Cost | None = None, comm: float = 0.0,
           overhead: float = 0.0, stage_size: float = 1.0, a2a: Cost = 0.0,
           a2a_b: Cost | None = None, overlap: bool = False,
           comm_events: bool = True) -> SimResult:
    """Simulate per-rank compute lists; raises ValueError if they deadlock. ``order`` may be
    compiled already (:func:`compile_order`: the same lists replayed with other costs).

    ``num_stages`` is the length of the chain a micro-batch runs through. The rank of a stage
    may depend on the micro-batch (DualPipe's two directions). An OVERLAP_F_B action runs its
    two chunks back to back on its rank, or interleaved with ``overlap`` (module docstring).

    Costs: ``f``, ``b`` (input gradient I), ``w`` (weight gradient W) and ``full_b`` (a full
    backward B; default b + w) are each one figure or one per stage index (a real model's
    first and last stages carry the embedding, the head and the loss). ``comm`` is the latency
    of a cross-rank dependency; ``overhead`` is the runtime's own time per chunk on its rank
    (issuing the chunk's sends and receives, bookkeeping), which occupies the rank but is not
    counted as busy in ``bubble_ratio``. ``a2a`` is one F chunk's expert-parallel all-to-all
    time and ``a2a_b`` one I or B chunk's (default ``a2a``; more under full AC, whose backward
    recomputes the forward's), each one figure or one per stage. ``comm_events=False`` leaves
    the all-to-all lane (``SimResult.comm_events``) empty, every figure as it is (the planner
    replays thousands of schedules and draws none).

    >>> from titanext.schedules import schedule_order
    >>> order = schedule_order("1F1B", pp=2, microbatches=4)
    >>> replay(order, num_stages=2).makespan, replay(order, num_stages=2, f=[1, 2]).makespan
    (15.0, 19.0)
    """
    program = order if isinstance(order, ReplayProgram) else compile_order(
        order, num_stages=num_stages, overlap=overlap)
    by_kind = {"F": f, "I": b, "W": w, "B": full_b}

    def cost(kind: str, stage: int) -> float:
        if kind == "B" and full_b is None:
            return cost("I", stage) + cost("W", stage)
        return stage_cost(by_kind[kind], stage)

    def a2a_of(kind: str, stage: int) -> float:
        if kind == "W":
            return 0.0
        return stage_cost(a2a if kind == "F" or a2a_b is None else a2a_b, stage)

    # (compute, all-to-all) seconds of each (kind, stage)
    costs = {(k, s): (cost(k, s), a2a_of(k, s)) for k, s in program.kind_stages}
    # Events refer to nothing that refers back: reference counting frees them, and with the
    # cyclic collector paused it does not walk a long replay's thousands of them again and
    # again (half the time of the planner's advice, which replays hundreds of schedules)
    paused = gc.isenabled()
    gc.disable()
    try:
        events, lane, exposed, spans = _place_all(program, costs, comm, overhead, comm_events)
    finally:
        if paused:
            gc.enable()
    result = _result(events, lane, program.ranks, program.peak, exposed, stage_size, spans)
    result.program = program
    return result


def _place_all(program: ReplayProgram, costs: dict, comm: float, overhead: float,
               comm_events: bool) -> tuple[list, list, dict, tuple]:
    """:func:`replay`'s events: each step at the earliest its rank and inputs allow, in the
    program's order; (events, all-to-all lane, exposed all-to-all per rank, _result's spans)."""
    done = [0.0] * program.slots  # the end of each F and I (a B's too) the others wait for
    free = dict.fromkeys(program.ranks, 0.0)
    events: list[Event] = []
    lane: list[Event] = []  # the all-to-alls (comm_events)
    exposed = dict.fromkeys(program.ranks, 0.0)
    # each rank's first start, last end and busy seconds (its events' in order), for _result
    first: dict[int, float] = {}  # ranks in the order of their first event
    last = dict.fromkeys(program.ranks, -math.inf)
    busy = dict.fromkeys(program.ranks, 0.0)
    comm_last = dict.fromkeys(program.ranks, -math.inf)  # the last all-to-all's end
    add = events.append
    add_comm = lane.append if comm_events else _skip
    for r, k, s, j, key, tag, a_slot, b_slot, cross, write in _flat_steps(program):
        start = free[r]
        if k is None:  # an interleaved pair: s, j, key are its unit, needs and writes
            unit, needs, write = s, j, key
            for need in needs:  # each chunk's inputs (compile_order's tags)
                t = _ready(need[0], done, need[1:], comm)
                if t > start:
                    start = t
            # each side's all-to-all runs while the other side computes
            (kf, sf, jf), (kb, sb, jb) = unit
            (cf, af), (cb, ab) = costs[kf, sf], costs[kb, sb]
            hide_b, hide_f = max(0.0, ab - cf), max(0.0, af - cb)
            f_end = start + cf
            add(Event(r, sf, kf, jf, start, f_end))
            busy[r] += f_end - start
            mid = start + cf + hide_b
            last_end = mid + cb
            add(Event(r, sb, kb, jb, mid, last_end))
            busy[r] += last_end - mid
            if ab:
                add_comm(Event(r, sb, "A", jb, start, start + ab))
                comm_last[r] = max(comm_last[r], start + ab)
            if af:
                add_comm(Event(r, sf, "A", jf, mid, mid + af))
                comm_last[r] = max(comm_last[r], mid + af)
            exposed[r] += hide_b + hide_f
            end = mid + cb + hide_f
            start, last_end = min(start, mid), max(f_end, last_end)  # the unit's span
        else:  # one chunk (kind k, stage s, micro-batch j), its all-to-all exposed after it
            if tag == _SENT:
                t = done[a_slot] + (comm if cross else 0.0)
            elif tag == _BACKWARD:
                t = max(done[a_slot], done[b_slot] + (comm if cross else 0.0))
            else:
                t = done[a_slot] if tag == _AFTER else 0.0
            if t > start:
                start = t
            c, a = costs[key]
            end = start + c
            add(Event(r, s, k, j, start, end))
            busy[r] += end - start
            last_end = end
            if a:
                add_comm(Event(r, s, "A", j, end, end + a))
                end += a
                exposed[r] += a
                comm_last[r] = max(comm_last[r], end)
        if start < first.get(r, math.inf):
            first[r] = start
        if last_end > last[r]:
            last[r] = last_end
        free[r] = end + overhead
        if isinstance(write, int):
            if write >= 0:
                done[write] = end
        else:
            for slot in write:
                done[slot] = end
    return events, lane, exposed, (first, last, busy, comm_last)


def _ready(tag: int, done: list[float], slots: tuple, comm: float) -> float:
    """When a chunk's input (compile_order's tagged ``slots``) is there."""
    if tag == _FIRST:
        return 0.0
    if tag == _AFTER:
        return done[slots[0]]
    if tag == _SENT:
        return done[slots[0]] + (comm if slots[1] else 0.0)
    # _BACKWARD: its own F, and the next stage's input gradient
    return max(done[slots[0]], done[slots[1]] + (comm if slots[2] else 0.0))


def _flat_steps(program: ReplayProgram) -> list[tuple]:
    """``program``'s steps, a one-chunk step as (rank, kind, stage, micro-batch, (kind, stage),
    its input's tag, slot, second slot, cross-rank, the slot it ends or -1), read the fastest;
    any other as (rank, None, unit, needs, writes, ...). Made once per program, kept in its
    ``derived``."""
    flat = program.derived.get("flat steps")
    if flat is not None:
        return flat
    out = []
    for r, unit, needs, writes in program.steps:
        if len(unit) == 1 and len(needs) == 1 and len(writes) <= 1:
            (k, s, j), (need,) = unit[0], needs
            tag = need[0]
            if tag == _BACKWARD:
                a_slot, b_slot, cross = need[1], need[2], bool(need[3])
            elif tag == _SENT:
                a_slot, b_slot, cross = need[1], 0, bool(need[2])
            else:
                a_slot, b_slot, cross = (need[1] if tag == _AFTER else 0), 0, False
            out.append((r, k, s, j, (k, s), tag, a_slot, b_slot, cross,
                        writes[0] if writes else -1))
        else:
            out.append((r, None, unit, needs, writes, None, 0, 0, False, ()))
    program.derived["flat steps"] = out
    return out


def _skip(_event) -> None:
    """Where no all-to-all lane is kept."""


# what a chunk waits for, in a ReplayProgram's steps: nothing (the first stage's F), one slot
# (a backward of the last stage: its own F; a W: its I), one slot sent from another stage (F:
# the previous stage's F), or a backward's own F and the next stage's input gradient
_FIRST, _AFTER, _SENT, _BACKWARD = range(4)


@dataclass(frozen=True)
class ReplayProgram:
    """An order's replay worked out once, whatever the costs (:func:`compile_order`): the
    order in which :func:`replay` places the chunks (which action can start next depends only
    on which have run, not on when), what each waits for, and the ranks' activation peaks.
    The planner replays the same order with many costs."""

    ranks: tuple[int, ...]
    #: (rank, unit: its (kind, stage, micro-batch) chunks, what each chunk waits for (a
    #: tagged tuple of slots, and whether a slot comes from another rank), the slots it ends)
    steps: tuple[tuple, ...]
    slots: int
    kind_stages: frozenset
    peak: dict[int, int]
    #: what a reader works out of the program once, whatever the costs, by name (the replay's
    #: flat steps, the planner's event index): it lives and dies with the program
    derived: dict[str, object] = field(default_factory=dict, compare=False, repr=False)


def compile_order(order: dict[int, list], *, num_stages: int,
                  overlap: bool = False) -> ReplayProgram:
    """``order``'s :class:`ReplayProgram` (for :func:`replay`); raises ValueError if the
    lists deadlock.

    >>> from titanext.schedules import schedule_order
    >>> program = compile_order(schedule_order("1F1B", pp=2, microbatches=4), num_stages=2)
    >>> replay(program, num_stages=2).makespan, program.peak
    (15.0, {0: 2, 1: 1})
    """
    order_units = {r: [u for a in acts for u in _units(a, overlap)] for r, acts in order.items()}
    # each unit as (kind, stage, micro-batch) triples, read once
    units = {r: [tuple((_KIND[x.computation_type], x.stage_index, x.microbatch_index)
                       for x in u) for u in us] for r, us in order_units.items()}
    owner = {(s, j): r for r, us in units.items() for u in us for _, s, j in u}
    slot: dict[tuple[str, int, int], int] = {}  # each F and I that has run: its slot

    def need(kind: str, s: int, j: int) -> tuple | None:
        """What chunk (kind, s, j) waits for, or None while some of it has not run."""
        if kind == "F":
            if s == 0:
                return (_FIRST,)
            dep = slot.get(("F", s - 1, j))
            return None if dep is None else (_SENT, dep, owner[s - 1, j] != owner[s, j])
        if kind in ("I", "B"):
            own = slot.get(("F", s, j))
            if own is None:
                return None
            if s == num_stages - 1:
                return (_AFTER, own)
            dep = slot.get(("I", s + 1, j))
            if dep is None:
                return None
            return (_BACKWARD, own, dep, owner[s + 1, j] != owner[s, j])
        dep = slot.get(("I", s, j))
        return None if dep is None else (_AFTER, dep)

    steps = []
    pos = dict.fromkeys(units, 0)
    live = dict.fromkeys(units, 0)
    peak = dict.fromkeys(units, 0)
    remaining = sum(len(us) for us in units.values())
    while remaining:
        progressed = False
        for r, us in units.items():
            while pos[r] < len(us):
                unit = us[pos[r]]
                needs = []
                for kind, s, j in unit:
                    n = need(kind, s, j)
                    if n is None:
                        break
                    needs.append(n)
                else:
                    writes = []
                    for kind, s, j in unit:
                        if kind != "W":  # a full backward is also the input gradient others
                            key = ("F" if kind == "F" else "I", s, j)  # wait for
                            writes.append(slot.setdefault(key, len(slot)))
                        if kind == "F":
                            live[r] += 1
                            peak[r] = max(peak[r], live[r])
                        elif kind in ("W", "B"):
                            live[r] -= 1
                    steps.append((r, unit, tuple(needs), tuple(writes)))
                    pos[r] += 1
                    remaining -= 1
                    progressed = True
                    continue
                break
        if not progressed:
            stuck = {r: str(order_units[r][pos[r]]) for r in units if pos[r] < len(units[r])}
            raise ValueError(f"the schedule deadlocks; next actions per rank: {stuck}")
    kind_stages = frozenset((k, s) for us in units.values() for u in us for k, s, _ in u)
    return ReplayProgram(tuple(units), tuple(steps), len(slot), kind_stages, peak)


def _units(a, overlap: bool) -> list[tuple]:
    """The chunks that run as one: an OVERLAP_F_B pair of a forward and a backward when
    overlapping, else each chunk alone."""
    xs = leaves(a)
    if overlap and len(xs) == 2 and xs[0].computation_type == F \
            and xs[1].computation_type in (I, B):
        return [xs]
    return [(x,) for x in xs]


def _result(events, comm_events, ranks, peak, exposed, stage_size, spans) -> SimResult:
    """``spans``: each rank's first start (ranks in the order of their first event), last end
    and busy seconds over its compute events, and its last all-to-all's end, which replay
    keeps as it goes."""
    first, last, busy_by_rank, comm_last = spans
    last = {r: last[r] for r in first}
    makespan = max(last.values()) - min(first.values())
    for r in last:  # an exposed all-to-all ends a rank's span too
        last[r] = max(last[r], comm_last[r])
    makespan = max(makespan, max(last.values()) - min(first.values()))
    widest = max(first, key=lambda r: last[r] - first[r])
    span, busy = last[widest] - first[widest], busy_by_rank[widest]
    ranks = sorted(ranks)
    return SimResult(makespan=makespan, bubble_ratio=1 - busy / span,
                     peak_activations=[peak[r] for r in ranks], events=events,
                     peak_memory=[peak[r] * stage_size for r in ranks],
                     comm_events=comm_events, a2a_exposed=[exposed[r] for r in ranks],
                     busy=[busy_by_rank.get(r, 0.0) for r in ranks])
