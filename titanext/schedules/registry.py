"""The schedules by name: torch's built-ins and titanext's generated ones, each a class that
declares its stage placement, and the one schedule factory (:func:`build_schedule`).

>>> get_schedule_class("zbv").__name__, len(SCHEDULE_NAMES) > 6
('ZBV', True)
"""

from __future__ import annotations

from titanext._text import did_you_mean
from titanext.schedules import dualpipe, zero_bubble
from titanext.schedules._torch_ir import is_single_stage, no_self_warmup, torch_schedule_class
from titanext.schedules.zero_bubble import GeneratedSchedule, one_f_one_b

__all__ = ["SCHEDULE_NAMES", "build_schedule", "get_schedule_class"]


def _zb(name: str, fn, placement: str = "loop", stages_per_rank: int = 1) -> type:
    return type(name, (GeneratedSchedule,), {
        "placement": placement, "stages_per_rank": stages_per_rank, "splits_backward": True,
        "generate": staticmethod(fn), "__doc__": fn.__doc__})


_OURS: dict[str, type] = {
    "ZBH1": _zb("ZBH1", zero_bubble.zbh1),
    "ZBH2": _zb("ZBH2", zero_bubble.zbh2),
    "ZBV": _zb("ZBV", zero_bubble.zbv, "v", 2),
    "DualPipe": dualpipe.DualPipe,
    "DualPipeV": dualpipe.DualPipeV,
    "Auto": zero_bubble.Auto,
}


def _gpipe_order(pp: int, m: int) -> dict[int, list]:
    # torch's private pipelining: loaded only to build a schedule
    from titanext.schedules._torch_ir import B, F, action
    return {r: [action(r, F, j) for j in range(m)] + [action(r, B, j) for j in range(m)]
            for r in range(pp)}


def _torch(cls_name: str, placement: str, stages_per_rank: int | None,
           splits_backward: bool = False, min_microbatches_per_stage: int = 0,
           min_microbatches_per_rank: int = 0, textbook_order=None) -> type | None:
    base = torch_schedule_class(cls_name)
    if base is None:
        return None
    attrs = {"placement": placement, "stages_per_rank": stages_per_rank,
             "splits_backward": splits_backward, "__doc__": base.__doc__,
             # checks torch makes only once it holds real stages (inside Trainer start-up)
             "min_microbatches_per_stage": min_microbatches_per_stage,
             "min_microbatches_per_rank": min_microbatches_per_rank}
    if textbook_order is not None:  # single-stage runtimes keep no action lists
        attrs["textbook_order"] = staticmethod(textbook_order)
    return type(cls_name.removeprefix("Schedule"), (base,), attrs)


_TORCH = {name: cls for name, cls in {
    "GPipe": _torch("ScheduleGPipe", "loop", 1, textbook_order=_gpipe_order),
    "1F1B": _torch("Schedule1F1B", "loop", 1, min_microbatches_per_stage=1,
                   textbook_order=one_f_one_b),
    "Interleaved1F1B": _torch("ScheduleInterleaved1F1B", "loop", None),
    "LoopedBFS": _torch("ScheduleLoopedBFS", "loop", None),
    "InterleavedZeroBubble": _torch("ScheduleInterleavedZeroBubble", "loop", None, True),
    "ZBVZeroBubble": _torch("ScheduleZBVZeroBubble", "v", 2, True),
    # torch's DualPipeV; "DualPipeV" is titanext's (overlapped F&B chunks)
    "TorchDualPipeV": _torch("ScheduleDualPipeV", "v", 2, True, min_microbatches_per_rank=2),
}.items() if cls is not None}

SCHEDULE_NAMES: tuple[str, ...] = (*_TORCH, *_OURS)
_SIMULATED = SCHEDULE_NAMES  # every schedule can be simulated
_BY_LOWER = {n.lower(): n for n in SCHEDULE_NAMES}


def get_schedule_class(name: str) -> type:
    """The schedule class for ``name`` (torch's names and ours, any case).

    Raises ValueError listing the choices. Every class has ``placement``,
    ``stages_per_rank`` (None = configurable) and ``splits_backward`` (uses I/W actions).
    """
    canonical = _BY_LOWER.get(name.lower()) if isinstance(name, str) else None
    if canonical is None:
        hint = did_you_mean(name, SCHEDULE_NAMES)
        raise ValueError(f"pipeline schedule {name!r} is not known{hint}"
                         f"; choose one of {', '.join(SCHEDULE_NAMES)}")
    return _OURS.get(canonical) or _TORCH[canonical]


def build_schedule(schedule: str | type, stages: list, n_microbatches: int, loss_fn=None, *,
                   costs: dict[str, float | tuple[float, ...]] | None = None, **kwargs):
    """The schedule ``schedule`` (a name or class) over this rank's ``PipelineStage`` objects.

    torch's single-stage GPipe / 1F1B take the one stage object, every other class the list.
    ``costs`` (f, b, w: one figure or each stage's; comm) regenerate a schedule that uses them
    (Auto) for measured times;
    ``kwargs`` go to the constructor (e.g. ``scale_grads=False``). The one schedule factory:
    :func:`titanext.distributed.pipeline.build_pipeline` and the trainer's pipeline call it.

    >>> # schedule = build_schedule("ZBH1", [stage], 8, loss_fn=loss_fn, scale_grads=False)
    """
    cls = get_schedule_class(schedule) if isinstance(schedule, str) else schedule
    if costs is not None and hasattr(cls, "with_costs"):  # generated for measured costs (Auto)
        cls = cls.with_costs(**costs)
    no_self_warmup(stages)
    if is_single_stage(cls):
        if len(stages) != 1:
            raise ValueError(f"{cls.__name__} runs one stage per rank, got {len(stages)}")
        return cls(stages[0], n_microbatches, loss_fn=loss_fn, **kwargs)
    return cls(list(stages), n_microbatches, loss_fn=loss_fn, **kwargs)
