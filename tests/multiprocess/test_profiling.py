"""``[profiling]`` on 2 gloo ranks: traces, the step table, unchanged numerics, and the CPU
memory breakdown against the dry run's figures. One spawn runs every case."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest

from tests.spawn import fp32_trainer_overrides, run_distributed

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "train_configs" / "debug_model.toml")
PROFILED = ["--profiling.enable_profiling", "--profiling.profile_freq=2",
            "--profiling.profiler_warmup=0", "--profiling.profiler_active=1",
            "--profiling.enable_memory_snapshot", "--training.gc_freq=2"]
# name -> (layout overrides, the ranges each rank's trace must hold)
CASES = {
    "fsdp": (["--parallelism.data_parallel_shard_degree=2"],
             {"titanext:data", "titanext:forward", "titanext:backward", "titanext:optimizer",
              "titanext:loss", "titanext:log"}),
    "pp": (["--parallelism.pipeline_parallel_degree=2", "--training.local_batch_size=4",
            "--parallelism.pipeline_parallel_schedule=ZBH1",
            "--parallelism.pipeline_parallel_microbatches=4"],
           {"titanext:pipeline", "titanext:optimizer"}),
}


def _cfg(folder: str, layout: list[str], extra: list[str]):
    from titanext.config import load_config

    return load_config(CONFIG, [*fp32_trainer_overrides(steps=4, seq_len=32, flavor="debugtiny"),
                                "--training.local_batch_size=4", *layout,
                                f"--job.dump_folder={folder}", *extra], world_size=2)


def _heap_bytes() -> int:
    """Bytes malloc has handed out and not taken back (glibc's mallinfo2: heap and mmap)."""
    import ctypes

    class Info(ctypes.Structure):
        _fields_ = [(f, ctypes.c_size_t) for f in ("arena", "ordblks", "smblks", "hblks",
                                                    "hblkhd", "usmblks", "fsmblks", "uordblks",
                                                    "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Info
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def _body(rank: int, world_size: int, folder: str) -> dict:
    import torch.distributed as dist

    from titanext._fake_backend import init_fake_process_group
    from titanext.launch.dry_run import measure
    from titanext.trainer import Trainer

    out: dict = {}
    for name, (layout, _) in CASES.items():
        # the profiled run first: a memory breakdown on a pipeline's first step once left
        # its tracker's module hooks switched on for good (the stage start-up's wrapper
        # stayed on the schedule), and the next pipeline trainer's backward shape inference
        # failed on them
        profiled = Trainer(_cfg(f"{folder}/{name}", layout, PROFILED)).train()
        gc_after = gc.isenabled()  # [training] gc_freq gives Python's setting back
        gc.collect()
        gc.disable()  # kept off by train() (it restores the setting it found)
        trainer = Trainer(_cfg(f"{folder}/{name}-plain", layout, []))
        plain = trainer.train()
        before = _heap_bytes()
        gc.collect()  # what only the cyclic collector frees: held by cycles since the build
        cyclic = before - _heap_bytes()
        gc.enable()
        del trainer
        out[name] = {"profiled": profiled, "plain": plain, "gc_after": gc_after,
                     "cyclic_bytes": cyclic}
    dist.barrier()
    dist.destroy_process_group()
    init_fake_process_group(rank, world_size)  # the same rank, now in a dry run
    layout = CASES["fsdp"][0]
    dry = measure(_cfg(f"{folder}/dry", layout, ["--comm.mode=fake_backend",
                                                  f"--comm.fake_rank={rank}"]))
    out["dry"] = {"memory": dry.memory, "peak": dry.peak}
    return out


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> tuple[Path, list[dict]]:
    """(the runs' folder, each rank's results): one spawn for every test of this module."""
    folder = tmp_path_factory.mktemp("profiling")
    return folder, run_distributed(_body, 2, args=(str(folder),), timeout_s=600)


def test_profiled_runs_write_traces_and_tables_and_keep_the_numerics(spawned):
    """Every rank writes a trace per window holding titanext's ranges and a step table whose
    phases add up to the step within 10% (in the better of its two traced steps; gc_freq = 2:
    Python's collector runs in the gc phase of the traced steps, so no collection pauses a step
    outside the phases, and it is on again after train()); the losses equal an unprofiled run's
    bitwise; the pipeline run reports its F/I/W chunks, its measured and simulated bubble, and its
    send/recv time as the time it blocked waiting (> 0, within the pipeline phase)."""
    tmp_path, results = spawned
    problems = []
    for name, (_, ranges) in CASES.items():
        for rank in (0, 1):
            r = results[rank][name]
            if not r["gc_after"]:
                problems.append(f"{name} rank {rank}: Python's collector left off after train()")
            # gc_freq keeps the collector off for up to 50 steps: a reference cycle holding a
            # step's tensors would pile them up (measured: 2-110 KB from the build, none a step)
            if r["cyclic_bytes"] > 256 * 1024:
                problems.append(f"{name} rank {rank}: {r['cyclic_bytes']} bytes held by "
                                "reference cycles after 4 steps with the collector off")
            if r["profiled"] != r["plain"]:  # bitwise: profiling only observes
                problems.append(f"{name} rank {rank}: losses {r['profiled']} != {r['plain']}")
            shares = []
            for step in (2, 4):
                trace = tmp_path / name / "profile_traces" / f"iteration_{step}" / \
                    f"rank{rank}_trace.json"
                names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
                if not ranges <= names:
                    problems.append(f"{name} {trace.name} step {step}: no {ranges - names}")
                table = json.loads((trace.parent / f"rank{rank}_step_table.json").read_text())
                if table["steps"] != [step]:
                    problems.append(f"{name} rank {rank}: table of steps {table['steps']}")
                shares.append(sum(table["phases"].values()) / table["step_ms"])
                if shares[-1] > 1.0 + 1e-9:
                    problems.append(f"{name} rank {rank} step {step}: phases are "
                                    f"{shares[-1]:.1%} of the step")
                # gc_freq = 2: steps 2 and 4 collect, in their own range, and nothing else does
                if not table["phases"].get("gc", 0) > 0:
                    problems.append(f"{name} rank {rank} step {step}: no gc phase in "
                                    f"{table['phases']}")
            # Code outside every phase shows in both traced steps; another process taking the
            # core between two phases (the README's command runs two test streams) in one: a
            # 27 ms step has shown 86% where it shows 99% alone. So the better step must reach 90%.
            if max(shares) < 0.9:
                problems.append(f"{name} rank {rank}: phases are "
                                f"{', '.join(f'{x:.1%}' for x in shares)} of steps 2 and 4")
            if name == "fsdp" and not table["comm"].get("FSDP all-gather"):
                problems.append(f"fsdp rank {rank}: no FSDP all-gather time in {table['comm']}")
            if name == "pp":
                pipe = table.get("pipeline", {})
                if not (0 <= pipe.get("idle_measured", -1) < 1
                        and 0 <= pipe.get("idle_simulated", -1) < 1):
                    problems.append(f"pp rank {rank}: pipeline idle {pipe}")
                if not {"F", "I", "W"} <= {k for c in table["chunks"].values() for k in c}:
                    problems.append(f"pp rank {rank}: chunks {table['chunks']}")
                # the send/recv row is the time blocked in the waits, within the pipeline phase
                wait, wall = table["comm"].get("PP send/recv", 0.0), table["phases"]["pipeline"]
                print(f"pp rank {rank}: PP send/recv {wait:.2f} ms of a {wall:.2f} ms pipeline "
                      f"phase ({table['step_ms']:.2f} ms step)")
                if not 0 < wait <= wall <= table["step_ms"]:
                    problems.append(f"pp rank {rank}: PP send/recv {wait} ms, pipeline phase "
                                    f"{wall} ms, step {table['step_ms']} ms")
    assert not problems, "\n".join(problems)


def test_cpu_memory_breakdown_matches_the_dry_run(spawned):
    """The MemTracker breakdown of step 3 (optimizer state exists, as in the dry run's measured
    step) matches the dry run of the same config within 5%: peak, parameters, gradients and
    optimizer state."""
    tmp_path, results = spawned
    bad = []
    for rank in (0, 1):
        path = tmp_path / "fsdp" / "memory_snapshot" / "iteration_3" / \
            f"rank{rank}_memory_breakdown.json"
        breakdown = json.loads(path.read_text())
        dry = results[rank]["dry"]
        if abs(breakdown["peak_bytes"] / dry["peak"] - 1) > 0.05:
            bad.append(f"rank {rank}: peak {breakdown['peak_bytes']} vs dry run {dry['peak']}")
        for key in ("Parameter", "Gradient", "Optstate"):
            mine, theirs = breakdown["bytes"].get(key, 0), dry["memory"].get(key, 0)
            if theirs and abs(mine / theirs - 1) > 0.05:
                bad.append(f"rank {rank} {key}: {mine} vs dry run {theirs}")
    assert not bad, "\n".join(bad)
