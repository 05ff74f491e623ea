"""MoE expert parallelism, measured side by side: dispatch bytes, MoE-layer time, grouped GEMM.

    python benchmarks/moe_dispatch.py [--tokens 2048] [--dim 256] [--iters 5] [--markdown]

1. Bytes each rank sends per step (forward + backward) with the all-to-all dispatch (counted
   by ``count_comm`` in ``titanext.plugins.expert_parallel``) against an all-gather dispatch
   (all-gather tokens and routing, each rank runs its experts on every token, reduce-scatter the
   outputs), at ep = 2 and 4, next to the formulas: all-to-all ~ 4 x T*k*(ep-1)/ep*dim*bytes
   (dispatch and combine, forward and backward), all-gather ~ 4 x (ep-1)*T*dim*bytes.
2. Forward+backward time of one MoE layer on the same global tokens at ep=1 (one process) and
   ep=2 (two processes, one core each) with both dispatches.
3. ``GroupedExperts`` forward+backward with ``torch._grouped_mm`` against the per-expert loop.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
import torch.distributed as dist

from titanext._text import format_table
from titanext.launch.local import run_distributed
from titanext.models.moe import GroupedExperts, MoE, MoEArgs
from titanext.plugins.expert_parallel import apply_expert_parallel, count_comm

# torch 2.13 renamed reduce_scatter_tensor; 2.11 has only the old name.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_SENT = {"bytes": 0}


def _layer(a, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    return MoE(a.dim, MoEArgs(num_experts=a.experts, top_k=a.top_k, hidden_dim=a.hidden,
                              load_balance_coeff=None, score_func="softmax"))


# -- the all-gather dispatch (for comparison only) -------------------------------------------------

class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group, world = group, dist.get_world_size(group)
        out = x.new_empty((world * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        _SENT["bytes"] += (world - 1) * x.numel() * x.element_size()
        return out

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return _ReduceScatter.apply(g, ctx.group), None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group, world = group, dist.get_world_size(group)
        out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
        _reduce_scatter(out, x.contiguous(), group=group)
        _SENT["bytes"] += (world - 1) * out.numel() * out.element_size()
        return out

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return _AllGather.apply(g, ctx.group), None


def allgather_moe(moe: MoE, local: GroupedExperts, x: torch.Tensor, group) -> torch.Tensor:
    """The MoE forward with an all-gather dispatch: every rank sees every token, runs only its
    experts on them, and the weighted outputs are reduce-scattered back to their owners."""
    rank, n_local = dist.get_rank(group), local.w1.shape[0]
    tokens = x.reshape(-1, x.shape[-1])
    weights, ids, _ = moe.router(tokens)
    every = _AllGather.apply(tokens, group)
    ids_all = _AllGather.apply(ids, group)
    w_all = _AllGather.apply(weights, group)
    mine = (ids_all // n_local == rank).reshape(-1)
    flat = (ids_all % n_local).reshape(-1)[mine]
    order = torch.argsort(flat, stable=True)
    assignment = mine.nonzero().squeeze(-1)[order]
    token_of = assignment // ids.shape[1]
    y = local(every[token_of], torch.bincount(flat, minlength=n_local))
    y = y * w_all.reshape(-1)[assignment].unsqueeze(-1)
    out = torch.zeros_like(every).index_add_(0, token_of, y)
    return _ReduceScatter.apply(out, group).view_as(x)


def _local_experts(moe: MoE, rank: int, world: int) -> GroupedExperts:
    e = moe.experts
    n_local = e.w1.shape[0] // world
    local = GroupedExperts(n_local, e.w1.shape[2], e.w1.shape[1])
    with torch.no_grad():
        for name in ("w1", "w2", "w3"):
            getattr(local, name).copy_(getattr(e, name)[rank * n_local:(rank + 1) * n_local])
    return local


# -- 1 and 2: bytes and time -----------------------------------------------------------------------

def _timed(fn, iters: int) -> float:
    times = []
    for i in range(iters + 1):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        elapsed = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step ends when the slowest rank does
        if i:  # the first iteration warms up
            times.append(elapsed.item())
    return statistics.median(times)


def _measure(rank: int, world: int, a, iters: int) -> dict:
    """Per rank: T = tokens / world of the global tokens; bytes sent and time per fwd+bwd."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    group = mesh.get_group()
    x = torch.randn(a.tokens, a.dim, generator=torch.Generator().manual_seed(1))
    x = x.view(world, 1, -1, a.dim)[rank].clone().requires_grad_(True)
    ref = _layer(a)
    out = {}
    if world == 1:
        out["time a2a"] = _timed(lambda: ref(x).sum().backward(), iters)
        return out
    ep = copy.deepcopy(ref)
    apply_expert_parallel(ep, mesh)
    with count_comm() as cc:
        ep(x).sum().backward()
    out["bytes a2a"], out["rows a2a"] = cc.bytes_sent, cc.rows_sent
    local = _local_experts(ref, rank, world)
    _SENT["bytes"] = 0
    y = allgather_moe(ref, local, x, group)
    y.sum().backward()
    out["bytes allgather"] = _SENT["bytes"]
    torch.testing.assert_close(y, ep(x), rtol=1e-5, atol=1e-5)  # the two dispatches agree
    if iters:
        out["time a2a"] = _timed(lambda: ep(x).sum().backward(), iters)
        out["time allgather"] = _timed(
            lambda: allgather_moe(ref, local, x, group).sum().backward(), iters
        )
    return out


def bytes_table(a) -> list[dict]:
    rows = []
    elem = 4  # fp32
    for world in (2, 4):
        per_rank = run_distributed(_measure, world, args=(a, 0), timeout_s=600)
        t = a.tokens // world
        f_a2a = 4 * t * a.top_k * (world - 1) / world * a.dim * elem
        f_ag = 4 * (world - 1) * t * a.dim * elem
        a2a = statistics.mean(r["bytes a2a"] for r in per_rank)
        ag = statistics.mean(r["bytes allgather"] for r in per_rank)
        rows.append({"ep": world, "tokens/rank": t, "a2a measured (MB)": f"{a2a / 1e6:.2f}",
                     "a2a formula (MB)": f"{f_a2a / 1e6:.2f}",
                     "all-gather measured (MB)": f"{ag / 1e6:.2f}",
                     "all-gather formula (MB)": f"{f_ag / 1e6:.2f}",
                     "a2a / all-gather": f"{a2a / ag:.2f}"})
    for world in (8, 64):  # formula only: the ratio is top_k / ep
        rows.append({"ep": world, "a2a / all-gather": f"{a.top_k / world:.2f} (formula)"})
    return rows


# -- 3: grouped GEMM vs loop -----------------------------------------------------------------------

def gemm_table(a, iters: int) -> list[dict]:
    torch.manual_seed(0)
    rows = []
    n = a.tokens * a.top_k
    counts = torch.bincount(torch.randint(0, a.experts, (n,)), minlength=a.experts)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(n, a.dim, dtype=dtype, requires_grad=True)
        dy = torch.randn(n, a.dim, dtype=dtype)  # a dense gradient, as training has
        row = {"dtype": str(dtype).replace("torch.", ""), "rows": n}
        outs = {}
        for name, grouped in (("grouped_mm", True), ("loop", False)):
            e = GroupedExperts(a.experts, a.dim, a.hidden, use_grouped_mm=grouped).to(dtype)
            with torch.no_grad():
                for p in e.parameters():
                    p.normal_(0, 0.02, generator=torch.Generator().manual_seed(2))
            times = []
            for i in range(iters + 1):
                t0 = time.perf_counter()
                y = e(x, counts)
                y.backward(dy)
                if i:
                    times.append(time.perf_counter() - t0)
            outs[name] = y.detach().float()
            row[f"{name} (ms)"] = f"{statistics.median(times) * 1e3:.1f}"
        diff = (outs["grouped_mm"] - outs["loop"]).abs().max() / outs["loop"].abs().max()
        row["speed-up"] = f"{float(row['loop (ms)']) / float(row['grouped_mm (ms)']):.2f}x"
        row["max rel diff"] = f"{diff:.1e}"
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048, help="global tokens per MoE layer call")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=512, help="hidden size of each expert")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--markdown", action="store_true", help="print tables as Markdown")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    shape = (f"{a.tokens} tokens, dim {a.dim}, {a.experts} experts (hidden {a.hidden}), "
             f"top-{a.top_k}, fp32")
    print(f"1. bytes each rank sends per step (fwd+bwd), {shape}; softmax router at init")
    print(format_table(bytes_table(a), markdown=a.markdown), flush=True)

    print(f"\n2. one MoE layer, fwd+bwd, {shape}, one core per rank (median of {a.iters}; a step "
          "is the slowest rank's)", flush=True)
    one = run_distributed(_measure, 1, args=(a, a.iters), timeout_s=600)[0]
    two = run_distributed(_measure, 2, args=(a, a.iters), timeout_s=600)[0]
    rows = [{"layout": "ep=1 (1 process, all tokens)", "time (ms)": f"{one['time a2a'] * 1e3:.1f}",
             "speed-up": "1.00x"}]
    for name in ("a2a", "allgather"):
        rows.append({"layout": f"ep=2, {name} dispatch",
                     "time (ms)": f"{two['time ' + name] * 1e3:.1f}",
                     "speed-up": f"{one['time a2a'] / two['time ' + name]:.2f}x"})
    print(format_table(rows, markdown=a.markdown), flush=True)

    print(f"\n3. GroupedExperts fwd+bwd, {a.tokens} x top-{a.top_k} rows, one process (median of "
          f"{a.iters})", flush=True)
    print(format_table(gemm_table(a, a.iters), markdown=a.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
