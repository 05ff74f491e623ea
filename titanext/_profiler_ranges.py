"""The named profiler ranges titanext's own code opens, and the one function that opens them.

:func:`phase` is ``torch.profiler.record_function`` when a profiler is collecting and a shared
null context otherwise: ``record_function`` itself costs about 13 us per call with no profiler
running (measured on this project's CPU machine, torch 2.13; it builds a RecordFunction even
when nothing records it), which would add up inside per-layer code such as EP dispatch and CP
ring steps; the check here is one C call. The names are the contract with the step table of
:mod:`titanext.components.profiling`, which classifies a trace's events by them.

>>> with phase(FORWARD):
...     pass
"""

from __future__ import annotations

import contextlib

from torch.profiler import record_function

from titanext._compat import profiler_enabled

__all__ = ["BACKWARD", "CP", "DATA", "EP_ALL_TO_ALL", "FORWARD", "GC", "LOG", "LOSS", "OPTIMIZER",
           "PHASES", "PIPELINE", "PP_CHUNK", "PP_WAIT", "PREFIX", "phase", "pp_chunk"]

PREFIX = "titanext:"
DATA = PREFIX + "data"  # next micro-batches, CP slicing of the batch
FORWARD = PREFIX + "forward"  # model forward and loss (no pipeline)
BACKWARD = PREFIX + "backward"
PIPELINE = PREFIX + "pipeline"  # a pipeline schedule's step (torch names its actions PP:...)
LOSS = PREFIX + "loss"  # the token count and loss all-reduces
OPTIMIZER = PREFIX + "optimizer"  # clipping, optimizer and LR steps, MoE bias, zero_grad
LOG = PREFIX + "log"  # metrics, validation, checkpoint saving after the step
GC = PREFIX + "gc"  # the scheduled garbage collection after a step ([training] gc_freq)
EP_ALL_TO_ALL = PREFIX + "ep_all_to_all"  # EP dispatch/combine exchanges, forward and backward
CP = PREFIX + "cp"  # a context-parallel attention's communication (ring step, all-to-all)

PP_CHUNK = PREFIX + "pp_{kind}/s{stage}"  # one pipeline stage's F, I, W or full-B chunk
#: a rank blocked in wait() on pipeline sends / receives (the schedules' wait points): the
#: step table's "PP send/recv" row, which the ops' lifetimes (overlapping compute) would not be
PP_WAIT = PREFIX + "pp_wait"

#: the top-level phases of one training step, in order; they do not nest in each other
PHASES = (DATA, FORWARD, BACKWARD, PIPELINE, LOSS, OPTIMIZER, LOG, GC)

_NULL = contextlib.nullcontext()
_profiler_enabled = profiler_enabled  # one C call, no allocation


def phase(name: str) -> contextlib.AbstractContextManager:
    """A profiler range named ``name`` while a profiler collects; otherwise a null context."""
    return record_function(name) if _profiler_enabled() else _NULL


def pp_chunk(kind: str, stage: int) -> str:
    """The range name of stage ``stage``'s ``kind`` chunk ("F", "I", "W" or "B").

    >>> pp_chunk("I", 3)
    'titanext:pp_I/s3'
    """
    return PP_CHUNK.format(kind=kind, stage=stage)
