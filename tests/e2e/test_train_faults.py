"""The trainer under faults, as a user runs it: a raising rank, unwritable folders, checkpoint
errors, a changed config on resume, the pipeline banner, and torchrun's elastic restarts.

Faults are injected by a wrapped entry point, ``tests/e2e/fault_entry.py`` (``TITANEXT_TEST_FAULT``
says which); titanext itself holds no test hook.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests import REPO_ROOT
from tests.spawn import free_port

ROOT = REPO_ROOT
DEBUG = str(ROOT / "train_configs" / "debug_model.toml")
SMALL = ["--config", DEBUG, "--model.flavor=debugtiny", "--training.dataset=synthetic",
         "--training.seq_len=32", "--training.local_batch_size=2",
         "--training.mixed_precision_param=float32",
         "--training.mixed_precision_reduce=float32", "--metrics.enable_tensorboard=false",
         "--metrics.log_freq=1", "--lr_scheduler.warmup_steps=2"]


def _env(**extra) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1", **extra)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _ranks_by_hand(args, logs: Path, world_size=2, **extra):
    """``python -m titanext.train`` in ``world_size`` processes without torchrun (nobody tears
    the others down: each rank must leave on its own); output to ``logs/<rank>.out|err``."""
    port = free_port()
    entry = "tests.e2e.fault_entry" if "TITANEXT_TEST_FAULT" in extra else "titanext.train"
    procs = []
    for r in range(world_size):
        env = _env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world_size),
                   LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), **extra)
        with open(logs / f"{r}.out", "w") as out, open(logs / f"{r}.err", "w") as err:
            procs.append(subprocess.Popen([sys.executable, "-m", entry, *args],
                                          cwd=ROOT, env=env, stdout=out, stderr=err))
    return procs


def _exit_times(procs, timeout=300) -> list[float]:
    """When each process ended (monotonic seconds); kills what is left after ``timeout``."""
    ended: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(ended) < len(procs) and time.monotonic() < deadline:
            for i, p in enumerate(procs):
                if i not in ended and p.poll() is not None:
                    ended[i] = time.monotonic()
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [ended.get(i, float("inf")) for i in range(len(procs))]


def _read(logs: Path, name: str) -> str:
    return (logs / name).read_text()


@pytest.mark.slow
def test_an_exception_on_one_rank_ends_every_rank_within_seconds(tmp_path):
    """Rank 0 raises after step 2 while rank 1 goes on into step 3's collectives."""
    procs = _ranks_by_hand([*SMALL, f"--job.dump_folder={tmp_path}", "--training.steps=50",
                            "--comm.init_timeout_seconds=60", "--comm.train_timeout_seconds=60"],
                           tmp_path, TITANEXT_TEST_FAULT="raise:0:2")
    ended = _exit_times(procs)
    err0, err1 = _read(tmp_path, "0.err"), _read(tmp_path, "1.err")
    assert [p.returncode for p in procs] == [1, 1], (err0[-2000:], err1[-2000:])
    gap = max(ended) - min(ended)
    assert gap < 15, gap  # a rank waiting for the collective timeout would take 60 s
    assert err0.count("titanext: rank 0 failed:") == 1
    assert "injected test fault on rank 0 after step 2" in err0
    assert "titanext: rank 1: stopping, another rank failed" in err1
    assert "injected test fault" not in err1


def test_unwritable_dump_folder_exits_2_on_every_rank_with_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    procs = _ranks_by_hand([*SMALL, f"--job.dump_folder={blocker / 'dump'}"], tmp_path)
    _exit_times(procs)
    assert [p.returncode for p in procs] == [2, 2]
    assert _read(tmp_path, "0.err").strip() == (
        f"titanext: config error: job.dump_folder = '{blocker / 'dump'}': cannot create this "
        "folder (Not a directory); choose a path whose parent folders exist or can be created, "
        "and that are folders")
    assert _read(tmp_path, "1.err").strip() == ""  # printed once, by rank 0


def _train(args, timeout=300):
    return subprocess.run([sys.executable, "-m", "titanext.train", *SMALL, *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=_env())


def _lrs(text: str) -> dict[int, float]:
    return {int(s): float(lr) for s, lr in re.findall(r"step\s+(\d+)/\d+.*?lr ([0-9.e+-]+)", text)}


@pytest.mark.slow
def test_checkpoint_errors_and_a_changed_config_on_resume(tmp_path):
    from titanext.components.optim import lr_lambda

    dump = [f"--job.dump_folder={tmp_path}", "--checkpoint.enable", "--checkpoint.interval=2"]
    first = _train([*dump, "--training.steps=4", "--optimizer.lr=1e-3"])
    assert first.returncode == 0, first.stderr[-2000:]

    missing = _train([*dump, "--training.steps=4", "--checkpoint.load_step=3"])
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert missing.stderr.strip().endswith("available steps: 2, 4")

    flavor = _train([*dump, "--training.steps=4", "--model.flavor=debugmodel"])
    assert flavor.returncode == 2 and "Traceback" not in flavor.stderr
    assert "saved for llama3/debugtiny and this run builds llama3/debugmodel" in flavor.stderr

    # Extend the run 4 -> 8 steps with a new peak LR: step 5 runs at the LR the new schedule
    # gives (not the old schedule's 0 at its end), and the changes are named once.
    resumed = _train([*dump, "--training.steps=8", "--optimizer.lr=2e-3"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    expected = 2e-3 * lr_lambda(4, warmup_steps=2, total_steps=8, decay_ratio=None,
                                decay_type="linear", min_lr_factor=0.0)
    assert _lrs(resumed.stdout)[5] == pytest.approx(expected, rel=1e-3)
    [changed] = [ln for ln in resumed.stdout.splitlines() if "with a changed config" in ln]
    assert "optimizer.lr 0.001 -> 0.002" in changed and "training.steps 4 -> 8" in changed

    shard = sorted((tmp_path / "checkpoint" / "step-8").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    corrupt = _train([*dump, "--training.steps=8"])
    assert corrupt.returncode == 2 and "Traceback" not in corrupt.stderr
    assert f"'{shard.name}' has 100 bytes" in corrupt.stderr and "step-8" in corrupt.stderr
    assert "--checkpoint.load_step=6" in corrupt.stderr


@pytest.mark.slow
def test_pipeline_banner_counts_the_whole_model_and_this_ranks_share(tmp_path):
    procs = _ranks_by_hand([*SMALL, f"--job.dump_folder={tmp_path}", "--training.steps=1",
                            "--parallelism.pipeline_parallel_degree=2",
                            "--parallelism.pipeline_parallel_microbatches=2"], tmp_path)
    _exit_times(procs)
    out0 = _read(tmp_path, "0.out")
    assert [p.returncode for p in procs] == [0, 0], _read(tmp_path, "0.err")[-2000:]
    one = _train([f"--job.dump_folder={tmp_path / 'one'}", "--training.steps=1"])
    whole = re.search(r"\((\d+\.\d+)M params", one.stdout).group(1)
    banner = re.search(r"\((\d+\.\d+)M params, this rank's stages (\d+\.\d+)M\)", out0)
    assert banner and banner.group(1) == whole, out0
    assert 0 < float(banner.group(2)) < float(whole)


def _torchrun(args, dump, restarts=0, **extra):
    # titanext-run (validate, then torchrun -m titanext.train); torchrun itself for the wrapped
    # entry point that injects a fault
    launch = (["torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               f"--max-restarts={restarts}", "-m", "tests.e2e.fault_entry"]
              if "TITANEXT_TEST_FAULT" in extra else
              ["titanext.launch", "--standalone", "--nproc_per_node", "2",
               f"--max-restarts={restarts}"])
    cmd = [sys.executable, "-m", *launch, *SMALL, "--training.steps=8",
           "--training.deterministic", "--checkpoint.enable", "--checkpoint.interval=5",
           f"--job.dump_folder={dump}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=ROOT,
                          env=_env(**extra))


def _final(dump) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(dump / "checkpoint" / "step-8"), str(dump / "final.pt"))
    return torch.load(dump / "final.pt", weights_only=False)["model"]


def _losses(text: str) -> dict[int, str]:
    return dict(re.findall(r"step\s+(\d+)/8\s+loss ([0-9.]+)", text))


@pytest.mark.slow
def test_torchrun_max_restarts_resumes_and_matches_an_uninterrupted_run(tmp_path):
    """SIGKILL rank 1 after the step-5 checkpoint; torchrun restarts both workers, which resume
    from step 5 and end with the uninterrupted run's losses and parameters."""
    plain = _torchrun([], tmp_path / "plain")
    assert plain.returncode == 0, plain.stderr[-3000:]
    marker = tmp_path / "killed-once"
    killed = _torchrun([], tmp_path / "killed", restarts=1,
                       TITANEXT_TEST_FAULT=f"kill:1:5:{marker}")
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert marker.exists()  # the fault happened
    assert "resumed from" in killed.stdout and "step 5" in killed.stdout
    assert _losses(killed.stdout)["8"] == _losses(plain.stdout)["8"]
    reference, restarted = _final(tmp_path / "plain"), _final(tmp_path / "killed")
    assert reference.keys() == restarted.keys()
    for name, value in reference.items():
        assert torch.equal(value, restarted[name]), name
