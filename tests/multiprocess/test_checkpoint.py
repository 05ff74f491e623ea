"""CheckpointManager across gloo ranks: an FSDP save and load on 2 ranks restores every piece
of state (parameters, AdamW state, scheduler, loader, extra states, per-rank RNG) even after a
crashed save, a checkpoint saved under FSDP 4 loads under FSDP 2 x TP 2 on 4 ranks (AdamW's
state, with fp32 and with bf16 moments, and Muon's), ZeRO-1's optimizer state round-trips on 2
ranks and loads on 1 (also with bf16 moments), and a world-size-1 group saves and loads exactly.
Training is faked with the helpers of tests/unit/test_checkpoint.py (gradients a pointwise
function of the parameters), and every restored tensor must equal the saved one bitwise.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import titanext.components.checkpoint as ckpt_module
from tests.spawn import run_distributed
from tests.unit.test_checkpoint import (
    StubLoader,
    _assert_equal,
    _crash_after,
    _fake_step,
    _full,
    _lr_lambda,
    _snapshot,
    _tiny_model,
    _training,
)
from titanext.components.checkpoint import CheckpointManager


class Counter:
    """An extra state object."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def _fsdp(model: nn.Module, dp_mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def _tp(model: nn.Module, tp_mesh) -> nn.Module:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel()}
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, plan)
    return model


# -- FSDP round trip -------------------------------------------------------------------------------
def _fsdp_round_trip(rank, world_size, folder):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    model = _fsdp(_tiny_model(seed=0), mesh)
    counter = Counter()
    opt, sched, loader, ckpt = _training(model, folder, interval=2,
                                         extra_states={"counter": counter})
    torch.manual_seed(100 + rank)  # per-rank RNG streams: each rank must get its own back
    saved_at = []
    for step in (1, 2):
        _fake_step(model, opt, sched, loader)
        counter.value += 1
        if ckpt.maybe_save(step):
            saved_at.append(step)
    reference = _snapshot(model, opt)
    ref_sched, ref_loader = sched.state_dict(), loader.state_dict()
    ref_random = torch.rand(4)  # what the RNG draws right after the save
    # Training moves on, and Ctrl-C hits every rank during the next save.
    _fake_step(model, opt, sched, loader)
    real_save = ckpt_module.dcp.save
    ckpt_module.dcp.save = _crash_after(real_save)
    try:
        ckpt.maybe_save(3, last=True)  # the final step: saved despite the interval
    except KeyboardInterrupt:
        pass
    finally:
        ckpt_module.dcp.save = real_save
    dist.barrier()
    assert sorted(os.listdir(folder)) == ["step-2", "step-3.tmp"] and ckpt.latest_step() == 2

    # A restarted job: new objects, other weights, no optimizer state.
    fresh = _fsdp(_tiny_model(seed=1), mesh)
    fresh_counter = Counter()
    opt2, sched2, loader2, ckpt2 = _training(fresh, folder, extra_states={"counter": fresh_counter})
    assert ckpt2.load() == 2
    assert saved_at == [2]
    _assert_equal(reference, _snapshot(fresh, opt2))
    assert sched2.state_dict() == ref_sched
    assert sched2.get_last_lr() == pytest.approx([1e-2 / 3])
    assert loader2.state_dict() == ref_loader == {"position": 16}
    assert fresh_counter.value == 2
    assert torch.equal(torch.rand(4), ref_random)  # same world size: RNG restored
    return True


def test_fsdp_save_then_load_restores_every_piece_of_state_even_after_a_crashed_save(tmp_path):
    assert run_distributed(_fsdp_round_trip, 2, args=(str(tmp_path),)) == [True, True]


# -- resharding ------------------------------------------------------------------------------------
def _muon_training(model: nn.Module, folder: str):
    """_training with Muon on the blocks' matrices and AdamW on the rest (the shipped groups;
    float32 Newton-Schulz, so that the step after the load compares at 1e-6)."""
    from titanext.components.optim import build_optimizer
    from titanext.components.param_groups import param_groups

    named = list(model.named_parameters())
    groups = param_groups({n: tuple(p.shape) for n, p in named}, name="Muon")
    opt = build_optimizer(named, name="Muon", lr=1e-2, groups=groups, implementation="for-loop",
                          muon={"lr": 1e-2, "ns_dtype": torch.float32})
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda)
    loader = StubLoader()
    return opt, sched, loader, CheckpointManager(
        folder=folder, interval=1, keep_latest_k=0, load_step="latest", last_save=True,
        enable=True, model_parts=[model], optimizer=opt, lr_scheduler=sched, dataloader=loader)


def _bf16_training(model: nn.Module, folder: str):
    """_training with [optimizer] state_dtype = bfloat16: AdamW's moments in bf16."""
    return _training(model, folder, torch.bfloat16)


def _reshard(rank, world_size, folder):
    """AdamW, AdamW with bf16 moments, then Muon (its momentum buffers are DTensors sharded
    like their parameters), one after the other in one spawn."""
    from torch.distributed.device_mesh import init_device_mesh

    for kind, training in (("adamw", _training), ("adamw_bf16", _bf16_training),
                           ("muon", _muon_training)):
        fsdp_mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        model = _fsdp(_tiny_model(seed=0), fsdp_mesh)
        opt, sched, loader, ckpt = training(model, os.path.join(folder, kind))
        for _ in (1, 2):
            _fake_step(model, opt, sched, loader)
        ckpt.save(2)
        reference = _snapshot(model, opt)
        if kind == "muon":
            assert set(reference["optim"]["layers.0.attention.wq.weight"]) == {"momentum_buffer"}

        mesh_2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        resharded = _fsdp(_tp(_tiny_model(seed=1), mesh_2d["tp"]), mesh_2d["dp"])
        wq = resharded.layers["0"].attention.wq.weight
        assert wq.device_mesh.ndim == 2  # really FSDP 2 x TP 2
        opt2, sched2, loader2, ckpt2 = training(resharded, os.path.join(folder, kind))
        assert ckpt2.load() == 2
        _assert_equal(reference, _snapshot(resharded, opt2))
        if kind == "adamw_bf16":
            assert all(st["exp_avg"].dtype == torch.bfloat16 for st in opt2.state.values())

        # The restored optimizer state is live: one more step matches the original layout's.
        _fake_step(model, opt, sched, loader)
        _fake_step(resharded, opt2, sched2, loader2)
        for (name, a), (_, b) in zip(model.named_parameters(), resharded.named_parameters()):
            torch.testing.assert_close(_full(a), _full(b), rtol=1e-6, atol=1e-6,
                                       msg=f"{kind}: {name}")
    return True


@pytest.mark.torch_seam
def test_checkpoint_saved_under_fsdp4_loads_under_fsdp2_x_tp2(tmp_path):
    """AdamW's state (fp32 and, with [optimizer] state_dtype = bfloat16, bf16 moments) and
    Muon's reshard bitwise."""
    assert run_distributed(_reshard, 4, args=(str(tmp_path),)) == [True] * 4


# -- ZeRO-1 ----------------------------------------------------------------------------------------
def _zero1_training(folder: str, seed: int, state_dtype: str = "float32"):
    from torch.nn.parallel import DistributedDataParallel

    from titanext.components.optim import build_optimizer

    model = _tiny_model(seed)
    DistributedDataParallel(model)  # broadcasts rank 0's weights, as in training
    opt = build_optimizer(model.parameters(), lr=1e-2, weight_decay=0.1,
                          zero1_group=dist.group.WORLD, state_dtype=state_dtype)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda)
    loader = StubLoader()
    ckpt = CheckpointManager(folder=folder, interval=1, keep_latest_k=0, load_step="latest",
                             last_save=True, enable=True, model_parts=[model], optimizer=opt,
                             lr_scheduler=sched, dataloader=loader)
    return model, opt, sched, loader, ckpt


def _consolidated(opt) -> dict | None:
    opt.consolidate_state_dict(to=0)
    return opt.state_dict() if dist.get_rank() == 0 else None


def _zero1_save_then_load(rank, world_size, folder, state_dtype):
    model, opt, sched, loader, ckpt = _zero1_training(folder, 0, state_dtype)
    for _ in (1, 2):
        _fake_step(model, opt, sched, loader)
    assert opt.optim.state, "each rank holds a partition of the optimizer state"
    ckpt.save(2)
    saved = {"optim": _consolidated(opt),
             "params": {n: _full(p) for n, p in model.named_parameters()}}
    loaded = _zero1_load(rank, world_size, folder, state_dtype)
    if rank == 0:
        _assert_equal(saved["optim"], loaded["optim"])
    _assert_equal(saved["params"], loaded["params"])
    assert loaded["step"] == 2 and loaded["position"] == 16 and not loaded["warnings"]
    return saved


def _zero1_load(rank, world_size, folder, state_dtype):
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("titanext").addHandler(handler)
    model, opt, sched, loader, ckpt = _zero1_training(folder, 1, state_dtype)
    step = ckpt.load()
    logging.getLogger("titanext").removeHandler(handler)
    dtypes = {s[k].dtype for s in opt.optim.state.values() for k in ("exp_avg", "exp_avg_sq")}
    assert dtypes == {getattr(torch, state_dtype)}, dtypes
    return {"step": step, "optim": _consolidated(opt), "warnings": records,
            "params": {n: _full(p) for n, p in model.named_parameters()},
            "position": loader.position}


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_zero1_optimizer_state_round_trips_on_the_same_and_a_smaller_dp_size(tmp_path,
                                                                             state_dtype):
    saved = run_distributed(_zero1_save_then_load, 2, args=(str(tmp_path), state_dtype))[0]
    assert os.path.exists(tmp_path / "step-2" / "zero1_optimizer.pt")
    # One rank now owns the whole state: load_state_dict re-partitions the consolidated file.
    loaded = run_distributed(_zero1_load, 1, args=(str(tmp_path), state_dtype))[0]
    assert loaded["step"] == 2 and loaded["position"] == 16
    _assert_equal(saved["optim"], loaded["optim"])
    _assert_equal(saved["params"], loaded["params"])
    assert any("RNG state is not restored" in m for m in loaded["warnings"])

# -- a world-size-1 process group ------------------------------------------------------------------
def _world_of_one(rank, world_size, folder):
    model = _tiny_model(seed=0)
    opt, sched, loader, ckpt = _training(model, folder)
    _fake_step(model, opt, sched, loader)
    ckpt.save(1)
    reference, ref_random = _snapshot(model, opt), torch.rand(2)
    fresh = _tiny_model(seed=1)
    opt2, _, loader2, ckpt2 = _training(fresh, folder)
    assert ckpt2.load() == 1 and loader2.position == 8
    _assert_equal(reference, _snapshot(fresh, opt2))
    assert torch.equal(torch.rand(2), ref_random)
    return True


def test_world_size_one_process_group(tmp_path):
    assert run_distributed(_world_of_one, 1, args=(str(tmp_path),)) == [True]
