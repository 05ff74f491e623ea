"""No rank left waiting: an exception on one rank ends every rank within seconds, and the
training command ends once, on every rank. Rank failure lives here, in one module.

The library guard. The process group is aborted when a rank fails, so that peers blocked in a
collective fail at once instead of waiting out the timeout. The same mechanism guards the library
calls a user's own script makes, where nothing else would
(:func:`~titanext.distributed.split.split_model`,
:func:`~titanext.distributed.pipeline.build_pipeline` and the ``step`` of the schedule it
returns, :class:`~titanext.distributed.pipeline.PipelineRunner`,
:func:`~titanext.distributed.parallelize.parallelize`, the parity check's run):

- An error every rank raises alike (a bad argument, checked on every rank) is re-raised as it
  is and the process group stays usable: the ranks count their failures in the default
  group's store and find within moments that every rank failed.
- An error on some ranks only is re-raised on those ranks after :data:`ALIKE_GRACE_S` seconds,
  once its rank and first line are recorded in the store, and the process group is aborted:
  the other ranks' collectives then fail within a second, and those ranks raise
  :class:`PeerFailed`, whose message names the rank that failed first and its error.

The training command's end (:func:`run_guarded`, which ``titanext.train`` runs):

- An unexpected exception on one rank is printed once, naming the rank, and the process group
  is aborted without waiting for peers (no barrier): their collectives fail at once ("connection
  closed by peer") instead of waiting for the timeout, they exit non-zero too, and under
  torchrun the agent stops the rest as soon as one worker has exited non-zero.
- Errors every rank raises alike (a config or checkpoint problem, a diverged loss) are printed
  once, by rank 0, with their exit code: 2 for bad input, 1 for divergence, 130 for Ctrl-C;
  the process group is aborted all the same, so a rank that raised alone never blocks.
- A clean run ends with a barrier and ``destroy_process_group``.

Importing this module does not import torch (``--help`` and a bad config end through it). Without
a process group nothing changes:

>>> with fail_together("split_model"):
...     pass
>>> run_guarded(lambda: None)   # no process group: nothing to tear down
0
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from typing import NoReturn, TypeVar

from titanext.errors import CheckpointError, ConfigError, TrainingDiverged

__all__ = ["ALIKE_GRACE_S", "PEER_GONE", "PeerFailed", "abort_process_group", "exit_process",
           "fail_together", "guarded", "print_output", "report_once", "run_guarded",
           "settle_failure"]

#: Seconds a failed rank waits for the other ranks to fail alike before it aborts the group.
ALIKE_GRACE_S = 5.0
#: Seconds a rank whose collective broke waits for the failed rank's record in the store.
_RECORD_WAIT_S = 2.0
#: Errors raised by a collective because a peer is gone: the peer reports its own error.
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
             "Socket closed", "NCCL communicator was aborted", "Connection refused")

_FIRST_KEY = "titanext/failsafe/first_error"
_COUNT_KEY = "titanext/failsafe/failed/{}"
_state = {"failures": 0, "store": None}  # this process's failures so far; the store, kept alive

F = TypeVar("F", bound=Callable)


class PeerFailed(RuntimeError):
    """This rank stopped because another rank failed first.

    ``rank`` is that rank, ``error`` its error's first line and ``where`` the call it failed
    in; the local error (a broken collective) is the ``__cause__``.
    """

    def __init__(self, rank: int, where: str, error: str, here: str):
        self.rank, self.where, self.error = rank, where, error
        super().__init__(f"{here}: stopped on rank {_rank()} because rank {rank} failed first "
                         f"in {where}: {error}")

    def __reduce__(self):  # crosses process boundaries (spawned workers) intact
        return (_rebuild_peer_failed, (self.rank, self.where, self.error, str(self)))


def _rebuild_peer_failed(rank: int, where: str, error: str, message: str) -> PeerFailed:
    e = PeerFailed.__new__(PeerFailed)
    e.rank, e.where, e.error = rank, where, error
    RuntimeError.__init__(e, message)
    return e


def _initialized() -> bool:
    import torch.distributed as dist  # torch-free at import: --help and bad configs end here

    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    import torch.distributed as dist  # torch-free at import: --help and bad configs end here

    return dist.get_rank() if _initialized() else int(os.environ.get("RANK", "0"))


def abort_process_group() -> None:
    """Tear every process group of this process down now, without a barrier.

    Peers blocked in a collective with this rank fail within a second ("connection closed by
    peer") instead of waiting for the timeout. Best effort: where this torch cannot abort,
    ending the process closes the connections just the same.
    """
    if not _initialized():
        return
    from titanext import _compat  # (torch is imported only once a group may exist)

    try:
        _compat.abort_all_process_groups()
    except Exception:  # noqa: BLE001 - best effort: exiting closes the connections anyway
        pass


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def _record(store, where: str, e: BaseException) -> None:
    """Record this rank's error as the first one, unless another rank's is there already."""
    value = f"{_rank()}\n{where}\n{_first_line(e)}"
    try:
        store.compare_set(_FIRST_KEY, "", value)
    except Exception:  # noqa: BLE001 - a store that cannot compare: the plain set
        if not store.check([_FIRST_KEY]):
            store.set(_FIRST_KEY, value)


def _recorded(store, wait_s: float) -> tuple[int, str, str] | None:
    """(rank, where, error) of another rank's recorded error, waiting up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if store.check([_FIRST_KEY]):
                rank, where, error = store.get(_FIRST_KEY).decode().split("\n", 2)
                return (int(rank), where, error) if int(rank) != _rank() else None
        except Exception:  # noqa: BLE001 - the store is gone too: nothing to show
            return None
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def _all_failed(store, key: str, world: int) -> bool:
    """Count this rank's failure; True once every rank has counted one (within the grace)."""
    deadline = time.monotonic() + ALIKE_GRACE_S
    count = store.add(key, 1)
    while count < world:
        if time.monotonic() >= deadline or _recorded(store, 0.0) is not None:
            return False
        time.sleep(0.05)
        count = store.add(key, 0)
    return True


def settle_failure(where: str, e: Exception) -> PeerFailed | None:
    """What :func:`fail_together` does with an exception ``e`` raised in ``where``, for code that
    reports errors instead of raising them (the parity check): returns the
    :class:`PeerFailed` to report where this rank stopped because another rank failed first,
    else None (the ranks failed alike, or the group was aborted for this rank's own error).
    Settles each exception once: a :class:`PeerFailed` is returned as it is, another exception
    already settled (by an inner guard) returns None."""
    import torch.distributed as dist  # torch-free at import: --help and bad configs end here

    from titanext import _compat  # torch-free at import: --help and bad configs end here

    if isinstance(e, PeerFailed):  # settled by an inner guard already
        return e
    if getattr(e, "_titanext_failsafe", False) or not _initialized():
        return None
    try:
        e._titanext_failsafe = True  # an outer guard leaves it as it is
    except AttributeError:  # an exception type without attributes: settled again outside
        pass
    if dist.get_backend() == "fake":  # the dry run: one process plays every rank
        return None
    try:
        store = _compat.default_store()
        if store is None:
            raise RuntimeError("no store")
        _state["store"] = store  # the store outlives the group (its server may live here)
        peer = _recorded(store, _RECORD_WAIT_S if any(m in str(e) for m in PEER_GONE) else 0.0)
        if peer is not None:  # another rank failed and ended the group: that is the error
            abort_process_group()
            failed = PeerFailed(*peer, here=where)
            failed._titanext_failsafe = True
            return failed
        _state["failures"] += 1
        if _all_failed(store, _COUNT_KEY.format(_state["failures"]), dist.get_world_size()):
            return None  # every rank raised: nobody waits, the group stays usable
        _record(store, where, e)
    except Exception:  # noqa: BLE001 - no usable store: end the group all the same
        pass
    abort_process_group()
    return None


@contextmanager
def fail_together(where: str) -> Iterator[None]:
    """Run the block so that an exception in it on any rank ends every rank within seconds
    (see the module docstring); ``where`` names the call in :class:`PeerFailed` messages.

    Use it around your own collective code the same way::

        with fail_together("my training step"):
            loss = train_step(batch)
    """
    try:
        yield
    except Exception as e:
        peer = settle_failure(where, e)
        if peer is not None and peer is not e:
            raise peer from e
        raise


def guarded(fn: F, where: str | None = None) -> F:
    """``fn`` run inside :func:`fail_together` (named ``where``, default its name)."""
    name = where or getattr(fn, "__qualname__", repr(fn))

    @wraps(fn)
    def run(*args, **kwargs):
        with fail_together(name):
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]


# -- the training command's end ---------------------------------------------------------------
# Under torchrun the first worker to exit non-zero gets the others SIGTERMed: ranks that stay
# silent wait this long, so that rank 0 (slower to start, say) prints the shared error first.
_QUIET_RANK_GRACE_S = 3.0


def _env_rank() -> int:
    """This process's rank from torchrun's environment (no torch: bad-config paths print)."""
    return int(os.environ.get("RANK", "0"))


def exit_process(code: int) -> NoReturn:
    """``sys.exit(code)``; a failed run skips the interpreter's shutdown (no thread or writer
    may keep a dead job alive), after flushing what it printed."""
    if code:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
    sys.exit(code)


def print_output(text: str) -> int:
    """Print what ``--help`` or ``--print-config`` asked for; exit code 0 even when the reader
    closed the pipe early (``--help | head``: no BrokenPipeError traceback)."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        pass
    return 0


def _say(message: str, everyone: bool = False) -> None:
    if everyone or _env_rank() == 0:
        print(message, file=sys.stderr, flush=True)


def report_once(lines: list[str], prefix: str = "titanext: config error: ") -> int:
    """Print an error every rank found alike from rank 0 only; exit code 2.

    Other ranks linger for a moment first: under torchrun the first worker to exit gets the
    rest stopped, and that must not be before rank 0 has printed.
    """
    for line in lines:
        _say(prefix + line)
    if _env_rank() != 0:
        time.sleep(_QUIET_RANK_GRACE_S)
    return 2


def _teardown() -> None:
    if not _initialized():
        return
    import torch.distributed as dist  # torch-free at import: --help and bad configs end here

    dist.barrier()
    dist.destroy_process_group()


def run_guarded(body: Callable[[], object]) -> int:
    """Run ``body`` (build the trainer and train) and end the process group; the exit code.

    Ctrl-C and SIGTERM (torchrun stopping the workers) stop the run without saving anything
    partial (checkpoint writes are atomic anyway).
    """
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        body()
    except (ConfigError, CheckpointError) as e:  # raised alike on every rank
        kind = "config" if isinstance(e, ConfigError) else "checkpoint"
        abort_process_group()
        return report_once(getattr(e, "problems", None) or [str(e)], f"titanext: {kind} error: ")
    except TrainingDiverged as e:
        _say(f"titanext: training diverged: {e}")
        abort_process_group()
        return 1
    except KeyboardInterrupt:
        _say("titanext: interrupted; nothing partial was saved")
        abort_process_group()
        return 130
    except Exception as e:  # noqa: BLE001 - any other error must not leave the peers waiting
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if isinstance(e, PeerFailed) or any(marker in str(e) for marker in PEER_GONE):
            _say(f"titanext: rank {_env_rank()}: stopping, another rank failed ({first[:160]})",
                 everyone=True)
        else:
            _say(f"titanext: rank {_env_rank()} failed:\n{traceback.format_exc().rstrip()}",
                 everyone=True)
        abort_process_group()
        return 1
    _teardown()
    return 0
