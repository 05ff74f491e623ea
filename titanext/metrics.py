"""Training metrics: one console line per log step, a progress bar with ETA on terminals, and
TensorBoard event files.

>>> logger = MetricsLogger(job_dir="outputs/job", rank=0, is_logging_rank=True, log_freq=10,
...                        total_steps=100, enable_tensorboard=False, device=torch.device("cpu"),
...                        flops_per_token=6 * 5e6)
>>> logger.record_tokens(2048)
>>> logger.log(1, loss=5.5, grad_norm=1.2, lr=3e-4)            # doctest: +SKIP
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["MetricsLogger", "device_peak_flops", "format_table"]

# Dense bf16 peak FLOP/s (no sparsity) by a substring of torch.cuda.get_device_name().
_PEAK_BF16 = (
    ("B200", 2.25e15),
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM / HBM3
    ("H20", 148e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10G", 125e12),
    ("MI300X", 1307e12),
)


def device_peak_flops(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> float | None:
    """Dense peak FLOP/s of ``device`` for ``dtype`` (bf16/fp16), or None when unknown (CPU)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in _PEAK_BF16:
        if key in name:
            return peak
    return None


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """Render ``rows`` as an aligned text table (numbers right-aligned)."""
    if not rows:
        return ""
    columns = list(columns or rows[0].keys())

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"
        return "" if v is None else str(v)

    cells = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    numeric = [all(isinstance(r.get(c), (int, float)) or r.get(c) is None for r in rows) for c in columns]

    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    out = [line(columns), "  ".join("-" * w for w in widths)]
    out += [line(row) for row in cells]
    return "\n".join(out)


def _memory(device: torch.device) -> tuple[str, dict[str, float]]:
    gib = 1024**3
    if device.type == "cuda":
        alloc = torch.cuda.max_memory_allocated(device) / gib
        reserved = torch.cuda.max_memory_reserved(device) / gib
        total = torch.cuda.get_device_properties(device).total_memory / gib
        return (f"memory {alloc:.2f}/{reserved:.2f} GiB ({100 * reserved / total:.0f}%)",
                {"memory/max_allocated_gib": alloc, "memory/max_reserved_gib": reserved})
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / gib
    except (OSError, ValueError):
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
    return f"rss {rss:.2f} GiB", {"memory/rss_gib": rss}


class MetricsLogger:
    """Logs on ``is_logging_rank`` only; other ranks do nothing (cheaply)."""

    def __init__(self, *, job_dir: str | None, rank: int, is_logging_rank: bool, log_freq: int,
                 total_steps: int, enable_tensorboard: bool, device: torch.device,
                 flops_per_token: float | None = None, num_devices: int = 1, tb_folder: str = "tb",
                 color: bool = True, progress_bar: bool = True, stream=None):
        self.rank, self.active = rank, is_logging_rank
        self.log_freq, self.total_steps = log_freq, total_steps
        self.device, self.flops_per_token, self.num_devices = device, flops_per_token, num_devices
        self.stream = stream or sys.stdout
        tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.color = color and tty
        self.bar = progress_bar and tty and is_logging_rank
        self.peak = device_peak_flops(device)
        self._tokens = 0
        self._t_last = time.perf_counter()
        self._t_start = self._t_last
        self._start_step: int | None = None
        self.writer = None
        if self.active and enable_tensorboard and job_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(os.path.join(job_dir, tb_folder))

    def record_tokens(self, n: int) -> None:
        """Add the tokens processed (globally) in the step just finished."""
        self._tokens += n

    def should_log(self, step: int) -> bool:
        return step == 1 or step % self.log_freq == 0 or step == self.total_steps

    def log(self, step: int, *, loss: float, grad_norm: float, lr: float,
            extra: dict[str, float] | None = None) -> dict[str, float] | None:
        """Log ``step`` if it is a log step; returns the metrics dict (None otherwise)."""
        if not self.active:
            return None
        if self._start_step is None:
            self._start_step = step - 1
        if not self.should_log(step):
            self._draw_bar(step)
            return None
        now = time.perf_counter()
        elapsed = max(now - self._t_last, 1e-9)
        tps = self._tokens / elapsed
        tps_dev = tps / self.num_devices
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "tps": tps, "tps_per_device": tps_dev}
        mfu = None
        if self.peak and self.flops_per_token:
            mfu = 100.0 * self.flops_per_token * tps_dev / self.peak
            metrics["mfu_pct"] = mfu
        mem_text, mem = _memory(self.device)
        metrics.update(mem)
        metrics.update(extra or {})
        self._tokens, self._t_last = 0, now
        c = (lambda code, s: f"\033[{code}m{s}\033[0m") if self.color else (lambda code, s: s)
        parts = [c("36", f"step {step:>{len(str(self.total_steps))}}/{self.total_steps}"),
                 c("32", f"loss {loss:.4f}"), f"grad_norm {grad_norm:.4f}", f"lr {lr:.2e}",
                 c("33", f"tps {tps:,.0f} ({tps_dev:,.0f}/device)")]
        parts.append(f"mfu {mfu:.1f}%" if mfu is not None else "mfu n/a")
        parts.append(mem_text)
        parts += [f"{k} {v:.4g}" for k, v in (extra or {}).items()]
        if self.bar:
            self.stream.write("\r\033[K")
        print("  ".join(parts), file=self.stream, flush=True)
        if self.writer is not None:
            for k, v in metrics.items():
                self.writer.add_scalar(k, v, step)
        self._draw_bar(step)
        return metrics

    def _draw_bar(self, step: int) -> None:
        if not self.bar or step >= self.total_steps:
            return
        done = step - (self._start_step or 0)
        rate = (time.perf_counter() - self._t_start) / max(done, 1)
        eta = rate * (self.total_steps - step)
        width = 30
        fill = int(width * step / self.total_steps)
        self.stream.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {step}/{self.total_steps} "
                          f"ETA {int(eta // 60)}m{int(eta % 60):02d}s")
        self.stream.flush()

    def close(self) -> None:
        if self.bar:
            self.stream.write("\r\033[K")
            self.stream.flush()
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
            self.writer = None
