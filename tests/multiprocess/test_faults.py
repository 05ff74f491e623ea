"""A failing rank never hangs the job: printed once, process group aborted, every rank exits.

The workers are plain processes started by hand (no torchrun to clean up after them), with a
60 s collective timeout: a run that relied on the timeout would take a minute, these take
seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests import REPO_ROOT
from tests.spawn import free_port

ROOT = REPO_ROOT

# Rank 0 raises while rank 1 waits in an all-reduce (the TensorBoard-writer case of the issue).
WORKER = """
import datetime, sys, torch, torch.distributed as dist
from titanext.distributed.failsafe import exit_process, run_guarded

def body():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    dist.barrier()
    if dist.get_rank() == 0:
        raise OSError("cannot create the TensorBoard folder")
    dist.all_reduce(torch.ones(4))

exit_process(run_guarded(body))
"""


def _env(rank: int, port: int) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1", RANK=str(rank), WORLD_SIZE="2",
               LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_an_exception_on_one_rank_ends_every_rank_within_seconds():
    port, start = free_port(), time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", WORKER], env=_env(rank, port), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    try:
        outs = [p.communicate(timeout=50) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    elapsed = time.monotonic() - start
    assert [p.returncode for p in procs] == [1, 1], outs
    err0, err1 = outs[0][1], outs[1][1]
    assert err0.count("titanext: rank 0 failed:") == 1 and "TensorBoard folder" in err0
    assert "titanext: rank 1: stopping, another rank failed" in err1
    assert "TensorBoard folder" not in err1  # the error is printed once, by its rank
    assert elapsed < 45, elapsed  # start-up included; waiting for the timeout would take 60 s


def test_each_torchrun_attempt_gets_its_own_store_keys(monkeypatch):
    """A restarted rank must not read a dead peer's address left by the previous attempt."""
    import datetime

    import torch.distributed as dist

    from titanext.distributed.process_group import elastic_store

    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    timeout = datetime.timedelta(seconds=5)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    elastic_store(timeout).set("rank_1", "address of attempt 0")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    second = elastic_store(timeout)
    assert second.check(["rank_1"]) is False  # attempt 1 sees none of attempt 0's keys
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    assert elastic_store(timeout) is None  # not under torchrun's agent: the default store
