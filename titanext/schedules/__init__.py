"""Pipeline schedules: torch's built-ins and titanext's generated ones, plus a simulator.

The package only re-exports: the classes by name and the schedule factory are
:mod:`~titanext.schedules.registry`, stage placement :mod:`~titanext.schedules.placement`, the
action lists, their check, the simulator and the settings' problems
:mod:`~titanext.schedules.orders`.

``get_schedule_class(name)`` returns a schedule class that torch's pipelining runtime
executes. Every class declares its stage placement (``placement``: "loop", "v" or
"dualpipe") and ``stages_per_rank`` (None: configurable), so callers place stages from data,
never from the schedule's name:

>>> cls = get_schedule_class("ZBV")
>>> cls.placement, cls.stages_per_rank, stage_ids_for_rank(cls.placement, 1, 4, 2)
('v', 2, [1, 6])

Ours (ZBH1, ZBH2, ZBV, Auto, DualPipe, DualPipeV) are per-rank action lists from
:mod:`~titanext.schedules.zero_bubble` and :mod:`~titanext.schedules.dualpipe`; the simulator
(:func:`simulate`) replays the very same lists, and for torch's multi-stage schedules the
lists torch builds:

>>> round(simulate("ZBH1", pp=4, microbatches=8).bubble_ratio, 4)   # (p-1)/(3m+p-1)
0.1111
"""

from __future__ import annotations

from titanext.schedules._torch_ir import follow_in_flight, leaves
from titanext.schedules.memory_cap import capped_schedule_class
from titanext.schedules.orders import (
    forwards_in_flight,
    schedule_order,
    schedule_problems,
    simulate,
    validate_order,
)
from titanext.schedules.placement import (
    num_stages_for,
    pipeline_stage_ids,
    resolved_stages_per_rank,
    stage_ids_for_rank,
    stage_owners,
)
from titanext.schedules.registry import SCHEDULE_NAMES, build_schedule, get_schedule_class
from titanext.schedules.simulator import SimResult
from titanext.schedules.zero_bubble import auto_schedule_class
from titanext.schedules.zero_bubble import stage_ids as stage_ids

__all__ = ["SCHEDULE_NAMES", "SimResult", "auto_schedule_class", "build_schedule",
           "capped_schedule_class", "follow_in_flight", "forwards_in_flight", "get_schedule_class",
           "leaves",
           "num_stages_for",
           "pipeline_stage_ids", "resolved_stages_per_rank",
           "schedule_order", "schedule_problems", "simulate", "stage_ids_for_rank", "stage_owners",
           "validate_order"]
