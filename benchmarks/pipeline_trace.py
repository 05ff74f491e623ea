"""Where a pipeline step's time goes, per rank, through the trainer: the trace table.

    python benchmarks/pipeline_trace.py [--markdown] [--schedules 1F1B,ZBV,Auto,DualPipeV]
        [--steps 10 --measured 7] [--pin]

The shape of ``benchmarks/pipeline_trainer.py`` (debug model, pp = 2 on gloo, 8 micro-batches
of 2 x 512 tokens, fp32, one thread per rank). Every schedule's ``Trainer`` is built in one
2-process spawn and runs ``--steps`` steps in turn; the last ``--measured`` are timed. No
profiler runs (torch.profiler slows this model's steps by 50% or more and would be the largest
item of its own table): the benchmark wraps the stages' chunk methods, ``Work.wait``, the
weight-gradient queue's ``run`` and the pipeline's ``step`` with two clocks each, the wall
clock and the thread's CPU clock, and counts the garbage collector's passes and the process's
page faults. Rows (ms per step, one column per rank, means over the measured steps):

- step: barrier to barrier, the slowest rank's (mean); pipeline: inside ``PipelineRunner.step``;
  outside: the rest (loss all-reduces, clipping, optimizer);
- F / I / W / B: the stages' chunks (wall), and "off-CPU in chunks": their wall minus the
  compute thread's CPU time (the thread waiting for a core, or for page faults' I/O);
- W: queue run / torch's W step: the deferral queue's GEMMs inside W chunks, and what torch's
  W action adds around them; the queue's appends happen inside I (a list append per linear);
  (DualPipe's overlapped chunks run a full B's queue inside B: counted in B);
- waits on send / recv: inside ``Work.wait`` during the pipeline step;
- runtime between chunks: pipeline - chunks - waits (issuing P2P, the schedule's Python);
- garbage collector: time inside ``gc`` passes (any thread holding the GIL), and their count;
- page faults: minor faults of the process per step (fresh pages from the OS: the CPU
  allocator's cost; a reused block costs none);
- idle % measured: 1 - chunks / pipeline; idle % simulated: the same lists replayed by
  ``titanext.schedules.simulator`` with this run's per-stage F / I / W / B (comm = 0): what the
  schedule itself leaves idle given those costs; pipeline simulated: the replay's step (the
  rank's chunks / (1 - simulated idle)).

A last table puts the schedules side by side (:func:`summary_rows`): each one's measured step
against 1F1B's, its simulated step (the replay plus the measured time outside the pipeline)
against 1F1B's simulated step, and its compute (every rank's chunks) against 1F1B's. The
simulated ratio is the lead the schedule's order gives with the chunk costs it had; if the
measured ratio is higher, the rest went to waits and the runtime; a compute ratio above 1 says
its chunks cost more than 1F1B's for the same model.

The ranks keep freed memory (``pipeline_trainer.KEEP_FREED_MEMORY``) unless
``--glibc-default``: the page-fault row is that setting's reason. ``--pin`` pins rank r's
process (every thread: compute, gloo's) to core r mod cores before anything is built
(``os.sched_setaffinity``).
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import sys
import tempfile
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from titanext._text import format_table
from titanext.launch.local import run_distributed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pipeline_trainer import (  # noqa: E402
    BATCH,
    MICROBATCHES,
    SCHEDULES,
    SEQ,
    _overrides,
    pin_rank,
    rank_environment,
)

TRACED = ["1F1B", "ZBV", "Auto", "DualPipeV"]
_KIND = {"forward_one_chunk": "F", "backward_weight_one_chunk": "W"}


class _Clocks:
    """Wall and CPU seconds per named bucket, over the steps between ``start`` and ``stop``."""

    def __init__(self):
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.count: dict[str, int] = defaultdict(int)
        self.per_stage: dict[tuple[int, str], list[float]] = defaultdict(list)
        self.on = False
        self.inside: list[str] = []  # the chunk kinds open now (a queue runs inside W or B)
        self._undo: list = []
        self._gc_t0 = 0.0

    def timed(self, fn, key, stage=None):
        def run(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            k = key or ("B" if kwargs.get("full_backward", args[2] if len(args) > 2 else True)
                        else "I")
            if k == "queue run":
                k = f"queue run in {self.inside[-1] if self.inside else '-'}"
            self.inside.append(k)
            w0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.inside.pop()
                dw = time.perf_counter() - w0
                self.wall[k] += dw
                self.cpu[k] += time.thread_time() - c0
                self.count[k] += 1
                if stage is not None:
                    self.per_stage[(stage, k)].append(dw)
        return run

    def attach(self, trainer) -> None:
        from titanext.plugins.weight_grad import WeightGradQueue

        pipe = trainer.pipeline
        for st in pipe.stages:
            for meth in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                orig = getattr(st, meth)
                self._undo.append((st, meth, orig, meth in vars(st)))
                setattr(st, meth, self.timed(orig, _KIND.get(meth), st.stage_index))
            # the stage's own module: the compute inside an F chunk (the rest is the stage's)
            self._undo.append((st.submod, "forward", st.submod.forward, False))
            st.submod.forward = self.timed(st.submod.forward, "module forward")
        for owner, name, key in ((pipe, "step", "pipeline"), (dist.Work, "wait", "wait"),
                                 (WeightGradQueue, "run", "queue run"),
                                 (WeightGradQueue, "__call__", "queue run"),
                                 (torch.autograd, "backward", "autograd backward")):
            orig = getattr(owner, name)
            self._undo.append((owner, name, orig, owner is not pipe or name in vars(pipe)))
            setattr(owner, name, self.timed(orig, key))
        gc.callbacks.append(self._gc)

    def detach(self) -> None:
        for owner, name, orig, had in reversed(self._undo):
            if had:
                setattr(owner, name, orig)
            else:
                delattr(owner, name)
        self._undo.clear()
        gc.callbacks.remove(self._gc)

    def _gc(self, phase, info) -> None:
        if not self.on:
            return
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.wall["gc"] += time.perf_counter() - self._gc_t0
            self.count["gc"] += 1


def _one(trainer, clocks: _Clocks, steps: int, measured: int) -> dict:
    """Run ``steps`` steps of ``trainer``; this rank's figures over the last ``measured``."""
    step_times, faults = [], 0
    for i in range(steps):
        timed = i >= steps - measured
        if timed and not clocks.on:
            clocks.attach(trainer)
            clocks.on = True
        dist.barrier()
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        trainer.train_step(trainer.next_microbatches())
        elapsed = time.perf_counter() - t0
        dist.barrier()
        if timed:
            step_times.append(elapsed)
            faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    clocks.on = False
    clocks.detach()
    return {"step": step_times, "wall": dict(clocks.wall), "cpu": dict(clocks.cpu),
            "count": dict(clocks.count), "faults": faults / measured,
            "per_stage": {k: statistics.mean(v) for k, v in clocks.per_stage.items()}}


def _trace(rank, world, schedules, steps, measured, folder, pin):
    if pin:
        pin_rank(rank)
    from titanext.config import load_config
    from titanext.trainer import Trainer

    out = {}
    for i, name in enumerate(schedules):
        cfg = load_config(None, _overrides(name, "deferred", f"{folder}/{i}", False),
                          world_size=world)
        trainer = Trainer(cfg)
        mine = out[name] = _one(trainer, _Clocks(), steps, measured)
        stages = [None] * world
        dist.all_gather_object(stages, mine["per_stage"])
        mine["sim"] = _sim_idle(trainer.layout.pipeline, trainer.dims.pp_mesh.get_local_rank(),
                                stages)
        del trainer
        gc.collect()
    everyone = [None] * world
    dist.all_gather_object(everyone, out)
    return everyone


def _sim_idle(plan, pp_rank: int, per_stage: list[dict]) -> float | None:
    """This rank's simulated idle fraction from every stage's measured mean chunk costs
    (``per_stage``: each rank's {(stage, kind): seconds})."""
    from titanext.components.step_table import simulated_idle

    chunks: dict[int, dict[str, dict[str, float]]] = defaultdict(dict)
    for r in per_stage:
        for (stage, kind), sec in r.items():
            chunks[stage][kind] = {"ms": sec * 1e3}
    try:
        return simulated_idle(plan, pp_rank=pp_rank, chunks=chunks)
    except (ValueError, KeyError) as e:  # a schedule the simulator cannot replay
        print(f"(simulated idle unavailable: {type(e).__name__}: {e})")
        return None


def trace_rows(per_rank: list[dict], measured: int) -> list[dict]:
    """The table rows of one schedule from every rank's figures (``_one``)."""
    n = measured
    step = [max(ts) for ts in zip(*(r["step"] for r in per_rank))]
    sim = [r["sim"] for r in per_rank]

    def ms(r, key, clock="wall"):
        return r[clock].get(key, 0.0) * 1e3 / n

    def chunks(r, clock="wall"):
        return sum(ms(r, k, clock) for k in "FIWB")

    rows = [("step (slowest rank)", lambda r, i: statistics.mean(step) * 1e3),
            ("pipeline", lambda r, i: ms(r, "pipeline")),
            ("outside the pipeline", lambda r, i: statistics.mean(r["step"]) * 1e3
             - ms(r, "pipeline"))]
    for k in "FIWB":
        if any(k in r["wall"] for r in per_rank):
            rows.append((f"  {k} chunks", lambda r, i, k=k: ms(r, k)))
    rows += [
        ("  F: the module's forward", lambda r, i: ms(r, "module forward")),
        ("  F: the stage around it", lambda r, i: ms(r, "F") - ms(r, "module forward")),
        ("  I / B: autograd's backward", lambda r, i: ms(r, "autograd backward")),
        ("  I / B: the stage around it", lambda r, i: ms(r, "I") + ms(r, "B")
         - ms(r, "autograd backward") - ms(r, "queue run in B")),
        ("  off-CPU in chunks", lambda r, i: chunks(r) - chunks(r, "cpu")),
        ("  W: queue run", lambda r, i: ms(r, "queue run in W")),
        ("  W: torch's W step around it", lambda r, i: ms(r, "W") - ms(r, "queue run in W")),
        ("  waits on send / recv", lambda r, i: ms(r, "wait")),
        ("  runtime between chunks", lambda r, i: ms(r, "pipeline") - chunks(r)
         - ms(r, "wait")),
        ("garbage collector", lambda r, i: ms(r, "gc")),
        ("  gc passes / step", lambda r, i: r["count"].get("gc", 0) / n),
        ("page faults / step (x1000)", lambda r, i: r["faults"] / 1e3),
        ("idle % measured", lambda r, i: 100 * (1 - chunks(r) / ms(r, "pipeline"))),
        ("idle % simulated", lambda r, i: None if sim[i] is None else 100 * sim[i]),
        ("pipeline simulated", lambda r, i: None if sim[i] is None
         else chunks(r) / (1 - sim[i])),
    ]
    out = []
    for label, get in rows:
        row = {"ms per step": label}
        for i, r in enumerate(per_rank):
            v = get(r, i)
            row[f"rank {i}"] = "" if v is None else f"{v:,.1f}"
        out.append(row)
    return out


def _figures(per_rank: list[dict], measured: int) -> dict[str, float | None]:
    """One schedule's step (ms, slowest rank), its simulated step (the slowest rank's replayed
    pipeline plus the measured time outside it) and its chunks' total over ranks (ms)."""
    step = statistics.mean(max(ts) for ts in zip(*(r["step"] for r in per_rank))) * 1e3
    chunks = [sum(r["wall"].get(k, 0.0) for k in "FIWB") * 1e3 / measured for r in per_rank]
    outside = max(statistics.mean(r["step"]) * 1e3 - r["wall"]["pipeline"] * 1e3 / measured
                  for r in per_rank)
    sims = [None if r["sim"] is None else c / (1 - r["sim"]) for r, c in zip(per_rank, chunks)]
    return {"step": step, "chunks": sum(chunks),
            "sim": None if None in sims else max(sims) + outside}


def summary_rows(figures: dict[str, dict], base: str = "1F1B") -> list[dict]:
    """Per schedule: the measured step against ``base``'s; the simulated step (each schedule's
    own measured chunk costs replayed, no communication) against ``base``'s simulated step;
    and its compute (every rank's chunks) against ``base``'s. measured = simulated x overhead:
    the schedule's order gives the simulated ratio, the run's waits and runtime the rest, and
    the compute ratio says how much of either comes from chunks costing more than under base."""
    b = figures.get(base)

    def ratio(f: dict, key: str) -> str:
        if b is None or f[key] is None or b[key] is None:
            return ""
        return f"{f[key] / b[key]:.3f}x"

    return [{"schedule": name, "step (ms)": f"{f['step']:,.0f}", f"vs {base}": ratio(f, "step"),
             "simulated step (ms)": "" if f["sim"] is None else f"{f['sim']:,.0f}",
             f"simulated vs {base}": ratio(f, "sim"), f"compute vs {base}": ratio(f, "chunks")}
            for name, f in figures.items()]


def trace_tables(schedules, steps: int, measured: int, pin: bool, glibc_default: bool
                 ) -> tuple[dict[str, list[dict]], list[dict]]:
    """Every schedule's trace table, and the summary table (:func:`summary_rows`)."""
    with tempfile.TemporaryDirectory() as folder, rank_environment(glibc_default):
        everyone = run_distributed(_trace, 2, args=(schedules, steps, measured, folder, pin),
                                   timeout_s=3600)[0]
    per = {name: [r[name] for r in everyone] for name in schedules}
    return ({name: trace_rows(p, measured) for name, p in per.items()},
            summary_rows({name: _figures(p, measured) for name, p in per.items()}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--schedules", default=",".join(TRACED))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--measured", type=int, default=7)
    ap.add_argument("--pin", action="store_true", help="pin rank r to core r (mod cores)")
    ap.add_argument("--glibc-default", action="store_true",
                    help="leave glibc's malloc trimming freed memory (the table before the fix)")
    a = ap.parse_args(argv)
    bad = [f"--steps {a.steps}: allowed: a whole number >= 2"] if a.steps < 2 else []
    if not bad and not 1 <= a.measured <= a.steps - 1:
        bad.append(f"--measured {a.measured}: allowed: 1 to --steps - 1 = {a.steps - 1} (the "
                   "first step is never timed)")
    unknown = [n for n in a.schedules.split(",") if n not in SCHEDULES]
    if unknown:
        bad.append(f"--schedules {a.schedules}: allowed: any of {', '.join(SCHEDULES)}")
    if bad:
        print("\n".join(bad), file=sys.stderr)
        return 2
    load, t0 = os.getloadavg(), time.time()
    print(f"debug model, pp=2 on gloo, {MICROBATCHES} micro-batches of {BATCH // MICROBATCHES} "
          f"x {SEQ} tokens, fp32; {a.steps} steps per schedule, the last {a.measured} measured"
          f"{', ranks pinned to cores' if a.pin else ''}"
          f"{', glibc malloc defaults' if a.glibc_default else ', freed memory kept'}", flush=True)
    tables, summary = trace_tables(a.schedules.split(","), a.steps, a.measured, a.pin,
                                   a.glibc_default)
    for name, rows in tables.items():
        print(f"\n{name}:")
        print(format_table(rows, markdown=a.markdown))
    print("\nThe schedules side by side (simulated: each one's measured chunk costs replayed):")
    print(format_table(summary, markdown=a.markdown))
    after = os.getloadavg()
    print(f"\nload average before {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}, after "
          f"{after[0]:.1f} {after[1]:.1f} {after[2]:.1f}; the run took {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
