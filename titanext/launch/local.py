"""Run a function in several local gloo processes on CPU (tests and benchmarks use it).

Usage::

    def body(rank, world_size, x):
        ...                       # a process group is already initialised
        return something_picklable

    results = run_distributed(body, world_size=4, args=(x,))   # list, one entry per rank

The function must be importable (module level), as with any spawn-based launcher.
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from titanext.distributed.process_group import free_port, local_cuda_index


def _worker(rank, world_size, port, fn, args, kwargs, timeout_s, out_dir, backend="gloo"):
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    device_id = None
    if backend == "nccl":  # (several ranks may share one GPU: see local_cuda_index)

        device_id = torch.device("cuda", local_cuda_index())
        torch.cuda.set_device(device_id)
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device_id,
    )
    try:
        result = fn(rank, world_size, *args, **kwargs)
        torch.save({"ok": True, "result": result}, os.path.join(out_dir, f"{rank}.pt"))
    except BaseException:
        torch.save(
            {"ok": False, "error": traceback.format_exc()}, os.path.join(out_dir, f"{rank}.pt")
        )
        raise
    finally:
        if dist.is_initialized():  # (titanext's fail-safe may have aborted the group)
            try:
                dist.barrier()
            finally:
                dist.destroy_process_group()
    # Done and saved: leave without the interpreter's teardown, where gloo's threads can race
    # C++ static destructors and abort a finished rank ("terminate called without an active
    # exception", seen about once in tens of runs on 2 busy cores), failing a passing run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    kwargs: dict | None = None,
    timeout_s: float = 60.0,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` in ``world_size`` gloo processes (or
    ``backend="nccl"``: one GPU per ``LOCAL_RANK``, see ``local_cuda_index``).

    ``fn`` must be a module-level function. Returns the per-rank results; any rank's
    exception is re-raised here with its traceback.
    """
    # The result files are full pickles (any picklable result), read with weights_only=False:
    # safe because the folder is mkdtemp's (mode 0700, a fresh random name) and only this
    # function's own children write into it, so nobody but this user could plant a file there.
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.spawn(
                _worker,
                args=(world_size, free_port(), fn, args, kwargs or {}, timeout_s, out_dir, backend),
                nprocs=world_size,
                join=True,
            )
        except Exception as e:  # surface the first rank's traceback
            for r in range(world_size):
                p = os.path.join(out_dir, f"{r}.pt")
                if os.path.exists(p):
                    res = torch.load(p, weights_only=False)
                    if not res["ok"]:
                        raise AssertionError(f"rank {r} failed:\n{res['error']}") from e
            raise
        results = []
        for r in range(world_size):
            res = torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False)
            results.append(res["result"])
        return results
