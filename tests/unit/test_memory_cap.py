"""The cap on pending weight gradients (titanext.schedules.memory_cap): the pass over the
per-rank lists, the simulator and planner reading the capped lists, and the config key."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.unit.config.helpers import problems_of, the_problem
from titanext.schedules import (
    capped_schedule_class,
    get_schedule_class,
    schedule_order,
    simulate,
    validate_order,
)
from titanext.schedules._torch_ir import I, W, leaves
from titanext.schedules.dualpipe import dualpipe_order
from titanext.schedules.memory_cap import (
    CAPPABLE,
    cap_pending_weight_grads,
    max_pending_weight_grads,
)

KEY = "--parallelism.pipeline_parallel_max_pending_weight_grads"


def _flat(acts):
    return [x for a in acts for x in leaves(a)]


@pytest.mark.parametrize("name,pp,m", [("DualPipe", 8, 16), ("DualPipeV", 4, 8), ("ZBV", 4, 8),
                                       ("ZBH1", 4, 8), ("ZBH2", 4, 8), ("Auto", 4, 8)])
def test_the_cap_bounds_pending_ws_and_only_moves_ws_earlier(name, pp, m):
    plain = schedule_order(name, pp=pp, microbatches=m)
    peak = max(max_pending_weight_grads(plain).values())
    assert peak >= 2, "the uncapped schedule must defer W's for the test to mean anything"
    for cap in range(1, peak):
        capped = schedule_order(name, pp=pp, microbatches=m, max_pending_weight_grads=cap)
        assert max(max_pending_weight_grads(capped).values()) == cap
        for r in plain:
            a, b = _flat(plain[r]), _flat(capped[r])
            assert Counter(map(str, a)) == Counter(map(str, b))   # the same actions, once each
            # everything but W keeps its order; each W still follows its own I
            assert [str(x) for x in a if x.computation_type != W] == \
                [str(x) for x in b if x.computation_type != W]
            pos = {(x.computation_type, x.stage_index, x.microbatch_index): i
                   for i, x in enumerate(b)}
            for x in b:
                if x.computation_type == W:
                    assert pos[I, x.stage_index, x.microbatch_index] < pos[W, x.stage_index,
                                                                           x.microbatch_index]
        if get_schedule_class(name).placement != "dualpipe":
            spr = get_schedule_class(name).stages_per_rank
            validate_order(capped, pp=pp, num_stages=pp * spr, microbatches=m)


def test_simulated_cost_of_the_cap_dualpipe_pp16():
    """The 671B's schedule (DualPipe, pp 16, 32 micro-batches, F = I = W): the middle ranks
    hold 8 pending W's; a cap of 4 costs 4% of the step, a cap of 1 about 7%."""
    span = {cap: simulate("DualPipe", pp=16, microbatches=32, max_pending_weight_grads=cap,
                          runtime_order=True).makespan for cap in (0, 8, 4, 1)}
    assert span == {0: 103.0, 8: 103.0, 4: 107.0, 1: 110.0}
    order = cap_pending_weight_grads(dualpipe_order(16, 32), 4)
    assert max_pending_weight_grads(order)[8] == 4
    assert max_pending_weight_grads(dualpipe_order(16, 32))[8] == 8


def test_capped_class_generates_capped_lists_and_refuses_torchs():
    cls = capped_schedule_class(get_schedule_class("DualPipe"), 2)
    assert cls.__name__ == "DualPipe" and cls.max_pending_weight_grads == 2
    assert max(max_pending_weight_grads(cls.generate(8, 16)).values()) == 2
    assert capped_schedule_class(get_schedule_class("ZBV"), 0) is get_schedule_class("ZBV")
    for name in ("1F1B", "Interleaved1F1B", "ZBVZeroBubble"):
        with pytest.raises(ValueError, match="no weight-gradient cap"):
            capped_schedule_class(get_schedule_class(name), 1)
    assert set(CAPPABLE) <= set(get_schedule_class(n).__name__ for n in CAPPABLE)


def test_planner_reads_the_capped_lists():
    """Under full AC the planner's middle-rank activations fall with the cap (each pending W
    holds the matmul inputs and output gradients of the rank's blocks for one micro-batch),
    and its step time rises (micro-batches of 4 sequences: compute, not the p2p latency, sets
    the pace; with 1 sequence the debug model's p2p latency equals a stage's forward and the
    capped Ws fit in the waits)."""
    from titanext.config import load_config
    from titanext.planning.estimate import plan_config

    def peaks(cap):
        cfg = load_config(None, ["--model.flavor=debugmodel", "--training.local_batch_size=32",
                                 "--parallelism.pipeline_parallel_degree=4",
                                 "--parallelism.pipeline_parallel_schedule=DualPipe",
                                 "--parallelism.pipeline_parallel_microbatches=8",
                                 "--activation_checkpoint.mode=full", f"{KEY}={cap}"], world_size=4)
        plan = plan_config(cfg, 4)
        return [m["activations"] for m in plan.memory_per_pp_rank], plan.time["step_s"]

    (act0, t0), (act1, t1) = peaks(0), peaks(1)
    assert act1[1] < act0[1] / 3 and act1[2] < act0[2] / 3  # middle ranks: 2 W's uncapped
    assert act1[0] == act0[0] and act1[3] == act0[3]  # the end ranks hold 1 either way
    assert t1 > t0


def test_config_key_bad_values():
    pp2 = ["--parallelism.pipeline_parallel_degree=2", "--model.flavor=debugmodel",
           "--training.local_batch_size=8"]
    assert problems_of([*pp2, "--parallelism.pipeline_parallel_schedule=ZBV", f"{KEY}=2"],
                       world_size=2) == []
    msg = the_problem([*pp2, "--parallelism.pipeline_parallel_schedule=ZBV", f"{KEY}=-1"],
                      world_size=2)
    assert "pipeline_parallel_max_pending_weight_grads" in msg and "-1" in msg
    msg = the_problem([*pp2, "--parallelism.pipeline_parallel_schedule=Interleaved1F1B",
                       f"{KEY}=2"], world_size=2)
    assert "max_pending_weight_grads = 2" in msg and "Interleaved1F1B" in msg and "DualPipe" in msg
