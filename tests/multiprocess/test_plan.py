"""The planner's activation estimate is within 15% of what TP 2 with SP, CP 2 ring and CP 2
Ulysses really keep alive for backward on debugmodel: each case measures one forward on 2 gloo
ranks (saved-tensor hooks and new live tensors, the largest rank counts) and compares it with
``plan_config``. The one-process cases (activation checkpointing modes, MoE blocks) and the
measurement itself: tests/unit/test_plan.py.
"""

from __future__ import annotations

import pytest

from tests.spawn import run_distributed
from tests.unit.test_plan import BASE, _assert_estimate_within_15_percent, _measure_body

CASES = {
    "tp2_sp": (2, ["--parallelism.tensor_parallel_degree=2"]),
    "cp2": (2, ["--parallelism.context_parallel_degree=2"]),
    "cp2_ulysses": (2, ["--parallelism.context_parallel_degree=2",
                        "--parallelism.context_parallel_comm=alltoall"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_activation_estimate_within_15_percent_of_measurement(case):
    world, extra = CASES[case]
    overrides = [*BASE, *extra]
    measured = max(run_distributed(_measure_body, world, args=(overrides,), timeout_s=60))
    _assert_estimate_within_15_percent(overrides, world, measured)
