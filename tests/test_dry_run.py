"""The dry run (``[comm] mode = "fake_backend"``): one process plays rank R of N over torch's fake
process group and fake tensors, builds the real trainer, steps once and prints its memory and
communication next to the planner's (docs/dry_run.md)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from titanext.config import ConfigError, load_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
SUMMARY = re.compile(r"^titanext: dry run: rank (\d+) of (\d+), peak memory (\d+\.\d\d) GiB "
                     r"\(planner: (\d+\.\d\d) GiB\), step comm (\d+\.\d\d) GB$")


def dry_run(config: str, *overrides: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)  # an ordinary process, no torchrun
    return subprocess.run(
        [sys.executable, "-m", "titanext.train", "--config", str(ROOT / "train_configs" / config),
         "--comm.mode=fake_backend", "--metrics.enable_tensorboard=false", *overrides],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


@pytest.mark.parametrize("world_size,rank", [(8, 3), (64, 63)])
def test_debug_model_dry_run_prints_the_summary_line(world_size, rank):
    out = dry_run("debug_model.toml", f"--comm.fake_world_size={world_size}",
                  f"--comm.fake_rank={rank}")
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    m = SUMMARY.match(last)
    assert m, last
    assert (int(m[1]), int(m[2])) == (rank, world_size)
    assert float(m[3]) > 0 and float(m[4]) > 0 and float(m[5]) > 0  # FSDP gathers and reduces
    assert "allgather" in out.stdout and "reduce_scatter" in out.stdout


def test_bad_fake_world_exits_2_with_one_line():
    out = dry_run("debug_model.toml", "--comm.fake_world_size=6",
                  "--parallelism.tensor_parallel_degree=4", timeout=60)
    assert out.returncode == 2
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "world size 6" in out.stderr


def test_fake_world_rules():
    cfg = load_config(None, ["--comm.mode=fake_backend", "--parallelism.tensor_parallel_degree=2",
                             "--parallelism.pipeline_parallel_degree=2"], world_size=1)
    from titanext.config.rules import fake_world_size

    assert fake_world_size(cfg) == 4  # the degrees' product, dp_shard = -1 counting 1
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--comm.mode=fake_backend", "--comm.fake_world_size=4",
                           "--comm.fake_rank=4"])
    assert e.value.problems == ["comm.fake_rank = 4 must be below the dry run's world size 4"]
    with pytest.raises(ConfigError) as e:  # real mode keeps the launcher's world size
        load_config(None, ["--parallelism.tensor_parallel_degree=2"], world_size=1)
