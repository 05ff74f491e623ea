"""Pipeline schedules through the trainer: tokens/s of the debug model at pp = 2.

    python benchmarks/pipeline_trainer.py [--markdown] [--rounds 6] [--steps-per-turn 2]
        [--schedules 1F1B,ZBH1,ZBH2,ZBV,Auto,DualPipeV,DualPipe] [--autograd-split] [--profile]

Every schedule gets its own ``titanext.trainer.Trainer`` (debug model, pp = 2 on gloo, one
thread per rank, 8 micro-batches of 2 x 512 tokens, fp32, synthetic data), all built in one
2-process spawn. After two warm-up steps each (Auto measures F, I, W on its first step and
switches), the trainers take turns: each round runs ``--steps-per-turn`` timed steps of every
schedule in turn, so a burst of load from elsewhere hits all of them alike. Per schedule: the
median step time over all timed steps, tokens/s (16 x 512 tokens per step), the ratio to 1F1B
(torch's Schedule1F1B), the spread of the per-round medians (min - max ratio over rounds) and
the load average. ``--autograd-split`` adds "ZBH1 (autograd split)": torch's
stage_backward_input / _weight instead of deferred weight gradients.

``--profile``: after the timed rounds, each trainer runs two more steps through its
``[profiling]`` keys (one profiler warm-up step, one traced), and the benchmark prints every
schedule's step table (docs/profiling.md): phases, F/I/W chunks, measured and simulated
bubble, send/recv time, per rank. The timed steps run without a profiler.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
import time

import torch.distributed as dist

from titanext._text import format_table
from titanext.components.step_table import breakdown_rows
from titanext.launch.local import run_distributed

SCHEDULES = ["1F1B", "ZBH1", "ZBH2", "ZBV", "Auto", "DualPipeV", "DualPipe"]
BATCH, SEQ, MICROBATCHES = 16, 512, 8
PROFILE_FREQ = 2  # --profile: step 1 warms the profiler up, step 2 is traced
PROFILE = ["--profiling.enable_profiling", f"--profiling.profile_freq={PROFILE_FREQ}",
           "--profiling.profiler_warmup=1", "--profiling.profiler_active=1"]


def _overrides(schedule: str, split: str, folder: str, profile: bool) -> list[str]:
    return [*(PROFILE if profile else []),
            "--model.flavor=debugmodel", "--training.dataset=synthetic",
            f"--training.local_batch_size={BATCH}", f"--training.seq_len={SEQ}",
            "--training.steps=100000", "--training.mixed_precision_param=float32",
            "--metrics.enable_tensorboard=false", "--metrics.log_freq=100000",
            "--metrics.progress_bar=false", f"--job.dump_folder={folder}",
            "--parallelism.pipeline_parallel_degree=2",
            f"--parallelism.pipeline_parallel_schedule={schedule}",
            f"--parallelism.pipeline_parallel_microbatches={MICROBATCHES}",
            f"--parallelism.pipeline_parallel_split_backward={split}"]


def pin_rank(rank: int) -> None:
    """Pin this process (its compute thread and gloo's) to core ``rank`` mod the cores it may
    use, so that two ranks never share a core while another is idle."""
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})


def _turns(rank, world, variants, rounds, per_turn, folder, profile):
    """Per variant: every timed step's seconds, grouped by round (then, with ``profile``, a
    profiled window of each trainer: its tables land in the variant's dump folder)."""
    from titanext.config import load_config
    from titanext.trainer import Trainer

    trainers = {}
    for i, (name, split) in enumerate(variants):
        cfg = load_config(None, _overrides(name, split, f"{folder}/{i}", profile),
                          world_size=world)
        trainers[(name, split)] = Trainer(cfg)

    def step(trainer) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        trainer.train_step(trainer.next_microbatches())
        elapsed = time.perf_counter() - t0
        dist.barrier()
        return elapsed

    for trainer in trainers.values():  # warm-up (Auto measures and switches on step 1)
        for _ in range(2):
            step(trainer)
    times = {v: [] for v in variants}
    for _ in range(rounds):
        for v, trainer in trainers.items():
            times[v].append([step(trainer) for _ in range(per_turn)])
    for trainer in trainers.values() if profile else ():
        with contextlib.redirect_stdout(io.StringIO()):  # the benchmark prints the tables
            trainer.train(until_step=PROFILE_FREQ)
    # the step time is the slowest rank's: every rank's barrier-to-return time
    everyone = [None] * world
    dist.all_gather_object(everyone, times)
    return {v: [[max(r[v][i][j] for r in everyone) for j in range(per_turn)]
                for i in range(rounds)] for v in variants}


def _label(variant: tuple[str, str]) -> str:
    name, split = variant
    return name if split == "deferred" or name == "1F1B" else f"{name} ({split} split)"


def _step_tables(folder: str, variants, world: int) -> dict[str, list[dict]]:
    """Per variant: the step table rows of its profiled window, from every rank's JSON."""
    out = {}
    for i, v in enumerate(variants):
        window = os.path.join(folder, str(i), "profile_traces", f"iteration_{PROFILE_FREQ}")
        tables = []
        for rank in range(world):
            with open(os.path.join(window, f"rank{rank}_step_table.json")) as f:
                tables.append(json.load(f))
        out[_label(v)] = breakdown_rows(tables)
    return out


def trainer_table(schedules, rounds: int, per_turn: int, autograd_split: bool = False,
                  profile: bool = False) -> tuple[list[dict], dict]:
    """The timing rows, and ``info``: the load, the run's seconds and (``profile``) each
    variant's step table rows under ``"step_tables"``."""
    variants = [(s, "deferred") for s in schedules]
    if autograd_split:
        variants.insert(schedules.index("ZBH1") + 1 if "ZBH1" in schedules else 1,
                        ("ZBH1", "autograd"))
    assert variants[0][0] == "1F1B", "1F1B is the baseline"
    load_before, t0 = os.getloadavg(), time.time()
    with tempfile.TemporaryDirectory() as folder:
        times = run_distributed(_turns, 2, args=(variants, rounds, per_turn, folder, profile),
                                timeout_s=3600)[0]
        tables = _step_tables(folder, variants, 2) if profile else {}
    info = {"load_before": load_before, "load_after": os.getloadavg(),
            "seconds": time.time() - t0, "step_tables": tables}
    base = statistics.median(t for r in times[variants[0]] for t in r)
    base_rounds = [statistics.median(r) for r in times[variants[0]]]
    rows = []
    for v in variants:
        med = statistics.median(t for r in times[v] for t in r)
        per_round = [statistics.median(r) / b for r, b in zip(times[v], base_rounds, strict=True)]
        rows.append({"schedule": _label(v), "step (s)": f"{med:.3f}",
                     "tokens/s": f"{BATCH * SEQ / med:,.0f}", "vs 1F1B": f"{med / base:.2f}x",
                     "per-round range": f"{min(per_round):.2f}-{max(per_round):.2f}x"})
    return rows, info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps-per-turn", type=int, default=2)
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--autograd-split", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="profile one step per schedule and print its step table")
    a = ap.parse_args(argv)
    schedules = a.schedules.split(",")
    print(f"debug model, pp=2 on gloo, {MICROBATCHES} micro-batches of {BATCH // MICROBATCHES} "
          f"x {SEQ} tokens, fp32, one thread per rank; {a.rounds} rounds x {a.steps_per_turn} "
          "steps per schedule, the schedules taking turns", flush=True)
    rows, info = trainer_table(schedules, a.rounds, a.steps_per_turn, a.autograd_split,
                               a.profile)
    print(format_table(rows, markdown=a.markdown))
    for label, table in info["step_tables"].items():
        print(f"\nstep table of {label} (one profiled step, ms):")
        print(format_table(table, markdown=a.markdown))
    lb, la = info["load_before"], info["load_after"]
    print(f"load average before {lb[0]:.1f} {lb[1]:.1f} {lb[2]:.1f}, after {la[0]:.1f} "
          f"{la[1]:.1f} {la[2]:.1f}; {os.cpu_count()} cores; the run took {info['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
