"""What a checkpoint save costs the training loop: sync against async (and pinned) saves.

    python benchmarks/async_checkpoint.py [--markdown] [--rounds 6] [--dim 256] [--layers 2]

2 gloo ranks (``titanext.launch.local``, one thread each), a llama model of ``--dim`` x
``--layers`` with a 32k vocabulary under FSDP 2, AdamW, fp32, 2 x 128 tokens per rank; a
``CheckpointManager`` per ``[checkpoint] async_mode`` saves model and optimizer state (about
12 bytes per parameter) into a temporary folder. Each round, for every mode in turn: A, three
steps without a save; B, a step followed by ``maybe_save`` (the "saving step"), then the two
steps after it; then the manager's ``wait()`` (the commit of an async save, timed apart: in a
job it happens at the next save, where the write has long finished). The first round warms up
(the pinned mode starts torch's checkpoint process there) and is dropped. Per mode: medians of
the plain steps (A), of the saving step and of each step after it, and their ratios to the
plain step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

from titanext._text import format_table
from titanext.launch.local import run_distributed

MODES = ("disabled", "async", "async_with_pinned_mem")


def _body(rank, world_size, dim, layers, rounds, folder):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from titanext.components.checkpoint import CheckpointManager
    from titanext.models import ModelArgs
    from titanext.models.llama import Transformer

    torch.set_num_threads(1)
    args = ModelArgs(dim=dim, n_layers=layers, n_heads=8, n_kv_heads=4, vocab_size=32000)
    mesh = init_device_mesh("cpu", (world_size,))
    model = Transformer(args)
    model.init_weights(seed=0)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, args.vocab_size, (2, 129),
                           generator=torch.Generator().manual_seed(rank))
    managers = {mode: CheckpointManager(
        folder=os.path.join(folder, mode), interval=1, keep_latest_k=1, load_step="none",
        last_save=False, enable=True, model_parts=[model], optimizer=opt, lr_scheduler=None,
        dataloader=None, async_mode=mode) for mode in MODES}

    def step():
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def timed(fn):
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - start

    out = {mode: {"plain": [], "saving": [], "after1": [], "after2": [], "commit": []}
           for mode in MODES}
    save_step = 0
    for r in range(rounds + 1):
        for mode in MODES:
            ckpt, rec = managers[mode], out[mode]
            plain = [timed(step) for _ in range(3)]
            save_step += 1

            def saving(ckpt=ckpt, n=save_step):
                step()
                ckpt.maybe_save(n)

            times = [timed(saving), timed(step), timed(step), timed(ckpt.wait)]
            if r:  # round 0 warms up
                rec["plain"] += plain
                for key, t in zip(("saving", "after1", "after2", "commit"), times, strict=True):
                    rec[key].append(t)
    for ckpt in managers.values():
        ckpt.close()
    nbytes = sum(p.numel() for p in model.parameters()) * 4 * 3  # params, exp_avg, exp_avg_sq
    return out, nbytes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as folder:
        res, nbytes = run_distributed(_body, 2, args=(args.dim, args.layers, args.rounds,
                                                      folder), timeout_s=600)[0]
    rows = []
    for mode in MODES:
        r = {k: statistics.median(v) for k, v in res[mode].items()}
        rows.append({"async_mode": mode, "plain step ms": f"{1e3 * r['plain']:.0f}",
                     "saving step ms": f"{1e3 * r['saving']:.0f}",
                     "saving / plain": f"{r['saving'] / r['plain']:.2f}",
                     "1st after ms": f"{1e3 * r['after1']:.0f}",
                     "1st after / plain": f"{r['after1'] / r['plain']:.2f}",
                     "2nd after ms": f"{1e3 * r['after2']:.0f}",
                     "2nd after / plain": f"{r['after2'] / r['plain']:.2f}",
                     "commit wait ms": f"{1e3 * r['commit']:.0f}"})
    print(f"llama dim {args.dim} x {args.layers} layers, FSDP 2 gloo ranks, {nbytes / 2**20:.0f} "
          f"MiB of model + AdamW state per save, {args.rounds} rounds (medians); load "
          f"{os.getloadavg()[0]:.1f}")
    print(format_table(rows, markdown=args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
