"""CheckpointManager in one process: atomic commits, step resolution, pruning, pipeline stages.

Training is faked with gradients that are a pointwise function of the parameters
(``grad = 0.5 * p + 0.1``), so every layout computes the same update and no forward pass is
needed. References are full tensors (``full_tensor()``) taken right before the save. The
round trips across ranks (FSDP, resharding, ZeRO-1, a world of one) are in
tests/multiprocess/test_checkpoint.py, which shares these helpers.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import titanext.components.checkpoint as ckpt_module
from titanext.components.checkpoint import CheckpointManager
from titanext.components.lowp_adam import LowPrecisionStateAdamW
from titanext.models import ModelArgs

TINY = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=264, multiple_of=32)


# -- a tiny training setup, shared with tests/multiprocess/test_checkpoint.py ----------------------
class StubLoader:
    """A data loader position: the same on every rank, whatever the layout."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def _lr_lambda(step: int) -> float:
    return 1.0 / (step + 1)


def _tiny_model(seed: int) -> nn.Module:
    from titanext.models.llama import Transformer

    model = Transformer(TINY)
    model.init_weights(seed=seed)  # layout-invariant: the same values before and after sharding
    return model


def _training(model: nn.Module, folder: str, state_dtype: torch.dtype = torch.float32,
              **manager_kwargs):
    # for-loop AdamW: FSDP x TP mixes DTensors of 1D and 2D meshes in one group.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    if state_dtype != torch.float32:  # [optimizer] state_dtype
        opt = LowPrecisionStateAdamW(model.parameters(), lr=1e-2, weight_decay=0.1,
                                     state_dtype=state_dtype)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda)
    loader = StubLoader()
    kwargs = dict(folder=folder, interval=1, keep_latest_k=0, load_step="latest", last_save=True,
                  enable=True, model_parts=[model], optimizer=opt, lr_scheduler=sched,
                  dataloader=loader)
    kwargs.update(manager_kwargs)
    return opt, sched, loader, CheckpointManager(**kwargs)


def _fake_step(model: nn.Module, opt, sched, loader: StubLoader) -> None:
    for p in model.parameters():
        p.grad = p.detach() * 0.5 + 0.1  # a DTensor for a DTensor parameter, same placements
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    loader.position += 8


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _snapshot(model: nn.Module, opt) -> dict:
    """Full parameters and AdamW state by parameter name."""
    params = {name: _full(p) for name, p in model.named_parameters()}
    optim = {name: {k: _full(v) for k, v in opt.state[p].items()}
             for name, p in model.named_parameters()}
    return {"params": params, "optim": optim}


def _assert_equal(a, b, path: str = "") -> None:
    """Recursive equality: tensors bitwise, everything else with ==."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), f"tensors differ at {path}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"keys differ at {path}: {a.keys() ^ b.keys()}"
        for k in a:
            _assert_equal(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"lengths differ at {path}"
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{path}/{i}")
    else:
        assert a == b, f"{a!r} != {b!r} at {path}"


def _crash_after(real):
    def crash(*args, **kwargs):
        real(*args, **kwargs)
        raise KeyboardInterrupt  # Ctrl-C once the shards are written, before the commit
    return crash


# -- atomicity and step resolution (one process, no process group) ---------------------------------
def _single_process(folder, seed=0, **kwargs):
    model = _tiny_model(seed)
    opt, sched, loader, ckpt = _training(model, str(folder), **kwargs)
    return model, opt, sched, loader, ckpt


def test_crash_during_save_keeps_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    model, opt, sched, loader, ckpt = _single_process(tmp_path)
    _fake_step(model, opt, sched, loader)
    ckpt.save(1)
    reference = _snapshot(model, opt)
    _fake_step(model, opt, sched, loader)
    with monkeypatch.context() as patch:
        patch.setattr(ckpt_module.dcp, "save", _crash_after(ckpt_module.dcp.save))
        with pytest.raises(KeyboardInterrupt):
            ckpt.save(2)
    assert sorted(os.listdir(tmp_path)) == ["step-1", "step-2.tmp"]
    assert ckpt.latest_step() == 1  # the .tmp folder is never a checkpoint

    fresh, opt2, _, loader2, ckpt2 = _single_process(tmp_path, seed=1)
    assert ckpt2.load() == 1 and loader2.position == 8
    _assert_equal(reference, _snapshot(fresh, opt2))

    ckpt2.save(3)  # the next save removes the stale .tmp
    assert sorted(os.listdir(tmp_path)) == ["step-1", "step-3"]


def test_crash_at_the_commit_rename_leaves_no_partial_step(tmp_path, monkeypatch):
    model, opt, sched, loader, ckpt = _single_process(tmp_path)
    ckpt.save(1)

    def refuse(src, dst):
        raise OSError("disk went away")

    with monkeypatch.context() as patch:
        patch.setattr(ckpt_module.os, "replace", refuse)
        with pytest.raises(OSError, match="disk went away"):
            ckpt.save(2)
    assert not (tmp_path / "step-2").exists() and (tmp_path / "step-2.tmp").exists()
    assert ckpt.latest_step() == 1


def test_keep_latest_k_prunes_older_checkpoints(tmp_path):
    model, opt, sched, loader, ckpt = _single_process(tmp_path, keep_latest_k=2)
    for step in range(1, 5):
        _fake_step(model, opt, sched, loader)
        ckpt.save(step)
    assert ckpt.complete_steps() == [3, 4]
    assert sorted(os.listdir(tmp_path)) == ["step-3", "step-4"]


def test_maybe_save_follows_the_interval_and_last_save(tmp_path):
    *_, ckpt = _single_process(tmp_path, interval=3, last_save=True)
    assert [s for s in range(1, 8) if ckpt.maybe_save(s, last=s == 7)] == [3, 6, 7]
    *_, no_last = _single_process(tmp_path / "b", interval=3, last_save=False)
    assert not no_last.maybe_save(7, last=True)


def test_load_step_latest_int_none_and_missing(tmp_path):
    model, opt, sched, loader, ckpt = _single_process(tmp_path)
    for step in (2, 5):
        _fake_step(model, opt, sched, loader)
        ckpt.save(step)
    (tmp_path / "step-9.tmp").mkdir()  # an interrupted save: never "latest"
    assert ckpt.latest_step() == 5

    for load_step, expected_step, expected_position in (("latest", 5, 16), (-1, 5, 16),
                                                         (2, 2, 8), ("none", 0, 0)):
        *_, loader2, ckpt2 = _single_process(tmp_path, seed=1, load_step=load_step)
        assert ckpt2.load() == expected_step
        assert loader2.position == expected_position

    *_, missing = _single_process(tmp_path, load_step=3)
    with pytest.raises(ValueError, match=r"step-3 in .*available steps: 2, 5"):
        missing.load()
    *_, empty = _single_process(tmp_path / "nothing", load_step="latest")
    assert empty.load() == 0 and empty.latest_step() is None
    with pytest.raises(ValueError, match="load_step"):
        _single_process(tmp_path, load_step="newest")


def test_resaving_an_existing_step_replaces_it(tmp_path):
    model, opt, sched, loader, ckpt = _single_process(tmp_path)
    ckpt.save(1)
    _fake_step(model, opt, sched, loader)
    ckpt.save(1)  # e.g. a resumed run saving the same step again
    assert sorted(os.listdir(tmp_path)) == ["step-1"]
    *_, loader2, ckpt2 = _single_process(tmp_path, seed=1)
    assert ckpt2.load() == 1 and loader2.position == 8


def test_disabled_manager_does_nothing(tmp_path):
    model, opt, sched, loader, ckpt = _single_process(tmp_path / "ckpt", enable=False)
    assert not ckpt.maybe_save(1) and ckpt.load() == 0
    ckpt.save(1)
    assert not (tmp_path / "ckpt").exists()


def _pipeline_stages(model: nn.Module) -> list[nn.Module]:
    """Two stages that keep the full model's FQNs, as a pipeline split does."""
    first, second = copy.deepcopy(model), copy.deepcopy(model)
    del first.layers["1"]
    first.norm, first.output = None, None
    del second.layers["0"]
    second.tok_embeddings = None
    return [first, second]


def test_pipeline_stage_checkpoint_loads_into_the_whole_model(tmp_path):
    stages = _pipeline_stages(_tiny_model(seed=0))
    params = [p for stage in stages for p in stage.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda)
    for p in params:
        p.grad = p.detach() * 0.5 + 0.1
    opt.step()
    CheckpointManager(folder=str(tmp_path), interval=1, keep_latest_k=0, load_step="latest",
                      last_save=True, enable=True, model_parts=stages, optimizer=opt,
                      lr_scheduler=sched, dataloader=None).save(1)
    reference = {}
    for stage in stages:
        reference.update(_snapshot(stage, opt)["params"])

    whole, opt2, *_, ckpt2 = _single_process(tmp_path, seed=1)
    assert ckpt2.load() == 1
    snapshot = _snapshot(whole, opt2)
    _assert_equal(reference, snapshot["params"])
    exp_avg = dict(zip([n for s in stages for n, _ in s.named_parameters()],
                       [opt.state[p]["exp_avg"] for p in params]))
    _assert_equal(exp_avg, {n: s["exp_avg"] for n, s in snapshot["optim"].items()})
