"""Hot-expert replication in one process: the plan (conservation, target, bound, determinism),
each rank's routing from it, the planner's and the rules' figures. The multi-process exactness
tests: tests/multiprocess/test_expert_replication.py and tests/unit/test_expert_parallel.py."""

from __future__ import annotations

import random

import pytest

from titanext.plugins.expert_parallel.replication import (
    SLACK,
    nominal_plan,
    plan_replicas,
    rank_routing,
)
from titanext.plugins.expert_parallel.rules import max_replicas


def _table(rng: random.Random, world: int, n_exp: int) -> list[list[int]]:
    skew = [1.0 / (e + 1) ** rng.uniform(0, 2) for e in range(n_exp)]
    rng.shuffle(skew)
    return [[int(rng.randint(0, 40) * s) for s in skew] for _ in range(world)]


@pytest.mark.parametrize("world,n_exp", [(2, 8), (4, 8), (4, 16), (8, 8)])
def test_plan_conserves_rows_and_meets_the_target(world, n_exp):
    rng = random.Random(world * 100 + n_exp)
    for _ in range(50):
        counts = _table(rng, world, n_exp)
        copies = rng.randint(0, max_replicas(n_exp, world))
        plan = plan_replicas(counts, copies)
        assert plan == plan_replicas(counts, copies)  # deterministic: every rank agrees
        total = sum(map(sum, counts))
        target = -(-total // world)
        assert sum(plan.after) == total and len(plan.replicas) <= copies
        assert max(plan.after) <= max(plan.before)
        assert len({(r.expert, r.rank) for r in plan.replicas}) == len(plan.replicas)
        assert all(r.home == r.expert // (n_exp // world) != r.rank for r in plan.replicas)
        if len(plan.replicas) < copies:  # not limited by the copies: within the slack
            assert max(plan.after) <= max(target, total / world * (1 + SLACK)), (counts, plan)
        # every rank's routing agrees with every other's: what s sends d, d receives from s
        routes = [rank_routing(plan, r) for r in range(world)]
        for s in range(world):
            for d in range(world):
                assert routes[s].send_splits[d] == routes[d].recv_splits[s]
        assert [sum(r.slot_counts) for r in routes] == list(plan.after)
        for me, r in enumerate(routes):
            assert sum(n for _, n in r.segments) == sum(counts[me])


def test_plan_examples():
    # ep = 2, experts 0-1 on rank 0: rank 0 has 14 rows, rank 1 has 2; one copy of expert 0
    # takes 6 of its 12 rows to rank 1 (ceil(mean) = 8)
    plan = plan_replicas([[6, 2, 1, 0], [6, 0, 1, 0]], max_copies=2)
    assert plan.before == (14, 2) and plan.after == (8, 8)
    assert [(r.expert, r.home, r.rank, r.rows) for r in plan.replicas] == [(0, 0, 1, 6)]
    assert plan_replicas([[4, 4, 4, 4], [4, 4, 4, 4]], 2).replicas == ()  # balanced: nothing
    skew = [[44, 40, 40, 40], [40, 40, 40, 40]]  # 164 / 160 rows: 1.012 x the mean
    assert plan_replicas(skew, 2).replicas == ()  # within the slack: a copy is not worth it
    assert plan_replicas(skew, 2, slack=0).after == (162, 162)
    # the copy takes the last rows of expert 0 in (source, row) order: rank 1's 6, so rank 1
    # keeps its expert-0 rows and rank 0 sends none of its own to the copy
    r0, r1 = rank_routing(plan, 0), rank_routing(plan, 1)
    assert r0.send_splits == [8, 1] and r1.send_splits == [0, 7]
    assert r1.slot_counts == [2, 0, 6]  # its experts 2, 3, then the copy of expert 0


def test_nominal_plan_is_the_planners_bound():
    plan = nominal_plan(8, 4, copies=3, rows=64)
    for r in range(4):
        assert len(plan.sent(r)) == 3 and len(plan.hosted(r)) == 3
    assert plan.after == plan.before == (64, 64, 64, 64)  # 64 rows from each of 4 ranks


def test_planner_counts_the_copies():
    from titanext.config import load_config
    from titanext.planning.estimate import plan_config

    base = ["--model.flavor=debugmoe", "--parallelism.expert_parallel_degree=2",
            "--training.mixed_precision_param=bfloat16"]
    rows = {}
    for copies in (0, 2):
        cfg = load_config(None, [*base, f"--moe.replicate_hot_experts={copies}"], world_size=4)
        rows[copies] = {c["parallelism"]: c for c in plan_config(cfg, 4).comm}
    row = rows[2]["EP expert copies (replicate_hot_experts = 2)"]
    # debugmoe: 2 MoE blocks of 8 experts (3 x 64 x 32 weights each), bf16: 2 copies forward
    # and 2 gradients backward per block and step (1 micro-batch)
    assert row["bytes"] == 2 * 2 * (2 * 3 * 64 * 32 * 2) and row["collectives"] == 4
    assert not any("copies" in k for k in rows[0])
    assert rows[0]["EP all-to-all"] == rows[2]["EP all-to-all"]


def test_planner_counts_the_copies_once_per_step():
    """4 accumulation steps under full AC: the token all-to-alls grow, the copies do not (they
    are sent and returned once per step: expert_replication.copies_per_step)."""
    from titanext.config import load_config
    from titanext.planning.estimate import plan_config

    base = ["--model.flavor=debugmoe", "--parallelism.expert_parallel_degree=2",
            "--training.mixed_precision_param=bfloat16", "--moe.replicate_hot_experts=2"]
    rows = [{c["parallelism"]: c for c in plan_config(load_config(
        None, [*base, *extra], world_size=4), 4).comm} for extra in (
        [], ["--training.global_batch_size=32", "--training.local_batch_size=2",
             "--activation_checkpoint.mode=full"])]
    name = "EP expert copies (replicate_hot_experts = 2)"
    assert rows[1][name]["bytes"] == rows[0][name]["bytes"] == 2 * 2 * (2 * 3 * 64 * 32 * 2)
    assert rows[1][name]["collectives"] == rows[0][name]["collectives"] == 4
    assert rows[1]["EP all-to-all"]["collectives"] > rows[0]["EP all-to-all"]["collectives"]


def test_planner_plans_replication_within_the_slack_and_compares_both():
    from titanext.config import load_config
    from titanext.planning.estimate import plan_config
    from titanext.plugins.expert_parallel.rules import REPLICATION_SLACK

    base = ["--model.flavor=debugmoe", "--parallelism.expert_parallel_degree=2"]
    plain = load_config(None, base, world_size=4)
    copies = load_config(None, [*base, "--moe.replicate_hot_experts=2"], world_size=4)
    a2a = {}
    for name, cfg, imb in (("plain 1.5", plain, 1.5), ("plain slack", plain,
                           1 + REPLICATION_SLACK), ("copies 1.5", copies, 1.5)):
        a2a[name] = next(c["bytes"] for c in plan_config(cfg, 4, imbalance=imb).comm
                         if c["parallelism"] == "EP all-to-all")
    # with copies the busiest rank is planned at the slack, whatever the routing's imbalance
    assert a2a["copies 1.5"] == a2a["plain slack"] < a2a["plain 1.5"]
    r = plan_config(plain, 4, imbalance=1.5, compare_replication=True).time["ep_replication"]
    assert (r["imbalance"], r["copies"], r["imbalance_with_copies"]) == (1.5, 2, 1.05)
    assert r["copy_gb"] > 0 and r["step_off_s"] > 0 and r["step_on_s"] > 0
    assert r["step_off_s"] == plan_config(plain, 4, imbalance=1.5).time["step_s"]


@pytest.mark.parametrize("overrides,world_size,problem", [
    (["--moe.replicate_hot_experts=2"], 1,
     "moe.replicate_hot_experts = 2 needs expert parallelism: parallelism.expert_parallel_degree "
     "= 1 (copies go from one ep rank to another); set expert_parallel_degree > 1 or "
     "replicate_hot_experts = 0"),
    (["--moe.replicate_hot_experts=-1", "--parallelism.expert_parallel_degree=2"], 2,
     "moe.replicate_hot_experts = -1 is out of range; it must be >= 0"),
    (["--moe.replicate_hot_experts=5", "--parallelism.expert_parallel_degree=2"], 2,
     "moe.replicate_hot_experts = 5 is more than the experts there are to copy: at most "
     "num_experts - num_experts / expert_parallel_degree = 8 - 4 = 4 (the experts a rank does "
     "not hold)"),
])
def test_replication_config_problems(overrides, world_size, problem):
    from titanext.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, ["--model.flavor=debugmoe", *overrides], world_size=world_size)
    assert e.value.problems == [problem]


def test_bad_replication_exits_2(capsys):
    from titanext.train import main

    code = main(["--config", "train_configs/debug_moe.toml", "--moe.replicate_hot_experts=3"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "moe.replicate_hot_experts = 3 needs expert parallelism" in err[0]


def test_apply_rejects_too_many_copies():
    from torch import nn

    from titanext.models.moe import GroupedExperts
    from titanext.plugins.expert_parallel import apply_expert_parallel

    class FakeMesh:  # checked before anything is distributed
        ndim = 1

        def size(self):
            return 4

        def get_group(self):
            return None

    model = nn.Module()
    model.experts = GroupedExperts(8, 4, 6)
    with pytest.raises(ValueError, match="replicate_hot_experts = 7 is more than the 6 experts"):
        apply_expert_parallel(model, FakeMesh(), replicate_hot_experts=7)
    with pytest.raises(ValueError, match="replicate_hot_experts = -1 must be >= 0"):
        apply_expert_parallel(model, FakeMesh(), replicate_hot_experts=-1)
