"""A memory cap on deferred weight gradients: run W earlier once too many are pending.

A schedule that splits the backward (ZB-H1/H2, ZB-V, Auto, DualPipe, DualPipeV) keeps, for
every micro-batch whose input gradient I has run and whose weight gradient W has not, the
inputs of W: each matmul's input and output gradient (titanext.plugins.weight_grad). Where a
schedule defers many W's, typically in the cool-down of the middle ranks, these pile up:
DeepSeek-V3 671B under DualPipe (PP 16) holds eight micro-batches' worth on pp rank 8, and
that is what decides the step's peak.

:func:`cap_pending_weight_grads` is a pass over the per-rank compute lists, as the zero-bubble
paper's memory-limited schedules do: walking each rank's list, before an I that would leave
more than ``cap`` micro-batches with a pending W, it runs the oldest pending W first (moved up
from its later place in the list). Nothing else moves, so the lists stay valid (a W still
follows its own I) and the runtime, the simulator and the planner read the same capped lists.
The price is time: each moved W now delays the I behind it, which the previous rank waits for
(the simulator's step time measures it; ``python -m titanext.schedules`` prints it).

>>> from titanext.schedules.dualpipe import dualpipe_order
>>> order = dualpipe_order(4, 8)
>>> capped = cap_pending_weight_grads(order, 1)
>>> max_pending_weight_grads(order)[1], max_pending_weight_grads(capped)[1]
(2, 1)

:func:`capped_schedule_class` gives a schedule class whose lists are capped; the config key
``parallelism.pipeline_parallel_max_pending_weight_grads`` selects it for the trainer, the
planner and the dry run alike.
"""

from __future__ import annotations

import functools
from collections import deque

from titanext.schedules._torch_ir import I, W, action, leaves

__all__ = ["CAPPABLE", "cap_pending_weight_grads", "capped_schedule_class",
           "max_pending_weight_grads"]

#: titanext's schedules whose lists the cap rewrites (torch's build their lists themselves)
CAPPABLE = ("ZBH1", "ZBH2", "ZBV", "Auto", "DualPipe", "DualPipeV")


def _key(a) -> tuple[int, int]:
    return a.stage_index, a.microbatch_index


def _cap_rank(acts: list, cap: int) -> list:
    standalone = {_key(a) for a in acts if a.computation_type == W and a.sub_actions is None}
    pending: deque[tuple[int, int]] = deque()  # (stage, micro-batch) after I, before W
    moved: set[tuple[int, int]] = set()
    out = []
    for a in acts:
        if a.computation_type == W and _key(a) in moved:
            continue  # already run earlier
        inputs = sum(x.computation_type == I for x in leaves(a))
        while inputs and len(pending) + inputs > cap:
            early = next((k for k in pending if k in standalone), None)
            if early is None:  # only W's inside overlapped actions are pending: none can move
                break
            pending.remove(early)
            moved.add(early)
            out.append(action(early[0], W, early[1]))
        out.append(a)
        for x in leaves(a):
            if x.computation_type == I:
                pending.append(_key(x))
            elif x.computation_type == W and _key(x) in pending:
                pending.remove(_key(x))
    return out


def cap_pending_weight_grads(order: dict[int, list], cap: int) -> dict[int, list]:
    """``order`` (per-rank compute lists) with at most ``cap`` micro-batches' W pending on any
    rank, counting the one whose I runs; ``cap <= 0`` returns ``order`` unchanged. Only
    stand-alone W actions move (W's inside an overlapped F&B pair stay)."""
    if cap <= 0:
        return order
    return {r: _cap_rank(acts, cap) for r, acts in order.items()}


def max_pending_weight_grads(order: dict[int, list]) -> dict[int, int]:
    """Per rank, the most micro-batches whose W is pending at once (during an I, counting its
    own): what :func:`cap_pending_weight_grads` bounds."""
    peaks = {}
    for r, acts in order.items():
        pending, peak = set(), 0
        for a in acts:
            for x in leaves(a):
                if x.computation_type == I:
                    pending.add(_key(x))
                    peak = max(peak, len(pending))
                elif x.computation_type == W:
                    pending.discard(_key(x))
        peaks[r] = peak
    return peaks


@functools.cache  # one class per (schedule, cap): caches key on it
def capped_schedule_class(cls: type, cap: int) -> type:
    """Schedule class ``cls`` (one of :data:`CAPPABLE`) whose generated lists are capped at
    ``cap`` pending W's per rank; ``cap <= 0`` returns ``cls``. Raises ValueError for a class
    that does not generate its own lists (torch's schedules). The same class for the same
    arguments, so a plan's class keys the schedule caches (``schedule_order``, the planner's
    ``simulate_schedule``) as its name and cap did."""
    if cap <= 0:
        return cls
    if not hasattr(cls, "generate") or cls.__name__ not in CAPPABLE:
        raise ValueError(f"schedule {cls.__name__!r} has no weight-gradient cap; it applies to "
                         f"{', '.join(CAPPABLE)}")
    base = cls.generate

    def generate(pp: int, microbatches: int, **costs: float) -> dict[int, list]:
        return cap_pending_weight_grads(base(pp, microbatches, **costs), cap)

    generate.__doc__ = base.__doc__
    return type(cls.__name__, (cls,), {"generate": staticmethod(generate),
                                       "max_pending_weight_grads": cap,
                                       "__doc__": cls.__doc__})
