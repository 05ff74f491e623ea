"""Two chunks of work interleaved at their communication points (all-to-all overlap).

:func:`run_interleaved` runs a forward chunk and a backward chunk of a pipeline schedule's
overlapped pair on two threads that hand one *baton* back and forth: exactly one side computes
at any time, and a side gives the baton away only at a communication point, right after it has
issued an asynchronous collective (:func:`comm_point`). While the other side computes, the
collective travels; the side then waits for it (the wait releases the GIL) and for the baton.

Why threads and a baton, not hooks that split the layer by hand:

- the split falls wherever a collective is issued, in any model, including inside the autograd
  backward and inside activation-checkpoint recomputation: no per-model forward/backward
  surgery, nothing to keep in step with selective or full AC, deferred weight gradients or
  float8 (they run unchanged on whichever side calls them);
- the order in which the two sides issue collectives is a function of the code alone (strict
  alternation at communication points), so every rank of an expert-parallel group issues the
  same collectives in the same order: no extra process group, and no deadlock;
- one side computes at a time, so each tensor op sees exactly the inputs and the summation
  order of the plain run: results are bitwise those of the non-overlapped run.

On an accelerator the same code runs unchanged: the collectives are asynchronous on the
communication library's own stream, ``Work.wait()`` orders the current stream after them, and
the worker thread takes the main thread's device and current stream.

Process-wide state a plugin keeps between a forward and its backward (the deferred-weight-
gradient switch of :mod:`titanext.plugins.weight_grad`) is saved and restored at every hand-
over with :func:`register_side_state`.

>>> order = []
>>> run_interleaved(lambda: order.append("F"), lambda: order.append("B"))
>>> order
['F', 'B']
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from titanext._fake_backend import fake_mode_active

__all__ = ["CommWait", "active", "comm_point", "comm_waits", "emulated_link",
           "register_side_state", "run_interleaved"]

_STATES: list[tuple[Callable[[], object], Callable[[object], None]]] = []


def register_side_state(get: Callable[[], object], put: Callable[[object], None]) -> None:
    """Keep a piece of process-wide state per side: ``get()`` is saved when a side gives the
    baton away and ``put(saved)`` restores it when the side gets it back."""
    _STATES.append((get, put))


@dataclass
class CommWait:
    """Seconds this process spent waiting on collectives issued at communication points.

    ``exposed``: time no side could compute (every unfinished side waited on its collective),
    the all-to-all time the step could not hide; ``calls``: collectives waited on;
    ``handovers``: times a side gave the baton to the other at a collective."""

    exposed: float = 0.0
    calls: int = 0
    handovers: int = 0


_WAIT = CommWait()


def comm_waits(reset: bool = False) -> CommWait:
    """This process's :class:`CommWait` totals (``reset``: return them and start again)."""
    global _WAIT
    out = _WAIT
    if reset:
        _WAIT = CommWait()
    return out


class _Pair:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.turn = 0  # side 0 (forward) starts
        self.done = [False, False]
        self.running = 0  # sides computing now (0 or 1)
        self.idle_since: float | None = None
        self.saved: list[list] = [[], []]

    def _start(self) -> None:  # a side computes again
        if self.idle_since is not None:
            _WAIT.exposed += time.perf_counter() - self.idle_since
            self.idle_since = None
        self.running += 1

    def _stop(self) -> None:  # a side stops computing
        self.running -= 1
        if self.running == 0 and not all(self.done):
            self.idle_since = time.perf_counter()

    def _wait_turn(self, side: int) -> None:
        while self.turn != side:
            self.cond.wait()
        self._start()
        for (_, put), value in zip(_STATES, self.saved[side], strict=True):
            put(value)

    def pause(self, work) -> None:
        """The holder issued ``work``: hand the baton over, wait, take it back."""
        with self.cond:
            side = self.turn
            self.saved[side] = [get() for get, _ in _STATES]
            if not self.done[1 - side]:
                self.turn = 1 - side
                _WAIT.handovers += 1
                self.cond.notify_all()
            self._stop()
        work.wait()
        with self.cond:
            self._wait_turn(side)

    def run_side(self, side: int, fn: Callable[[], None], errors: list) -> None:
        with self.cond:
            self._wait_turn(side)
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised by run_interleaved
            errors.append(e)
        finally:
            with self.cond:
                self.done[side] = True
                self._stop()
                self.turn = 1 - side
                self.cond.notify_all()


_ACTIVE: _Pair | None = None
_LINK: list[float] = []  # emulated bandwidth in bytes/s (benchmarks), innermost last


@contextlib.contextmanager
def emulated_link(bytes_per_s: float) -> Iterator[None]:
    """Benchmarks: inside the block every collective issued at a communication point takes at
    least ``nbytes / bytes_per_s`` seconds longer from its issue, as over a slower link (the
    delay elapses inside the wait, so the other side of a pair computes meanwhile; outside a
    pair the caller sleeps it). The same delay with overlap on and off."""
    _LINK.append(bytes_per_s)
    try:
        yield
    finally:
        _LINK.pop()


class _Slow:
    """A collective's Work that completes ``delay`` seconds after its issue at the earliest."""

    def __init__(self, work, delay: float):
        self.work, self.ready = work, time.perf_counter() + delay

    def wait(self) -> None:
        self.work.wait()
        time.sleep(max(0.0, self.ready - time.perf_counter()))


def active() -> bool:
    """Whether an interleaved pair is running (communication points hand over)."""
    return _ACTIVE is not None


def comm_point(issue: Callable[[bool], object], nbytes: int = 0, *,
               hand_over: bool = True) -> None:
    """Run one collective: ``issue(async_op)`` issues it (returning its ``Work`` when
    ``async_op``). Inside :func:`run_interleaved` it is issued asynchronously and the baton goes
    to the other side until it completes; elsewhere, or with ``hand_over=False`` (a small
    collective not worth two thread switches, such as the split sizes), it runs synchronously.
    Both are timed into :func:`comm_waits`. ``nbytes`` (this rank's input bytes) is what
    :func:`emulated_link` delays by."""
    pair = _ACTIVE
    _WAIT.calls += 1
    delay = nbytes / _LINK[-1] if _LINK else 0.0
    if pair is None or not hand_over:
        start = time.perf_counter()
        issue(False)
        if delay:  # an emulated slower link (benchmarks); no sleep call otherwise
            time.sleep(delay)
        _WAIT.exposed += time.perf_counter() - start
        return
    work = issue(True)
    pair.pause(_Slow(work, delay) if delay else work)


def _thread_setup() -> Callable[[], None]:
    """What the worker thread takes from the caller's thread: grad mode, intra-op threads,
    device and stream. The thread count is per OS thread for OpenMP: a new thread starts at
    the core count, and MKL ran its first matrix products there on that many threads, which
    block the sums otherwise on some kernel paths (AVX2: the overlapped run ended with other
    parameters than the plain one, 2026-11-28)."""
    grad = torch.is_grad_enabled()
    threads = torch.get_num_threads()
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    index = torch.accelerator.current_device_index() if acc is not None else None
    stream = torch.accelerator.current_stream() if acc is not None else None

    def setup() -> None:
        torch.set_grad_enabled(grad)
        torch.set_num_threads(threads)
        if acc is not None:
            torch.accelerator.set_device_index(index)
            torch.accelerator.set_stream(stream)

    return setup


def run_interleaved(forward: Callable[[], None], backward: Callable[[], None]) -> None:
    """Run ``forward`` (on this thread) and ``backward`` (on a worker thread) interleaved at
    their communication points, forward first; returns when both are done and re-raises the
    first error of either. Not re-entrant.

    A dry run (fake mode) runs the two one after the other on this thread: its collectives
    return at once, so there is nothing to overlap, and torch's fake mode and memory tracker
    live on this thread (their mode stack is per thread, and the tracker's module hierarchy
    cannot follow two threads' forwards interleaved). Both micro-batches' activations are alive
    across the hand-over either way, so the memory peak is the same."""
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("run_interleaved is not re-entrant: a pair is already running")
    if fake_mode_active():
        forward()
        backward()
        return
    pair, errors = _Pair(), []
    baseline = [get() for get, _ in _STATES]
    pair.saved = [list(baseline), list(baseline)]
    setup = _thread_setup()

    def worker() -> None:
        setup()
        pair.run_side(1, backward, errors)

    _ACTIVE = pair
    thread = threading.Thread(target=worker, name="titanext-overlap-backward", daemon=True)
    try:
        thread.start()
        pair.run_side(0, forward, errors)
        thread.join()
    finally:
        _ACTIVE = None
        for (_, put), value in zip(_STATES, baseline, strict=True):
            put(value)
    if errors:
        raise errors[0]
