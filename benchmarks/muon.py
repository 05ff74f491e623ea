"""Distributed Muon side by side: owners against every rank gathering everything, and a Muon
training step against an AdamW one.

    python benchmarks/muon.py [--markdown] [--rounds 5] [--world-size 4] [--ns-dtype float32]

One gloo process group of ``--world-size`` ranks (one thread each), the debug model (llama3
debugmodel, fp32, synthetic data, 4 x 128 tokens per rank) under FSDP over every rank.

1. The optimizer step alone, on the gradients of one training step, in turns: titanext's
   :class:`~titanext.components.muon.MuonWithAdamW` (each matrix's pieces gathered to one owner,
   orthogonalized there, scattered back) against the naive way (every rank all-gathers every
   matrix's update and orthogonalizes all of them). Per variant: bytes that cross between
   ranks per step (pieces in the Newton-Schulz dtype), Newton-Schulz FLOPs of the busiest rank,
   and the median step time. Target: the owner way's FLOPs per rank at most naive / dp + the
   largest matrix.
2. A whole training step with Muon against one with AdamW (two trainers in the same group,
   steps in turns A B A B): medians and their ratio (target: Muon within 1.3x).

Run ``cat /proc/loadavg`` next to it: on a loaded machine every time moves.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
import time

import torch

from titanext._text import format_table
from titanext.config.muon_split import ns_dtype_on
from titanext.launch.local import run_distributed

BASE = ["--training.dataset=synthetic", "--training.seq_len=128", "--training.local_batch_size=4",
        "--training.mixed_precision_param=float32", "--training.mixed_precision_reduce=float32",
        "--metrics.enable_tensorboard=false", "--metrics.log_freq=1000",
        "--checkpoint.enable=false", "--parallelism.check_replicated_grads_steps=0"]


def _naive_class():
    import torch
    from torch.distributed.tensor import DTensor

    from titanext.components.muon import MuonWithAdamW, _local, _piece, adjusted_lr, newton_schulz

    class NaiveMuon(MuonWithAdamW):
        """Every rank gathers every matrix's whole update and orthogonalizes all of them."""

        def _muon_step(self) -> None:
            for fqn, p, update, g in self._muon_items():
                u = update.to(self._ns_dtype)
                full = (DTensor.from_local(u, p.device_mesh, p.placements).full_tensor()
                        if isinstance(p, DTensor) else u)
                full3 = full if full.ndim == 3 else full.unsqueeze(0)
                ortho = torch.stack([newton_schulz(m, g["ns_coefficients"], g["ns_steps"],
                                                   g["eps"], self._ns_dtype) for m in full3])
                piece = _piece(fqn, p)
                o, s = piece.offsets, piece.sizes
                mine = ortho[o[0]:o[0] + s[0], o[1]:o[1] + s[1], o[2]:o[2] + s[2]]
                local = _local(p)
                local.mul_(1 - g["lr"] * g["weight_decay"])
                lr = adjusted_lr(g["lr"], g["adjust_lr_fn"], *full3.shape[1:])
                local.add_(mine.reshape(local.shape), alpha=-lr)

    return NaiveMuon


def _trainer(optimizer: str, folder: str, world_size: int, steps: int, ns_dtype: str):
    from titanext.config import load_config
    from titanext.trainer import Trainer

    cfg = load_config("train_configs/debug_model.toml", [
        *BASE, f"--training.steps={steps}", f"--optimizer.name={optimizer}",
        f"--optimizer.muon_ns_dtype={ns_dtype}",
        f"--job.dump_folder={folder}/{optimizer}"], world_size=world_size)
    with contextlib.redirect_stdout(io.StringIO()):
        return Trainer(cfg)


def _body(rank, world_size, rounds, folder, ns_dtype):
    import torch
    import torch.distributed as dist

    from titanext.components.muon_plan import ns_flops

    torch.set_num_threads(1)
    steps = 4 + 2 * rounds
    muon, adamw = (_trainer(o, folder, world_size, steps, ns_dtype) for o in ("Muon", "AdamW"))

    def step(trainer):
        dist.barrier()
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            trainer.train_step(trainer.next_microbatches())
        trainer.step += 1
        return time.perf_counter() - start

    for _ in range(2):
        step(muon), step(adamw)
    whole = {"Muon": [], "AdamW": []}
    for _ in range(rounds):
        whole["Muon"].append(step(muon))
        whole["AdamW"].append(step(adamw))

    # the optimizer step alone, on stand-in gradients (the trainer has zeroed the real ones;
    # the Newton-Schulz time does not depend on the values)
    owner = muon.optimizer
    naive = _naive_class()(owner.param_groups, lr=owner.defaults["lr"],
                           param_names=owner._names, foreach=True,
                           ns_dtype=getattr(torch, ns_dtype))
    naive.state = owner.state
    for g in owner.param_groups:
        for p in g["params"]:
            p.grad = p.detach() * 0.5 + 0.1  # a DTensor for a DTensor parameter
    opt_times = {"owner": [], "naive": []}
    for _ in range(rounds):
        for name, opt in (("owner", owner), ("naive", naive)):
            dist.barrier()
            start = time.perf_counter()
            opt.step()
            opt_times[name].append(time.perf_counter() - start)
    plan = owner._plan[1]
    size = torch.empty(0, dtype=getattr(torch, ns_dtype)).element_size()  # pieces travel in it
    naive_flops = sum(ns_flops(*m.shape) for m in plan.matrices)
    largest = max(ns_flops(*m.shape) for m in plan.matrices)
    # naive: every holding rank receives every other rank's piece of every matrix
    naive_bytes = sum(c.numel * (len({h for c2 in m.chunks for h in c2.holders}) - 1)
                      for m in plan.matrices for c in m.chunks) * size
    if rank:
        return None
    return {"whole": whole, "opt": opt_times, "owner_bytes": plan.bytes_moved(size),
            "naive_bytes": naive_bytes, "owner_flops": max(plan.flops),
            "naive_flops": naive_flops, "largest": largest, "matrices": len(plan.matrices)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--ns-dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                        help="[optimizer] muon_ns_dtype (auto: float32 on CPU, whose bfloat16 "
                             "GEMMs run ~4x slower; bfloat16 on CUDA)")
    args = parser.parse_args(argv)
    args.ns_dtype = ns_dtype_on(args.ns_dtype, "cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as folder:
        r = run_distributed(_body, args.world_size, args=(args.rounds, folder, args.ns_dtype),
                            timeout_s=600)[0]
    print(json.dumps(r), file=sys.stderr)  # the raw times, for a table rendered again
    med = {k: statistics.median(v) for k, v in r["opt"].items()}
    dp = args.world_size
    print(f"{r['matrices']} matrices over {dp} ranks (FSDP), {args.rounds} rounds in turns, "
          f"Newton-Schulz in {args.ns_dtype}")
    print(format_table([
        {"variant": "owner (titanext)", "bytes moved / step": f"{r['owner_bytes'] / 1e6:.2f} MB",
         "NS GFLOP, busiest rank": f"{r['owner_flops'] / 1e9:.2f}",
         "optimizer step (median)": f"{med['owner'] * 1e3:.0f} ms"},
        {"variant": "naive (every rank gathers all)",
         "bytes moved / step": f"{r['naive_bytes'] / 1e6:.2f} MB",
         "NS GFLOP, busiest rank": f"{r['naive_flops'] / 1e9:.2f}",
         "optimizer step (median)": f"{med['naive'] * 1e3:.0f} ms"}], markdown=args.markdown))
    bound = r["naive_flops"] / dp + r["largest"]
    print(f"\ntarget: owner NS FLOPs per rank {r['owner_flops'] / 1e9:.2f} G <= naive / dp + "
          f"largest matrix = {bound / 1e9:.2f} G: "
          f"{'met' if r['owner_flops'] <= bound else 'MISSED'}\n")
    whole = {k: statistics.median(v) for k, v in r["whole"].items()}
    print(format_table([{"optimizer": k, "training step (median)": f"{v * 1e3:.0f} ms",
                         "ratio to AdamW": f"{v / whole['AdamW']:.2f}x"}
                        for k, v in whole.items()], markdown=args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
