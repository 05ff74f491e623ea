"""Replay per-rank pipeline action lists with costs: makespan, bubble, memory, timeline.

The simulator reads the same compute lists that torch's runtime executes (torch actions per
rank). An action starts when its rank is free and its inputs have arrived: F after the
previous stage's F (+ ``comm`` across ranks), I (or B) after the next stage's I and its own F,
W after its I.

``bubble_ratio`` follows the zero-bubble paper: 1 - busy / C, with C the largest span of any
rank (first action's start to last action's end) and busy that rank's compute time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from titanext.schedules._torch_ir import B, F, I, W, leaves

#: the colour and the name of each chunk kind in the timelines (this one and the profiler's)
KIND_COLOURS = {"F": "#4c78a8", "I": "#f58518", "W": "#54a24b", "B": "#e45756"}
KIND_NAMES = {"F": "forward", "I": "input grad", "W": "weight grad", "B": "full backward"}


@dataclass
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

    def timeline(self, width: int = 96) -> str:
        """One text row per rank: each slot shows the kind (F, I, W, B) of what runs there."""
        scale = width / self.makespan
        rows = []
        for r in sorted({e.rank for e in self.events}):
            line = [" "] * width
            for e in (e for e in self.events if e.rank == r):
                a, b = int(e.start * scale + 1e-9), max(int(e.start * scale + 1e-9) + 1,
                                                        int(e.end * scale + 1e-9))
                for x in range(a, min(b, width)):
                    line[x] = e.kind if x > a else str(e.microbatch % 10)
            rows.append(f"rank {r} |{''.join(line)}|")
        return "\n".join(rows)

    def svg(self, title: str = "") -> str:
        """The timeline as SVG: one row per rank, coloured by kind, labelled by micro-batch."""
        colours = KIND_COLOURS
        ranks = sorted({e.rank for e in self.events})
        scale, row = 900 / self.makespan, 26
        out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="980" '
               f'height="{70 + row * len(ranks)}" font-family="sans-serif" font-size="10">',
               f'<text x="10" y="16" font-size="13">{title}</text>']
        for e in self.events:
            x, y = 60 + e.start * scale, 28 + ranks.index(e.rank) * row
            wdt = (e.end - e.start) * scale
            out.append(f'<rect x="{x:.1f}" y="{y}" width="{wdt:.1f}" height="{row - 4}" '
                       f'fill="{colours[e.kind]}" stroke="white"><title>stage {e.stage} '
                       f'{e.kind}{e.microbatch}</title></rect>')
            out.append(f'<text x="{x + wdt / 2:.1f}" y="{y + 15}" text-anchor="middle" '
                       f'fill="white">{e.microbatch}</text>')
        for i, r in enumerate(ranks):
            out.append(f'<text x="8" y="{28 + i * row + 15}">rank {r}</text>')
        y = 28 + len(ranks) * row + 12
        kinds = [k for k in colours if any(e.kind == k for e in self.events)]
        for i, k in enumerate(kinds):  # legend
            out.append(f'<rect x="{60 + 130 * i}" y="{y - 10}" width="12" height="12" '
                       f'fill="{colours[k]}"/>'
                       f'<text x="{76 + 130 * i}" y="{y}">{k}: {KIND_NAMES[k]}</text>')
        out.append(f'<text x="{60 + 130 * len(kinds)}" y="{y}">number = micro-batch; '
                   f'makespan {self.makespan:g}, bubble {self.bubble_ratio:.3f}</text>')
        out.append("</svg>")
        return "\n".join(out)


_KIND = {F: "F", I: "I", W: "W", B: "B"}


#: a chunk's cost: one figure for every stage, or one per stage index
Cost = float | Mapping[int, float] | Sequence[float]


def replay(order: dict[int, list], *, num_stages: int, f: Cost = 1.0, b: Cost = 1.0,
           w: Cost = 1.0, full_b: Cost | None = None, comm: float = 0.0,
           overhead: float = 0.0, stage_size: float = 1.0) -> SimResult:
    """Simulate per-rank compute lists; raises ValueError if they deadlock.

    ``num_stages`` is the length of the chain a micro-batch runs through. The rank of a stage
    may depend on the micro-batch (DualPipe's two directions). An OVERLAP_F_B action runs its
    two chunks back to back on its rank.

    Costs: ``f``, ``b`` (input gradient I), ``w`` (weight gradient W) and ``full_b`` (a full
    backward B; default b + w) are each one figure or one per stage index (a real model's
    first and last stages carry the embedding, the head and the loss). ``comm`` is the latency
    of a cross-rank dependency; ``overhead`` is the runtime's own time per chunk on its rank
    (issuing the chunk's sends and receives, bookkeeping), which occupies the rank but is not
    counted as busy in ``bubble_ratio``.

    >>> from titanext.schedules import schedule_order
    >>> order = schedule_order("1F1B", pp=2, microbatches=4)
    >>> replay(order, num_stages=2).makespan, replay(order, num_stages=2, f=[1, 2]).makespan
    (15.0, 19.0)
    """
    order = {r: [x for a in acts for x in leaves(a)] for r, acts in order.items()}
    owner = {(a.stage_index, a.microbatch_index): r for r, acts in order.items() for a in acts}
    by_kind = {"F": f, "I": b, "W": w, "B": full_b}

    def cost(kind: str, stage: int) -> float:
        if kind == "B" and full_b is None:
            return cost("I", stage) + cost("W", stage)
        c = by_kind[kind]
        return float(c) if isinstance(c, (int, float)) else float(c[stage])
    done: dict[tuple[str, int, int], float] = {}
    pos = {r: 0 for r in order}
    free = {r: 0.0 for r in order}
    events: list[Event] = []
    live = {r: 0 for r in order}
    peak = {r: 0 for r in order}

    def ready(kind: str, s: int, j: int) -> float | None:
        if kind == "F":
            if s == 0:
                return 0.0
            dep = done.get(("F", s - 1, j))
            return None if dep is None else dep + (comm if owner[s - 1, j] != owner[s, j] else 0.0)
        if kind in ("I", "B"):
            own = done.get(("F", s, j))
            if own is None:
                return None
            if s == num_stages - 1:
                return own
            dep = done.get(("I", s + 1, j))
            if dep is None:
                return None
            return max(own, dep + (comm if owner[s + 1, j] != owner[s, j] else 0.0))
        return done.get(("I", s, j))

    remaining = sum(len(a) for a in order.values())
    while remaining:
        progressed = False
        for r, acts in order.items():
            while pos[r] < len(acts):
                a = acts[pos[r]]
                kind = _KIND[a.computation_type]
                t = ready(kind, a.stage_index, a.microbatch_index)
                if t is None:
                    break
                start = max(t, free[r])
                end = start + cost(kind, a.stage_index)
                free[r] = end + overhead
                done[(kind, a.stage_index, a.microbatch_index)] = end
                if kind == "B":  # a full backward is also the input gradient others wait for
                    done[("I", a.stage_index, a.microbatch_index)] = end
                events.append(Event(r, a.stage_index, kind, a.microbatch_index, start, end))
                if kind == "F":
                    live[r] += 1
                    peak[r] = max(peak[r], live[r])
                elif kind in ("W", "B"):
                    live[r] -= 1
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(order[r][pos[r]]) for r in order if pos[r] < len(order[r])}
            raise ValueError(f"the schedule deadlocks; next actions per rank: {stuck}")
    makespan = max(e.end for e in events) - min(e.start for e in events)
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    busy_by_rank: dict[int, float] = {}
    for e in events:
        first[e.rank] = min(first.get(e.rank, e.start), e.start)
        last[e.rank] = max(last.get(e.rank, e.end), e.end)
        busy_by_rank[e.rank] = busy_by_rank.get(e.rank, 0.0) + e.end - e.start
    widest = max(first, key=lambda r: last[r] - first[r])
    span, busy = last[widest] - first[widest], busy_by_rank[widest]
    return SimResult(makespan=makespan, bubble_ratio=1 - busy / span,
                     peak_activations=[peak[r] for r in sorted(order)], events=events,
                     peak_memory=[peak[r] * stage_size for r in sorted(order)])
