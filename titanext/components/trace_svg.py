"""The profiled steps of every rank as one SVG timeline, drawn from their Chrome traces.

:func:`trace_svg` reads each rank's trace of one profiling window (the events that
:func:`titanext.components.step_table.read_ranges` classifies, the same ones the step table
sums) and draws, per rank:

- a lane of titanext's step phases (data, forward, backward or pipeline, loss, optimizer, log)
  over a grey band per traced step;
- with a pipeline, a lane of its F, I, W and B chunks (the simulator timeline's colours);
- a lane of the collectives the backend ran, coloured by kind (FSDP all-gather, reduce-scatter,
  TP, CP, EP, PP send/recv, loss and optimizer all-reduces); those of one kind closer than
  half a pixel are drawn as one box.

Times are in ms from the earliest rank's first traced step, on the traces' own clock: the ranks
of one host share it, ranks on other hosts are off by their clocks' skew. :func:`write_timeline`
is what the trainer calls on rank 0 at the end of each window (docs/profiling.md).

>>> step = {"ph": "X", "name": "ProfilerStep#0", "ts": 0, "dur": 100, "tid": 1}
>>> fwd = {"ph": "X", "name": "titanext:forward", "ts": 5, "dur": 40, "tid": 1}
>>> trace_svg({0: {"traceEvents": [step, fwd]}}).count("<title>titanext:forward")
1
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from html import escape
from typing import Any

from titanext._profiler_ranges import PREFIX
from titanext.components.step_table import TraceRanges, read_ranges, step_number
from titanext.schedules.simulator import KIND_COLOURS, KIND_NAMES

__all__ = ["trace_svg", "write_timeline"]

PHASE_COLOURS = {"data": "#9d755d", "forward": KIND_COLOURS["F"], "backward": KIND_COLOURS["B"],
                 "pipeline": "#9c9590", "loss": "#72b7b2", "optimizer": "#b279a2",
                 "log": "#ff9da6"}
COMM_COLOURS = {"FSDP all-gather": "#eeca3b", "FSDP reduce-scatter": "#bcbd22",
                "TP (DTensor)": "#17becf", "CP ring / all-to-all": "#9467bd",
                "EP all-to-all": "#8c564b", "PP send/recv": "#e377c2",
                "loss all-reduce": "#2ca02c", "optimizer (grad norm, ZeRO-1)": "#7b4173",
                "other collectives": "#7f7f7f"}
LEFT, PLOT, LANE, GAP = 110, 860, {"phases": 22, "chunks": 16, "comm": 12}, 10

# a box: (start us, end us, colour, label drawn inside, tooltip)
Box = tuple[float, float, str, str, str]


def trace_svg(traces: Mapping[int, Mapping[str, Any]], title: str = "") -> str:
    """One timeline of the ranks' traces (``{rank: Chrome trace dict}``, one profiling window
    each): a block of lanes per rank, a legend and a time axis in ms."""
    ranges = {r: read_ranges(t) for r, t in sorted(traces.items())}
    t0 = min(r.base_us + min(e["ts"] for e in r.steps) for r in ranges.values())
    t1 = max(r.base_us + max(e["ts"] + e["dur"] for e in r.steps) for r in ranges.values())
    scale = PLOT / max(t1 - t0, 1e-9)
    pipelined = any(r.chunks for r in ranges.values())
    lanes = ["phases", "chunks", "comm"] if pipelined else ["phases", "comm"]
    block = sum(LANE[k] for k in lanes) + GAP
    top = 36
    body: list[str] = []
    for i, (rank, r) in enumerate(ranges.items()):
        y = top + i * block
        body.append(f'<g id="rank{rank}">')
        body += _steps(r, y, block - GAP, t0, scale, label=i == 0)
        for lane in lanes:
            name = {"phases": f"rank {rank}", "chunks": "  pp chunks"}.get(lane, "  comm")
            body.append(f'<text x="8" y="{y + LANE[lane] - 6}" xml:space="preserve">'
                        f'{name}</text>')
            body += _boxes(_lane_boxes(r, lane), y, LANE[lane], t0, scale,
                           merge=lane == "comm")
            y += LANE[lane]
        body.append("</g>")
    y = top + len(ranges) * block
    axis = _axis(y, (t1 - t0) / 1e3)
    legend, height = _legend(ranges.values(), y + 40)
    head = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{LEFT + PLOT + 20}" '
            f'height="{height}" font-family="sans-serif" font-size="10">',
            f'<text x="10" y="18" font-size="13">{escape(title)}</text>']
    return "\n".join([*head, *body, *axis, *legend, "</svg>"]) + "\n"


def _lane_boxes(r: TraceRanges, lane: str) -> list[Box]:
    """The boxes of one lane of one rank, host time in us."""
    b = r.base_us
    if lane == "phases":
        boxes = [(e, PHASE_COLOURS.get(e["name"].removeprefix(PREFIX), "#bab0ac"),
                  e["name"].removeprefix(PREFIX)) for e in r.phases]
    elif lane == "chunks":
        boxes = [(e, KIND_COLOURS[kind], kind) for e, kind, _ in r.chunks]
    else:
        boxes = [(e, COMM_COLOURS.get(kind, "#7f7f7f"), "") for e, kind in r.comm]
    return [(e["ts"] + b, e["ts"] + e["dur"] + b, colour, label, e["name"])
            for e, colour, label in boxes]


def _boxes(boxes: Iterable[Box], y: float, height: int, t0: float, scale: float,
           merge: bool = False) -> list[str]:
    """SVG rects (with a label where it fits); with ``merge``, boxes of one colour under half a
    pixel apart are drawn as one, so thousands of short collectives stay a small file."""
    merged: list[list[Any]] = []
    last: dict[str, list[Any]] = {}
    for start, end, colour, label, tip in sorted(boxes):
        prev = last.get(colour)
        if merge and prev is not None and (start - prev[1]) * scale < 0.5:
            prev[1] = max(prev[1], end)
            prev[5] += 1
            continue
        last[colour] = [start, end, colour, label, tip, 1]
        merged.append(last[colour])
    out, edge = [], "" if merge else ' stroke="white" stroke-width="0.8"'  # chunk by chunk
    for start, end, colour, label, tip, n in merged:
        x, w = LEFT + (start - t0) * scale, max((end - start) * scale, 0.5)
        more = f" and {n - 1} more" if n > 1 else ""
        out.append(f'<rect x="{x:.1f}" y="{y + 1}" width="{w:.1f}" height="{height - 2}" '
                   f'fill="{colour}"{edge}><title>{escape(tip)}{more}: {(end - start) / 1e3:.3g} ms'
                   '</title></rect>')
        if label and w > 7 * len(label):
            out.append(f'<text x="{x + w / 2:.1f}" y="{y + height / 2 + 4:.1f}" '
                       f'text-anchor="middle" fill="white">{label}</text>')
    return out


def _steps(r: TraceRanges, y: float, height: int, t0: float, scale: float, label: bool
           ) -> list[str]:
    """A grey band per traced step behind the rank's lanes (numbered above it if ``label``)."""
    out = []
    for i, e in enumerate(sorted(r.steps, key=lambda e: e["ts"])):
        x = LEFT + (e["ts"] + r.base_us - t0) * scale
        out.append(f'<rect x="{x:.1f}" y="{y}" width="{e["dur"] * scale:.1f}" height="{height}" '
                   f'fill="{"#eeeeee" if i % 2 == 0 else "#e0e0e0"}"><title>step '
                   f'{step_number(e)}: {e["dur"] / 1e3:.3g} ms</title></rect>')
        if label:
            out.append(f'<text x="{x + 2:.1f}" y="{y - 3}" font-size="9">step '
                       f'{step_number(e)}</text>')
    return out


def _axis(y: float, span_ms: float) -> list[str]:
    """The time axis under the lanes: ticks at 1, 2 or 5 x 10^k ms."""
    raw = span_ms / 8 or 1.0
    tick = next(t for t in (m * 10 ** math.floor(math.log10(raw)) for m in (1, 2, 5, 10))
                if t >= raw)
    out = [f'<line x1="{LEFT}" x2="{LEFT + PLOT}" y1="{y}" y2="{y}" stroke="black"/>',
           f'<text x="{LEFT - 8}" y="{y + 14}" text-anchor="end">ms</text>']
    t = 0.0
    while t <= span_ms * (1 + 1e-9):
        x = LEFT + PLOT * t / span_ms if span_ms else LEFT
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y}" y2="{y + 4}" stroke="black"/>'
                   f'<text x="{x:.1f}" y="{y + 14}" text-anchor="middle">{t:g}</text>')
        t += tick
    return out


def _legend(ranges: Iterable[TraceRanges], y: float) -> tuple[list[str], int]:
    """A swatch per phase, chunk kind and communication kind present; (the SVG, the height
    of the whole picture)."""
    ranges = list(ranges)
    present = {e["name"].removeprefix(PREFIX) for r in ranges for e in r.phases}
    kinds = {kind for r in ranges for _, kind, _ in r.chunks}
    comm = {kind for r in ranges for _, kind in r.comm}
    items = [(c, k) for k, c in PHASE_COLOURS.items() if k in present]
    items += [(c, f"{k}: {KIND_NAMES[k]}") for k, c in KIND_COLOURS.items() if k in kinds]
    items += [(c, f"comm: {k}") for k, c in COMM_COLOURS.items() if k in comm]
    out, x = [], LEFT
    for colour, name in items:
        width = 24 + 6 * len(name)
        if x + width > LEFT + PLOT:
            x, y = LEFT, y + 16
        out.append(f'<rect x="{x}" y="{y - 9}" width="10" height="10" fill="{colour}"/>'
                   f'<text x="{x + 14}" y="{y}">{escape(name)}</text>')
        x += width
    return out, int(y + 14)


def write_timeline(folder: str, ranks: Sequence[int], title: str = "") -> tuple[str, list[int]]:
    """Draw ``folder``'s ``rank<R>_trace.json`` of each rank in ``ranks`` into
    ``folder/timeline.svg``; returns the path and the ranks whose trace was not there (on
    another host's filesystem, say): the picture has the ranks present."""
    traces, missing = {}, []
    for rank in ranks:
        path = os.path.join(folder, f"rank{rank}_trace.json")
        if not os.path.exists(path):
            missing.append(rank)
            continue
        with open(path) as f:
            traces[rank] = json.load(f)
    out = os.path.join(folder, "timeline.svg")
    if traces:
        with open(out, "w") as f:
            f.write(trace_svg(traces, title))
    return out, missing
