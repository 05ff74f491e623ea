"""Context parallelism, measured side by side: load balance, attention-layer time, training tokens/s.

    python benchmarks/context_parallel.py [--seq 8192] [--iters 5] [--markdown]

1. Attention work per rank (unmasked FLOPs, from the same step plan ring_attention runs) for
   zigzag against contiguous sharding at W = 2, 4, 8: max/mean over ranks.
2. Forward+backward time of one causal attention layer on a long sequence at cp=2 (one rank
   per core) for zigzag-p2p, contiguous-p2p and zigzag-allgather, plus torch's built-in ring
   attention where it can run (it needs CUDA SDPA kernels).
3. Training tokens/s of the debug model at cp=1 (dp=2) and cp=2 on 2 ranks, same global batch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from titanext.local_launch import run_distributed
from titanext.metrics import format_table
from titanext.plugins.context_parallel import _step_slices, ring_attention, shard_sequence

# -- 1. work per rank -------------------------------------------------------------------------------

def work_per_rank(layout: str, world: int, local_seq: int = 1024) -> list[float]:
    """Unmasked query-key pairs each rank computes over the whole ring (causal)."""
    work = []
    for rank in range(world):
        total = 0.0
        for source in range(world):
            step = _step_slices(layout, True, rank, source, local_seq)
            if step is None:
                continue
            qs, ks, causal = step
            pairs = (qs.stop - qs.start) * (ks.stop - ks.start)
            total += pairs / 2 if causal else pairs  # a causal diagonal block is half masked
        work.append(total)
    return work


def balance_table() -> list[dict]:
    rows = []
    for world in (2, 4, 8):
        row = {"W": world}
        for layout in ("zigzag", "contiguous"):
            w = work_per_rank(layout, world)
            row[f"{layout} max/mean"] = f"{max(w) / statistics.mean(w):.3f}"
        # contiguous: rank r computes r full blocks and half a diagonal one
        row["contiguous expected"] = f"{(2 * world - 1) / world:.3f}"
        rows.append(row)
    return rows


# -- 2. one attention layer -------------------------------------------------------------------------

VARIANTS = {"zigzag-p2p": ("zigzag", "p2p"), "contiguous-p2p": ("contiguous", "p2p"),
            "zigzag-allgather": ("zigzag", "allgather")}


def _time_layer(rank, world, seq, heads, kv_heads, dim, iters):
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, h, seq, dim, generator=g) for h in (heads, kv_heads, kv_heads)]
    group = dist.group.WORLD
    results = {}
    for name, (layout, comm) in VARIANTS.items():
        q, k, v = (shard_sequence(t, 2, group, layout).clone().requires_grad_() for t in full)
        times = []
        for i in range(iters + 1):
            dist.barrier()
            t0 = time.perf_counter()
            ring_attention(q, k, v, group, layout=layout, comm=comm).sum().backward()
            elapsed = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step ends when the slowest rank does
            if i:  # the first iteration warms up allocators and threads
                times.append(elapsed.item())
        results[name] = statistics.median(times)
    results["torch context_parallel"] = _torch_ring(full, group)
    return results


def _torch_ring(full, group) -> float | str:
    """torch's built-in CP on the same problem: it only intercepts CUDA SDPA kernels."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
        rep = full[0].shape[1] // full[1].shape[1]
        q, k, v = full[0].clone(), full[1].repeat_interleave(rep, 1), full[2].repeat_interleave(rep, 1)
        w = torch.ones((), requires_grad=True)  # gradients flow to a parameter, as in a model
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            torch.nn.functional.scaled_dot_product_attention(q * w, k, v, is_causal=True).sum().backward()
        return "ran (untimed)"
    except Exception as e:  # noqa: BLE001 - reported in the table, not hidden
        return "fails: " + str(e).splitlines()[0][:110]


# -- 3. training tokens/s ---------------------------------------------------------------------------

def _train_tps(rank, world, overrides, steps):
    from titanext.config import load_config
    from titanext.train import Trainer

    base = ["--model.flavor=debugmodel", "--training.dataset=synthetic", f"--training.steps={steps}",
            "--training.seq_len=2048", "--metrics.enable_tensorboard=false",
            "--metrics.log_freq=1000", "--metrics.progress_bar=false",
            f"--job.dump_folder=/tmp/titanext_cp_bench_{os.getpid()}"]
    trainer = Trainer(load_config(None, [*base, *overrides], world_size=world))
    trainer.train(until_step=1)  # warm-up step
    dist.barrier()
    t0 = time.perf_counter()
    trainer.train()
    elapsed = time.perf_counter() - t0
    tokens = (steps - 1) * trainer.cfg.training.seq_len * 4  # global batch of 4 sequences
    return tokens / elapsed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=8192, help="sequence length of the attention layer")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--train-steps", type=int, default=6)
    ap.add_argument("--markdown", action="store_true", help="print tables as Markdown")
    a = ap.parse_args(argv)

    print("1. attention work per rank, causal (max/mean over ranks; 1.000 is balanced)")
    print(format_table(balance_table(), markdown=a.markdown), flush=True)

    print(f"\n2. one attention layer, fwd+bwd, seq {a.seq}, heads {a.heads}/{a.kv_heads}, head_dim "
          f"{a.head_dim}, cp=2, fp32 (median of {a.iters}; a step is the slowest rank's)", flush=True)
    times = run_distributed(_time_layer, 2, args=(a.seq, a.heads, a.kv_heads, a.head_dim, a.iters),
                            timeout_s=600)[0]
    base = times["contiguous-p2p"]
    rows = [{"variant": k, "time (s)": f"{v:.3f}" if isinstance(v, float) else v,
             "speed-up vs contiguous": f"{base / v:.2f}x" if isinstance(v, float) else "n/a"}
            for k, v in times.items()]
    print(format_table(rows, markdown=a.markdown), flush=True)

    print(f"\n3. training the debug model, seq 2048, global batch 4, 2 ranks ({a.train_steps - 1} "
          "timed steps)", flush=True)
    rows = []
    for name, overrides in (("cp=1 (dp_shard=2)", ["--training.local_batch_size=2"]),
                            ("cp=2", ["--training.local_batch_size=4",
                                      "--parallelism.context_parallel_degree=2"])):
        tps = run_distributed(_train_tps, 2, args=(overrides, a.train_steps), timeout_s=900)[0]
        rows.append({"layout": name, "tokens/s": f"{tps:,.0f}"})
    print(format_table(rows, markdown=a.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
