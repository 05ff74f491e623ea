"""Pipeline schedules side by side: simulated bubble and memory, and a real gloo run.

    python benchmarks/pipeline_schedules.py [--markdown] [--real-steps 5] [--dim 512]

1. Simulated (titanext.schedules.simulate, the action lists that execute): bubble and peak
   activations of every generated schedule for pp in {4, 8} and m in {8, 16, 32}, at F = I = W
   and at an unequal profile (F = 1, I = 1, W = 0.5, comm = 0.05: W is the cheaper half of the
   backward, as in the zero-bubble paper's profiles).
2. Real: pp = 2 on gloo (one rank per core), 8 micro-batches of an MLP pipeline, the step time
   of torch's 1F1B against titanext's ZBH1, ZBH2 and Auto (median of --real-steps).
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
    stage_ids,
)

PROFILES = {"F=I=W": dict(f=1.0, b=1.0, w=1.0, comm=0.0),
            "F=1 I=1 W=0.5 comm=0.05": dict(f=1.0, b=1.0, w=0.5, comm=0.05)}


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


def _time_schedules(rank, world, names, microbatches, dim, steps):
    from torch.distributed.pipelining import PipelineStage

    x = torch.randn(microbatches * 8, dim)
    y = torch.randn(microbatches * 8, dim)
    out = {}
    for name in names:
        cls = get_schedule_class(name)
        per_rank = cls.stages_per_rank or 1
        ids = stage_ids(cls.placement, rank, world, per_rank)
        # The same 8-block model whatever the schedule: V schedules hold two half-size stages.
        stages = [PipelineStage(_mlp_stage(s, dim, 4 // per_rank), stage_index=s,
                                num_stages=world * per_rank,
                                device=torch.device("cpu"), group=dist.group.WORLD) for s in ids]
        sched = build_schedule(name, stages, microbatches, loss_fn=_loss)
        times = []
        for i in range(steps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            if 0 in ids:
                sched.step(x, target=y) if world * per_rank - 1 in ids else sched.step(x)
            else:
                sched.step(target=y)
            elapsed = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i:
                times.append(elapsed.item())
        out[name] = statistics.median(times)
    return out


def real_table(steps: int, dim: int) -> list[dict]:
    names = ["1F1B", "ZBH1", "ZBH2", "Auto"]
    times = run_distributed(_time_schedules, 2, args=(names, 8, dim, steps), timeout_s=900)[0]
    base = times["1F1B"]
    return [{"schedule": n, "step (s)": f"{t:.3f}", "vs 1F1B": f"{t / base:.2f}x",
             "simulated bubble": f"{simulate(n, pp=2, microbatches=8).bubble_ratio:.3f}"}
            for n, t in times.items()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--real-steps", type=int, default=5)
    ap.add_argument("--dim", type=int, default=512)
    a = ap.parse_args(argv)
    print("1. simulated: bubble / peak activations (in micro-batches of one rank's share)")
    print(format_table(simulated_table(), markdown=a.markdown), flush=True)
    print(f"\n2. real: pp=2 on gloo, 8 micro-batches, MLP stages of dim {a.dim} "
          f"(median of {a.real_steps} steps; a step ends with the slowest rank)", flush=True)
    print(format_table(real_table(a.real_steps, a.dim), markdown=a.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
