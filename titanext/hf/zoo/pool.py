"""A persistent group of gloo ranks for the zoo: the processes start, import torch and
transformers and join one process group once; each architecture is then one case sent to all of
them. A case that raises outside its cells, kills a rank or outlives its deadline (a collective
left waiting by one rank's error) ends the group; the next case starts a new one."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import traceback
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

from titanext.distributed.process_group import free_port
from titanext.hf.zoo.cells import certify_rank

__all__ = ["ZooPool"]

#: seconds the ranks get to start (import torch and transformers, the gloo handshake)
START_S = 300.0


def _worker(rank: int, world_size: int, port: int, conn, timeout_s: float) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    conn.send_bytes(pickle.dumps(("ready", None)))
    while True:
        try:
            job = pickle.loads(conn.recv_bytes())
        except EOFError:
            break
        if job is None:
            break
        try:
            result = certify_rank(rank, world_size, *job)
            if not result.get("_incomplete"):
                dist.barrier()
            message = ("ok", result)
        except BaseException:  # noqa: BLE001 - reported to the parent, which ends the group
            message = ("error", traceback.format_exc())
        conn.send_bytes(pickle.dumps(message))
        if message[0] == "ok" and message[1].get("_incomplete"):
            break  # the case ended the group: the parent starts a new one
    os._exit(0)  # no interpreter teardown: gloo's threads can race C++ static destructors


class ZooPool:
    """``world_size`` ranks that certify one architecture per :meth:`run` call."""

    def __init__(self, world_size: int = 2, *, timeout_s: float = 60.0, deadline_s: float = 600.0):
        self.world_size, self.timeout_s, self.deadline_s = world_size, timeout_s, deadline_s
        self.procs: list = []
        self.conns: list = []

    def _start(self) -> None:
        ctx, port = mp.get_context("spawn"), free_port()
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(rank, self.world_size, port, child,
                                                  self.timeout_s), daemon=True)
            p.start()
            self.procs.append(p)
            self.conns.append(parent)
        self._collect(START_S, "start")

    def _collect(self, deadline_s: float, what: str) -> list:
        results: list = [None] * self.world_size
        pending = dict(enumerate(self.conns))
        end = datetime.datetime.now() + datetime.timedelta(seconds=deadline_s)
        while pending:
            left = (end - datetime.datetime.now()).total_seconds()
            ready = wait(list(pending.values()), timeout=max(left, 0))
            if not ready:
                self.close()
                raise TimeoutError(f"{what}: no answer from rank(s) {sorted(pending)} within "
                                   f"{deadline_s:.0f} s (a collective left waiting?)")
            for rank, conn in list(pending.items()):
                if conn in ready:
                    try:
                        kind, value = pickle.loads(conn.recv_bytes())
                    except EOFError:
                        self.close()
                        raise RuntimeError(f"{what}: rank {rank} died") from None
                    if kind == "error":
                        self.close()
                        raise RuntimeError(f"{what}: rank {rank} failed:\n{value}")
                    results[rank] = value
                    del pending[rank]
        return results

    def run(self, model_type: str, plugins, done=()) -> list[dict]:
        """Every rank's :func:`~titanext.hf.zoo.cells.certify_rank` result for ``model_type``."""
        if not self.procs:
            self._start()
        for conn in self.conns:
            conn.send_bytes(pickle.dumps((model_type, tuple(plugins), tuple(done))))
        results = self._collect(self.deadline_s, model_type)
        if any(r.get("_incomplete") for r in results):
            self.close()
        return results

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send_bytes(pickle.dumps(None))
            except (OSError, ValueError):
                pass
        for p in self.procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
        self.procs, self.conns = [], []
