"""The planner's Muon Newton-Schulz term against a measured CPU step.

    python benchmarks/muon_ns_check.py [--world-size 4] [--rounds 5] [--ns-dtype float32]

One process, one thread. The planner (:mod:`titanext.planning.muon`) gives the busiest owner's
matrices for ``train_configs/debug_muon.toml`` on ``--world-size`` ranks under FSDP and their
Newton-Schulz FLOPs; its term is those FLOPs over the matmul rate. Here the rate is this CPU's,
measured on one square GEMM in the Newton-Schulz dtype, so the ratio measured / planned checks
the FLOP count and the rate model (not the GPU's fp32 slowdown, a datasheet figure). The
measured side runs :func:`titanext.components.muon.newton_schulz` on each of those matrices,
the GEMM and the iteration in turns, medians of ``--rounds``. Run ``cat /proc/loadavg`` next
to it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from titanext._text import format_table
from titanext.components.muon import newton_schulz
from titanext.components.muon_plan import assign_owners, blocks, matrix_flops
from titanext.config import load_config
from titanext.planning.layout import resolve_layout
from titanext.planning.muon import muon_matrices


def _busiest_matrices(world_size: int, ns_dtype: str) -> tuple[list, int]:
    cfg = load_config("train_configs/debug_muon.toml", [f"--optimizer.muon_ns_dtype={ns_dtype}"])
    lo = resolve_layout(cfg, world_size)
    mats = muon_matrices(lo, lo.pipe.ranks[0])
    costs = [matrix_flops(shape, split) for _, _, shape, split in mats]
    owners, flops = assign_owners(costs, [range(world_size)] * len(mats), world_size)
    busiest = max(range(world_size), key=lambda r: flops[r])
    return [m for m, o in zip(mats, owners) if o == busiest], flops[busiest]


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ns-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dtype = getattr(torch, args.ns_dtype)
    mats, flops = _busiest_matrices(args.world_size, args.ns_dtype)
    g = torch.Generator().manual_seed(0)
    updates = [torch.randn(shape, generator=g) for _, _, shape, _ in mats]
    a, b = torch.randn(512, 512, dtype=dtype), torch.randn(512, 512, dtype=dtype)
    gemm_flops = 2 * 512 ** 3

    def orthogonalize() -> None:
        for (_, _, shape, split), u in zip(mats, updates):
            for r0, rows, c0, cols in blocks(shape, split):
                newton_schulz(u[r0:r0 + rows, c0:c0 + cols].contiguous(), dtype=dtype)

    orthogonalize()  # warm-up
    gemm, ns = [], []
    for _ in range(args.rounds):  # in turns
        gemm.append(_seconds(lambda: [a @ b for _ in range(8)]) / 8)
        ns.append(_seconds(orthogonalize))
    rate = gemm_flops / statistics.median(gemm)
    planned = flops / rate
    measured = statistics.median(ns)
    print(format_table([{"NS dtype": args.ns_dtype, "matrices": len(mats),
                         "GFLOP (busiest owner)": f"{flops / 1e9:.2f}",
                         "CPU GEMM GFLOP/s": f"{rate / 1e9:.1f}",
                         "planned ms": f"{planned * 1e3:.0f}",
                         "measured ms": f"{measured * 1e3:.0f}",
                         "measured / planned": f"{measured / planned:.2f}"}]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
