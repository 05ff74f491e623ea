"""Gloo worker pools that live for the whole pytest run: process start-up, ``import torch`` and the
gloo handshake are paid once per world size, not once per test, and the workers are forked from a
server that imported torch and the trainer once (:func:`fork_context`).

``run(fn, world_size, args, kwargs, timeout_s)`` hands ``fn(rank, world_size, *args, **kwargs)``
to the ``world_size`` workers of that size's pool and returns the per-rank results, exactly as a
fresh spawn would (tests reach it through ``tests.spawn.run_distributed``).

Each case starts from the state a fresh process would have, but for torch's seed (the fixed
:data:`SEED`, where a fresh process draws one at random): the environment, working directory,
default dtype, grad mode, deterministic-algorithms flag and signal handlers as the worker had them
before its first case, a reset torch.compile cache, and the default group's collective timeout
set to the case's ``timeout_s``. A case that destroys or
replaces the default process group (the dry run's fake group) retires its pool: the next case
gets a new one.

Failures stay with their case:

- an exception on any rank fails the case at once, naming the case (pytest's node id), the body
  and the rank, with that rank's traceback (and the other ranks' first lines, if they failed
  within a second). The pool is then killed, so that no rank waits on a dead peer, and the next
  case starts a new pool;
- a rank that dies (a signal, ``os._exit``) is named with its exit code;
- a worker left with more than ``THREAD_LIMIT`` threads (process groups something still holds)
  retires its pool after the case;
- a case that outlives its deadline (``max(300, 4 x timeout_s)`` seconds: subgroups keep torch's
  30-minute gloo timeout, so the parent is the only clock that always runs) gets every rank's
  Python stacks dumped (faulthandler) into the error, and the pool is killed.

The pools end with the pytest session (``tests/conftest.py``) or the interpreter.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import faulthandler
import gc
import io
import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
import warnings
from multiprocessing.connection import wait

__all__ = ["fork_context", "forget_meshes", "freeze_what_lives", "run", "shutdown"]

#: At most this many idle workers stay alive (1 + 2 + 3 + 4 + 8 fit); the least recently used pool
#: is closed first when a new one would pass it.
MAX_WORKERS = 18
#: A worker with more threads than this after a case retires its pool. Every gloo group runs
#: three threads; a case's groups are destroyed after it, but where something outside the case
#: still holds one (seen: 176 groups in one worker of a full run), its threads stay and wake up
#: now and then, and hundreds of them slow every other process on 2 cores. A fresh worker
#: has about 30. Measured on tests/multiprocess (2026-11-27): 291 s at 100, 296 s at 60, 360 s
#: at 250 (fewer restarts, but the kernel time doubled).
THREAD_LIMIT = 100
#: Seconds the workers get for ``import torch`` and the gloo handshake.
START_TIMEOUT_S = 180.0
#: How long to wait, after the first failed rank, for the others' errors (shown beside it).
ERROR_GRACE_S = 1.0
#: Imported once by the server that forks the workers (:func:`fork_context`): every case needs
#: torch, and most build a Trainer. torchao (float8) and transformers with its Llama (the
#: adapters, the zoo, the HF cases) were imported again by every pool that used them: about 4%
#: of tests/multiprocess's CPU (py-spy, 2026-11-29), where the server pays some 2.5 s once.
PRELOAD = ["torch", "torch.distributed", "titanext.trainer", "torchao",
           "transformers.models.llama.modeling_llama"]
#: torch's seed at the start of every case, on every rank (and of every in-process test:
#: tests/conftest.py), so that a run here and a run on CI draw the same numbers.
SEED = 0
#: The shortest time a case may run before it counts as hung.
DEADLINE_FLOOR_S = 300.0


def freeze_what_lives() -> None:
    """Collect, then move every object alive now out of the collector's generations
    (``gc.freeze``): for what lives as long as its process (torch, the trainer, a worker's own
    state), a full collection then walks only what was made after. Each case ends with up to
    five (:func:`forget_meshes`), which walked the whole heap: 11% of the CPU that
    tests/multiprocess and tests/e2e spent (py-spy, 2026-11-29). A cycle made later is collected
    as before."""
    gc.collect()
    gc.freeze()


def case_deadline_s(timeout_s: float) -> float:
    """How long a case with collective timeout ``timeout_s`` may run before it counts as hung."""
    return max(DEADLINE_FLOOR_S, 4.0 * timeout_s)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- worker side


def fork_context():
    """The multiprocessing context the workers start from: forked by a server that imported
    PRELOAD once, where each spawned worker imported torch and the trainer itself (some 2-4 s
    of CPU each, for dozens of workers a run). tests/e2e/test_dry_run.py's dry runs start
    from it too."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _worker(rank: int, world_size: int, port: int, conn, dump_path: str, environ: dict) -> None:
    import torch
    import torch.distributed as dist

    # the parent's environment now, as a spawned worker would have it (the fork server keeps
    # the one it started with)
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    dump = open(dump_path, "w")  # noqa: SIM115 - lives as long as the worker
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
    except BaseException:
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc(), "failed")))
        raise
    home = dist.group.WORLD  # a case may replace it (the dry run's fake group): retire then
    fresh = _FreshState(torch)
    freeze_what_lives()  # torch, the trainer and the worker's own state: as long as the worker
    base_store, cases = dist.distributed_c10d._world.pg_map[home][1], 0
    conn.send_bytes(pickle.dumps(("ready", None, "")))
    while True:
        try:
            fn, args, kwargs, timeout_s = pickle.loads(conn.recv_bytes())
        except EOFError:  # the parent is gone
            break
        if fn is None:
            break
        fresh.restore(torch, timeout_s)
        cases += 1
        _case_store(dist, home, base_store, cases)
        try:
            result = fn(rank, world_size, *args, **kwargs)
            alive = dist.is_initialized() and dist.group.WORLD is home
            if alive:  # every rank finished its case before any rank reports it
                dist.barrier()
                _drop_case_groups(dist, home)
            buf = io.BytesIO()
            torch.save(result, buf)
            threads = _thread_count()
            retire = ("" if alive and threads <= THREAD_LIMIT else
                      "its group ended" if not alive else f"{threads} threads")
            message = ("ok", buf.getvalue(), retire)
        except BaseException:
            message = ("error", traceback.format_exc(), "failed")
        conn.send_bytes(pickle.dumps(message))
        if message[0] == "ok" and message[2]:  # the group is gone or leaked: retire this pool
            break
        # After an error, stay connected (the parent kills the pool): leaving now would fail
        # the peers with "Connection closed by peer" and bury the real error among theirs.
    sys.stdout.flush()
    sys.stderr.flush()
    # No interpreter teardown: gloo's threads can race C++ static destructors and abort the
    # process ("terminate called without an active exception").
    os._exit(0)


def _thread_count() -> int:
    """This process's threads, C++ ones included (0 where /proc is missing)."""
    try:
        return len(os.listdir(f"/proc/{os.getpid()}/task"))
    except OSError:
        return 0


def _case_store(dist, home, base_store, case: int) -> None:
    """Give the case's new process groups a key prefix of their own in the rendezvous store.

    A group's gloo rendezvous writes each rank's address under ``<group name>/`` in the default
    group's store, and a group made with ``use_local_synchronization=True`` is named by a hash of
    its ranks alone: the same name in every case. An earlier case's keys, left in the store,
    would hand a later case's group the addresses of sockets long closed ("connectFullMesh
    failed ... Connection refused"). Every rank runs the same cases, so the prefixes agree.
    """
    c10d = dist.distributed_c10d
    backend = c10d._world.pg_map[home][0]
    c10d._world.pg_map[home] = (backend, dist.PrefixStore(f"case{case}/", base_store))


def _drop_case_groups(dist, home) -> None:
    """Destroy every process group the case created, and forget the meshes torch caches.

    Each gloo group keeps sockets and threads that wake up now and then: the hundreds that a
    few dozen cases leave behind kept idle workers busy (load average 500, three quarters of
    the CPU in the kernel). Every rank is past the case's final barrier, so nothing is in
    flight on them. torch 2.11 caches sliced and flattened meshes in a module-level registry
    (dicts keyed by mesh); an equal mesh of a later case must not find the old groups there.
    """
    c10d = dist.distributed_c10d
    groups = [g for g in list(c10d._world.pg_map) if g is not home]
    if not groups:  # most cases: nothing to end, nothing cached that names an ended group
        return
    for group in groups:
        dist.destroy_process_group(group)
    forget_meshes()


def forget_meshes() -> None:
    """Forget the meshes and groups torch.distributed caches (after destroying groups): a case
    that ends the default group and starts another (the dry run's fake one after a real run)
    calls it too, or the new group's equal meshes come back with the old group names."""
    import torch.distributed.device_mesh as device_mesh

    registry = getattr(device_mesh, "_mesh_resources", None)
    for value in vars(registry).values() if registry is not None else ():
        if isinstance(value, (dict, list)):
            value.clear()
    _clear_torch_distributed_caches()
    # the groups' last references (meshes, DTensors of the case) go now; a collection that
    # runs weak-reference callbacks (a weak-keyed cache whose entry holds the model, as after a
    # DualPipe x EP trainer) frees more for the next one, so collect until nothing is left
    for _ in range(5):
        if not gc.collect():
            break


def _clear_torch_distributed_caches() -> None:
    """Forget what torch.distributed memoised during the case.

    DTensor's sharding propagation and redistribute planner cache their answers by value
    (specs whose meshes compare equal by shape and names): a later case's equal mesh would get
    back the earlier mesh object, whose groups are destroyed ("Could not resolve the process
    group registered under the name 1"), and the redistribute planners cached per mesh keep the
    groups (and their threads) alive. Clearing a cache only costs recomputation, so every
    ``functools`` cache in torch.distributed's modules (and their classes) and every module-level
    ``*_cache`` dict goes, plus the sharding propagator's per-thread and C++ caches where this
    torch has the helper for them.
    """
    with warnings.catch_warnings():  # reading a deprecated name (reduce_op) warns
        warnings.simplefilter("ignore", FutureWarning)
        _clear_functools_caches()
    if "torch.distributed.tensor" not in sys.modules:
        return
    import torch.distributed.tensor.debug as debug

    clear_prop = getattr(debug, "_clear_sharding_prop_cache", None)
    if clear_prop is not None:
        clear_prop()


def _clear_functools_caches() -> None:
    for name, module in list(sys.modules.items()):
        if not name.startswith("torch.distributed") or module is None:
            continue
        for attr, obj in list(vars(module).items()):
            if attr.endswith("_cache") and isinstance(obj, dict):  # e.g. DTensor's planners,
                obj.clear()  # keyed by a weak reference to a mesh, holding its groups alive
                continue
            holders = [obj, *vars(obj).values()] if isinstance(obj, type) else [obj]
            for holder in holders:
                # a cached staticmethod (DTensor's MeshTopoInfo.build_from_mesh, keyed by
                # mesh: it kept every case's meshes, their groups and gloo's threads alive)
                holder = getattr(holder, "__func__", holder)
                clear = getattr(holder, "cache_clear", None)
                if callable(clear) and not isinstance(holder, type):
                    clear()


class _FreshState:
    """What a case may change and the next case must not see."""

    def __init__(self, torch) -> None:
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.dtype = torch.get_default_dtype()
        self.handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def restore(self, torch, timeout_s: float) -> None:
        import torch.distributed as dist

        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(True)
        torch.use_deterministic_algorithms(False)
        torch.set_num_threads(1)
        torch.manual_seed(SEED)
        for sig, handler in self.handlers.items():
            signal.signal(sig, handler)
        if "torch._dynamo" in sys.modules:
            sys.modules["torch._dynamo"].reset()
        from titanext._compat import set_pg_timeout

        set_pg_timeout(timeout_s)
        assert dist.is_initialized()


# ----------------------------------------------------------------------------- parent side


class _Pool:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.dumps = tempfile.mkdtemp(prefix=f"titanext-pool{world_size}-")
        self.procs: list = []
        self.conns: list = []
        ctx = fork_context()
        port = _free_port()
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, daemon=True, name=f"pool{world_size}-rank{rank}",
                               args=(rank, world_size, port, child,
                                     os.path.join(self.dumps, f"{rank}.txt"), dict(os.environ)))
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        try:
            self._collect(f"starting {world_size} gloo workers", START_TIMEOUT_S)
        except BaseException:
            self.close(kill=True)
            raise

    def run(self, fn, args: tuple, kwargs: dict, timeout_s: float, case: str) -> tuple[list, str]:
        """Per-rank results, and why the pool must be retired after this case ("" if not)."""
        task = pickle.dumps((fn, args, kwargs, timeout_s))
        for conn in self.conns:
            conn.send_bytes(task)
        return self._collect(case, case_deadline_s(timeout_s))

    def _collect(self, case: str, deadline_s: float) -> tuple[list, str]:
        results: dict[int, object] = {}
        errors: dict[int, str] = {}
        retire = ""
        deadline = time.monotonic() + deadline_s
        pending = dict(enumerate(self.conns))
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            sentinels = {self.procs[r].sentinel: r for r in pending}
            ready = wait([*pending.values(), *sentinels], timeout=left)
            for obj in ready:
                rank = sentinels.get(obj)
                if rank is None:
                    rank = next(r for r, c in pending.items() if c is obj)
                if rank not in pending:
                    continue
                try:
                    kind, payload, rank_retires = pickle.loads(pending[rank].recv_bytes())
                except (EOFError, OSError):
                    self.procs[rank].join(1.0)
                    kind, payload, rank_retires = (
                        "error", f"the process died (exit code {self.procs[rank].exitcode})",
                        "failed")
                del pending[rank]
                retire = retire or rank_retires
                if kind == "error":
                    if not errors:  # give the others a moment to say why, then stop
                        deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
                    errors[rank] = payload
                else:
                    results[rank] = payload
        if errors:
            report = self._error_report(case, errors)
            if pending:
                report += "\n" + self._stacks(sorted(pending), "still running")
            raise AssertionError(report)
        if pending:
            raise AssertionError(f"{case}: still running after {deadline_s:.0f} s.\n"
                                 + self._stacks(sorted(pending), "still running"))
        import torch

        return [torch.load(io.BytesIO(results[r]), weights_only=False) if isinstance(
            results[r], bytes) else results[r] for r in range(self.world_size)], retire

    def _error_report(self, case: str, errors: dict[int, str]) -> str:
        first = next(iter(errors))  # the first to fail; the others usually fail because of it
        lines = [f"{case}: rank {first} of {self.world_size} failed:\n{errors[first].rstrip()}"]
        for rank, tb in sorted(errors.items()):
            if rank != first:
                last = tb.strip().splitlines()[-1] if tb.strip() else "?"
                lines.append(f"(rank {rank} failed too: {last})")
        return "\n".join(lines)

    def _stacks(self, ranks: list[int], what: str) -> str:
        """Rank(s) ``ranks``'s Python stacks, dumped by faulthandler on SIGUSR1."""
        for rank in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.procs[rank].pid, signal.SIGUSR1)
        time.sleep(1.0)
        stacks = []
        for rank in ranks:
            with contextlib.suppress(OSError):
                with open(os.path.join(self.dumps, f"{rank}.txt")) as f:
                    stacks.append(f"--- rank {rank}:\n{f.read().strip()}")
        return f"rank(s) {ranks} of {self.world_size} {what}; their Python stacks:\n" + \
            "\n".join(stacks)

    def close(self, kill: bool = False) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                if not kill:
                    conn.send_bytes(pickle.dumps((None, (), {}, 0.0)))
        for proc in self.procs:
            if not kill:
                proc.join(5.0)
            if proc.is_alive():
                proc.kill()
            proc.join(5.0)
        for conn in self.conns:
            conn.close()
        for name in os.listdir(self.dumps):
            os.unlink(os.path.join(self.dumps, name))
        os.rmdir(self.dumps)


_POOLS: dict[int, _Pool] = {}  # world size -> pool, least recently used first
#: Cases handed to any pool so far (tests/unit/conftest.py checks that unit tests hand none).
cases_run = 0
#: Pools started so far, and why the ones that ended early did ("failed", "retired").
pools_started = 0
pools_ended: dict[str, int] = {}
#: The cases after which a pool retired, and why ("its group ended", "N threads").
retired_by: list[str] = []


def _case_name(fn) -> str:
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    body = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
    return f"{test} [body {body}]" if test else f"[body {body}]"


def run(fn, world_size: int, args: tuple = (), kwargs: dict | None = None,
        timeout_s: float = 60.0) -> list:
    """``fn(rank, world_size, *args, **kwargs)`` on every worker of the ``world_size`` pool."""
    global cases_run, pools_started
    cases_run += 1
    pool = _POOLS.pop(world_size, None)
    if pool is None:
        while _POOLS and sum(p.world_size for p in _POOLS.values()) + world_size > MAX_WORKERS:
            _POOLS.pop(next(iter(_POOLS))).close()
        try:
            pool = _Pool(world_size)
        except AssertionError:  # the free port was taken before rank 0 bound it: once more
            pool = _Pool(world_size)
        pools_started += 1
    try:
        results, retire = pool.run(fn, args, kwargs or {}, timeout_s, _case_name(fn))
    except BaseException:
        pool.close(kill=True)
        pools_ended["failed"] = pools_ended.get("failed", 0) + 1
        raise
    if retire:
        pool.close()
        pools_ended["retired"] = pools_ended.get("retired", 0) + 1
        retired_by.append(f"{_case_name(fn)}: {retire}")
    else:
        _POOLS[world_size] = pool  # most recently used last
    return results


def shutdown() -> None:
    """Close every pool (the end of the pytest session)."""
    while _POOLS:
        _POOLS.popitem()[1].close()


atexit.register(shutdown)
