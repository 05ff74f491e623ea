"""FusedColwiseParallel: a fused qkv (GQA) and gate+up under TP=2 match one process.

The plain ColwiseParallel on the same fused Linears is run through the same comparison and must
fail it: that is the silent bug the style exists for.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from tests.spawn import run_distributed

DIM, HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 32, 4, 2, 8, 48
QKV = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM)


class FusedBlock(nn.Module):
    """Attention with one qkv Linear (GQA) and a SwiGLU with one gate+up Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, sum(QKV), bias=True)
        self.out = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)
        self.gate_up = nn.Linear(DIM, 2 * HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)
        self.tp = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [batch, seq, dim]
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split([n // self.tp for n in QKV], dim=-1)
        q = q.view(b, s, -1, HEAD_DIM).transpose(1, 2)
        k = k.view(b, s, -1, HEAD_DIM).transpose(1, 2)
        v = v.view(b, s, -1, HEAD_DIM).transpose(1, 2)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.out(att.transpose(1, 2).reshape(b, s, -1))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def _model() -> FusedBlock:
    torch.manual_seed(0)
    return FusedBlock()


def _data() -> torch.Tensor:
    return torch.randn(2, 8, DIM, generator=torch.Generator().manual_seed(1))


def _reference():
    model = _model()
    loss = model(_data()).square().mean()
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}, model.state_dict()


def _tp_body(rank, world_size, fused: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from titanext.plugins.tensor_parallel import FusedColwiseParallel, apply_tensor_parallel

    mesh = init_device_mesh("cpu", (world_size,))
    model = _model()
    qkv = FusedColwiseParallel(split_sizes=QKV) if fused else ColwiseParallel()
    gate_up = FusedColwiseParallel(split_sizes=(HIDDEN, HIDDEN)) if fused else ColwiseParallel()
    apply_tensor_parallel(model, mesh, plan={"qkv": qkv, "out": RowwiseParallel(),
                                             "gate_up": gate_up, "down": RowwiseParallel()})
    model.tp = world_size
    loss = model(_data()).square().mean()
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        full = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        style = {"qkv": qkv, "gate_up": gate_up}.get(name.split(".")[0])
        if fused and style is not None:
            full = style.to_original(full, world_size)
        grads[name] = full
    state = {k: v.full_tensor() for k, v in model.state_dict().items()}
    # Loading the saved (original-order) state into a fresh TP model gives the same parameters.
    again = _model()
    with torch.no_grad():
        for p in again.parameters():
            p.add_(1.0)
    apply_tensor_parallel(again, mesh, plan={"qkv": qkv, "out": RowwiseParallel(),
                                             "gate_up": gate_up, "down": RowwiseParallel()})
    again.load_state_dict(model.state_dict())
    reloaded = all(torch.equal(a.full_tensor(), b.full_tensor())
                   for a, b in zip(again.parameters(), model.parameters(), strict=True))
    dist.barrier()
    return loss.item(), grads, state, reloaded


def _worst(grads, ref):
    errs = {n: ((grads[n] - r).norm() / r.norm()).item() for n, r in ref.items()}
    name = max(errs, key=errs.get)
    return name, errs[name]


def test_fused_qkv_and_gate_up_under_tp_match_one_process():
    ref_loss, ref_grads, ref_state = _reference()
    for loss, grads, state, reloaded in run_distributed(_tp_body, 2, args=(True,), timeout_s=60):
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
        name, err = _worst(grads, ref_grads)
        assert err < 1e-5, f"{name}: {err:.2e}"
        for key, value in ref_state.items():  # the state dict is in the plain [q; k; v] order
            torch.testing.assert_close(state[key], value, rtol=0, atol=0)
        assert reloaded


def test_plain_colwise_on_a_fused_linear_is_silently_wrong():
    ref_loss, ref_grads, _ = _reference()
    loss, grads, _, _ = run_distributed(_tp_body, 2, args=(False,), timeout_s=60)[0]
    name, err = _worst(grads, ref_grads)
    assert abs(loss - ref_loss) > 1e-5 * abs(ref_loss) or err > 1e-3
