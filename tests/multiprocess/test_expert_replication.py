"""Hot-expert replication is exact: with skewed routing, a MoE layer with copies gives the
outputs and gradients of the same layer without them (and of one process), while every rank
computes at most ceil(mean) rows. One 4-rank spawn: ep = 2 (two groups) and ep = 4, the real
MoE layer (grouped GEMM and per-expert loop) and an adapter layout (``StackedExperts``).
The trainer under FSDP / HSDP / TP / CP + AC / PP: tests/multiprocess/test_expert_parallel.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tests.spawn import run_distributed

TOL = dict(rtol=1e-6, atol=1e-6)


def _skewed_moe(grouped: bool):
    """A MoE layer whose router strongly prefers the first experts (Zipf-like bias)."""
    from titanext.models.moe import MoE, MoEArgs

    torch.manual_seed(3)
    args = MoEArgs(num_experts=8, top_k=2, hidden_dim=12, num_shared_experts=0, route_norm=True,
                   load_balance_coeff=1e-3, use_grouped_mm=grouped)
    moe = MoE(16, args)
    moe.router.expert_bias.copy_(torch.tensor([1.0 / (i + 1) for i in range(8)]))
    return moe


def _grads(model: nn.Module, group) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if isinstance(p.grad, DTensor):
            out[name] = p.grad.full_tensor()
        else:  # replicated router: each rank has its own tokens' share
            out[name] = p.grad.clone()
            dist.all_reduce(out[name], group=group)
    return out


def _layer_case(mesh, grouped: bool, copies: int) -> dict:
    """EP with ``copies`` vs EP without vs one process, on skewed routing."""
    from titanext.plugins.expert_parallel import apply_expert_parallel, count_comm

    rank, world, group = mesh.get_local_rank(), mesh.size(), mesh.get_group()
    ref = _skewed_moe(grouped)
    plain, rep = copy.deepcopy(ref), copy.deepcopy(ref)
    apply_expert_parallel(plain, mesh)
    apply_expert_parallel(rep, mesh, replicate_hot_experts=copies)
    g = torch.Generator().manual_seed(11)
    xs = torch.randn(2 * world, 6, 16, generator=g).requires_grad_(True)
    cs = torch.randn(2 * world, 6, 16, generator=g)
    (ref(xs) * cs).sum().backward()
    mine = slice(2 * rank, 2 * rank + 2)
    results = {}
    for name, model in (("plain", plain), ("rep", rep)):
        x = xs.detach()[mine].clone().requires_grad_(True)
        with count_comm() as cc:
            y = model(x)
            (y * cs[mine]).sum().backward()
        results[name] = (y.detach(), x.grad, _grads(model, group), cc)
    y, xg, grads, cc = results["rep"]
    assert_same_layer(y, xg, grads, {"plain": results["plain"][:3], "one process": (
        ref(xs.detach())[mine], xs.grad[mine], _grads_ref(ref))})
    assert cc.replicas > 0 and cc.weight_bytes_sent > 0 or world == 1, cc
    assert results["plain"][3].weight_bytes_sent == 0
    return {"replicas": cc.replicas, "weight_bytes": cc.weight_bytes_sent}


def assert_same_layer(y, x_grad, grads, references: dict[str, tuple]) -> None:
    """The output, input gradient and every parameter gradient of a layer against each of
    ``references`` ({name: (output, input gradient, {parameter: gradient})}), to TOL."""
    for other, (y2, xg2, grads2) in references.items():
        torch.testing.assert_close(y, y2, **TOL, msg=lambda m, o=other: f"output vs {o}: {m}")
        torch.testing.assert_close(x_grad, xg2, **TOL,
                                   msg=lambda m, o=other: f"x grad vs {o}: {m}")
        for n, want in grads2.items():
            torch.testing.assert_close(grads[n], want, **TOL,
                                       msg=lambda m, n=n, o=other: f"{n} grad vs {o}: {m}")


def _grads_ref(ref: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in ref.named_parameters()}


class StackedSwiGLU(nn.Module):
    """Experts in another layout: stacked [E, in, out] weights, called transformers-style."""

    def __init__(self, n: int, dim: int, hidden: int):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.gate_proj = nn.Parameter(torch.randn(n, dim, hidden, generator=g) * 0.2)
        self.up_proj = nn.Parameter(torch.randn(n, dim, hidden, generator=g) * 0.2)
        self.down_proj = nn.Parameter(torch.randn(n, hidden, dim, generator=g) * 0.2)

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x)
        for e in range(self.gate_proj.shape[0]):
            tok, slot = torch.where(top_k_index == e)
            h = torch.nn.functional.silu(x[tok] @ self.gate_proj[e]) * (x[tok] @ self.up_proj[e])
            out = out.index_add(0, tok, (h @ self.down_proj[e]) * top_k_weights[tok, slot, None])
        return out


class Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = StackedSwiGLU(8, 6, 10)


def _adapter_case(mesh, copies: int, **ep_options) -> None:
    """The adapter (ExpertParallelExperts) with copies == one process (``ep_options``: more
    ``apply_expert_parallel`` arguments, such as the two-level dispatch)."""
    from titanext.plugins.expert_parallel import StackedExperts, apply_expert_parallel

    rank, world, group = mesh.get_local_rank(), mesh.size(), mesh.get_group()
    ref = Holder()
    rep = copy.deepcopy(ref)
    apply_expert_parallel(rep, mesh, filter_fn=lambda n, m: n == "experts",
                          layout=StackedExperts("gate_proj", "up_proj", "down_proj",
                                                           transposed=True),
                          replicate_hot_experts=copies, **ep_options)
    g = torch.Generator().manual_seed(2)
    xs = torch.randn(6 * world, 6, generator=g)
    ids = torch.stack([torch.multinomial(torch.tensor([8.0, 4, 2, 1, 1, 1, 1, 1]), 2,
                                         generator=g) for _ in range(6 * world)])
    w = torch.rand(6 * world, 2, generator=g)
    ys = ref.experts(xs, ids, w)
    ys.pow(2).sum().backward()
    mine = slice(6 * rank, 6 * rank + 6)
    y = rep.experts(xs[mine], ids[mine], w[mine])
    y.pow(2).sum().backward()
    torch.testing.assert_close(y, ys[mine], **TOL)
    for n, want in _grads_ref(ref).items():
        torch.testing.assert_close(_grads(rep, group)[n], want, **TOL)


def _cases(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    out = {}
    for ep in (2, 4):
        mesh = init_device_mesh("cpu", (world_size // ep, ep), mesh_dim_names=("rep", "ep"))["ep"]
        for grouped in (True, False) if ep == 2 else (True,):  # the loop once is enough
            out[(ep, grouped)] = _layer_case(mesh, grouped, copies=ep)
        _adapter_case(mesh, copies=2)
    return out


@pytest.mark.slow
def test_replication_matches_no_replication_and_one_process():
    per_rank = run_distributed(_cases, 4, timeout_s=60)
    for got in per_rank:
        assert all(v["replicas"] > 0 for v in got.values()), got
