"""Pipeline schedules: torch's built-ins and titanext's generated ones, plus a simulator.

``get_schedule_class(name)`` returns a schedule class that torch's pipelining runtime
executes. Every class declares its stage placement (``placement``: "loop" or "v") and
``stages_per_rank``, so callers place stages from data, never from the schedule's name.
Our schedules (ZBH1, ZBH2, ZBV, Auto) are per-rank action lists produced by
:mod:`titanext.schedules.zero_bubble` and run by ``_PipelineScheduleRuntime``; the simulator
(:func:`simulate`) replays the very same lists.

>>> from titanext.schedules import simulate
>>> round(simulate("ZBH1", pp=4, microbatches=8).bubble_ratio, 4)   # (p-1)/(3m+p-1)
0.1111
"""

from __future__ import annotations

from collections.abc import Callable

from torch.distributed.pipelining import schedules as torch_schedules

from titanext.schedules import zero_bubble
from titanext.schedules._torch_ir import validate, with_comms
from titanext.schedules.simulator import SimResult, replay
from titanext.schedules.zero_bubble import stage_ids

__all__ = ["SCHEDULE_NAMES", "get_schedule_class", "build_schedule", "simulate", "stage_ids",
           "SimResult", "schedule_problems"]

_Runtime = torch_schedules._PipelineScheduleRuntime  # the documented home of custom schedules


class GeneratedSchedule(_Runtime):
    """A schedule whose per-rank action lists come from ``generate(pp, microbatches)``.

    Constructed like torch's multi-stage schedules: ``cls(stages, n_microbatches, loss_fn=...)``
    with this rank's stages (``stages_per_rank`` of them, placed by ``placement``).
    """

    placement = "loop"
    stages_per_rank = 1
    generate: Callable[..., dict[int, list]]

    def __init__(self, stages, n_microbatches: int, loss_fn=None, *, costs: dict | None = None,
                 **kwargs):
        super().__init__(stages=stages, n_microbatches=n_microbatches, loss_fn=loss_fn, **kwargs)
        pp = stages[0].group_size
        mapping = {s: r for r in range(pp)
                   for s in stage_ids(self.placement, r, pp, self.stages_per_rank)}
        for stage in self._stages:
            stage.stage_index_to_group_rank = mapping
        self.stage_index_to_group_rank = mapping
        self.pipeline_order = type(self).generate(pp, n_microbatches, **(costs or {}))
        self._prepare_schedule_with_comms(self.pipeline_order)


def _generated(name: str, fn, placement: str = "loop", stages_per_rank: int = 1,
               use_costs: bool = False) -> type:
    def generate(pp, microbatches, **costs):
        return fn(pp, microbatches, **costs) if use_costs else fn(pp, microbatches)

    return type(name, (GeneratedSchedule,), {
        "placement": placement, "stages_per_rank": stages_per_rank,
        "generate": staticmethod(generate), "__doc__": fn.__doc__})


ZBH1 = _generated("ZBH1", zero_bubble.zbh1)
ZBH2 = _generated("ZBH2", zero_bubble.zbh2)
ZBV = _generated("ZBV", zero_bubble.zbv, placement="v", stages_per_rank=2)
Auto = _generated("Auto", zero_bubble.auto, use_costs=True)

_OURS = {"ZBH1": ZBH1, "ZBH2": ZBH2, "ZBV": ZBV, "Auto": Auto}


def _torch(name: str, cls_name: str, placement: str, stages_per_rank: int | None) -> type | None:
    base = getattr(torch_schedules, cls_name, None)
    if base is None:
        return None
    return type(name, (base,), {"placement": placement, "stages_per_rank": stages_per_rank,
                                "__doc__": base.__doc__})


_TORCH = {name: cls for name, cls in {
    "GPipe": _torch("GPipe", "ScheduleGPipe", "loop", 1),
    "1F1B": _torch("1F1B", "Schedule1F1B", "loop", 1),
    "Interleaved1F1B": _torch("Interleaved1F1B", "ScheduleInterleaved1F1B", "loop", None),
    "LoopedBFS": _torch("LoopedBFS", "ScheduleLoopedBFS", "loop", None),
    "InterleavedZeroBubble": _torch("InterleavedZeroBubble", "ScheduleInterleavedZeroBubble",
                                    "loop", None),
    "ZBVZeroBubble": _torch("ZBVZeroBubble", "ScheduleZBVZeroBubble", "v", 2),
}.items() if cls is not None}

SCHEDULE_NAMES = (*_TORCH, *_OURS)


def get_schedule_class(name: str) -> type:
    """The schedule class for ``name`` (torch's names and ours); ValueError with the choices."""
    if name in _OURS:
        return _OURS[name]
    if name in _TORCH:
        return _TORCH[name]
    raise ValueError(f"pipeline schedule {name!r} is not known; choose one of "
                     f"{', '.join(SCHEDULE_NAMES)}")


# Simulation covers the schedules whose action lists we generate, plus 1F1B as the baseline.
_SIMULATED = {"1F1B": (zero_bubble.one_f_one_b, 1, False), "ZBH1": (zero_bubble.zbh1, 1, False),
              "ZBH2": (zero_bubble.zbh2, 1, False), "ZBV": (zero_bubble.zbv, 2, False),
              "Auto": (zero_bubble.auto, 1, True)}


def simulate(name: str, *, pp: int, microbatches: int, f: float = 1.0, b: float = 1.0,
             w: float = 1.0, comm: float = 0.0) -> SimResult:
    """Replay schedule ``name``'s action lists with these costs (``b`` = I, ``w`` = W).

    Costs are per rank's share of the model: a schedule with two stages per rank (ZBV) runs
    each stage at half of them, and its ``peak_activations`` are counted in the same units
    (a micro-batch's activations of one rank's share), so schedules compare directly.
    """
    if name not in _SIMULATED:
        raise ValueError(f"simulate: {name!r} is not one of {', '.join(_SIMULATED)}")
    fn, per_rank, use_costs = _SIMULATED[name]
    costs = dict(f=f / per_rank, b=b / per_rank, w=w / per_rank, comm=comm)
    order = fn(pp, microbatches, **costs) if use_costs else fn(pp, microbatches)
    validate(order, pp, pp * per_rank, microbatches)
    result = replay(order, num_stages=pp * per_rank, **costs)
    if per_rank > 1:
        result.peak_activations = [a / per_rank for a in result.peak_activations]
    return result


def schedule_problems(name: str, *, pp: int, microbatches: int, compiled: bool = False) -> list[str]:
    """Config problems of running ``name`` with these settings (one line each)."""
    problems = []
    if name not in SCHEDULE_NAMES:
        return [f"parallelism.pipeline_parallel_schedule = {name!r} is not one of "
                f"{', '.join(SCHEDULE_NAMES)}"]
    if microbatches < pp:
        problems.append(f"parallelism.pipeline_parallel_microbatches = {microbatches} must be >= "
                        f"pipeline_parallel_degree = {pp} for {name}")
    if compiled and name in ("ZBVZeroBubble",):
        problems.append(f"parallelism.pipeline_parallel_schedule = {name!r} (torch's) refuses "
                        "torch.compile'd stages; use 'ZBV' or disable compile")
    return problems


def build_schedule(name: str, stages: list, n_microbatches: int, loss_fn=None, **kwargs):
    """Instantiate schedule ``name`` with this rank's stages (one stage for torch's
    single-stage schedules such as GPipe and 1F1B, the list otherwise)."""
    cls = get_schedule_class(name)
    single = issubclass(cls, torch_schedules.PipelineScheduleSingle)
    if single and len(stages) != 1:
        raise ValueError(f"{name} runs one stage per rank; got {len(stages)}")
    return cls(stages[0] if single else stages, n_microbatches, loss_fn=loss_fn, **kwargs)


def _stage_to_rank(placement: str, pp: int, stages_per_rank: int) -> dict[int, int]:
    return {s: r for r in range(pp) for s in stage_ids(placement, r, pp, stages_per_rank)}


def with_comm_actions(name: str, pp: int, microbatches: int) -> dict[int, list]:
    """Our schedule's full per-rank lists including torch's send/recv actions (for inspection)."""
    cls = get_schedule_class(name)
    order = cls.generate(pp, microbatches)
    mapping = _stage_to_rank(cls.placement, pp, cls.stages_per_rank)
    return with_comms(order, mapping.__getitem__, pp * cls.stages_per_rank)
