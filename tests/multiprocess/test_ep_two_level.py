"""Two-level expert-parallel dispatch and float8 dispatch (issue 34, items 1 and 2).

One 4-rank spawn, ep = 4 split into 2 "nodes" of 2 gloo ranks:

- two-level dispatch gives the outputs and gradients of the flat dispatch and of one process
  (fp32, 1e-6), on the real MoE layer (grouped GEMM and the per-expert loop), with node-limited
  routing and without it, with hot-expert replication, and through the adapter layout
  (``StackedExperts``); the inter-node dispatch bytes are at most M x dim x 4 per token, where
  M = num_limited_groups (one group per node), and below the flat dispatch's;
- float8 dispatch (bf16 model): the outputs stay within float8 error of the bf16 dispatch's, the
  gradients within bf16 error (they travel in bf16), and the dispatch bytes halve.

The trainer (FSDP, pipeline schedules, overlap, float8 linears, deferred W) is in
tests/multiprocess/test_ep_two_level_trainer.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tests.multiprocess.test_expert_replication import (
    _adapter_case,
    _grads,
    _grads_ref,
    assert_same_layer,
)
from tests.spawn import run_distributed

TOL = dict(rtol=1e-6, atol=1e-6)  # assert_same_layer's too
NODE = 2  # ranks per "node"


def _moe(grouped: bool | str, *, limited: bool, dim: int = 16, skew: bool = False):
    from titanext.models.moe import MoE, MoEArgs

    torch.manual_seed(3)
    groups = dict(num_expert_groups=2, num_limited_groups=1) if limited else {}
    args = MoEArgs(num_experts=8, top_k=3, hidden_dim=12, num_shared_experts=1, route_norm=True,
                   score_func="sigmoid", load_balance_coeff=1e-3, use_grouped_mm=grouped,
                   **groups)
    moe = MoE(dim, args)
    if skew:  # most tokens want expert 0 and 1: replication has copies to make
        moe.router.expert_bias.copy_(torch.tensor([1.0 / (i + 1) for i in range(8)]))
    return moe


def _run(model, x, cotangent, group):
    from titanext.plugins.expert_parallel import count_comm

    x = x.clone().requires_grad_(True)
    with count_comm() as fwd:
        y = model(x)
    with count_comm() as bwd:
        (y.float() * cotangent).sum().backward()
    return y.detach(), x.grad, _grads(model, group), fwd, bwd


def _layer_case(mesh, grouped: bool, limited: bool, copies: int = 0) -> dict:
    """Flat vs two-level vs one process; the inter-node dispatch bytes of each."""
    from titanext.plugins.expert_parallel import apply_expert_parallel

    rank, world, group = mesh.get_local_rank(), mesh.size(), mesh.get_group()
    ref = _moe(grouped, limited=limited, skew=bool(copies))
    flat, two = copy.deepcopy(ref), copy.deepcopy(ref)
    apply_expert_parallel(flat, mesh, ranks_per_node=NODE)
    apply_expert_parallel(two, mesh, dispatch="two_level", ranks_per_node=NODE,
                          replicate_hot_experts=copies)
    g = torch.Generator().manual_seed(11)
    xs = torch.randn(2 * world, 6, 16, generator=g).requires_grad_(True)
    cs = torch.randn(2 * world, 6, 16, generator=g)
    (ref(xs) * cs).sum().backward()
    mine = slice(2 * rank, 2 * rank + 2)
    got = {name: _run(model, xs.detach()[mine], cs[mine], group)
           for name, model in (("flat", flat), ("two_level", two))}
    assert_same_layer(*got["two_level"][:3], {"flat": got["flat"][:3], "one process": (
        ref(xs.detach())[mine], xs.grad[mine], _grads_ref(ref))})
    tokens = 2 * 6
    inter = {k: v[3].inter_node_dispatch_bytes_sent for k, v in got.items()}
    if limited:  # M = 1 node per token: at most one row of dim fp32 values per token
        assert inter["two_level"] <= 1 * tokens * 16 * 4, inter
    return {"inter": inter, "syncs": got["two_level"][3].host_syncs,
            "routing": got["two_level"][3].routing_bytes_sent,
            "copies": (got["two_level"][3].replicas, got["two_level"][3].weight_bytes_sent)}


def _float8_case(mesh, dispatch: str) -> dict:
    """bf16 layer: float8 dispatch vs bf16 dispatch (same dispatch mode)."""
    from titanext.plugins.expert_parallel import apply_expert_parallel

    rank, group = mesh.get_local_rank(), mesh.get_group()
    ref = _moe("auto", limited=False, dim=256).to(torch.bfloat16)
    plain, f8 = copy.deepcopy(ref), copy.deepcopy(ref)
    node = dict(dispatch=dispatch, ranks_per_node=NODE)
    apply_expert_parallel(plain, mesh, **node)
    apply_expert_parallel(f8, mesh, float8_dispatch=True, **node)
    g = torch.Generator().manual_seed(5 + rank)
    x = torch.randn(2, 8, 256, generator=g).to(torch.bfloat16)
    cs = torch.randn(2, 8, 256, generator=g)
    got = {name: _run(model, x, cs, group) for name, model in (("bf16", plain), ("f8", f8))}

    def sqnr(a, b):
        a, b = a.float(), b.float()
        return (20 * torch.log10(b.norm() / (a - b).norm())).item()

    return {"out_db": sqnr(got["f8"][0], got["bf16"][0]),
            "dx_db": sqnr(got["f8"][1], got["bf16"][1]),
            "dw1_db": sqnr(got["f8"][2]["experts.w1"], got["bf16"][2]["experts.w1"]),
            "bytes": (got["f8"][3].dispatch_bytes_sent, got["bf16"][3].dispatch_bytes_sent),
            "combine": (got["f8"][3].bytes_sent - got["f8"][3].dispatch_bytes_sent,
                        got["bf16"][3].bytes_sent - got["bf16"][3].dispatch_bytes_sent),
            "backward": (got["f8"][4].bytes_sent, got["bf16"][4].bytes_sent)}


def _cases(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    out = {}
    for grouped, limited in ((True, True), (False, True), (True, False)):
        out[("layer", grouped, limited)] = _layer_case(mesh, grouped, limited)
    out["replicated"] = _layer_case(mesh, True, limited=True, copies=2)
    # the adapter (ExpertParallelExperts, transformers' call), with copies inside a node
    _adapter_case(mesh, copies=2, dispatch="two_level", ranks_per_node=NODE)
    for dispatch in ("flat", "two_level"):
        out[("float8", dispatch)] = _float8_case(mesh, dispatch)
    dist.barrier()
    return out


@pytest.mark.slow
def test_two_level_and_float8_dispatch():
    per_rank = run_distributed(_cases, 4, timeout_s=60)
    copies = [got["replicated"]["copies"] for got in per_rank]
    assert any(n > 0 and sent > 0 for n, sent in copies), copies  # copies moved, inside a node
    for got in per_rank:
        for limited in (True, False):  # dedup: fewer bytes cross nodes than the flat dispatch's
            inter = got[("layer", True, limited)]["inter"]
            assert inter["two_level"] < inter["flat"], inter
        assert got[("layer", True, True)]["syncs"] == 2  # one count exchange per level
        for dispatch in ("flat", "two_level"):
            f8 = got[("float8", dispatch)]
            assert f8["out_db"] >= 25 and f8["dx_db"] >= 25 and f8["dw1_db"] >= 25, f8
            sent, plain = f8["bytes"]
            assert 0.5 * plain < sent <= 0.51 * plain, f8  # (256 + 2) / 512 bytes per row
            assert f8["combine"][0] == f8["combine"][1], f8  # the combine stays bf16
            assert f8["backward"][0] == f8["backward"][1], f8  # so do the gradients
