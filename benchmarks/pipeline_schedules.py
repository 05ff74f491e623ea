"""Pipeline schedules side by side: simulated bubble and memory, and a real gloo run.

    python benchmarks/pipeline_schedules.py [--markdown] [--real-steps 9] [--dim 512]
        [--rows 64] [--skip-simulated]

1. Simulated (titanext.schedules.simulate, the action lists that execute): bubble and peak
   memory of every schedule, ours and torch's, for pp in {4, 8} and m in {8, 16, 32}, at
   F = I = W and at an unequal profile (F = 1, I = 1, W = 0.5, comm = 0.03: W is the cheaper
   half of the backward, the kind of profile the zero-bubble paper measures).
2. Real: pp = 2 on gloo (one rank per core, one thread each), 8 micro-batches through the same
   8-block MLP for every schedule, the schedules taking turns step by step: the step time
   (median of --real-steps), the measured bubble (1 - a rank's time inside the stage's
   F/I/W/B chunk methods / step time, mean over ranks; median over steps)
   and the simulated bubble and step for the F, I, W measured under ZBH1. Auto is generated
   for those measured costs, as the trainer does after its first step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from titanext.local_launch import run_distributed
from titanext.metrics import format_table
from titanext.schedules import (
    _SIMULATED,
    build_schedule,
    get_schedule_class,
    schedule_problems,
    simulate,
    stage_ids_for_rank,
)

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


REAL_SCHEDULES = ["1F1B", "ZBH1", "ZBH2", "ZBV", "ZBVZeroBubble", "DualPipeV", "DualPipe", "Auto"]


def _build(name, rank, world, microbatches, dim, costs=None):
    from torch.distributed.pipelining import PipelineStage

    from titanext.pipeline import StageTimer
    from titanext.schedules import auto_schedule_class, num_stages_for

    cls = get_schedule_class(name)
    per_rank = cls.stages_per_rank or 1
    n_stages = num_stages_for(cls.placement, world, per_rank)
    if costs is not None:  # Auto, as the trainer does: generated for the measured costs
        cls = auto_schedule_class(**{k: costs[k] / costs["f"] for k in "fbw"})
    ids = stage_ids_for_rank(cls.placement, rank, world, per_rank)
    # The same 8-block model whatever the schedule: 4 blocks per pp rank, split over the
    # stages a rank holds (DualPipe holds 2 copies of a 4-block stage)
    blocks = 4 * world // n_stages
    stages = [PipelineStage(_mlp_stage(s, dim, blocks), stage_index=s, num_stages=n_stages,
                            device=torch.device("cpu"), group=dist.group.WORLD) for s in ids]
    return stages, build_schedule(cls, stages, microbatches, loss_fn=_loss), StageTimer(stages)


def _one_step(stages, sched, timer, x, y, world):
    """(step time of the slowest rank, every rank's busy time in the chunk methods)."""
    for v in timer.times.values():
        v.clear()
    dist.barrier()
    t0 = time.perf_counter()
    if any(st.is_first for st in stages):
        sched.step(x, target=y if any(st.is_last for st in stages) else None)
    else:
        sched.step(target=y if any(st.is_last for st in stages) else None)
    elapsed = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    everyone = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(everyone, torch.tensor([sum(sum(v) for v in timer.times.values())]))
    return elapsed.item(), [float(b) for b in everyone]


def _time_schedules(rank, world, names, microbatches, dim, rows, steps):
    """Per schedule: median step time (slowest rank) and each rank's busy time inside the
    stage's F / I / W / B chunk methods (titanext.pipeline.StageTimer); F, I, W per
    micro-batch measured under ZBH1. The schedules take turns step by step (round robin), so
    a burst of load from elsewhere hits all of them alike."""
    torch.set_num_threads(1)  # one core per rank
    x = torch.randn(microbatches * rows, dim)
    y = torch.randn(microbatches * rows, dim)
    built = {"ZBH1": _build("ZBH1", rank, world, microbatches, dim)}
    for _ in range(3):  # warm-up; Auto is generated for the F, I, W seen here (max over ranks)
        _one_step(*built["ZBH1"], x, y, world)
    times = built["ZBH1"][2].times
    t = torch.tensor([sum(times[k]) / max(len(times[k]), 1) for k in "fbw"], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    costs = dict(zip("fbw", t.tolist()))
    for name in names:
        if name not in built:
            built[name] = _build(name, rank, world, microbatches, dim,
                                 costs if name == "Auto" else None)
    results = {name: [] for name in names}
    per_step_costs = []
    for i in range(steps + 1):
        for name in names:
            r = _one_step(*built[name], x, y, world)
            if i:  # the first round warms every schedule up
                results[name].append(r)
                if name == "ZBH1":
                    times = built[name][2].times
                    per_step_costs.append([sum(times[k]) / len(times[k]) for k in "fbw"])
    # the simulation uses the F, I, W of the timed rounds (median over steps, max over ranks)
    t = torch.tensor([statistics.median(c[i] for c in per_step_costs) for i in range(3)],
                     dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    costs = dict(zip("fbw", t.tolist()))
    out = {}
    for name, rs in results.items():
        step = statistics.median(r[0] for r in rs)
        busy = statistics.median(sum(r[1]) / len(r[1]) for r in rs)
        out[name] = {"step": step, "busy": busy}
    out["_costs"] = costs
    return out


def real_table(steps: int, dim: int, rows: int, names=REAL_SCHEDULES) -> tuple[list[dict], dict]:
    """pp = 2 on gloo: step time, measured and simulated bubble per schedule.

    Measured bubble: 1 - mean busy time of a rank / step time (the busy time is spent inside
    the stage's F, I, W, B chunk methods). Simulated: the same ratio from the simulator's
    timeline with the F, I, W measured under ZBH1 (comm = 0).
    """
    names = [n for n in names if n in _SIMULATED and not schedule_problems(n, pp=2, microbatches=8)]
    assert names[:2] == ["1F1B", "ZBH1"], "1F1B is the baseline, ZBH1 measures F, I, W"
    res = run_distributed(_time_schedules, 2, args=(names, 8, dim, rows, steps), timeout_s=1200)[0]
    costs = res.pop("_costs")
    base = res["1F1B"]["step"]
    rows_out = []
    for name, r in res.items():
        sim = simulate(name, pp=2, microbatches=8, **costs)
        ranks = sorted({e.rank for e in sim.events})
        sim_busy = [sum(e.end - e.start for e in sim.events if e.rank == q) for q in ranks]
        rows_out.append({
            "schedule": name, "step (s)": f"{r['step']:.3f}", "vs 1F1B": f"{r['step'] / base:.2f}x",
            "measured bubble": f"{1 - r['busy'] / r['step']:.3f}",
            "simulated bubble": f"{1 - sum(sim_busy) / len(sim_busy) / sim.makespan:.3f}",
            "simulated step (s)": f"{sim.makespan:.3f}"})
    return rows_out, costs


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
          f"{a.real_steps} steps (a step ends with the slowest rank)", flush=True)
    table, costs = real_table(a.real_steps, a.dim, a.rows)
    print(format_table(table, markdown=a.markdown))
    print("F, I, W per micro-batch of a rank's share (measured under ZBH1): "
          + ", ".join(f"{k.upper() if k != 'b' else 'I'} = {v * 1e3:.1f} ms" for k, v in costs.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
