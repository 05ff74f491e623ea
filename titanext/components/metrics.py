"""Training metrics: one console line per log step, a progress bar with ETA on terminals,
TensorBoard event files and (optionally) a Weights & Biases run, all on the logging rank only.

>>> import torch
>>> logger = MetricsLogger(job_dir=None, rank=0, is_logging_rank=True, log_freq=10,
...                        total_steps=100, enable_tensorboard=False, device=torch.device("cpu"),
...                        flops_per_token=6 * 5e6, peak_flops=1e12)
>>> logger.record_tokens(2048)
>>> metrics = logger.log(1, loss=5.5, grad_norm=1.2, lr=3e-4)  # doctest: +ELLIPSIS
step   1/100  loss 5.5000  grad_norm 1.2000  lr 3.000e-04  tps ... mfu ...%  memory rss ... GiB
>>> sorted(metrics)[:4]
['grad_norm', 'loss', 'lr', 'memory/rss_gib']
>>> logger.close()

Output goes through ``print`` to ``sys.stdout`` (looked up at each write, so redirection made
after construction is honoured). The same stream carries the progress bar, which is why we print
rather than use ``logging``: a bar and a log line must share one stream to be cleared correctly.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import sys
import time
from collections.abc import Mapping
from typing import IO, Any

import torch

__all__ = ["MetricsLogger", "device_peak_flops", "peak_flops_for_name"]

_GIB = 1024**3

# Dense (no 2:4 sparsity) bf16 tensor-core peak FLOP/s per device, from vendor datasheets, and
# whether the device has fp8 tensor cores at twice that rate. The first pattern that matches
# ``torch.cuda.get_device_name()`` wins, so more specific names come first ("H100 NVL" before
# "H100"); word boundaries keep "H20" from matching "H200" and "A10" from matching "A100"/"A10G".
_PEAK_BF16: tuple[tuple[str, float, bool], ...] = (
    (r"GB200", 2.5e15, True),
    (r"B200", 2.25e15, True),
    (r"B100", 1.75e15, True),
    (r"H200 NVL", 835e12, True),
    (r"H200", 989.4e12, True),  # SXM
    (r"H100 NVL", 835e12, True),
    (r"H[18]00 PCIe", 756.5e12, True),
    (r"H[18]00", 989.4e12, True),  # SXM ("H100 80GB HBM3")
    (r"H20\b", 148e12, True),
    (r"A[18]00", 312e12, False),  # SXM and PCIe share the tensor-core peak
    (r"A30\b", 165e12, False),
    (r"A10\b", 125e12, False),
    (r"L40S", 362.05e12, True),
    (r"L40\b", 181e12, True),
    (r"L4\b", 121e12, True),
    (r"MI3[02]5X", 1307.4e12, True),  # MI300X, MI325X
    (r"MI300A", 980.6e12, True),
    (r"MI250X", 383e12, False),
)


def peak_flops_for_name(name: str, dtype: torch.dtype = torch.bfloat16) -> float | None:
    """Dense peak FLOP/s of the device called ``name`` for ``dtype``, or None when unknown.

    bf16 and fp16 share the tensor-core rate. fp32 counts only when TF32 matmuls are enabled
    (``torch.set_float32_matmul_precision("high")``), at half the bf16 rate; plain IEEE fp32 runs
    on the vector units, whose peak is not tabled. fp8 is twice bf16 where the hardware has it.

    >>> peak_flops_for_name("NVIDIA H100 80GB HBM3") / 1e12
    989.4
    >>> peak_flops_for_name("NVIDIA A100-SXM4-80GB", torch.float8_e4m3fn) is None
    True
    """
    match = next((row for row in _PEAK_BF16 if re.search(row[0], name, flags=re.IGNORECASE)), None)
    if match is None:
        return None
    _, bf16, has_fp8 = match
    if dtype in (torch.bfloat16, torch.float16):
        return bf16
    if dtype == torch.float32:
        return bf16 / 2 if _tf32_enabled() else None
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return 2 * bf16 if has_fp8 else None
    return None


def _tf32_enabled() -> bool:
    # Either the legacy global switch or the per-backend one introduced in torch 2.9 can enable it.
    new_api = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    return torch.get_float32_matmul_precision() != "highest" or new_api == "tf32"


def device_peak_flops(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> float | None:
    """Dense peak FLOP/s of ``device`` for ``dtype``; None on CPU and on devices not tabled.

    ROCm GPUs report ``device.type == "cuda"`` too, so AMD Instinct names are in the table.

    >>> device_peak_flops(torch.device("cpu")) is None
    True
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return peak_flops_for_name(torch.cuda.get_device_name(device), dtype)


def _fmt_value(x: float) -> str:
    # Fixed 4 decimals keep at least 4 significant digits for values >= 0.1 and line up from one
    # log line to the next; smaller (or huge) values switch to scientific notation.
    return f"{x:.4f}" if x == 0 or 0.1 <= abs(x) < 1e6 or not math.isfinite(x) else f"{x:.4e}"


def _fmt_duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


# -- memory -------------------------------------------------------------------------------------

def _process_rss_gib() -> float:
    try:  # current RSS on Linux
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / _GIB
    except (OSError, ValueError, IndexError):
        import resource  # peak RSS elsewhere: kilobytes on Linux, bytes on macOS

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / _GIB if sys.platform == "darwin" else peak / 1024**2


def _memory(device: torch.device) -> tuple[str, dict[str, float]]:
    """Console text and scalars. CUDA peaks are since the previous call (we reset them)."""
    if device.type != "cuda":
        rss = _process_rss_gib()
        return f"memory rss {rss:.2f} GiB", {"memory/rss_gib": rss}
    total = torch.cuda.get_device_properties(device).total_memory / _GIB
    alloc = torch.cuda.max_memory_allocated(device) / _GIB
    reserved = torch.cuda.max_memory_reserved(device) / _GIB
    # Peak per log window, so a spike (e.g. a checkpoint save) shows where it happened.
    torch.cuda.reset_peak_memory_stats(device)
    text = (f"memory {alloc:.2f}/{reserved:.2f} GiB alloc/reserved "
            f"({100 * alloc / total:.1f}%/{100 * reserved / total:.1f}%)")
    return text, {"memory/max_allocated_gib": alloc, "memory/max_reserved_gib": reserved,
                  "memory/max_allocated_pct": 100 * alloc / total,
                  "memory/max_reserved_pct": 100 * reserved / total}


def _start_wandb(job_dir: str | os.PathLike[str] | None, config: Mapping[str, Any] | None):
    """A wandb run: the project from WANDB_PROJECT (default "titanext"), files under WANDB_DIR
    or else ``job_dir``; every other setting from wandb's own environment variables."""
    try:
        import wandb  # optional: the wandb extra
    except ImportError as e:
        raise ImportError("[metrics] enable_wandb = true needs wandb, which is not installed; "
                          "pip install 'titanext[wandb]'") from e
    folder = os.environ.get("WANDB_DIR") or (os.fspath(job_dir) if job_dir is not None else None)
    if folder is not None:
        os.makedirs(folder, exist_ok=True)
    return wandb.init(project=os.environ.get("WANDB_PROJECT", "titanext"), dir=folder,
                      config=dict(config or {}))


# -- logger -------------------------------------------------------------------------------------

_CLEAR_LINE = "\r\033[K"


class MetricsLogger:
    """Console line, progress bar and TensorBoard scalars for a training loop.

    Only ``is_logging_rank`` does anything: other ranks create no files and print nothing, so the
    trainer can call every method on every rank. Call :meth:`record_tokens` and :meth:`log` once
    per step; a line is printed when ``step == 1``, ``step % log_freq == 0`` or
    ``step == total_steps``.

    Throughput is measured per log window: tokens recorded since the previous log line divided by
    the wall time since it (or since construction, for the first line). Since step 1 is always
    logged, its line carries the warm-up (allocation, compilation) and every later line is free
    of it; after a resume the first window includes the warm-up. MFU is
    ``flops_per_token * tokens_per_s_per_device / peak_flops``. The ETA likewise ignores the
    first step this logger sees.

    ``peak_flops`` overrides the table lookup (``device_peak_flops(device, dtype)``); ``stream``
    overrides ``sys.stdout``. Example: see the module docstring.

    With ``enable_wandb`` the logging rank also starts a Weights & Biases run and logs the same
    scalars as TensorBoard, at the same steps (``wandb_config``: the run's config, e.g. the job
    config as a dict). wandb's own environment variables choose the rest: ``WANDB_PROJECT``
    (default "titanext"), ``WANDB_ENTITY``, ``WANDB_NAME`` (run name), ``WANDB_RUN_GROUP``,
    ``WANDB_TAGS``, ``WANDB_MODE`` (offline, disabled) and ``WANDB_DIR`` (default: ``job_dir``).
    wandb drops a step lower than one already logged, so log steps in order (the trainer does).
    """

    def __init__(self, *, job_dir: str | os.PathLike[str] | None, rank: int, is_logging_rank: bool,
                 log_freq: int, total_steps: int, enable_tensorboard: bool = True,
                 device: torch.device | None = None, flops_per_token: float | None = None,
                 num_devices: int = 1, tb_folder: str = "tb", color: bool = True,
                 progress_bar: bool = True, dtype: torch.dtype = torch.bfloat16,
                 peak_flops: float | None = None, stream: IO[str] | None = None,
                 enable_wandb: bool = False, wandb_config: Mapping[str, Any] | None = None):
        if log_freq < 1:
            raise ValueError(f"log_freq = {log_freq}: must be >= 1 (1 logs every step)")
        if num_devices < 1:
            raise ValueError(f"num_devices = {num_devices}: must be >= 1 (the world size)")
        self.rank, self.active = rank, is_logging_rank
        self.log_freq, self.total_steps = log_freq, total_steps
        self.device = device if device is not None else torch.device("cpu")
        self.flops_per_token, self.num_devices = flops_per_token, num_devices
        if peak_flops is None:
            peak_flops = device_peak_flops(self.device, dtype)
        self.peak_flops = peak_flops
        self._stream = stream
        tty = self.active and self._isatty()
        # NO_COLOR is the common convention for opting out of ANSI colours everywhere.
        self.color = color and tty and not os.environ.get("NO_COLOR")
        self.progress_bar = progress_bar and tty
        # A non-zero logging rank (e.g. the last pipeline stage, which owns the loss) says so.
        self._prefix = f"[rank {rank}] " if rank != 0 else ""
        self._tokens = 0
        self._t_window = time.perf_counter()
        self._last_logged_step: int | None = None
        self._first_step: tuple[int, float] | None = None  # (step, time it finished)
        self._bar_drawn = False
        self.writer = None
        if self.active and enable_tensorboard and job_dir is not None:
            from torch.utils.tensorboard import SummaryWriter  # slow import: only when used

            self.writer = SummaryWriter(log_dir=os.path.join(os.fspath(job_dir), tb_folder))
        self.wandb_run = None
        if self.active and enable_wandb:
            self.wandb_run = _start_wandb(job_dir, wandb_config)

    @property
    def stream(self) -> IO[str]:
        return self._stream if self._stream is not None else sys.stdout

    def _isatty(self) -> bool:
        isatty = getattr(self.stream, "isatty", None)
        return bool(isatty and isatty())

    def record_tokens(self, num_tokens: int) -> None:
        """Add the tokens processed globally (all data-parallel ranks) in the step just done."""
        self._tokens += int(num_tokens)

    def should_log(self, step: int) -> bool:
        """Whether :meth:`log` prints a line at ``step``.

        >>> MetricsLogger(job_dir=None, rank=0, is_logging_rank=False, log_freq=10,
        ...               total_steps=25).should_log(25)
        True
        """
        return step == 1 or step % self.log_freq == 0 or step == self.total_steps

    def log(self, step: int, *, loss: float | torch.Tensor,
            grad_norm: float | torch.Tensor | None = None, lr: float | None = None,
            extra: Mapping[str, float | torch.Tensor] | None = None,
            tb_extra: Mapping[str, float | torch.Tensor] | None = None,
            ) -> dict[str, float] | None:
        """Record ``step``; on a log step print a line, write scalars and return them.

        ``extra`` scalars go on the console line and to TensorBoard; ``tb_extra`` (e.g. one
        value per layer) only to TensorBoard and the returned dict.

        Returns None on non-log steps and on non-logging ranks. Tensors are read with ``float()``,
        which synchronises with the device, but only on log steps.
        """
        if not self.active:
            return None
        now = time.perf_counter()
        if self._first_step is None:
            self._first_step = (step, now)
        if not self.should_log(step):
            self._draw_bar(step, now)
            return None

        elapsed = max(now - self._t_window, 1e-9)
        steps_in_window = step - (self._last_logged_step if self._last_logged_step is not None
                                  else self._first_step[0] - 1)
        tps = self._tokens / elapsed
        tps_per_device = tps / self.num_devices
        metrics: dict[str, float] = {"loss": float(loss)}
        if grad_norm is not None:
            metrics["grad_norm"] = float(grad_norm)
        if lr is not None:
            metrics["lr"] = float(lr)
        metrics.update(tps=tps, tps_per_device=tps_per_device,
                       step_time_s=elapsed / max(steps_in_window, 1))
        mfu = None
        if self.peak_flops and self.flops_per_token:
            mfu = 100.0 * self.flops_per_token * tps_per_device / self.peak_flops
            metrics["mfu_pct"] = mfu
        mem_text, mem = _memory(self.device)
        metrics.update(mem)
        extras = {k: float(v) for k, v in (extra or {}).items()}
        metrics.update(extras)

        def paint(code: str, text: str) -> str:
            return f"\033[{code}m{text}\033[0m" if self.color else text

        parts = [paint("36", f"step {step:>{len(str(self.total_steps))}}/{self.total_steps}"),
                 paint("32", f"loss {_fmt_value(metrics['loss'])}")]
        if grad_norm is not None:
            parts.append(paint("33", f"grad_norm {_fmt_value(metrics['grad_norm'])}"))
        if lr is not None:
            parts.append(f"lr {metrics['lr']:.3e}")
        parts.append(paint("34", f"tps {tps:,.0f} ({tps_per_device:,.0f}/device)"))
        parts.append(paint("35", f"mfu {mfu:.2f}%" if mfu is not None else "mfu n/a"))
        parts.append(paint("90", mem_text))
        parts += [f"{k} {v:.4g}" for k, v in extras.items()]
        metrics.update({k: float(v) for k, v in (tb_extra or {}).items()})
        self._clear_bar()
        print(self._prefix + "  ".join(parts), file=self.stream, flush=True)

        self._write(metrics, step)
        self._tokens, self._t_window, self._last_logged_step = 0, now, step
        self._draw_bar(step, now)
        return metrics

    def log_validation(self, step: int, *, loss: float, perplexity: float, tokens: int,
                       seconds: float) -> dict[str, float] | None:
        """Print a validation line and write ``validation/loss`` and ``validation/perplexity``.

        >>> import io
        >>> out = io.StringIO()
        >>> MetricsLogger(job_dir=None, rank=0, is_logging_rank=True, log_freq=1, total_steps=9,
        ...               stream=out).log_validation(3, loss=2.0, perplexity=7.389, tokens=512,
        ...                                          seconds=0.5)
        {'validation/loss': 2.0, 'validation/perplexity': 7.389}
        >>> out.getvalue()
        'validation step 3/9  loss 2.0000  perplexity 7.389  (512 tokens, 0.5s)\\n'
        """
        if not self.active:
            return None
        scalars = {"validation/loss": float(loss), "validation/perplexity": float(perplexity)}
        self._clear_bar()
        print(f"{self._prefix}validation step {step}/{self.total_steps}  loss {loss:.4f}  "
              f"perplexity {perplexity:.4g}  ({tokens:,} tokens, {seconds:.1f}s)",
              file=self.stream, flush=True)
        self._write(scalars, step)
        return scalars

    def _write(self, scalars: dict[str, float], step: int) -> None:
        """To TensorBoard and wandb: the same names, values and step."""
        if self.writer is not None:
            for name, value in scalars.items():
                self.writer.add_scalar(name, value, step)
        if self.wandb_run is not None:
            self.wandb_run.log(scalars, step=step)

    # -- progress bar ---------------------------------------------------------------------------
    def _draw_bar(self, step: int, now: float) -> None:
        if not self.progress_bar or step >= self.total_steps:
            return
        first_step, first_time = self._first_step or (step, now)
        done = step - first_step
        eta = _fmt_duration((now - first_time) / done * (self.total_steps - step)) if done else "?"
        frac = step / max(self.total_steps, 1)
        tail = f" {step}/{self.total_steps} {100 * frac:5.1f}% ETA {eta}"
        # Leave a column free: writing the last one makes some terminals wrap the line.
        width = max(10, min(40, shutil.get_terminal_size().columns - len(tail) - 3))
        fill = int(width * frac)
        self.stream.write(f"\r[{'#' * fill}{'.' * (width - fill)}]{tail}\033[K")
        self.stream.flush()
        self._bar_drawn = True

    def _clear_bar(self) -> None:
        if self._bar_drawn:
            self.stream.write(_CLEAR_LINE)
            self._bar_drawn = False

    def close(self) -> None:
        """Clear the bar, close the TensorBoard writer and finish the wandb run. Safe to call
        twice."""
        self._clear_bar()
        if self.active:
            self.stream.flush()
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
            self.writer = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
