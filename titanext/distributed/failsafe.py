"""No rank left waiting: an exception on one rank ends every rank within seconds.

The trainer's fail-safe (:mod:`titanext.distributed.faults`) aborts the process group when a rank
fails, so that peers blocked in a collective fail at once instead of waiting out the timeout.
The same mechanism guards the library calls a user's own script makes, where nothing else
would (:func:`~titanext.distributed.split.split_model`,
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

Without a process group nothing changes:

>>> with fail_together("split_model"):
...     pass
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from typing import TypeVar

__all__ = ["ALIKE_GRACE_S", "PEER_GONE", "PeerFailed", "abort_process_group", "fail_together",
           "guarded", "settle_failure"]

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
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    import torch.distributed as dist

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
    import torch.distributed as dist

    from titanext import _compat

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
