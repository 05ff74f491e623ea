"""Expert-parallel all-to-all overlap, measured: DualPipeV at pp = 2 with ep = 2 inside each stage.

    python benchmarks/moe_overlap.py [--steps 6] [--bandwidth-mb 0 50] [--schedule DualPipeV]
                                     [--markdown]

Four gloo ranks (pp = 2 x dp_shard = 2, ep = 2 borrowed from dp_shard) train a 4-block MoE
model through the real Trainer, two Trainers per rank: ``expert_parallel_comm_overlap`` off
(A) and on (B), built once and stepped in turn A B A B (after one warm-up step each). Per
variant it reports the median step time and the median time each rank waited on all-to-alls
per step (``titanext.plugins._baton_threads.comm_waits``: time no chunk could compute because
every side waited for its collective), their ratios B / A, and the loss of both (equal: bitwise).

``--bandwidth-mb X`` emulates a slower link (:func:`titanext.plugins._baton_threads.emulated_link`):
every EP all-to-all completes at the earliest ``input bytes / (X MB/s)`` after its issue, the
same delay in both variants (0 = the plain gloo run). On the 2-core CPU machine the four
ranks share two cores and gloo's all-to-all itself needs them, so the plain run has little to
hide; the emulated link is where the overlap shows.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
import time

import torch
import torch.distributed as dist

from titanext._text import format_table
from titanext.launch.local import run_distributed

FLAVOR = "bench_moe4"
P = "--parallelism."


def _overrides(a, overlap: bool, folder: str) -> list[str]:
    return ["--model.flavor=" + FLAVOR, "--training.dataset=synthetic",
            f"--training.seq_len={a.seq_len}", f"--training.local_batch_size={a.batch}",
            "--training.steps=1000", "--training.mixed_precision_param=float32",
            "--metrics.enable_tensorboard=false", "--metrics.log_freq=1000",
            f"--job.dump_folder={folder}", P + "data_parallel_shard_degree=2",
            P + "expert_parallel_degree=2", P + "pipeline_parallel_degree=2",
            P + f"pipeline_parallel_schedule={a.schedule}",
            P + f"pipeline_parallel_microbatches={a.microbatches}",
            P + f"expert_parallel_comm_overlap={'true' if overlap else 'false'}"]


def _worker(rank: int, world: int, a, folder: str) -> dict:
    from titanext.config import load_config
    from titanext.models import MODEL_FLAVORS
    from titanext.models.moe import MoEArgs
    from titanext.plugins import _baton_threads
    from titanext.trainer import Trainer

    flavors = MODEL_FLAVORS["llama3"]
    flavors[FLAVOR] = dataclasses.replace(
        flavors["debugmoe"], dim=a.dim, n_layers=4, n_heads=8, n_kv_heads=4,
        moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=a.hidden, load_balance_coeff=None,
                    score_func="softmax"))
    trainers = [Trainer(load_config(None, _overrides(a, on, f"{folder}/{on}"), world_size=world))
                for on in (False, True)]
    out: dict = {}
    for bw in a.bandwidth_mb:
        link = _baton_threads.emulated_link(bw * 1e6) if bw else contextlib.nullcontext()
        times: dict = {0: [], 1: []}
        waits: dict = {0: [], 1: []}
        losses: dict = {0: [], 1: []}
        with link:
            for step in range(a.steps + 1):
                for v, t in enumerate(trainers):  # A B A B
                    dist.barrier()
                    _baton_threads.comm_waits(reset=True)
                    start = time.perf_counter()
                    loss, _ = t.train_step(t.next_microbatches())
                    elapsed = time.perf_counter() - start
                    wait = _baton_threads.comm_waits().exposed
                    if step:  # the first step of each is a warm-up
                        times[v].append(elapsed)
                        waits[v].append(wait)
                        losses[v].append(loss)
        out[bw] = {"time": times, "wait": waits, "loss": losses}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="timed steps per variant")
    ap.add_argument("--bandwidth-mb", type=float, nargs="+", default=[0.0, 50.0],
                    help="emulated link MB/s per run (0 = plain gloo)")
    ap.add_argument("--schedule", default="DualPipeV")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="sequences per dp rank and step")
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args(argv)
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        per_rank = run_distributed(_worker, 4, args=(a, folder), timeout_s=1800)
    rows = []
    for bw in a.bandwidth_mb:
        med = {v: statistics.median(max(r[bw]["time"][v][k] for r in per_rank)
                                    for k in range(a.steps)) for v in (0, 1)}
        wait = {v: [statistics.median(r[bw]["wait"][v]) for r in per_rank] for v in (0, 1)}
        same = all(r[bw]["loss"][0] == r[bw]["loss"][1] for r in per_rank)
        link = f"{bw:g} MB/s" if bw else "plain gloo"
        for v, name in ((0, "overlap off (A)"), (1, "overlap on (B)")):
            rows.append({"link": link, "variant": name, "step s (median)": med[v],
                         "a2a wait per rank s": " ".join(f"{x:.3f}" for x in wait[v]),
                         "losses equal": same})
        rows.append({"link": link, "variant": "ratio B / A",
                     "step s (median)": med[1] / med[0],
                     "a2a wait per rank s": " ".join(
                         f"{b / x:.2f}" if x else "-" for x, b in zip(wait[0], wait[1],
                                                                      strict=True)),
                     "losses equal": same})
    print(f"{a.schedule}, pp=2 x ep=2 (dp_shard=2), 4 gloo ranks, torch {torch.__version__}, "
          f"{a.steps} timed steps per variant, {a.microbatches} micro-batches of "
          f"{a.batch // a.microbatches} x {a.seq_len} tokens, dim {a.dim}, 8 experts top-2")
    print(format_table(rows, markdown=a.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
