"""Each plugin works on a user's own nn.Module, without the trainer (the library route)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from tests.spawn import run_distributed
from titanext.plugins.activation_checkpoint import apply_activation_checkpointing
from titanext.plugins.compile import apply_compile


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class UserModel(nn.Module):
    """Not titanext's model: blocks live in `body`, not in `layers`."""

    def __init__(self, d: int = 32, n: int = 3):
        super().__init__()
        self.body = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 8)

    def forward(self, x):
        for b in self.body:
            x = b(x)
        return self.head(x)


def _reference(seed: int = 0):
    torch.manual_seed(seed)
    model = UserModel()
    x = torch.randn(8, 5, 32)
    return model, x


def _grads(model):
    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
            for n, p in model.named_parameters()}


def _ref_grads():
    model, x = _reference()
    model(x).square().mean().backward()
    return _grads(model)


def _fsdp_tp_body(rank, world_size, mode):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from titanext.plugins.fsdp import apply_fsdp
    from titanext.plugins.tensor_parallel import apply_tensor_parallel

    model, x = _reference()
    if mode == "fsdp":
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
        apply_fsdp(model, mesh, blocks=model.body)
        # The mean over a 1/W slice, averaged over W ranks by FSDP, is the global mean.
        x = x.chunk(world_size)[rank]
    else:
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
        plan = {"body.*.up": ColwiseParallel(), "body.*.down": RowwiseParallel()}
        apply_tensor_parallel(model, mesh, plan)
    model(x).square().mean().backward()
    return _grads(model)


@pytest.mark.parametrize("mode", ["fsdp", "tp"])
def test_fsdp_and_tp_on_user_model(mode):
    grads = run_distributed(_fsdp_tp_body, 2, args=(mode,))[0]
    for name, ref in _ref_grads().items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-7,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("mode,option", [("full", "op"), ("selective", "op"), ("selective", "2")])
def test_activation_checkpointing_on_user_model_keeps_gradients(mode, option):
    model, x = _reference()
    apply_activation_checkpointing(model, mode=mode, option=option, blocks=model.body)
    names_before = [n for n, _ in model.named_parameters()]
    model(x).square().mean().backward()
    assert [n for n, _ in model.named_parameters()] == names_before  # checkpoints stay compatible
    for name, ref in _ref_grads().items():
        torch.testing.assert_close(model.get_parameter(name).grad, ref,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_activation_checkpointing_saves_memory():
    """Full AC keeps fewer saved tensors alive between forward and backward."""

    def saved_bytes(model, x):
        total = []

        def pack(t):
            total.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(x).square().mean()
        out.backward()
        return sum(total)

    model, x = _reference()
    plain = saved_bytes(model, x)
    apply_activation_checkpointing(model, mode="full", blocks=model.body)
    assert saved_bytes(model, x) < plain / 2


def test_bad_ac_options_are_named():
    model, _ = _reference()
    with pytest.raises(ValueError, match="mode = 'sometimes'"):
        apply_activation_checkpointing(model, mode="sometimes", blocks=model.body)
    with pytest.raises(ValueError, match="selective_ac_option = 'x'"):
        apply_activation_checkpointing(model, mode="selective", option="x", blocks=model.body)
    with pytest.raises(ValueError, match="unknown aten op 'not_an_op'"):
        apply_activation_checkpointing(model, mode="selective", option="op", save_ops=["not_an_op"],
                                       blocks=model.body)
    with pytest.raises(ValueError, match="pass blocks="):
        apply_activation_checkpointing(model, mode="full")


def test_compile_each_block_of_user_model():
    model, x = _reference()
    ref = model(x)
    apply_compile(model, backend="inductor", blocks=model.body)
    names = [n for n, _ in model.named_parameters()]
    assert not any("_orig_mod" in n for n in names)
    torch.testing.assert_close(model(x), ref, rtol=1e-4, atol=1e-5)


# -- the whole recipe: titanext.distributed.parallelize.parallelize on a user's model -----------
class LayeredModel(nn.Module):
    """A user model that follows the block protocol (its blocks in ``layers``)."""

    def __init__(self, d: int = 32, n: int = 3):
        super().__init__()
        self.layers = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 8)

    def forward(self, x):
        for b in self.layers:
            x = b(x)
        return self.head(x)


def _init(model: nn.Module) -> None:
    """The user's own init, keyed by parameter name (the same on every rank and layout)."""
    with torch.no_grad():
        for i, (_, p) in enumerate(sorted(model.named_parameters())):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.1)


def _parallelize_body(rank, world_size):
    """FSDP x TP with full AC on `UserModel` (blocks passed explicitly, a real model), and
    ZeRO-1 with selective AC on `LayeredModel` built on meta and initialised by parallelize."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from titanext.config import ActivationCheckpoint, Parallelism
    from titanext.distributed.parallel_dims import ParallelDims
    from titanext.distributed.parallelize import parallelize

    out = {}
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, ep=1, world_size=world_size)
    dims.build_mesh("cpu")
    model, x = _reference()
    plan = {"body.*.up": ColwiseParallel(), "body.*.down": RowwiseParallel()}
    trained = parallelize(model, dims, activation_checkpoint=ActivationCheckpoint(mode="full"),
                          tp_plan=plan, blocks=model.body)
    assert trained is model
    trained(x.chunk(2)[dims.dp_mesh.get_local_rank()]).square().mean().backward()
    out["fsdp2_x_tp2_full_ac"] = _grads(model)

    dims = ParallelDims(dp_replicate=1, dp_shard=4, cp=1, tp=1, pp=1, ep=1, world_size=world_size)
    dims.build_mesh("cpu")
    with torch.device("meta"):
        model = LayeredModel()
    try:  # DDP needs real parameters
        parallelize(model, dims, parallelism=Parallelism(zero_stage=1))
    except ValueError as e:
        out["zero1_meta_error"] = str(e)
    with torch.device("meta"):
        model = LayeredModel()
    trained = parallelize(model, dims, parallelism=Parallelism(zero_stage=1), init_weights=_init,
                          activation_checkpoint=ActivationCheckpoint(mode="selective"))
    assert isinstance(trained, nn.parallel.DistributedDataParallel) and trained.module is model
    _, x = _reference()
    trained(x.chunk(4)[rank]).square().mean().backward()
    out["zero1_dp4_selective_ac_from_meta"] = _grads(model)
    return out


def test_parallelize_user_model_matches_one_process():
    """`parallelize(model, dims, ...)` on models that are not titanext's: every rank's full
    gradient equals one process's on the whole batch."""
    ref_a = _ref_grads()
    ref_model = LayeredModel()
    _init(ref_model)
    _, x = _reference()
    ref_model(x).square().mean().backward()
    ref_b = _grads(ref_model)
    per_rank = run_distributed(_parallelize_body, 4, timeout_s=120)
    for got in per_rank:
        assert "pass init_weights" in got["zero1_meta_error"]
        for case, ref in (("fsdp2_x_tp2_full_ac", ref_a),
                          ("zero1_dp4_selective_ac_from_meta", ref_b)):
            assert got[case].keys() == ref.keys(), case
            for name, want in ref.items():
                torch.testing.assert_close(got[case][name], want, rtol=1e-5, atol=1e-7,
                                           msg=lambda m, c=case, n=name: f"{c} {n}: {m}")

