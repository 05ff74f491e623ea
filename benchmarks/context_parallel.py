"""Context parallelism, measured side by side: load balance, attention-layer time and bytes,
document-masked work, training tokens/s.

    python benchmarks/context_parallel.py [--seq 8192] [--iters 5] [--markdown] [--skip-train]

1. Attention work per rank (unmasked FLOPs, from the same step plan ring_attention runs) for
   zigzag against contiguous sharding at W = 2, 4, 8: max/mean over ranks.
2. Work per rank for packed batches of documents (a realistic mix of lengths): unmasked FLOPs
   (query-key pairs that share a document, causal) max/mean over ranks, zigzag against
   contiguous, and the pairs the ring's tiles actually compute as a share of dense causal.
3. Forward+backward time and bytes sent per rank of one causal attention layer on a long
   sequence: ring (zigzag/contiguous, p2p/allgather) and Ulysses at cp=2; ring, Ulysses and
   hybrid 2x2 at cp=4; ring and Ulysses with document masks. Variants take turns (A B C A B C)
   so machine drift hits all alike; medians, and ratios against the first row of each block.
4. Training tokens/s of the debug model at cp=1 (dp=2) and cp=2 on 2 ranks, same global batch,
   runs alternating.
5. Sliding windows (the same plan ring_attention runs): per rank, the ring blocks computed, the
   query-key pairs the kernels get and the time of its forward kernel calls replayed in one
   process (ranks and layouts interleaved, median), zigzag against contiguous; and the p2p
   ring steps the window needs.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from titanext._text import format_table
from titanext.launch.local import run_distributed
from titanext.plugins._attention_kernels import block_forward
from titanext.plugins.context_parallel import (
    _step_slices,
    count_comm,
    count_work,
    hybrid_attention,
    layout_positions,
    plan_work,
    ring_attention,
    ring_steps,
    shard_sequence,
    ulysses_attention,
)

# -- 1. work per rank -----------------------------------------------------------------------------

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


# -- 2. work per rank with documents --------------------------------------------------------------

def packed_documents(batch: int, seq: int, seed: int = 0, median: int = 600) -> torch.Tensor:
    """[batch, seq] document ids of rows packed from documents with log-normally distributed
    lengths (median ``median`` tokens, sigma 1.2: mostly short documents, a few longer than
    the row), the last one cut at the row's end as a packing loader does."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        lengths, total = [], 0
        while total < seq:
            n = torch.empty(()).log_normal_(math.log(median), 1.2, generator=g)
            n = int(n.clamp(1, 4 * seq))
            lengths.append(min(n, seq - total))
            total += lengths[-1]
        rows.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)))
    return torch.stack(rows)


def document_work(docs: torch.Tensor, layout: str, world: int) -> list[int]:
    """Unmasked (same document, causal) query-key pairs of each rank's queries: a token at
    position p of a document starting at s sees p - s + 1 keys."""
    seq = docs.shape[1]
    pos = torch.arange(seq)
    first = torch.ones(docs.shape[0], 1, dtype=torch.bool)
    starts = torch.cat([first, docs[:, 1:] != docs[:, :-1]], dim=1)
    start_pos = torch.cummax(torch.where(starts, pos, 0), dim=1).values
    seen = pos - start_pos + 1  # [batch, seq]
    return [int(seen[:, layout_positions(layout, r, world, seq // world)].sum())
            for r in range(world)]


def document_table(seq: int = 32768, batch: int = 4, tile: int = 1024) -> tuple[list[dict], float]:
    """Rows: W. Unmasked work balance for zigzag and contiguous, and what the zigzag ring's
    plan computes (one packed row per rank batch, as long-context runs use)."""
    rows = []
    docs = packed_documents(batch, seq)
    dense = batch * seq * (seq + 1) / 2
    for world in (2, 4, 8):
        row = {"W": world}
        for layout in ("zigzag", "contiguous"):
            w = document_work(docs, layout, world)
            row[f"{layout} max/mean"] = f"{max(w) / statistics.mean(w):.3f}"
        row["unmasked / dense causal"] = f"{sum(document_work(docs, 'zigzag', world)) / dense:.3f}"
        local, computed, skipped = seq // world, [0] * world, 0
        for b in range(batch):
            shards = torch.stack([docs[b:b + 1, layout_positions("zigzag", r, world, local)]
                                  for r in range(world)])
            for rank, per_source in enumerate(plan_work("zigzag", True, world, shards, local,
                                                        tile=tile)):
                computed[rank] += sum((q.stop - q.start) * (k.stop - k.start)
                                      for items in per_source for q, k, _, _ in items)
                skipped += sum(not items for items in per_source)
        row["computed (tiles) / dense causal"] = f"{sum(computed) / dense:.3f}"
        row["computed max/mean"] = f"{max(computed) / statistics.mean(computed):.3f}"
        row["ring blocks skipped"] = f"{skipped / batch:.1f} of {world * world}"
        rows.append(row)
    lengths = torch.cat([torch.unique_consecutive(r, return_counts=True)[1] for r in docs])
    return rows, float(lengths.float().mean())


# -- 5. sliding windows ---------------------------------------------------------------------------

def _replay(items, q, kv, dk) -> float:
    """Seconds to run one rank's forward kernel calls (every source's items) in this process."""
    start = time.perf_counter()
    for per_source in items:
        for qs, ks, causal, mask in per_source:
            block_forward(q[:, :, qs], kv[:, :, ks, :dk], kv[:, :, ks, dk:], causal=causal,
                          scale=dk ** -0.5, kernel="flash_cpu", mask=mask)
    return time.perf_counter() - start


def window_table(seq: int, window: int, worlds=(2, 4), heads: int = 8, kv_heads: int = 2,
                 dim: int = 64, rounds: int = 3) -> list[dict]:
    """Rows: (W, layout). Per-rank blocks computed, pairs and replayed forward time."""
    rows = []
    for world in worlds:
        local = seq // world
        plans = {lay: plan_work(lay, True, world, None, local, window=window)
                 for lay in ("zigzag", "contiguous")}
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, heads, local, dim, generator=g)
        kv = torch.randn(1, kv_heads, local, 2 * dim, generator=g)
        times = {(lay, r): [] for lay in plans for r in range(world)}
        for _ in range(rounds):  # ranks and layouts take turns
            for r in range(world):
                for lay, plan in plans.items():
                    times[lay, r].append(_replay(plan[r], q, kv, dim))
        for lay, plan in plans.items():
            blocks = [sum(bool(items) for items in plan[r]) for r in range(world)]
            pairs = [sum((a.stop - a.start) * (b.stop - b.start) for items in plan[r]
                         for a, b, _, _ in items) for r in range(world)]
            secs = [statistics.median(times[lay, r]) for r in range(world)]
            rows.append({"W": world, "layout": lay,
                         "blocks per rank": " ".join(map(str, blocks)),
                         "pairs max/mean": f"{max(pairs) / statistics.mean(pairs):.3f}",
                         "fwd ms per rank": " ".join(f"{1e3 * t:.0f}" for t in secs),
                         "time max/mean": f"{max(secs) / statistics.mean(secs):.3f}",
                         "p2p ring steps": f"{ring_steps(lay, True, world, local, window)} "
                                           f"of {world}"})
    return rows


# -- 3. one attention layer -----------------------------------------------------------------------

def _groups(world: int, ulysses: int):
    """(Ulysses group, ring group) with cp rank = ring_rank * u + ulysses_rank."""
    ring = world // ulysses
    mine_u = mine_r = None
    for j in range(ring):
        g = dist.new_group(list(range(j * ulysses, (j + 1) * ulysses)))
        mine_u = g if dist.get_rank() // ulysses == j else mine_u
    for i in range(ulysses):
        g = dist.new_group(list(range(i, world, ulysses)))
        mine_r = g if dist.get_rank() % ulysses == i else mine_r
    return mine_u, mine_r


def _variants(world: int) -> dict[str, tuple[str, str, str, bool]]:
    """name -> (kind, layout, comm, document masks)."""
    if world == 2:
        return {"ring zigzag-p2p": ("ring", "zigzag", "p2p", False),
                "ring contiguous-p2p": ("ring", "contiguous", "p2p", False),
                "ring zigzag-allgather": ("ring", "zigzag", "allgather", False),
                "ulysses zigzag": ("ulysses", "zigzag", "p2p", False),
                "ring zigzag-p2p, documents": ("ring", "zigzag", "p2p", True),
                "ulysses, documents": ("ulysses", "zigzag", "p2p", True)}
    return {"ring zigzag-p2p": ("ring", "zigzag", "p2p", False),
            "ulysses zigzag": ("ulysses", "zigzag", "p2p", False),
            "hybrid 2x2 zigzag-p2p": ("hybrid", "zigzag", "p2p", False),
            "hybrid 2x2, documents": ("hybrid", "zigzag", "p2p", True)}


def _time_layer(rank, world, seq, heads, kv_heads, dim, iters):
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, h, seq, dim, generator=g) for h in (heads, kv_heads, kv_heads)]
    docs = packed_documents(1, seq, median=max(seq // 16, 1))
    group = dist.group.WORLD
    hybrid_groups = _groups(world, 2) if world == 4 else None
    variants = _variants(world)
    inputs, times, sent = {}, {name: [] for name in variants}, {}
    for name, (kind, layout, comm, masked) in variants.items():
        q, k, v = (shard_sequence(t, 2, group, layout).clone().requires_grad_() for t in full)
        ids = shard_sequence(docs, 1, group, layout) if masked else None
        inputs[name] = (kind, layout, comm, q, k, v, ids)

    def step(name):
        kind, layout, comm, q, k, v, ids = inputs[name]
        if kind == "ring":
            out = ring_attention(q, k, v, group, layout=layout, comm=comm, document_ids=ids)
        elif kind == "ulysses":
            out = ulysses_attention(q, k, v, group, layout=layout, document_ids=ids)
        else:
            out = hybrid_attention(q, k, v, *hybrid_groups, layout=layout, comm=comm,
                                   document_ids=ids)
        out.sum().backward()

    for name in variants:  # warm-up, and the bytes of one fwd+bwd
        with count_comm() as c, count_work() as w:
            step(name)
        sent[name] = (c.send_bytes + c.collective_bytes, w.blocks_skipped)
    for _ in range(iters):
        for name in variants:  # A B C A B C: drift hits every variant alike
            dist.barrier()
            t0 = time.perf_counter()
            step(name)
            elapsed = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step ends with the slowest rank
            times[name].append(elapsed.item())
    skipped = torch.tensor([sent[name][1] for name in variants])
    dist.all_reduce(skipped)
    return {name: (statistics.median(times[name]), sent[name][0], int(skipped[i]))
            for i, name in enumerate(variants)}


def layer_rows(world, seq, heads, kv_heads, dim, iters) -> list[dict]:
    res = run_distributed(_time_layer, world, args=(seq, heads, kv_heads, dim, iters),
                          timeout_s=1200)
    base = res[0][next(iter(res[0]))][0]
    rows = []
    for name in res[0]:
        t = res[0][name][0]
        rows.append({"variant": name, "time (s)": f"{t:.3f}", "vs first row": f"{base / t:.2f}x",
                     "MB sent / rank (max)": f"{max(r[name][1] for r in res) / 2**20:.1f}",
                     "blocks skipped (all ranks)": res[0][name][2]})
    return rows


# -- 4. training tokens/s -------------------------------------------------------------------------

def _train_tps(rank, world, overrides, steps):
    from titanext.config import load_config
    from titanext.trainer import Trainer

    base = ["--model.flavor=debugmodel", "--training.dataset=synthetic",
            f"--training.steps={steps}", "--training.seq_len=2048",
            "--metrics.enable_tensorboard=false",
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
    ap.add_argument("--train-repeats", type=int, default=2, help="alternating runs per layout")
    ap.add_argument("--skip-train", action="store_true", help="leave out table 4")
    ap.add_argument("--markdown", action="store_true", help="print tables as Markdown")
    ap.add_argument("--window", type=int, default=512, help="sliding window of table 5")
    ap.add_argument("--only-window", action="store_true", help="print table 5 only")
    a = ap.parse_args(argv)
    if a.window < 1:
        print(f"--window = {a.window}: must be a positive number of tokens", file=sys.stderr)
        return 2

    window_title = (f"5. sliding window {a.window}, seq {a.seq}, heads {a.heads}/{a.kv_heads}, "
                    f"head_dim {a.head_dim}: per-rank work of the ring's plan, forward kernels "
                    "replayed in one process (median of 3, interleaved)")
    if a.only_window:
        print(window_title)
        print(format_table(window_table(a.seq, a.window, heads=a.heads, kv_heads=a.kv_heads,
                                        dim=a.head_dim), markdown=a.markdown))
        return 0

    print("1. attention work per rank, causal (max/mean over ranks; 1.000 is balanced)")
    print(format_table(balance_table(), markdown=a.markdown), flush=True)

    rows, mean_len = document_table()
    print(f"\n2. work per rank with document masks: 4 packed rows of 32768 tokens, log-normal "
          f"document lengths (median 600, mean {mean_len:.0f}); ring tiles of 1024 "
          "(Ulysses: every rank attends the whole sequence for its heads, 1.000)", flush=True)
    print(format_table(rows, markdown=a.markdown), flush=True)

    for world in (2, 4):
        print(f"\n3. one attention layer, fwd+bwd, seq {a.seq}, heads {a.heads}/{a.kv_heads}, "
              f"head_dim {a.head_dim}, cp={world}, fp32, one thread per rank (median of "
              f"{a.iters}, variants interleaved; documents: median {a.seq // 16} tokens)",
              flush=True)
        print(format_table(layer_rows(world, a.seq, a.heads, a.kv_heads, a.head_dim, a.iters),
                           markdown=a.markdown), flush=True)

    print("\n" + window_title, flush=True)
    print(format_table(window_table(a.seq, a.window, heads=a.heads, kv_heads=a.kv_heads,
                                    dim=a.head_dim), markdown=a.markdown), flush=True)

    if a.skip_train:
        return 0
    print(f"\n4. training the debug model, seq 2048, global batch 4, 2 ranks ({a.train_steps - 1} "
          f"timed steps, median of {a.train_repeats} alternating runs)", flush=True)
    layouts = {"cp=1 (dp_shard=2)": ["--training.local_batch_size=2"],
               "cp=2": ["--training.local_batch_size=4", "--parallelism.context_parallel_degree=2"]}
    tps = {name: [] for name in layouts}
    for _ in range(a.train_repeats):
        for name, overrides in layouts.items():
            tps[name].append(run_distributed(_train_tps, 2, args=(overrides, a.train_steps),
                                             timeout_s=900)[0])
    print(format_table([{"layout": n, "tokens/s": f"{statistics.median(v):,.0f}"}
                        for n, v in tps.items()], markdown=a.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
