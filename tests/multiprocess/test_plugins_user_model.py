"""The plugins on a user's own nn.Module across gloo ranks, without the trainer (the library
route): FSDP and TP on 2 ranks, and ``parallelize`` on 4 (FSDP 2 x TP 2 with full AC on a model
whose blocks are passed explicitly, ZeRO-1 with selective AC on a meta model initialised by
parallelize), give every rank the full gradients one process computes on the whole batch
(1e-5). The models and the single-process plugins: tests/unit/test_plugins_user_model.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.spawn import run_distributed
from tests.unit.test_plugins_user_model import Block, _grads, _ref_grads, _reference


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

    from titanext.config import Recipe
    from titanext.distributed.parallel_dims import ParallelDims
    from titanext.distributed.parallelize import parallelize

    out = {}
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, ep=1, world_size=world_size)
    dims.build_mesh("cpu")
    model, x = _reference()
    plan = {"body.*.up": ColwiseParallel(), "body.*.down": RowwiseParallel()}
    trained = parallelize(model, dims, Recipe(ac="full"), tp_plan=plan, blocks=model.body)
    assert trained is model
    trained(x.chunk(2)[dims.dp_mesh.get_local_rank()]).square().mean().backward()
    out["fsdp2_x_tp2_full_ac"] = _grads(model)

    dims = ParallelDims(dp_replicate=1, dp_shard=4, cp=1, tp=1, pp=1, ep=1, world_size=world_size)
    dims.build_mesh("cpu")
    with torch.device("meta"):
        model = LayeredModel()
    try:  # DDP needs real parameters
        parallelize(model, dims, Recipe(zero_stage=1))
    except ValueError as e:
        out["zero1_meta_error"] = str(e)
    with torch.device("meta"):
        model = LayeredModel()
    trained = parallelize(model, dims, Recipe(zero_stage=1, ac="selective"),
                          init_weights=_init)
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

