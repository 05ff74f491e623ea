"""Several ranks on the one GPU: titanext's NCCL paths against one process.

Every other gpucheck row is single-rank, so on a one-GPU machine no NCCL collective of titanext
ever runs. NCCL 2.28 and newer let several ranks of one communicator share a GPU when
``NCCL_MULTI_RANK_GPU_ENABLE=1`` is set; older NCCL refuses with "Duplicate GPU detected". This
group reads the NCCL version, then trains a few fp32 steps of each 2-rank layout below on the
one GPU (both ranks on ``cuda:0``) and compares the losses with one process of the same run:

========================  ======================================================================
layout                    the NCCL path it drives
========================  ======================================================================
FSDP 2                    FSDP2's all-gather and reduce-scatter
TP 2                      DTensor redistributes of the TP plan (all-gather, reduce-scatter,
                          all-reduce) and loss_parallel
CP 2 ring                 the ring's send/recv of K and V (zigzag layout)
EP 2 all-to-all           the expert-parallel dispatch and combine (``all_to_all_single``)
PP 2 1F1B                 the pipeline's send/recv of activations and gradients
========================  ======================================================================

Without CUDA (the test suite) the rows say "skipped"; :func:`layout_losses` is the function each
rank runs, and the suite runs it on gloo ranks against one process.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import tempfile

import torch
import torch.distributed as dist

from titanext.config import load_config
from titanext.gpucheck._common import Ctx, Row, rel_err
from titanext.launch.local import run_distributed
from titanext.trainer import Trainer

__all__ = ["LAYOUTS", "check_multi_rank", "layout_losses", "nccl_version"]

SECTION = "check"

#: layout: (flavor, data-parallel degree, overrides) of a 2-rank run; the reference is the same
#: run in one process with the same global batch (local batch x the dp degree)
LAYOUTS: dict[str, tuple[str, int, list[str]]] = {
    "FSDP 2": ("debugmodel", 2, ["--parallelism.data_parallel_shard_degree=2"]),
    "TP 2": ("debugmodel", 1, ["--parallelism.tensor_parallel_degree=2"]),
    "CP 2 ring": ("debugmodel", 1, ["--parallelism.context_parallel_degree=2"]),
    "EP 2 all-to-all": ("debugmoe", 2, ["--parallelism.expert_parallel_degree=2"]),
    "PP 2 1F1B": ("debugmodel", 1, ["--parallelism.pipeline_parallel_degree=2",
                                    "--parallelism.pipeline_parallel_schedule=1F1B",
                                    "--parallelism.pipeline_parallel_microbatches=4"]),
}
STEPS, BATCH, SEQ = 3, 4, 128
#: fp32 on both sides; the layouts sum in another order than one process (and TF32 is off)
TOLERANCE = 1e-4


def run_overrides(flavor: str, layout: list[str], dump_folder: str, batch: int = BATCH
                  ) -> list[str]:
    """The fp32 run every layout and its reference share, plus ``layout``."""
    return [f"--model.flavor={flavor}", "--training.dataset=synthetic",
            f"--training.local_batch_size={batch}", f"--training.seq_len={SEQ}",
            f"--training.steps={STEPS}", "--training.seed=7", "--optimizer.lr=3e-3",
            "--optimizer.eps=1e-5", "--lr_scheduler.warmup_steps=1",
            "--training.mixed_precision_param=float32",
            "--training.mixed_precision_reduce=float32", "--metrics.enable_tensorboard=false",
            "--metrics.log_freq=1000", f"--job.dump_folder={dump_folder}", *layout]


def layout_losses(rank: int, world_size: int, name: str, dump_folder: str) -> list[float]:
    """Inside an initialised process group (any backend): train layout ``name`` (its one-process
    reference when ``world_size`` is 1) and return the per-step losses (the same on every
    rank)."""

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    flavor, dp, layout = LAYOUTS[name]
    overrides = (run_overrides(flavor, layout, dump_folder) if world_size > 1
                 else run_overrides(flavor, [], dump_folder, batch=BATCH * dp))
    cfg = load_config(None, overrides, world_size=world_size)
    with contextlib.redirect_stdout(io.StringIO()):
        return [float(x) for x in Trainer(cfg).train()]


def nccl_version() -> str | None:
    """The NCCL version torch was built with, as ``major.minor.patch`` (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def check_multi_rank(ctx: Ctx) -> list[Row]:
    """The NCCL version, then each 2-rank layout on the one GPU against one process."""
    if not ctx.cuda:
        return [Row(SECTION, f"2 ranks on one GPU: {name}", "skipped",
                    note="skipped: needs CUDA (the suite runs these layouts on gloo)")
                for name in LAYOUTS]


    logging.getLogger("titanext").setLevel(logging.ERROR)
    version = nccl_version()
    rows = [Row(SECTION, "NCCL version", "measured", value=version,
                note=f"{torch.cuda.device_count()} GPU(s) visible")]
    os.environ["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"
    for name, (flavor, dp, _) in LAYOUTS.items():
        with tempfile.TemporaryDirectory() as folder:
            ref = layout_losses(0, 1, name, f"{folder}/ref")
            _close_default_group()
            try:
                got = run_distributed(layout_losses, 2, args=(name, f"{folder}/2"),
                                      backend="nccl", timeout_s=300)[0]
            except Exception as e:  # noqa: BLE001 -- an NCCL refusal is the row's finding
                text = str(e)
                duplicate = "Duplicate GPU" in text
                rows.append(Row(SECTION, f"2 ranks on one GPU: {name}",
                                "skipped" if duplicate else "FAIL",
                                note=(f"NCCL {version} refuses several ranks per GPU "
                                      "(Duplicate GPU detected)" if duplicate
                                      else text.strip().splitlines()[-1][:300])))
                if duplicate:
                    break
                continue
        err = rel_err(torch.tensor(got), torch.tensor(ref))
        rows.append(Row(SECTION, f"2 ranks on one GPU: {name}",
                        "pass" if err <= TOLERANCE else "FAIL", value=f"{err:.1e}",
                        target=f"<= {TOLERANCE:g} (losses vs one process, fp32)",
                        note=f"{STEPS} steps {BATCH * dp}x{SEQ} {flavor}; NCCL {version}; losses "
                             + " ".join(f"{x:.4f}" for x in got),
                        data={"losses": got, "reference": ref}))
    return rows


def _close_default_group() -> None:

    if dist.is_initialized():
        dist.destroy_process_group()
