"""Pipeline schedules side by side: simulated bubble and memory, and a real gloo run.

    python benchmarks/pipeline_schedules.py [--markdown] [--real-steps 9] [--dim 512]
        [--rows 64] [--skip-simulated]

1. Simulated (titanext.schedules.simulate, the action lists that execute): bubble and peak
   memory of every schedule, ours and torch's, for pp in {4, 8} and m in {8, 16, 32}, at
   F = I = W and at an unequal profile (F = 1, I = 1, W = 0.5, comm = 0.03: W is the cheaper
   half of the backward, the kind of profile the zero-bubble paper measures).
2. Real: pp = 2 on gloo (one rank per core, one thread each), 8 micro-batches through the same
   8-block MLP for every schedule, the schedules taking turns step by step; split schedules
   defer weight gradients (titanext.plugins.weight_grad), and "ZBH1 (autograd split)" is
   torch's stage_backward_input / _weight for comparison. Per schedule (medians over
   --real-steps): step time and its ratio to 1F1B; the bubble measured as the simulator
   defines it (1 - mean busy / makespan, the makespan from the first F/I/W/B chunk to the last
   over all ranks, busy inside the chunk methods) next to the simulated bubble for the F, I, W
   measured in the same run; "outside": the step's time before the first and after the last
   chunk (DualPipe's mirrored-gradient sum lands there); the peak activation memory (bytes
   autograd saved for backward plus queued (X, dY), max over ranks) next to the simulator's
   peak. Also (I+W)/B per micro-batch and the load average. The lead's one command:
   ``python benchmarks/pipeline_schedules.py --skip-simulated --markdown``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from titanext._text import format_table
from titanext.launch.local import run_distributed
from titanext.schedules import (
    build_schedule,
    get_schedule_class,
    num_stages_for,
    resolved_stages_per_rank,
    schedule_order,
    schedule_problems,
    simulate,
    stage_ids_for_rank,
)
from titanext.schedules.registry import _SIMULATED
from titanext.schedules.simulator import replay

PROFILES = {"F=I=W": dict(f=1.0, b=1.0, w=1.0, comm=0.0),
            "F=1 I=1 W=0.5 comm=0.03": dict(f=1.0, b=1.0, w=0.5, comm=0.03)}


def simulated_table() -> list[dict]:
    rows = []
    for profile, costs in PROFILES.items():
        for pp in (4, 8):
            for m in (8, 16, 32):
                row = {"costs": profile, "pp": pp, "m": m}
                for name in _SIMULATED:
                    if schedule_problems(name, pp=pp, microbatches=m):
                        row[name] = "n/a"  # e.g. DualPipe needs m >= 2 pp
                        continue
                    r = simulate(name, pp=pp, microbatches=m, **costs)
                    row[name] = f"{r.bubble_ratio:.3f} / {max(r.peak_memory):g}"
                rows.append(row)
    return rows


def _mlp_stage(stage: int, dim: int, blocks: int) -> nn.Module:
    torch.manual_seed(stage)
    return nn.Sequential(*(m for _ in range(blocks) for m in (nn.Linear(dim, 4 * dim), nn.GELU(),
                                                               nn.Linear(4 * dim, dim))))


def _loss(out, target):
    return ((out - target) ** 2).mean()


#: (schedule, split backward) pairs of the real run; 1F1B (full backward) is the baseline, the
#: deferred ZBH1 measures F, I, W, and "autograd" is torch's stage_backward_input/_weight split.
REAL_VARIANTS = [("1F1B", "autograd"), ("ZBH1", "deferred"), ("ZBH1", "autograd"),
                 ("ZBH2", "deferred"), ("ZBV", "deferred"), ("ZBVZeroBubble", "deferred"),
                 ("DualPipeV", "deferred"), ("DualPipe", "deferred"), ("Auto", "deferred")]


class _Timeline:
    """(kind, start, end, stage, micro-batch) of every F / I / W / B chunk method call of this
    rank's stages (``time.perf_counter`` is CLOCK_MONOTONIC: one clock for all local
    processes)."""

    def __init__(self, stages):
        self.events: list[tuple[str, float, float, int, int]] = []
        for st in stages:
            for meth in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(st, meth, self._wrap(getattr(st, meth), meth, st.stage_index))

    def _wrap(self, fn, meth, stage):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            if meth == "forward_one_chunk":
                kind = "F"
            elif meth == "backward_weight_one_chunk":
                kind = "W"
            else:
                kind = "B" if kwargs.get("full_backward", True) else "I"
            self.events.append((kind, t0, time.perf_counter(), stage, args[0]))
            return out
        return timed


#: (kind, start, end) of this process's P2P calls: "post" (issuing sends / receives) and
#: "wait" (waiting for them), in torch's runtime and in ours
_P2P: list[tuple[str, float, float]] = []


def _time_p2p() -> None:
    """Wrap the runtimes' P2P helpers once per process to record into ``_P2P``."""
    from torch.distributed.pipelining import schedules as torch_schedules

    from titanext.schedules import _torch_ir

    def wrap(kind, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _P2P.append((kind, t0, time.perf_counter()))
        timed.wrapped = True
        return timed

    for module, post, wait in ((torch_schedules, "_batch_p2p", "_wait_batch_p2p"),
                               (_torch_ir, "_issue", "_wait")):
        if not getattr(getattr(module, post), "wrapped", False):
            setattr(module, post, wrap("post", getattr(module, post)))
            setattr(module, wait, wrap("wait", getattr(module, wait)))


class _ActivationMemory:
    """Live bytes of tensors autograd saved for backward (stage activations) plus the (X, dY)
    pairs in weight-gradient queues, per storage, and their peak: autograd's saved-tensor
    hooks count a tensor from its save until autograd frees it (after its backward, or after W
    when torch's split keeps the graph), the queues from I until W. Parameters (and views of
    them, such as the W^T an nn.Linear saves) don't count."""

    def __init__(self, modules):
        self.live: dict[int, list] = {}  # storage ptr -> [bytes, references]
        self.now = self.peak = 0
        # autograd saves weights too (as W^T views for nn.Linear): not activations
        self.params = {p.untyped_storage().data_ptr() for m in modules for p in m.parameters()}

    def add(self, t: torch.Tensor) -> int:
        s = t.untyped_storage()
        key = s.data_ptr()
        entry = self.live.setdefault(key, [s.nbytes(), 0])
        if entry[1] == 0:
            self.now += entry[0]
            self.peak = max(self.peak, self.now)
        entry[1] += 1
        return key

    def drop(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[key]

    def hooks(self):
        import weakref

        tracker = self

        class Packed:
            def __init__(self, t):
                self.t, self.key = t, tracker.add(t)
                weakref.finalize(self, tracker.drop, self.key)

        def pack(t):
            if t.untyped_storage().data_ptr() in tracker.params:  # a parameter (or a view)
                return t
            return Packed(t)

        def unpack(p):
            return p.t if isinstance(p, Packed) else p

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def watch(self, queue) -> None:
        """Count ``queue``'s entries from append to run (``take()`` hands them over intact)."""
        tracker, append = self, queue.append

        def counted(fn, param, x, dy, extra=None):
            keys = [tracker.add(x), tracker.add(dy)]

            def run(x_, dy_, param_, extra_, fn=fn, keys=keys):
                try:
                    return fn(x_, dy_, param_, extra_)
                finally:
                    for k in keys:
                        tracker.drop(k)
            append(run, param, x, dy, extra)

        queue.append = counted


def _build(name, split, rank, world, microbatches, dim, costs=None):
    from torch.distributed.pipelining import PipelineStage

    from titanext.plugins.weight_grad import (
        DeferredPipelineStage,
        WeightGradQueue,
        defer_weight_grads,
    )
    from titanext.schedules import auto_schedule_class

    cls = get_schedule_class(name)
    per_rank = cls.stages_per_rank or 1
    n_stages = num_stages_for(cls.placement, world, per_rank)
    if costs is not None:  # Auto, as the trainer does: generated for the measured costs
        cls = auto_schedule_class(**{k: costs[k] / costs["f"] for k in "fbw"})
    ids = stage_ids_for_rank(cls.placement, rank, world, per_rank)
    # The same 8-block model whatever the schedule: 4 blocks per pp rank, split over the
    # stages a rank holds (DualPipe holds 2 copies of a 4-block stage)
    blocks = 4 * world // n_stages
    modules = [_mlp_stage(s, dim, blocks) for s in ids]
    queue = None
    if split == "deferred" and cls.splits_backward:
        queue = WeightGradQueue()
        for m in modules:
            defer_weight_grads(m)
    kind, extra = PipelineStage, {}
    if queue is not None:  # (an empty queue is falsy)
        kind, extra = DeferredPipelineStage, {"weight_grad_queue": queue}
    stages = [kind(m, stage_index=s, num_stages=n_stages, device=torch.device("cpu"),
                   group=dist.group.WORLD, **extra)
              for m, s in zip(modules, ids, strict=True)]
    sched = build_schedule(cls, stages, microbatches, loss_fn=_loss)
    return {"stages": stages, "schedule": sched, "timeline": _Timeline(stages), "queue": queue}


def _run_step(b, x, y, memory: _ActivationMemory | None = None) -> None:
    stages, sched = b["stages"], b["schedule"]
    ctx = contextlib.ExitStack()
    if memory is not None:
        ctx.enter_context(memory.hooks())
    with ctx:
        target = y if any(st.is_last for st in stages) else None
        if any(st.is_first for st in stages):
            sched.step(x, target=target)
        else:
            sched.step(target=target)


def _one_step(b, x, y) -> dict:
    """This rank's step: start/end, its chunk events; gathered over ranks."""
    b["timeline"].events.clear()
    dist.barrier()
    _P2P.clear()
    t0 = time.perf_counter()
    _run_step(b, x, y)
    mine = {"start": t0, "end": time.perf_counter(), "events": list(b["timeline"].events),
            "p2p": list(_P2P)}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def _input_of(e) -> tuple[str, int, int]:
    """The chunk whose output event ``e`` needs: F the previous stage's F, I / B the next
    stage's I / B (recorded as "I"), W its own I."""
    kind, stage, j = e[0], e[3], e[4]
    if kind == "F":
        return ("F", stage - 1, j)
    return ("I", stage + 1, j) if kind in "IB" else ("I", stage, j)


def _chunks(ranks: list[dict]) -> dict[tuple[str, int, int], tuple[int, tuple]]:
    """(kind, stage, micro-batch) -> (rank, event) of every chunk of the step (a B is recorded
    as "I": it is the input gradient the previous stage waits for)."""
    return {(e[0] if e[0] != "B" else "I", e[3], e[4]): (q, e)
            for q, r in enumerate(ranks) for e in r["events"]}


def _hops(ranks: list[dict], where: dict) -> list[float]:
    """Cross-rank hop times: for every chunk whose input comes from another rank (F from the
    previous stage's F, I / B from the next stage's I / B) and whose rank sat idle when that
    input's chunk ended, the time from that end to this chunk's start: sending, receiving and
    waking up, what the simulator's ``comm`` stands for. ``where``: :func:`_chunks`."""
    out = []
    for q, r in enumerate(ranks):
        ends = sorted(e[2] for e in r["events"])
        for e in r["events"]:
            dep = _input_of(e) if e[0] != "W" else None
            if dep not in where or where[dep][0] == q:
                continue
            sent = where[dep][1][2]
            before = [t for t in ends if t <= e[1]]
            if sent < e[1] and (not before or before[-1] <= sent):  # idle until it arrived
                out.append(e[1] - sent)
    return out


def _overheads(ranks: list[dict], where: dict) -> list[float]:
    """The runtime's own time between two chunks of a rank when nothing had to be waited for
    (the next chunk's input was there when the previous chunk ended): issuing sends and
    receives, bookkeeping, the loss. What the simulator's ``overhead`` stands for.
    ``where``: :func:`_chunks`."""
    out = []
    for r in ranks:
        ev = sorted(r["events"], key=lambda e: e[1])
        for a, e in zip(ev, ev[1:]):
            dep = where.get(_input_of(e))
            if dep is None or dep[1][2] <= a[2]:
                out.append(e[1] - a[2])
    return out


def _idle(r: dict, first: float, last: float) -> dict[str, float]:
    """A rank's non-busy time inside [first, last]: waiting for P2P, issuing P2P, the rest."""
    def inside(kind):
        return sum(max(0.0, min(e[2], last) - max(e[1], first)) for e in r["p2p"] if e[0] == kind)

    busy = sum(e[2] - e[1] for e in r["events"])
    wait, post = inside("wait"), inside("post")
    return {"wait": wait, "post": post, "rest": last - first - busy - wait - post}


def _summary(ranks: list[dict]) -> dict:
    """Step (first start to last end over ranks), makespan of the chunk events (first event to
    last event over ranks: the simulator's makespan), mean busy, time per kind per call, the
    idle time split (mean over ranks) and the cross-rank hop times."""
    first = min(e[1] for r in ranks for e in r["events"])
    last = max(e[2] for r in ranks for e in r["events"])
    busy = [sum(e[2] - e[1] for e in r["events"]) for r in ranks]
    kinds = {}
    for k in "FIWB":
        per_rank = [[e[2] - e[1] for e in r["events"] if e[0] == k] for r in ranks]
        kinds[k] = [sum(t) / len(t) if t else 0.0 for t in per_rank]
    per_stage: dict[tuple[str, int], list[float]] = {}
    for r in ranks:
        for e in r["events"]:
            per_stage.setdefault((e[0], e[3]), []).append(e[2] - e[1])
    idle = [_idle(r, first, last) for r in ranks]
    where = _chunks(ranks)
    overheads = _overheads(ranks, where)
    return {"step": max(r["end"] for r in ranks) - min(r["start"] for r in ranks),
            "makespan": last - first, "busy": sum(busy) / len(busy), "kinds": kinds,
            "stage_kinds": {k: sum(t) / len(t) for k, t in per_stage.items()},
            "idle": {k: sum(i[k] for i in idle) / len(idle) for k in idle[0]},
            "hops": _hops(ranks, where),
            "overhead": sum(overheads) / len(overheads) if overheads else 0.0}


def _time_schedules(rank, world, variants, microbatches, dim, rows, steps):
    """Per variant: each timed step's summary, plus the peak activation memory of one step.
    The variants take turns step by step (round robin), so a burst of load from elsewhere hits
    all of them alike. Auto is generated for the F, I, W (deferred) of three warm-up steps."""
    torch.set_num_threads(1)  # one core per rank
    _time_p2p()
    x = torch.randn(microbatches * rows, dim)
    y = torch.randn(microbatches * rows, dim)
    probe = ("ZBH1", "deferred")
    built = {probe: _build(*probe, rank, world, microbatches, dim)}
    for _ in range(3):
        s = _summary(_one_step(built[probe], x, y))
    costs = {"f": max(s["kinds"]["F"]), "b": max(s["kinds"]["I"]), "w": max(s["kinds"]["W"])}
    for v in variants:
        if v not in built:
            built[v] = _build(*v, rank, world, microbatches, dim,
                              costs if v[0] == "Auto" else None)
    results = {v: [] for v in variants}
    for i in range(steps + 1):
        for v in variants:
            s = _summary(_one_step(built[v], x, y))
            if i:  # the first round warms every variant up
                results[v].append(s)
    memory = {}
    for v in variants:  # one tracked step each (the hooks slow it down: not timed)
        tracker = _ActivationMemory([st.submod for st in built[v]["stages"]])
        if built[v]["queue"] is not None:
            tracker.watch(built[v]["queue"])
        _run_step(built[v], x, y, tracker)
        peaks = [None] * world
        dist.all_gather_object(peaks, tracker.peak)
        memory[v] = peaks
    orders = {v: _compute_order(built[v]["schedule"]) for v in variants}
    return {"results": results, "memory": memory, "auto_costs": costs, "orders": orders}


def _compute_order(schedule) -> dict[int, list] | None:
    """The per-rank compute lists a multi-stage schedule ran (None: torch's single-stage
    schedules, which build none; the simulator generates the same order for them)."""
    from titanext.schedules._torch_ir import is_single_stage

    order = getattr(schedule, "pipeline_order", None)
    if not order or is_single_stage(type(schedule)):
        return None
    return {r: [a for a in acts if a is not None] for r, acts in order.items()}


def _simulated(name, order, microbatches, costs, comm):
    """Bubble (1 - mean busy / makespan, as measured) and peak memory of the executed lists."""
    if order is None:
        sim = simulate(name, pp=2, microbatches=microbatches, comm=comm, **costs)
    else:
        cls = get_schedule_class(name)
        spr = resolved_stages_per_rank(cls)
        share = 1.0 if cls.placement == "dualpipe" else 1.0 / spr
        sim = replay(order, num_stages=num_stages_for(cls.placement, 2, spr), stage_size=share,
                     comm=comm, **{k: v * share for k, v in costs.items()})
    return _bubble(sim), max(sim.peak_memory)


def _bubble(sim) -> float:
    ranks = sorted({e.rank for e in sim.events})
    busy = [sum(e.end - e.start for e in sim.events if e.rank == q) for q in ranks]
    return 1 - sum(busy) / len(busy) / sim.makespan


def _simulated_as_run(name, order, microbatches, summaries, hop) -> float:
    """The bubble of the executed lists replayed with what this schedule's own run measured:
    F, I, W and B per stage (mean per call, median over steps), the hop as ``comm`` and the
    runtime's time between chunks as ``overhead``."""
    cls = get_schedule_class(name)
    spr = resolved_stages_per_rank(cls)
    if order is None:
        order = schedule_order(name, pp=2, microbatches=microbatches)
    keys = set().union(*(s["stage_kinds"] for s in summaries))
    cost = {k: _med([s["stage_kinds"][k] for s in summaries if k in s["stage_kinds"]])
            for k in keys}

    def per_stage(kind):
        stages = {st: c for (k, st), c in cost.items() if k == kind}
        return stages or 0.0

    sim = replay(order, num_stages=num_stages_for(cls.placement, 2, spr), f=per_stage("F"),
                 b=per_stage("I"), w=per_stage("W"), full_b=per_stage("B") or None, comm=hop,
                 overhead=_med([s["overhead"] for s in summaries]))
    return _bubble(sim)


def _med(xs):
    return statistics.median(xs)


def real_table(steps: int, dim: int, rows: int, variants=REAL_VARIANTS, microbatches: int = 8
               ) -> tuple[list[dict], dict]:
    """pp = 2 on gloo: step time, measured and simulated bubble and peak activation memory per
    schedule, and the per-micro-batch F, I, W, B behind them.

    Bubble, measured and simulated alike: 1 - mean busy time of a rank / makespan, the
    makespan running from the first chunk to the last over all ranks (busy: inside the stage's
    F, I, W, B chunk methods). "outside" is the rest of the step (before the first chunk and
    after the last: loss exchange, DualPipe's mirrored-gradient sum, the last sends). The
    simulated bubble replays the lists each schedule ran with the F, I, W (max over ranks,
    median over steps) measured under the same split, at comm = 0 and at the measured hop
    ("hop": median over the run's cross-rank dependencies that a rank sat waiting for, from
    the sending chunk's end to the receiving chunk's start). "idle" splits the rest of the
    makespan (mean over ranks): waiting in P2P calls / issuing P2P calls / everything else
    (loss, Python between chunks).
    """
    variants = [v for v in variants if not schedule_problems(v[0], pp=2, microbatches=microbatches)]
    assert variants[0] == ("1F1B", "autograd"), "1F1B is the baseline"
    load_before = os.getloadavg()
    t0 = time.time()
    res = run_distributed(_time_schedules, 2, args=(variants, microbatches, dim, rows, steps),
                          timeout_s=1800)[0]
    info = {"load_before": load_before, "load_after": os.getloadavg(),
            "seconds": time.time() - t0, "variants": {}}
    summaries, memory, orders = res["results"], res["memory"], res["orders"]

    def kind_cost(v, k):  # per call, max over ranks, median over steps
        return _med([max(s["kinds"][k]) for s in summaries[v]])

    def kind_mean(v, k):  # per call, mean over ranks, median over steps
        return _med([sum(s["kinds"][k]) / len(s["kinds"][k]) for s in summaries[v]])

    costs = {split: {"f": kind_cost(("ZBH1", split), "F"), "b": kind_cost(("ZBH1", split), "I"),
                     "w": kind_cost(("ZBH1", split), "W")}
             for split in ("deferred", "autograd") if ("ZBH1", split) in summaries}
    full_b = kind_mean(variants[0], "B")
    info["iwb"] = {split: (kind_mean(("ZBH1", split), "I") + kind_mean(("ZBH1", split), "W"))
                   / full_b for split in costs}
    info["costs"], info["full_b"] = costs, full_b
    base_step = _med([s["step"] for s in summaries[variants[0]]])
    base_mem = max(memory[variants[0]])
    sim_base = None
    rows_out = []
    for v in variants:
        name, split = v
        ss = summaries[v]
        step, makespan = _med([s["step"] for s in ss]), _med([s["makespan"] for s in ss])
        bubble = _med([1 - s["busy"] / s["makespan"] for s in ss])
        c = costs.get(split) or costs["deferred"]
        hops = [h for s in ss for h in s["hops"]]
        hop = _med(hops) if hops else 0.0
        sim_bubble, sim_peak = _simulated(name, orders[v], microbatches, c, 0.0)
        sim_run = _simulated_as_run(name, orders[v], microbatches, ss, hop)
        overhead = _med([s["overhead"] for s in ss])
        idle = {k: _med([s["idle"][k] for s in ss]) * 1e3 for k in ("wait", "post", "rest")}
        if sim_base is None:
            sim_base = sim_peak
        label = name if split == "deferred" or name == "1F1B" else f"{name} ({split} split)"
        rows_out.append({
            "schedule": label, "step (s)": f"{step:.3f}", "vs 1F1B": f"{step / base_step:.2f}x",
            "bubble": f"{bubble:.3f}", "simulated": f"{sim_bubble:.3f}",
            "hop (ms)": f"{hop * 1e3:.1f}", "between (ms)": f"{overhead * 1e3:.2f}",
            "sim. as run": f"{sim_run:.3f}",
            "idle: wait/p2p/rest (ms)": "/".join(f"{idle[k]:.0f}" for k in idle),
            "outside (ms)": f"{(step - makespan) * 1e3:.0f}",
            "peak act. (MB)": f"{max(memory[v]) / 2**20:.1f}",
            "vs 1F1B ": f"{max(memory[v]) / base_mem:.2f}x",
            "simulated peak": f"{sim_peak:g} ({sim_peak / sim_base:.2f}x)"})
        info["variants"][label] = {"step": step, "bubble": bubble, "simulated": sim_bubble,
                                   "simulated_as_run": sim_run, "hop": hop,
                                   "between": overhead, "idle": idle}
    return rows_out, info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--real-steps", type=int, default=9)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--rows", type=int, default=64, help="rows per micro-batch")
    ap.add_argument("--skip-simulated", action="store_true")
    a = ap.parse_args(argv)
    if not a.skip_simulated:
        print("1. simulated: bubble / peak memory (in micro-batches of one rank's share)")
        print(format_table(simulated_table(), markdown=a.markdown), flush=True)
    print(f"\n2. real: pp=2 on gloo, 8 micro-batches of {a.rows} rows, 8 MLP blocks "
          f"{a.dim} -> {4 * a.dim} -> {a.dim} (4 per rank), one thread per rank; median of "
          f"{a.real_steps} steps; the variants take turns step by step", flush=True)
    table, info = real_table(a.real_steps, a.dim, a.rows)
    print(format_table(table, markdown=a.markdown))
    for split, c in info["costs"].items():
        print(f"{split} split, per micro-batch of a rank's share (under ZBH1, max over ranks): "
              + ", ".join(f"{'FIW'['fbw'.index(k)]} = {v * 1e3:.1f} ms" for k, v in c.items())
              + f"; (I+W)/B = {info['iwb'][split]:.2f} (B = {info['full_b'] * 1e3:.1f} ms "
              "under 1F1B; I, W, B: mean over ranks)")
    lb, la = info["load_before"], info["load_after"]
    print(f"load average before {lb[0]:.1f} {lb[1]:.1f} {lb[2]:.1f}, after {la[0]:.1f} "
          f"{la[1]:.1f} {la[2]:.1f}; {os.cpu_count()} cores; the run took {info['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
