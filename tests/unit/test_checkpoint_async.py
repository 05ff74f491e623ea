"""Async checkpoint saves and the weights-only last save, in one process.

An async save is committed only once its write has finished (the manifest is written last, by
:meth:`CheckpointManager.wait`); a job that stops before that leaves a ``step-N.tmp`` folder
that a resume skips, saying so. A weights-only save holds the model in ``export_dtype``: it
starts a new run (``initial_load_path``) and converts to HF, and refuses to resume. The
resume-equals-uninterrupted check across FSDP, TP, PP and EP is in
tests/multiprocess/test_resume.py.
"""

from __future__ import annotations

import os
from concurrent.futures import Future

import pytest
import torch

import titanext.components.checkpoint_async as ckpt_async
from tests.unit.test_checkpoint import TINY, _fake_step, _single_process, _snapshot
from titanext.errors import CheckpointError, CheckpointMismatch


def _never_completes(write: bool):
    """An async_save whose write never finishes, as in a job killed mid-save; with ``write``
    the shards are on disk (DCP's writer got through), yet the future is never resolved."""
    real = ckpt_async.dcp.save

    def fake(state, *, checkpoint_id, process_group=None, **_options):
        if write:
            real(state, checkpoint_id=checkpoint_id, process_group=process_group)
        return Future()

    return fake


@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
def test_async_save_is_committed_by_wait_and_restores_the_staged_state(tmp_path, mode):
    model, opt, sched, loader, ckpt = _single_process(tmp_path, async_mode=mode)
    _fake_step(model, opt, sched, loader)
    ckpt.save(1)
    reference = _snapshot(model, opt)
    _fake_step(model, opt, sched, loader)  # training goes on while the write may be in flight
    ckpt.wait()
    assert ckpt.complete_steps() == [1]
    ckpt.close()

    model2, opt2, _sched2, loader2, ckpt2 = _single_process(tmp_path, seed=1, async_mode=mode)
    assert ckpt2.load() == 1
    got = _snapshot(model2, opt2)
    for what in ("params", "optim"):
        for name, want in reference[what].items():
            value = got[what][name]
            assert (torch.equal(value, want) if what == "params" else
                    all(torch.equal(value[k], want[k]) for k in want)), f"{what} {name}"
    assert loader2.position == 8
    ckpt2.close()


@pytest.mark.parametrize("write", [False, True], ids=["nothing-written", "shards-written"])
def test_a_job_stopped_during_an_async_save_resumes_the_previous_step(tmp_path, monkeypatch,
                                                                      capsys, write):
    model, opt, sched, loader, ckpt = _single_process(tmp_path, async_mode="async")
    _fake_step(model, opt, sched, loader)
    ckpt.save(1)
    reference = _snapshot(model, opt)
    _fake_step(model, opt, sched, loader)
    monkeypatch.setattr(ckpt_async.dcp, "async_save", _never_completes(write))
    ckpt.save(2)  # commits step 1, starts step 2, whose write never finishes
    assert ckpt.complete_steps() == [1]
    assert os.path.isdir(tmp_path / "step-2.tmp") and not os.path.exists(tmp_path / "step-2")
    monkeypatch.undo()
    del ckpt  # the job is gone: nobody calls wait()

    model2, opt2, *_rest, ckpt2 = _single_process(tmp_path, seed=1, async_mode="async")
    assert ckpt2.load() == 1
    out = capsys.readouterr().out
    assert f"skipping {tmp_path / 'step-2'}.tmp: its save never completed" in out, out
    assert "resuming step 1" in out
    got = _snapshot(model2, opt2)["params"]
    assert all(torch.equal(got[n], w) for n, w in reference["params"].items())
    ckpt2.save(3)  # the next save removes the leftover
    ckpt2.close()
    assert sorted(os.listdir(tmp_path)) == ["step-1", "step-3"]


def test_a_failed_async_write_raises_and_commits_nothing(tmp_path, monkeypatch):
    model, opt, sched, loader, ckpt = _single_process(tmp_path, async_mode="async")

    def failing(*_args, **_kwargs):
        future: Future = Future()
        future.set_exception(OSError("No space left on device"))
        return future

    monkeypatch.setattr(ckpt_async.dcp, "async_save", failing)
    ckpt.save(1)
    with pytest.raises(CheckpointError, match=r"async save of step 1 failed on rank 0 \(OSError: "
                                              r"No space left on device\).*not committed"):
        ckpt.wait()
    assert ckpt.complete_steps() == []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_weights_only_last_save_starts_a_new_run_and_converts_to_hf(tmp_path, dtype):
    from safetensors.torch import load_file

    from tests.unit.test_checkpoint import _tiny_model
    from titanext.hf.checkpoint import load_initial_weights, to_hf_state_dict
    from titanext.hf.convert import dcp_to_hf

    folder = tmp_path / "ckpt"
    model, opt, sched, loader, ckpt = _single_process(folder, model_weights_only=True,
                                                      export_dtype=dtype, interval=100)
    _fake_step(model, opt, sched, loader)
    assert ckpt.maybe_save(1, last=True)
    exported = {n: p.detach().to(getattr(torch, dtype)) for n, p in model.named_parameters()}
    path = str(folder / "step-1")
    assert sorted(os.listdir(path)) == [".metadata", "__0_0.distcp", "manifest.json"]

    fresh = _tiny_model(seed=1)  # a new run from the export (fp32 parameters)
    load_initial_weights([fresh], path, TINY, in_hf=False)
    for name, p in fresh.named_parameters():
        assert p.dtype == torch.float32
        assert torch.equal(p, exported[name].float()), name

    assert dcp_to_hf(path, str(tmp_path / "hf"), model_args=TINY, progress=False) > 0
    hf = load_file(str(tmp_path / "hf" / "model.safetensors"))
    for name, t in exported.items():
        for hf_name, want in dict(to_hf_state_dict(name, t, TINY)).items():
            assert hf[hf_name].dtype == want.dtype and torch.equal(hf[hf_name], want), hf_name

    from titanext.components.checkpoint import resume_problems
    from titanext.config import load_config

    cfg = load_config(None, ["--checkpoint.enable=true", f"--job.dump_folder={tmp_path}",
                             "--checkpoint.folder=ckpt"], world_size=1)
    (problem,) = resume_problems(cfg)  # refused before any process starts
    assert problem.startswith("checkpoint.load_step = 'latest': checkpoint ") and (
        "holds model weights only" in problem), problem
    _model2, *_rest, ckpt2 = _single_process(folder, seed=1)
    with pytest.raises(CheckpointMismatch, match="holds model weights only .* cannot resume "
                                                 "training; start a new run from it with "
                                                 "--checkpoint.initial_load_path="):
        ckpt2.load()


def test_config_rules_for_async_and_weights_only():
    from titanext.config import load_config
    from titanext.errors import ConfigError

    cfg = load_config(None, ["--checkpoint.enable=true", "--checkpoint.async_mode=async",
                             "--checkpoint.model_weights_only=true",
                             "--checkpoint.export_dtype=bfloat16"], world_size=1)
    assert (cfg.checkpoint.async_mode, cfg.checkpoint.export_dtype) == ("async", "bfloat16")
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--checkpoint.enable=true", "--checkpoint.async_mode=background",
                           "--checkpoint.export_dtype=bfloat16"], world_size=1)
    lines = str(e.value).splitlines()
    assert any("checkpoint.async_mode" in line and "'background'" in line
               and "async_with_pinned_mem" in line for line in lines), lines
    assert any("checkpoint.export_dtype = 'bfloat16' applies only to the weights-only last save"
               in line and "model_weights_only = true" in line for line in lines), lines
    with pytest.raises(ConfigError, match="model_weights_only = true needs checkpoint.enable = "
                                          "true and checkpoint.last_save = true"):
        load_config(None, ["--checkpoint.model_weights_only=true"], world_size=1)
    with pytest.raises(ConfigError, match="export_dtype.*'fp8'"):
        load_config(None, ["--checkpoint.export_dtype=fp8"], world_size=1)
