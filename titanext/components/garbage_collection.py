"""Python's garbage collector on a fixed schedule while training (``[training] gc_freq``).

Python collects cyclic garbage whenever its allocation counters cross a threshold, so a
collection can pause any step at any point, and on one rank and not on the others: the others
then wait for it at their next collective. A full collection of a process that imported torch
and the trainer measured 184 ms on this project's CPU machine, against a 45 ms step of the
debug model. With ``gc_freq = N`` (N > 0) automatic collection is off while
:meth:`titanext.trainer.Trainer.train` runs; the young generations are collected once at the
start and after every N-th step, inside that step's ``titanext:gc`` profiler range, on the same
steps on every rank. The setting Python had comes back when training returns (objects that
reached the oldest generation in the meantime are collected by Python's own schedule then).

>>> import gc
>>> with scheduled_collection(2) as after_step:
...     gc.isenabled()
...     after_step(1)  # nothing: not a multiple of 2
...     after_step(2)  # collects generations 0 and 1
False
>>> gc.isenabled()
True
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator

from titanext._profiler_ranges import GC, phase

__all__ = ["YOUNG_GENERATIONS", "scheduled_collection"]

#: what a scheduled collection covers: generations 0 and 1, the objects a step allocates;
#: a full collection walks every object torch and the model hold (the 184 ms above)
YOUNG_GENERATIONS = 1


def _never(step: int) -> None:
    """The ``gc_freq = 0`` hook: Python's automatic collection stays on."""


@contextlib.contextmanager
def scheduled_collection(every: int) -> Iterator[Callable[[int], None]]:
    """Switch automatic collection off for the block (``every`` > 0) and yield the hook to call
    after each step with its number; ``every`` = 0 leaves Python's collector as it is."""
    if every <= 0:
        yield _never
        return

    def after_step(step: int) -> None:
        if step % every == 0:
            with phase(GC):
                gc.collect(YOUNG_GENERATIONS)

    was_enabled = gc.isenabled()
    gc.disable()
    gc.collect(YOUNG_GENERATIONS)
    try:
        yield after_step
    finally:
        if was_enabled:
            gc.enable()
