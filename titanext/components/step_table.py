"""Where a step's time went, read from a Chrome trace of torch.profiler (docs/profiling.md).

:func:`step_breakdown` takes the JSON trace one rank wrote for a profiling window and returns
milliseconds per step, averaged over the window's traced steps (torch's ``ProfilerStep#N``
ranges):

- the step's phases: titanext's own ranges (:mod:`titanext._profiler_ranges`: data, forward,
  backward, pipeline, loss, optimizer, log); they do not nest, so they add up to the step, and
  what is left is ``unaccounted``;
- inside the pipeline: each stage's F, I (input gradient), W (weight gradient) and full-B
  chunks, and the idle time between them (the bubble, as measured);
- communication, by kind: each collective the backend ran (gloo's ``gloo:*`` events, NCCL's
  kernels) is put down to the innermost range open where it was issued: FSDP's all-gather or
  reduce-scatter (FSDP's own ``FSDP::`` ranges), CP, EP all-to-all, the loss and optimizer
  all-reduces, and TP (DTensor's functional collectives outside those). A collective's time
  may overlap compute, so these rows are not part of the sum. Pipeline send/recv is the time
  the rank blocked in the schedules' wait points (titanext's ``pp_wait`` ranges, merged):
  a send or receive in flight while the rank computes costs nothing there, so this row is
  bounded by the pipeline phase (its ops' lifetimes, issue to completion, were not).

:func:`simulated_idle` replays the schedule with the measured per-stage costs
(:func:`titanext.schedules.simulator.replay`) for the bubble the simulator predicts.

>>> trace = {"traceEvents": [
...     {"ph": "X", "name": "ProfilerStep#3", "ts": 0, "dur": 1000, "tid": 1},
...     {"ph": "X", "name": "titanext:forward", "ts": 10, "dur": 400, "tid": 1},
...     {"ph": "X", "name": "titanext:backward", "ts": 420, "dur": 500, "tid": 1}]}
>>> b = step_breakdown(trace)
>>> b["step_ms"], b["phases"]["forward"], round(b["unaccounted_ms"], 2)
(1.0, 0.4, 0.1)
"""

from __future__ import annotations

import bisect
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from titanext.config.layout import PipelinePlan

from titanext._profiler_ranges import (
    CP,
    EP_ALL_TO_ALL,
    LOSS,
    OPTIMIZER,
    PHASES,
    PIPELINE,
    PP_WAIT,
    PREFIX,
)
from titanext.schedules import schedule_order
from titanext.schedules.simulator import replay

__all__ = ["TraceRanges", "breakdown_rows", "read_ranges", "simulated_idle", "step_breakdown",
           "step_number"]

_STEP = re.compile(r"ProfilerStep#(\d+)")
_CHUNK = re.compile(re.escape(PREFIX) + r"pp_([FIWB])/s(\d+)$")
_ISSUE = ("c10d::", "_c10d_functional::", "c10d_functional::", "gloo:", "nccl:")
_P2P = ("send", "recv", "isend", "irecv", "batch_isend_irecv")
_PP = "PP send/recv"  # the kind whose time is the rank's waiting (PP_WAIT), not its ops'


def _kind_of_stack(stack: Sequence[str], op: str) -> str:
    """The kind of communication ``op`` (a collective's event name) issued inside ``stack``
    (the names of the open ranges, outermost first)."""
    for name in reversed(stack):
        if name.startswith("FSDP::post_backward"):
            return "FSDP reduce-scatter"
        if name.startswith("FSDP::"):
            return "FSDP all-gather"
        if name == CP:
            return "CP ring / all-to-all"
        if name == EP_ALL_TO_ALL:
            return "EP all-to-all"
        if name.startswith("PP:") and ("SEND" in name or "RECV" in name):
            return "PP send/recv"
        if name == LOSS:
            return "loss all-reduce"
        if name == OPTIMIZER:
            return "optimizer (grad norm, ZeRO-1)"
    bare = op.split("::")[-1].split(":")[-1].strip("_")
    if any(bare.startswith(p) for p in _P2P):
        return _PP
    if op.startswith(("_c10d_functional::", "c10d_functional::")):
        return "TP (DTensor)"
    return "other collectives"


def _is_backend_comm(e: Mapping[str, Any]) -> bool:
    """A collective as the backend ran it: gloo's ``gloo:*`` ranges or an NCCL kernel."""
    name = e["name"]
    return name.startswith("gloo:") or (e.get("cat") == "kernel" and "nccl" in name.lower())


@dataclass
class TraceRanges:
    """The events of one rank's trace that the table and the timeline read, classified once
    (:func:`read_ranges`); each event is the trace's own dict (``ts``, ``dur`` in us)."""

    steps: list[dict]  # torch's ProfilerStep#N ranges
    phases: list[dict]  # titanext's step-level ranges (PHASES); they do not nest
    chunks: list[tuple[dict, str, int]]  # (event, "F" / "I" / "W" / "B", stage)
    comm: list[tuple[dict, str]]  # (a collective as the backend ran it, its kind)
    waits: list[dict] = field(default_factory=list)  # PP_WAIT ranges on the main thread
    base_us: float = 0.0  # the trace's baseTimeNanoseconds in us: ts + base_us is host time


def read_ranges(trace: Mapping[str, Any]) -> TraceRanges:
    """Classify ``trace``'s (a Chrome trace dict of torch.profiler) complete events."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in events if _STEP.fullmatch(e["name"])]
    if not steps:
        raise ValueError("the trace has no ProfilerStep#N ranges: was it written by "
                         "torch.profiler with a schedule, over whole training steps?")
    main = steps[0]["tid"]
    on_main = sorted((e for e in events if e["tid"] == main), key=lambda e: (e["ts"], -e["dur"]))
    out = TraceRanges(steps=steps, phases=[], chunks=[], comm=[],
                      base_us=trace.get("baseTimeNanoseconds", 0) / 1e3)
    issues: list[tuple[float, str]] = []  # (issue time, kind) of each collective call
    stack: list[tuple[float, str]] = []
    for e in on_main:
        while stack and stack[-1][0] <= e["ts"]:
            stack.pop()
        name = e["name"]
        if name in PHASES:
            out.phases.append(e)
        elif name == PP_WAIT:
            out.waits.append(e)
        elif m := _CHUNK.match(name):
            out.chunks.append((e, m.group(1), int(m.group(2))))
        if name.startswith(_ISSUE):
            kind = _kind_of_stack([s for _, s in stack], name)
            issues.append((e["ts"], kind))
            if _is_backend_comm(e):  # a blocking call run on this thread (gloo's recv)
                out.comm.append((e, kind))
        stack.append((e["ts"] + e["dur"], name))
    issue_times = [t for t, _ in issues]
    for e in events:  # collectives run by the backend's own threads (or the GPU)
        if e["tid"] != main and _is_backend_comm(e):
            i = bisect.bisect_right(issue_times, e["ts"]) - 1
            out.comm.append((e, issues[i][1] if i >= 0 else "other collectives"))
    return out


def step_breakdown(trace: Mapping[str, Any]) -> dict[str, Any]:
    """Milliseconds per traced step of ``trace`` (a Chrome trace dict): ``step_ms``,
    ``phases`` (short names), ``unaccounted_ms``, ``comm`` (per kind), ``chunks`` (per stage:
    mean ms of one F, I, W, B chunk, and counts) and ``pipeline`` (busy and idle per step);
    ``steps`` lists the traced step numbers."""
    r = read_ranges(trace)
    phases: dict[str, float] = defaultdict(float)
    for e in r.phases:
        phases[e["name"].removeprefix(PREFIX)] += e["dur"]
    chunks: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for e, kind, stage in r.chunks:
        chunks[stage][kind].append(e["dur"])
    comm: dict[str, float] = defaultdict(float)
    for e, kind in r.comm:
        if kind != _PP:
            comm[kind] += e["dur"]
    if r.waits:
        comm[_PP] = _union_us(r.waits)
    ms = 1e-3 / len(r.steps)
    step_ms = sum(e["dur"] for e in r.steps) * ms
    phase_ms = {k: v * ms for k, v in phases.items()}
    busy = sum(sum(v) for kinds in chunks.values() for v in kinds.values()) * ms
    out: dict[str, Any] = {
        # torch numbers ProfilerStep#N by the steps done before it; training steps count from 1
        "steps": sorted(step_number(e) for e in r.steps),
        "step_ms": step_ms, "phases": phase_ms,
        "unaccounted_ms": step_ms - sum(phase_ms.values()),
        "comm": {k: v * ms for k, v in sorted(comm.items())},
        "chunks": {s: {k: {"ms": sum(v) / len(v) * 1e-3, "count": len(v)} for k, v in kinds.items()}
                   for s, kinds in sorted(chunks.items())},
    }
    if PIPELINE.removeprefix(PREFIX) in phase_ms:
        wall = phase_ms[PIPELINE.removeprefix(PREFIX)]
        out["pipeline"] = {"busy_ms": busy, "idle_ms": wall - busy,
                           "idle_measured": 1 - busy / wall if wall else 0.0}
    return out


def _union_us(events: Sequence[Mapping[str, Any]]) -> float:
    """The time covered by ``events`` (``ts``, ``dur``), nested or overlapping ones once."""
    total, end = 0.0, float("-inf")
    for e in sorted(events, key=lambda e: e["ts"]):
        start, stop = max(e["ts"], end), e["ts"] + e["dur"]
        if stop > start:
            total += stop - start
        end = max(end, stop)
    return total


def step_number(event: Mapping[str, Any]) -> int:
    """The training step (1-based) of a ``ProfilerStep#N`` range: torch's N counts the steps
    done before it."""
    return int(_STEP.fullmatch(event["name"]).group(1)) + 1


def simulated_idle(plan: PipelinePlan, *, pp_rank: int,
                   chunks: Mapping[int, Mapping[str, Mapping[str, float]]]) -> float:
    """This pp rank's idle fraction of one schedule step as the simulator predicts it from the
    measured per-stage chunk costs (``chunks``: every stage's, as :func:`step_breakdown`
    gives them; a full B stands for I + W where the schedule does not split), on the lists of
    the job's resolved pipeline ``plan`` (capped as the trainer ran them; Auto's generated for
    these costs, as the trainer generates them for the costs it measured on step 1)."""

    chain = plan.num_stages

    def cost(stage: int, kind: str) -> float:
        c = chunks.get(stage, {})
        if kind in c:
            return c[kind]["ms"]
        if kind in "IW" and "B" in c:
            return c["B"]["ms"] / 2
        return c["I"]["ms"] + c.get("W", {"ms": 0.0})["ms"] if kind == "B" and "I" in c else 0.0

    costs = {k: [cost(s, k) for s in range(chain)] for k in "FIWB"}
    # a schedule that measures its costs (Auto) runs lists made for them: these stand in
    measured = {key: tuple(costs[k]) for key, k in (("f", "F"), ("b", "I"), ("w", "W"))} \
        if getattr(plan.schedule, "measures_costs", False) else {}
    order = schedule_order(plan.schedule, pp=plan.pp, microbatches=plan.microbatches,
                           stages_per_rank=plan.stages_per_rank, **measured)
    sim = replay(order, num_stages=chain, f=costs["F"], b=costs["I"], w=costs["W"],
                 full_b=costs["B"])
    busy = sum(e.end - e.start for e in sim.events if e.rank == pp_rank)
    return 1 - busy / sim.makespan if sim.makespan else 0.0


def breakdown_rows(per_rank: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Table rows (phase, then one ms column per rank; min / median / max over more than 8
    ranks) for :func:`titanext._text.format_table`."""
    names: list[tuple[str, Any]] = [("step", lambda b: b["step_ms"])]
    keys = list(dict.fromkeys(k for b in per_rank for k in b["phases"]))
    names += [(k, lambda b, k=k: b["phases"].get(k)) for k in keys]
    names.append(("unaccounted", lambda b: b["unaccounted_ms"]))
    for kind in ("F", "I", "W", "B"):
        if any(kind in c for b in per_rank for c in b["chunks"].values()):
            names.append((f"  pp {kind} chunks", lambda b, kind=kind: sum(
                c[kind]["ms"] * c[kind]["count"] for c in b["chunks"].values() if kind in c)
                / len(b["steps"]) if b["chunks"] else None))
    if any("pipeline" in b for b in per_rank):
        names.append(("  pp idle (bubble)", lambda b: b.get("pipeline", {}).get("idle_ms")))
        names.append(("  pp idle % measured", lambda b: _pct(b, "idle_measured")))
        names.append(("  pp idle % simulated", lambda b: _pct(b, "idle_simulated")))
    kinds = list(dict.fromkeys(k for b in per_rank for k in b["comm"]))
    names += [(f"comm: {k}", lambda b, k=k: b["comm"].get(k)) for k in kinds]
    rows = []
    for label, get in names:
        values = [get(b) for b in per_rank]
        row: dict[str, Any] = {"phase (ms/step)": label}
        if len(values) <= 8:
            row.update({f"rank {b['rank']}": v for b, v in zip(per_rank, values)})
        else:
            known = sorted(v for v in values if v is not None)
            if known:
                row.update(min=known[0], median=known[len(known) // 2], max=known[-1])
        rows.append(row)
    return rows


def _pct(b: Mapping[str, Any], key: str) -> float | None:
    v = b.get("pipeline", {}).get(key)
    return None if v is None else 100 * v
