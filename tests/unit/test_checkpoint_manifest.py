"""Checkpoint manifest and named errors: another model, a damaged newest step, a missing step.

Every error names what to do next, happens before anything is loaded, and is the same on every
rank (tests/multiprocess/test_checkpoint_manifest.py checks it on two ranks: it would hang if
one rank raised and the other waited).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from titanext.components.checkpoint import CheckpointManager, manifest_info, resume_problems
from titanext.config import JobConfig
from titanext.errors import CheckpointCorrupt, CheckpointMismatch, CheckpointNotFound
from titanext.models import ModelArgs
from titanext.models.llama import Transformer

SMALL = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=264, multiple_of=32)
WIDER = ModelArgs(dim=96, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=264, multiple_of=32)


def _cfg(flavor: str, dump: str = "out") -> JobConfig:
    cfg = JobConfig()
    cfg.model.flavor = flavor
    cfg.job.dump_folder = dump
    cfg.checkpoint.enable = True
    return cfg


def _manager(folder, args=SMALL, flavor="debugtiny", load_step="latest", seed=0):
    model = Transformer(args)
    model.init_weights(seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = CheckpointManager(folder=str(folder), interval=1, keep_latest_k=0, load_step=load_step,
                             last_save=True, enable=True, model_parts=[model], optimizer=opt,
                             lr_scheduler=None, dataloader=None,
                             manifest=manifest_info(_cfg(flavor), {"dp_shard": 1}))
    return model, ckpt


def _save_steps(folder, steps=(5, 10)):
    model, ckpt = _manager(folder)
    for step in steps:
        ckpt.save(step)
    return model


def _shard(step_dir) -> str:
    return sorted(n for n in os.listdir(step_dir) if n.endswith(".distcp"))[0]


def test_manifest_records_config_model_shapes_layout_versions_and_file_sizes(tmp_path):
    model = _save_steps(tmp_path, steps=(1,))
    manifest = json.loads((tmp_path / "step-1" / "manifest.json").read_text())
    assert manifest["model"] == {"name": "llama3", "flavor": "debugtiny"}
    assert manifest["config"]["model"]["flavor"] == "debugtiny"
    assert manifest["layout"] == {"world_size": 1, "dp_shard": 1}
    assert manifest["versions"]["torch"] == torch.__version__ and manifest["versions"]["titanext"]
    assert manifest["shapes"]["tok_embeddings.weight"] == list(model.tok_embeddings.weight.shape)
    assert manifest["files"][".metadata"] == os.path.getsize(tmp_path / "step-1" / ".metadata")


def test_another_flavor_names_both_flavors_before_loading(tmp_path):
    _save_steps(tmp_path, steps=(1,))
    model, ckpt = _manager(tmp_path, args=WIDER, flavor="debugmodel")
    before = model.tok_embeddings.weight.detach().clone()
    with pytest.raises(CheckpointMismatch, match=r"saved for llama3/debugtiny and this run builds "
                                                 r"llama3/debugmodel"):
        ckpt.load()
    assert torch.equal(model.tok_embeddings.weight, before)  # nothing was loaded


def test_other_shapes_under_the_same_flavor_name_the_tensor(tmp_path):
    _save_steps(tmp_path, steps=(1,))
    _, ckpt = _manager(tmp_path, args=WIDER, flavor="debugtiny")
    with pytest.raises(CheckpointMismatch, match=r"tok_embeddings.weight has shape \[264, 64\] in "
                                                 r"the checkpoint and \[264, 96\] in this model"):
        ckpt.load()


@pytest.mark.parametrize("damage", ["truncated shard", "missing .metadata"])
def test_damaged_newest_step_is_an_error_naming_folder_file_and_fallback(tmp_path, damage):
    _save_steps(tmp_path)
    newest = tmp_path / "step-10"
    if damage == "truncated shard":
        name = _shard(newest)
        data = (newest / name).read_bytes()
        (newest / name).write_bytes(data[: len(data) // 2])
    else:
        name = ".metadata"
        (newest / name).unlink()
    _, ckpt = _manager(tmp_path, seed=1)
    with pytest.raises(CheckpointCorrupt) as info:
        ckpt.load()  # never a silent step back to step 5
    message = str(info.value)
    assert str(newest) in message and repr(name) in message
    assert "--checkpoint.load_step=5" in message
    _, older = _manager(tmp_path, seed=1, load_step=5)
    assert older.load() == 5  # the fallback the message names works


def test_missing_step_lists_the_available_steps(tmp_path):
    _save_steps(tmp_path)
    _, ckpt = _manager(tmp_path, load_step=7)
    with pytest.raises(CheckpointNotFound, match=r"load_step = 7: .*available steps: 5, 10"):
        ckpt.load()


def test_resume_problems_are_found_before_any_process_starts(tmp_path):
    dump = tmp_path / "job"
    _save_steps(dump / "checkpoint")
    cfg = _cfg("debugtiny", str(dump))
    assert resume_problems(cfg) == []
    cfg.checkpoint.load_step = 7
    [line] = resume_problems(cfg)
    assert line.startswith("checkpoint.load_step = 7:") and line.endswith("available steps: 5, 10")
    cfg.checkpoint.load_step = "latest"
    cfg.model.flavor = "debugmodel"
    [line] = resume_problems(cfg)
    assert line.startswith("model.flavor = 'debugmodel':") and "llama3/debugtiny" in line
    (dump / "checkpoint" / "step-10" / ".metadata").unlink()
    cfg.model.flavor = "debugtiny"
    [line] = resume_problems(cfg)
    assert "step-10" in line and "'.metadata' is missing" in line
    cfg.checkpoint.load_step = "none"
    assert resume_problems(cfg) == []


def _scheduled(folder, steps: int, lr: float, load_step="latest"):
    from titanext.components.optim import build_lr_scheduler

    model = Transformer(SMALL)
    model.init_weights(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = build_lr_scheduler(opt, warmup_steps=2, total_steps=steps, decay_type="linear")
    cfg = _cfg("debugtiny")
    cfg.training.steps, cfg.optimizer.lr = steps, lr
    ckpt = CheckpointManager(folder=str(folder), interval=1, keep_latest_k=0, load_step=load_step,
                             last_save=True, enable=True, model_parts=[model], optimizer=opt,
                             lr_scheduler=sched, dataloader=None, manifest=manifest_info(cfg))
    return opt, sched, ckpt


def test_resume_follows_the_current_configs_schedule_and_names_the_changes(tmp_path, capsys):
    opt, sched, ckpt = _scheduled(tmp_path, steps=10, lr=8e-4)
    for _ in range(10):
        opt.step()
        sched.step()
    ckpt.save(10)
    assert sched.get_last_lr()[0] == 0.0  # the end of a 10-step linear decay
    # The reference: a 20-step run at lr 1e-3, at the start of step 11.
    ref_opt, ref_sched, _ = _scheduled(tmp_path / "ref", steps=20, lr=1e-3)
    for _ in range(10):
        ref_opt.step()
        ref_sched.step()
    expected = ref_sched.get_last_lr()[0]
    assert expected > 0
    capsys.readouterr()
    opt2, sched2, ckpt2 = _scheduled(tmp_path, steps=20, lr=1e-3)
    assert ckpt2.load() == 10
    assert sched2.get_last_lr() == [expected]
    assert [g["lr"] for g in opt2.param_groups] == [expected]
    opt2.step()
    sched2.step()
    ref_opt.step()
    ref_sched.step()
    assert sched2.get_last_lr() == ref_sched.get_last_lr()  # and the schedule continues alike
    out = capsys.readouterr().out
    assert "with a changed config" in out
    assert "optimizer.lr 0.0008 -> 0.001" in out and "training.steps 10 -> 20" in out
