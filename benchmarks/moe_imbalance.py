"""Hot-expert replication against skewed routing: rows per rank and MoE-layer time.

    python benchmarks/moe_imbalance.py [--tokens 2048] [--dim 256] [--hidden 512] [--iters 9]
                                       [--copies 2] [--zipf 0.05] [--markdown]

One MoE layer (8 experts, top-2, ``GroupedExperts``) at ep = 2 on 2 processes (one thread
each). Routing is skewed on purpose: the router's selection bias is Zipf-shaped,
``zipf / (i + 1)`` for expert i, which sends most rows to rank 0's experts (0-3); "balanced" has
no bias. Four variants, interleaved in every iteration (A B C D A B C D ...):
balanced / skewed routing x ``replicate_hot_experts`` = 0 / ``--copies``. For each: rows per
rank (max / mean, the busiest rank sets the step), forward+backward time of the layer (the
slowest rank, median over the iterations): wall clock, and the busiest rank's CPU time
(``time.thread_time``: its own compute, without waits or time taken by other processes, the
figure to read on a shared machine), and the expert weight bytes a rank sent per step
(``count_comm().weight_bytes_sent``: copies forward, their gradients backward).

Targets (issue 26): with replication on skewed routing, rows per rank within 1.05x of the mean
and the layer time within 1.10x of balanced routing's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

from titanext._text import format_table
from titanext.launch.local import run_distributed
from titanext.models.moe import MoE, MoEArgs
from titanext.plugins.expert_parallel import apply_expert_parallel, count_comm

EXPERTS, TOP_K, EP = 8, 2, 2


def _layer(a, skewed: bool, copies: int, mesh) -> tuple[MoE, list[int]]:
    torch.manual_seed(0)
    moe = MoE(a.dim, MoEArgs(num_experts=EXPERTS, top_k=TOP_K, hidden_dim=a.hidden,
                             load_balance_coeff=1e-3, score_func="softmax"))
    if skewed:
        moe.router.expert_bias.copy_(torch.tensor([a.zipf / (i + 1) for i in range(EXPERTS)]))
    apply_expert_parallel(moe, mesh, replicate_hot_experts=copies)
    rows: list[int] = []
    moe.experts.register_forward_pre_hook(  # after EP's dispatch: this rank's rows
        lambda m, args: rows.append(int(args[1].sum())))
    return moe, rows


def _measure(rank: int, world: int, a) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    variants = {(skewed, copies): _layer(a, skewed, copies, mesh)
                for skewed in (False, True) for copies in (0, a.copies)}
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(1, a.tokens, a.dim, generator=g)
    times = {k: [] for k in variants}
    cpu = {k: [] for k in variants}
    sent = {}
    for i in range(a.iters + 1):
        for key, (moe, rows) in variants.items():  # interleaved: A B C D A B C D
            rows.clear()
            xi = x.clone().requires_grad_(True)
            dist.barrier()
            with count_comm() as cc:
                t0, c0 = time.perf_counter(), time.thread_time()
                moe(xi).sum().backward()
                elapsed = torch.tensor([time.perf_counter() - t0, time.thread_time() - c0])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the step
            if i:  # the first round warms up
                times[key].append(elapsed[0].item())
                cpu[key].append(elapsed[1].item())
            sent[key] = cc.weight_bytes_sent
            moe.zero_grad(set_to_none=True)
    out = {}
    for key, (_, rows) in variants.items():
        per_rank = torch.tensor(rows[-1:], dtype=torch.float64)
        everyone = [torch.zeros_like(per_rank) for _ in range(world)]
        dist.all_gather(everyone, per_rank)
        loads = torch.cat(everyone)
        out[key] = {"max/mean": (loads.max() / loads.mean()).item(),
                    "rows": [int(v) for v in loads], "ms": 1e3 * statistics.median(times[key]),
                    "cpu ms": 1e3 * statistics.median(cpu[key]),
                    "weight KB": sent[key] / 1024}
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--iters", type=int, default=9)
    ap.add_argument("--copies", type=int, default=2, help="replicate_hot_experts when on")
    ap.add_argument("--zipf", type=float, default=0.05, help="bias of expert 0 (zipf / (i+1))")
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args(argv)
    got = run_distributed(_measure, EP, args=(a,), timeout_s=600)[0]
    base, base_cpu = got[(False, 0)]["ms"], got[(False, 0)]["cpu ms"]
    rows = [{"routing": "skewed" if skewed else "balanced", "replicate_hot_experts": copies,
             "rows per rank": " / ".join(map(str, r["rows"])),
             "max/mean": f"{r['max/mean']:.3f}", "wall ms": f"{r['ms']:.1f}",
             "wall vs balanced": f"{r['ms'] / base:.2f}x", "busiest CPU ms": f"{r['cpu ms']:.1f}",
             "CPU vs balanced": f"{r['cpu ms'] / base_cpu:.2f}x",
             "weight KB sent/step": f"{r['weight KB']:.0f}"}
            for (skewed, copies), r in got.items()]
    print(format_table(rows, markdown=a.markdown))
    on, off = got[(True, a.copies)], got[(True, 0)]
    print(f"targets: skewed + replication: rows max/mean {on['max/mean']:.3f} (<= 1.05), layer "
          f"time {on['ms'] / base:.2f}x (wall) / {on['cpu ms'] / base_cpu:.2f}x (busiest rank's "
          f"CPU) of balanced (<= 1.10); without replication {off['max/mean']:.3f}, "
          f"{off['ms'] / base:.2f}x / {off['cpu ms'] / base_cpu:.2f}x")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
