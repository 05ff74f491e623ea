"""``titanext-run``: validate for torchrun's world size, exit 2 before any worker starts.

Most cases call ``main`` in this process with the hand-over to torchrun replaced, so a bad config
is proven to stop before torchrun runs at all; one case runs the real command end to end (as
``python -m titanext.launch``, the same entry as the console script).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import titanext.launch.run as launcher
from tests import REPO_ROOT

ROOT = REPO_ROOT
DEBUG = str(ROOT / "train_configs" / "debug_model.toml")
MOE = str(ROOT / "train_configs" / "debug_moe.toml")


@pytest.fixture
def handed_over(monkeypatch):
    calls = []
    monkeypatch.setattr(launcher, "_hand_over", lambda args: calls.append(args) or 0)
    return calls


def _launch(capsys, *argv):
    code = launcher.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_split_argv_separates_torchrun_options_from_titanext_arguments():
    assert launcher.split_argv(["--nnodes", "2", "--rdzv-endpoint", "host.example:29400",
                                "--config", "a.toml", "--training.steps", "3"]) == (
        ["--nnodes", "2", "--rdzv-endpoint", "host.example:29400"],
        ["--config", "a.toml", "--training.steps", "3"])
    assert launcher.split_argv(["--standalone", "--", "--config=a.toml"]) == (
        ["--standalone"], ["--config=a.toml"])


def test_world_size_is_nnodes_times_nproc_per_node_or_the_largest_of_a_range():
    assert launcher.world_size_of("2", "4") == (8, None)
    assert launcher.world_size_of("3:3", "2") == (6, None)
    size, note = launcher.world_size_of("1:4", "2")
    assert size == 8 and "largest world size, 4 x 2 = 8" in note
    assert launcher.world_size_of("1", "cpu")[0] == os.cpu_count()


@pytest.mark.parametrize("torchrun, overrides, expected", [
    (["--nproc_per_node", "4"], ["--parallelism.tensor_parallel_degree=3"],
     "cannot fill the rest of the world size 4"),
    (["--nnodes", "2", "--nproc_per_node", "4"], ["--training.global_batch_size=48"],
     "training.global_batch_size = 48 must be a multiple of local_batch_size(4) x dp(8) = 32"),
    (["--nproc_per_node=2"], ["--parallelism.pipeline_parallel_degree=4"], "world size 2"),
    (["--nproc-per-node", "2"], ["--parallelism.pipeline_parallel_degree=2",
                                 "--parallelism.pipeline_parallel_microbatches=3"],
     "divisible by parallelism.pipeline_parallel_microbatches = 3"),
    (["--nproc_per_node", "2"], ["--config", MOE, "--parallelism.expert_parallel_degree=4"],
     "parallelism.expert_parallel_degree = 4 must divide data_parallel_shard_degree(2)"),
])
def test_world_size_rules_exit_2_before_torchrun_starts(capsys, handed_over, tmp_path, torchrun,
                                                        overrides, expected):
    config = [] if "--config" in overrides else ["--config", DEBUG]
    code, out, err = _launch(capsys, "--standalone", *torchrun, *config,
                             f"--job.dump_folder={tmp_path / 'job'}", *overrides)
    assert code == 2 and handed_over == []
    lines = err.strip().splitlines()
    assert lines and all(ln.startswith("titanext: config error: ") for ln in lines), err
    assert any(expected in ln for ln in lines), err
    assert not (tmp_path / "job").exists()  # nothing written


def test_a_good_config_hands_over_to_torchrun_with_the_train_module(capsys, handed_over, tmp_path):
    code, out, err = _launch(capsys, "--standalone", "--nproc_per_node", "2", "--max-restarts=1",
                             "--config", DEBUG, f"--job.dump_folder={tmp_path}",
                             "--training.steps", "3")
    assert code == 0 and err == ""
    [args] = handed_over
    assert (args.module, args.training_script, args.nproc_per_node, args.max_restarts) == (
        True, "titanext.train", "2", 1)
    assert args.training_script_args == ["--config", DEBUG, f"--job.dump_folder={tmp_path}",
                                         "--training.steps", "3"]


def test_an_elastic_node_range_is_checked_with_its_largest_world_size(capsys, handed_over,
                                                                      tmp_path):
    code, out, err = _launch(capsys, "--nnodes", "1:2", "--nproc_per_node", "2", "--config", DEBUG,
                             f"--job.dump_folder={tmp_path}",
                             "--parallelism.tensor_parallel_degree=4")
    assert code == 0 and "checked for the largest world size, 2 x 2 = 4" in out
    code, out, err = _launch(capsys, "--nnodes", "1:2", "--nproc_per_node", "2", "--config", DEBUG,
                             f"--job.dump_folder={tmp_path}",
                             "--parallelism.tensor_parallel_degree=8")
    assert code == 2 and "world size 4" in err


def test_unwritable_output_folder_exits_2_naming_the_path(capsys, handed_over, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    code, out, err = _launch(capsys, "--nproc_per_node", "2", "--config", DEBUG,
                             f"--job.dump_folder={blocker / 'dump'}")
    assert code == 2 and handed_over == []
    [line] = err.strip().splitlines()
    assert line.startswith(f"titanext: config error: job.dump_folder = '{blocker / 'dump'}': "
                           "cannot create this folder")


def test_missing_config_and_bad_nproc_exit_2(capsys, handed_over):
    assert _launch(capsys, "--nproc_per_node", "2")[0] == 2
    code, _, err = _launch(capsys, "--nproc_per_node", "lots", "--config", DEBUG)
    assert code == 2 and "--nproc_per_node 'lots'" in err and handed_over == []


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.mark.slow
def test_the_real_command_validates_then_trains(tmp_path):
    def run(*extra):
        return subprocess.run(
            [sys.executable, "-m", "titanext.launch", "--standalone", "--nproc_per_node", "2",
             "--config", DEBUG, f"--job.dump_folder={tmp_path}", "--training.steps=2",
             "--training.seq_len=32", "--metrics.enable_tensorboard=false", *extra],
            capture_output=True, text=True, timeout=300, cwd=ROOT, env=_env())

    bad = run("--parallelism.tensor_parallel_degree=3")
    assert bad.returncode == 2
    assert all(ln.startswith("titanext: config error: ") for ln in bad.stderr.strip().splitlines())
    assert bad.stdout == ""  # no worker, no torchrun banner
    good = run()
    assert good.returncode == 0, good.stderr[-3000:]
    assert "titanext: done, 2 steps" in good.stdout
