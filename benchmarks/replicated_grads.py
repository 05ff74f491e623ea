"""The cost of the replicated-gradient check: time per checked step against an unchecked one.

    python benchmarks/replicated_grads.py [--markdown] [--rounds 8] [--layouts tp2,cp2,fsdp2,zero1]

Per layout, one ``titanext.trainer.Trainer`` on the debug model (2 gloo ranks, one thread each,
fp32, synthetic data, 4 x 128 tokens per rank) with ``check_replicated_grads_steps = 0``. After
two warm-up steps, the steps take turns: one unchecked, then one with the check installed for
that step only (``install_replicated_grad_check(..., steps=1)`` over the dims the trainer would
check), and so on, so load from elsewhere hits both alike. Per layout: the median step time of
each, the added time (median of the per-pair differences), the check alone (median time of
``ReplicatedGradCheck()`` on the gradients of the last step) and how many (parameter, dim)
pairs it checks. tp2 checks the norms (SequenceParallel's replicated DTensors); under cp2 and
fsdp2 FSDP spans every dim, so nothing is replicated and the check is a no-op (the rows show the
noise); zero1 (DDP over 2 ranks) checks every parameter over dp: the worst case.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import tempfile
import time

from titanext._text import format_table
from titanext.launch.local import run_distributed

LAYOUTS = {
    "tp2": ["--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1"],
    "cp2": ["--parallelism.context_parallel_degree=2",
            "--parallelism.data_parallel_shard_degree=1"],
    "fsdp2": ["--parallelism.data_parallel_shard_degree=2"],
    "zero1": ["--parallelism.data_parallel_shard_degree=2", "--parallelism.zero_stage=1"],
}


def _dims_meshes(trainer) -> dict:
    """The dims parallelize() checks: tp, cp, and the loss ranks under ZeRO-1 (DDP)."""
    d = trainer.dims
    meshes = {"tp": d.tp_mesh if d.tp_enabled else None,
              "cp": d.cp_mesh if d.cp_enabled else None,
              "dp": d.loss_mesh if trainer.layout.recipe.zero1(d) else None}
    return {name: mesh for name, mesh in meshes.items() if mesh is not None}


def _body(rank, world_size, layouts, rounds, folder):
    import torch
    import torch.distributed as dist

    from titanext.config import load_config
    from titanext.plugins.replicated_grads import ReplicatedGradCheck, install_replicated_grad_check
    from titanext.trainer import Trainer

    torch.set_num_threads(1)
    out = {}
    for name in layouts:
        cfg = load_config("train_configs/debug_model.toml", [
            "--training.dataset=synthetic", "--training.seq_len=128",
            "--training.local_batch_size=4", f"--training.steps={4 + 2 * rounds}",
            "--training.mixed_precision_param=float32",
            "--training.mixed_precision_reduce=float32", "--metrics.enable_tensorboard=false",
            "--metrics.log_freq=1000", "--checkpoint.enable=false",
            "--parallelism.check_replicated_grads_steps=0",
            f"--job.dump_folder={folder}/{name}", *LAYOUTS[name]], world_size=world_size)
        with contextlib.redirect_stdout(io.StringIO()):
            trainer = Trainer(cfg)
            meshes = _dims_meshes(trainer)

            def step(trainer=trainer):
                dist.barrier()
                start = time.perf_counter()
                trainer.train_step(trainer.next_microbatches())
                trainer.step += 1
                return time.perf_counter() - start

            for _ in range(2):
                step()
            plain, checked = [], []
            for _ in range(rounds):
                plain.append(step())
                install_replicated_grad_check(trainer.model_parts, meshes, steps=1)
                checked.append(step())
            # the check alone, on the gradients of one more backward
            for part in trainer.model_parts:
                part.zero_grad(set_to_none=False)
            check = ReplicatedGradCheck(trainer.model_parts, meshes)
            alone = []
            for _ in range(rounds):
                dist.barrier()
                start = time.perf_counter()
                check()
                alone.append(time.perf_counter() - start)
        out[name] = {"plain": plain, "checked": checked, "alone": alone,
                     "pairs": check.checked}
    dist.barrier()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--layouts", default="tp2,cp2,fsdp2,zero1")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    layouts = args.layouts.split(",")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as folder:
        res = run_distributed(_body, 2, args=(layouts, args.rounds, folder), timeout_s=600)[0]
    rows = []
    for name in layouts:
        r = res[name]
        plain, checked = statistics.median(r["plain"]), statistics.median(r["checked"])
        added = statistics.median(c - p for c, p in zip(r["checked"], r["plain"]))
        rows.append({"layout": name, "unchecked ms": round(1e3 * plain, 1),
                     "checked ms": round(1e3 * checked, 1), "added ms": round(1e3 * added, 2),
                     "added %": round(100 * added / plain, 1),
                     "check alone ms": round(1e3 * statistics.median(r["alone"]), 2),
                     "(param, dim) pairs": r["pairs"]})
    print(f"debug model, 2 gloo ranks, 4 x 128 tokens per rank, fp32, {args.rounds} pairs of "
          f"steps in turns (medians); load {os.getloadavg()[0]:.1f}")
    print(format_table(rows, markdown=args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
