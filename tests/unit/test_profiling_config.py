"""``[profiling]`` bad input: one line per problem at load (ConfigError), exit 2 from the CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from titanext.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "train_configs" / "debug_model.toml")
ON = ["--profiling.enable_profiling", "--training.steps=10"]


def _problems(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as err:
        load_config(CONFIG, list(overrides))
    return err.value.problems


@pytest.mark.parametrize(("overrides", "says"), [
    ([*ON, "--profiling.profile_freq=20"],
     "profiling.profile_freq = 20 is longer than the run (training.steps = 10)"),
    ([*ON, "--profiling.profile_freq=4", "--profiling.profiler_warmup=3",
      "--profiling.profiler_active=2"],
     "profiling.profiler_warmup (3) + profiling.profiler_active (2) = 5 must be <= "
     "profiling.profile_freq = 4"),
    ([*ON, "--profiling.save_traces_folder=pyproject.toml/traces", f"--job.dump_folder={ROOT}"],
     "profiling.save_traces_folder = 'pyproject.toml/traces'"),
    (["--profiling.enable_memory_snapshot", "--training.steps=10",
      "--profiling.save_memory_snapshot_folder=pyproject.toml", f"--job.dump_folder={ROOT}"],
     "profiling.save_memory_snapshot_folder = 'pyproject.toml'"),
    ([*ON, "--profiling.profiler_active=0"], "profiling.profiler_active = 0 is out of range"),
])
def test_each_bad_profiling_input_is_one_line(overrides, says):
    problems = _problems(*overrides)
    assert len(problems) == 1 and problems[0].startswith(says), problems


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_history_without_cuda_is_an_error_and_auto_is_not():
    problems = _problems("--profiling.enable_memory_snapshot", "--training.steps=10",
                         "--profiling.memory_snapshot_kind=cuda_history")
    assert len(problems) == 1 and "needs CUDA's allocator history" in problems[0], problems
    load_config(CONFIG, ["--profiling.enable_memory_snapshot", "--training.steps=10"])


def test_profiling_off_checks_nothing():
    load_config(CONFIG, ["--training.steps=1", "--profiling.profile_freq=50"])


def test_the_cli_exits_2_with_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "titanext.train", "--config", CONFIG, *ON,
         "--profiling.profile_freq=20"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    lines = [x for x in proc.stderr.splitlines() + proc.stdout.splitlines() if x.strip()]
    assert proc.returncode == 2, proc
    assert len(lines) == 1 and "profiling.profile_freq = 20" in lines[0], lines
    assert "Traceback" not in proc.stderr


def test_window_steps_and_the_table_of_a_trace():
    from titanext.components.profiling import window_steps
    from titanext.components.step_table import step_breakdown
    from titanext.config import Profiling

    assert window_steps(Profiling(profile_freq=3, profiler_warmup=1, profiler_active=2), 7) \
        == [[2, 3], [5, 6]]
    trace = {"traceEvents": [
        {"ph": "X", "name": "ProfilerStep#1", "ts": 0, "dur": 100, "tid": 1},
        {"ph": "X", "name": "titanext:forward", "ts": 0, "dur": 60, "tid": 1},
        {"ph": "X", "name": "FSDP::all_gather (0)", "ts": 1, "dur": 20, "tid": 1},
        {"ph": "X", "name": "c10d::_allgather_base_", "ts": 2, "dur": 1, "tid": 1},
        {"ph": "X", "name": "gloo:all_gather", "ts": 3, "dur": 15, "tid": 7},
        {"ph": "X", "name": "titanext:backward", "ts": 60, "dur": 30, "tid": 1},
        {"ph": "X", "name": "FSDP::post_backward_reduce (0)", "ts": 70, "dur": 10, "tid": 1},
        {"ph": "X", "name": "c10d::_reduce_scatter_base_", "ts": 71, "dur": 1, "tid": 1},
        {"ph": "X", "name": "gloo:all_reduce", "ts": 72, "dur": 5, "tid": 7}]}
    b = step_breakdown(trace)
    assert b["steps"] == [2]
    assert b["comm"] == {"FSDP all-gather": 0.015, "FSDP reduce-scatter": 0.005}
    assert abs(b["unaccounted_ms"] - 0.01) < 1e-12


def test_the_pipeline_send_recv_row_is_the_time_blocked_waiting():
    """Sends and receives in flight for most of the step (their gloo lifetimes: 180 us in a
    100 us step) count only where the rank waited in titanext:pp_wait (nested or overlapping
    ranges once: 10 + 15 us)."""
    from titanext.components.step_table import step_breakdown

    trace = {"traceEvents": [
        {"ph": "X", "name": "ProfilerStep#0", "ts": 0, "dur": 100, "tid": 1},
        {"ph": "X", "name": "titanext:pipeline", "ts": 0, "dur": 95, "tid": 1},
        {"ph": "X", "name": "c10d::recv_", "ts": 1, "dur": 1, "tid": 1},
        {"ph": "X", "name": "gloo:recv", "ts": 1, "dur": 90, "tid": 1},
        {"ph": "X", "name": "titanext:pp_wait", "ts": 5, "dur": 10, "tid": 1},
        {"ph": "X", "name": "titanext:pp_F/s0", "ts": 15, "dur": 40, "tid": 1},
        {"ph": "X", "name": "c10d::send", "ts": 56, "dur": 1, "tid": 1},
        {"ph": "X", "name": "gloo:send", "ts": 56, "dur": 90, "tid": 7},
        {"ph": "X", "name": "titanext:pp_wait", "ts": 70, "dur": 15, "tid": 1},
        {"ph": "X", "name": "titanext:pp_wait", "ts": 72, "dur": 5, "tid": 1}]}
    b = step_breakdown(trace)
    assert b["comm"] == {"PP send/recv": 0.025}
    assert b["pipeline"]["busy_ms"] == 0.04
