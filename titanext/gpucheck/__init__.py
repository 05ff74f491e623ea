"""``python -m titanext.gpucheck``: check and measure titanext on one CUDA GPU, in one command.

Checks, each against an fp32 (or CPU) reference with a stated tolerance:

- the ring-attention block kernels (``flash_cuda``) forward and backward in bf16: causal, GQA,
  document masks, and a value head dim different from the query's where the kernels take one;
- deferred weight gradients (linears, grouped experts) against one autograd backward;
- grouped GEMM (``torch._grouped_mm``) against the per-expert loop;
- every float8 recipe's linear (SQNR of output and gradients), and the float8 grouped experts
  (``[float8] moe_experts``: emulated everywhere, torchao's rowwise kernels on SM90);
- the trainer for a few steps on the debug, debugdeepseek (MLA + MoE + MTP) and 1B flavors:
  compile + selective AC, full AC + float8, and bf16 autocast, against fp32 eager.

Measurements, variants side by side in turns (medians and ratios): float8 against bf16 for one
linear and one 1B block (against torchao's published 1.39x), and for DeepSeek-V3-shaped grouped
experts (SM90); the deferred split's (I+W)/B;
tokens/s and MFU of the 1B flavor through the trainer; the planner's memory against
``torch.cuda.max_memory_allocated``. (The trainer side by side with a plain PyTorch loop and
torchtitan is a benchmark: ``benchmarks/side_by_side.py``, which ``benchmarks/gpu_session.sh``
runs after this command.)

It prints one table and writes it as JSON (``--json``). Without CUDA every row runs its logic at
CPU sizes and the rows that need a GPU say "skipped" (the tests run it so); without torchao the
torchao recipes say "skipped: torchao missing". Exit code 0 when nothing failed, 1 otherwise.

The ``ranks`` group runs 2 ranks on the one GPU where NCCL allows it
(``NCCL_MULTI_RANK_GPU_ENABLE=1``, NCCL 2.28+): FSDP, TP, the CP ring, the EP all-to-all and the
pipeline's send/recv against one process (:mod:`titanext.gpucheck.ranks`).

>>> from titanext.gpucheck import run_gpucheck
>>> rows = run_gpucheck("cpu", quick=True, only=["grouped"])
>>> [(r.name, r.status) for r in rows]
[('grouped GEMM float32 vs fp32 loop', 'pass')]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from titanext.gpucheck import kernels, ranks, speed, training
from titanext.gpucheck._common import Ctx, Row, guarded

__all__ = ["ROWS", "Row", "run_gpucheck"]


def _rows() -> dict[str, tuple[str, Callable]]:

    return {
        "ring": ("check", kernels.check_ring_kernels),
        "deferred": ("check", kernels.check_deferred_weight_grads),
        "grouped": ("check", kernels.check_grouped_gemm),
        "float8": ("check", kernels.check_float8),
        "trainer": ("check", training.check_trainer),
        "float8_speed": ("measure", speed.measure_float8),
        "split": ("measure", speed.measure_deferred_split),
        "throughput": ("measure", training.measure_trainer),
        "ranks": ("check", ranks.check_multi_rank),
    }


#: the row groups, in the order they run (``--only`` takes these names)
ROWS = ("ring", "deferred", "grouped", "float8", "split", "float8_speed", "throughput",
        "trainer", "ranks")


def run_gpucheck(device: str | None = None, *, quick: bool | None = None,
                 only: Sequence[str] | None = None,
                 on_row: Callable[[Row], None] | None = None) -> list[Row]:
    """Run the row groups (all, or ``only``) on ``device`` (default: CUDA if available, else
    CPU); ``quick`` (default: on CPU) uses CPU-sized shapes. ``on_row`` sees each row as it
    comes (progress)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    ctx = Ctx(dev, dev.type != "cuda" if quick is None else quick)
    table = _rows()
    unknown = sorted(set(only or ()) - set(table))
    if unknown:
        raise ValueError(f"unknown row group(s) {unknown}; choose from {list(ROWS)}")
    rows: list[Row] = []
    for key in ROWS:
        if only and key not in only:
            continue
        section, fn = table[key]
        for row in guarded(section, key, lambda fn=fn: fn(ctx)):
            rows.append(row)
            if on_row is not None:
                on_row(row)
    return rows
