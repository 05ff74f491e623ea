"""expert_parallel_comm_overlap without processes: the baton, the paired lists, the simulator,
the planner and the config rules (the multi-process numerics: tests/multiprocess/
test_ep_overlap.py)."""

from __future__ import annotations

import threading

import pytest

from titanext.config import ConfigError, load_config
from titanext.plugins import _baton_threads
from titanext.schedules import simulate
from titanext.schedules.overlap import combined_order, overlap_problems


class _Work:
    """A collective that completes when ``done`` is set (by the test or at once)."""

    def __init__(self, log: list, name: str):
        self.log, self.name, self.done = log, name, threading.Event()
        self.done.set()

    def wait(self) -> None:
        self.done.wait(5)
        self.log.append(f"{self.name} waited")


def _side(log: list, name: str, steps: int):
    def run() -> None:
        for k in range(steps):
            log.append(f"{name}{k}")
            _baton_threads.comm_point(lambda async_op, k=k: _Work(log, f"{name}{k}") if async_op
                                else None)
        log.append(f"{name} end")
    return run


def test_sides_alternate_at_every_collective_forward_first():
    log: list = []
    _baton_threads.run_interleaved(_side(log, "F", 2), _side(log, "B", 3))
    computed = [x for x in log if "waited" not in x]
    assert computed == ["F0", "B0", "F1", "B1", "F end", "B2", "B end"]
    assert not _baton_threads.active()


def test_outside_a_pair_collectives_run_synchronously_and_count_as_waited():
    calls = []
    before = _baton_threads.comm_waits(reset=True)
    _baton_threads.comm_point(lambda async_op: calls.append(async_op))
    assert calls == [False] and _baton_threads.comm_waits().calls == 1 and before is not None


def test_process_wide_state_is_kept_per_side():
    state = {"v": "base"}
    _baton_threads.register_side_state(lambda: state["v"], lambda v: state.__setitem__("v", v))
    seen = []
    try:
        def side(name: str):
            def run() -> None:
                state["v"] = name
                _baton_threads.comm_point(lambda async_op: _Work([], name))
                seen.append((name, state["v"]))
            return run
        _baton_threads.run_interleaved(side("F"), side("B"))
    finally:
        _baton_threads._STATES.pop()
    assert sorted(seen) == [("B", "B"), ("F", "F")] and state["v"] == "base"


def _openmp():
    """The OpenMP runtime torch loaded (Linux: read from this process's mapped libraries)."""
    import ctypes
    from pathlib import Path

    maps = Path("/proc/self/maps")
    libs = sorted({part for line in (maps.read_text().splitlines() if maps.exists() else ())
                   for part in line.split() if "libgomp" in part or "libiomp" in part})
    return ctypes.CDLL(libs[0]) if libs else None


def test_the_worker_thread_computes_on_the_callers_intra_op_threads():
    """OpenMP's thread count is per OS thread and a new one starts at the core count: MKL ran
    the backward side's first products on every core, which on the AVX2 kernel path sums in
    another order than the plain run (docs/cpu_kernel_paths.md)."""
    import torch

    omp = _openmp()
    if omp is None:
        pytest.skip("no OpenMP runtime found in this process")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seen = []
        _baton_threads.run_interleaved(lambda: seen.append(omp.omp_get_max_threads()),
                                       lambda: seen.append(omp.omp_get_max_threads()))
        assert seen == [1, 1]
    finally:
        torch.set_num_threads(before)


def test_an_error_on_either_side_is_raised_after_both_ended():
    log: list = []

    def bad() -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        _baton_threads.run_interleaved(_side(log, "F", 1), bad)
    assert "F end" in log and not _baton_threads.active()


@pytest.mark.parametrize("name,spr", [("1F1B", 1), ("Interleaved1F1B", 2)])
def test_combined_lists_keep_the_makespan_and_hide_all_to_all(name, spr):
    plain = simulate(name, pp=4, microbatches=16, stages_per_rank=spr)
    combined = simulate(name, pp=4, microbatches=16, stages_per_rank=spr, overlap=True)
    assert combined.makespan == plain.makespan  # no all-to-all: the pairing costs nothing
    exposed = [simulate(name, pp=4, microbatches=16, stages_per_rank=spr, a2a=0.5, overlap=o)
               for o in (False, True)]
    assert sum(exposed[1].a2a_exposed) < 0.5 * sum(exposed[0].a2a_exposed)
    assert exposed[1].makespan < exposed[0].makespan
    assert any(len(a.sub_actions or ()) == 2 for acts in combined_order(name, 4, 16, spr).values()
               for a in acts)


def test_dualpipev_timeline_draws_the_all_to_all_lane():
    r = simulate("DualPipeV", pp=2, microbatches=4, a2a=0.5, overlap=True)
    assert "a2a" in r.timeline() and "a2a</text>" in r.svg()
    assert r.comm_events and all(e.kind == "A" for e in r.comm_events)


def test_schedules_without_paired_chunks_are_refused():
    assert "no paired forward/backward chunks" in overlap_problems(
        "ZBH1", pp=2, microbatches=4, stages_per_rank=1)[0]
    assert "cannot run" in overlap_problems("1F1B", pp=2, microbatches=2, stages_per_rank=1)[0]
    assert overlap_problems("DualPipeV", pp=2, microbatches=4, stages_per_rank=2) == []
    with pytest.raises(ValueError, match="no paired"):
        simulate("ZBH1", pp=2, microbatches=4, overlap=True)


MOE = ["--model.flavor=debugmoe", "--parallelism.expert_parallel_comm_overlap=true"]
PP2 = ["--parallelism.pipeline_parallel_degree=2", "--parallelism.data_parallel_shard_degree=2"]


@pytest.mark.parametrize("extra,world,expected", [
    ([], 1, "needs expert parallelism, but parallelism.expert_parallel_degree = 1"),
    (["--parallelism.expert_parallel_degree=2"], 2, "pipeline_parallel_degree = 1 has none"),
    ([*PP2, "--parallelism.expert_parallel_degree=2",
      "--parallelism.pipeline_parallel_schedule=ZBH1"], 4, "'ZBH1' has no paired"),
    ([*PP2, "--parallelism.expert_parallel_degree=2", "--parallelism.pipeline_parallel_schedule"
      "=1F1B", "--parallelism.pipeline_parallel_microbatches=2"], 4, "cannot run at pp = 2"),
])
def test_bad_overlap_config_is_one_line_naming_the_key(extra, world, expected):
    with pytest.raises(ConfigError) as e:
        load_config(None, [*MOE, *extra], world_size=world)
    lines = [p for p in e.value.problems if "expert_parallel_comm_overlap" in p]
    assert len(lines) == 1 and expected in lines[0], e.value.problems
    assert lines[0].startswith("parallelism.expert_parallel_comm_overlap = true")


def test_a_supported_overlap_config_loads():
    load_config(None, [*MOE, *PP2, "--parallelism.expert_parallel_degree=2",
                       "--parallelism.pipeline_parallel_schedule=1F1B",
                       "--parallelism.pipeline_parallel_microbatches=4"], world_size=4)


def test_planner_shows_the_all_to_all_with_overlap_off_and_on_and_the_imbalance():
    from tests import REPO_ROOT
    from titanext.planning.estimate import plan_config

    # flat bf16 dispatch and 32 micro-batches: the all-to-all's bytes, which scale with the
    # busiest rank's rows, dwarf what does not scale (the count exchanges, latencies)
    cfg = load_config(str(REPO_ROOT / "train_configs/deepseek_v3_671b.toml"),
                      ["--parallelism.expert_parallel_dispatch=flat",
                       "--parallelism.expert_parallel_float8_dispatch=false",
                       "--training.local_batch_size=32", "--training.global_batch_size=4096",
                       "--parallelism.pipeline_parallel_microbatches=32"], world_size=2048)
    even = plan_config(cfg, 2048).time["ep_all_to_all"]
    skewed = plan_config(cfg, 2048, imbalance=1.5).time["ep_all_to_all"]
    assert even["imbalance"] == 1.0 and skewed["imbalance"] == 1.5
    assert even["exposed_on_s"] < even["exposed_off_s"] and even["step_on_s"] < even["step_off_s"]
    assert skewed["per_step_s"] == pytest.approx(1.5 * even["per_step_s"], rel=1e-3)
    assert skewed["step_off_s"] > even["step_off_s"]


def test_float8_rows_round_trip_with_no_rows():
    """The float8 dispatch's payload of a rank that receives nothing (an idle node, or a
    micro-batch chunk routed elsewhere) decodes to [0, dim]; other counts decode within float8
    error (the overlapped 671B dry run crashed on 0 rows)."""
    import torch

    from titanext.plugins.expert_parallel._comm import dequantize_rows, quantize_rows

    for rows, dim in ((0, 7168), (0, 100), (3, 200)):
        x = torch.randn(rows, dim, dtype=torch.bfloat16)
        back = dequantize_rows(quantize_rows(x), dim, torch.bfloat16)
        assert back.shape == (rows, dim)
        if rows:
            assert (back.float() - x.float()).abs().max() <= 0.07 * x.float().abs().max()
