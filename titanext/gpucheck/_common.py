"""What every gpucheck row shares: the row itself, the run's context, errors and timers."""

from __future__ import annotations

import dataclasses
import statistics
import time
import traceback
from collections.abc import Callable, Iterable

import torch

__all__ = ["Ctx", "Row", "Skip", "guarded", "rel_err", "sqnr_db", "time_pairs"]


class Skip(Exception):  # noqa: N818 -- a row's outcome, not an error
    """Raised by a row that cannot run here; its message is the reason shown in the table."""


@dataclasses.dataclass
class Row:
    """One line of the table: a check (pass / FAIL against a target) or a measurement."""

    section: str
    name: str
    status: str  # "pass", "FAIL", "skipped", "measured"
    value: str = ""
    target: str = ""
    note: str = ""
    seconds: float = 0.0
    data: dict = dataclasses.field(default_factory=dict)  # the raw figures, for the JSON


@dataclasses.dataclass
class Ctx:
    """Where and how big: ``device`` is cuda or cpu; ``quick`` picks CPU-sized shapes."""

    device: torch.device
    quick: bool

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def need_cuda(self, what: str) -> None:
        if not self.cuda:
            raise Skip(f"needs CUDA ({what})")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def rel_err(actual: torch.Tensor, ref: torch.Tensor) -> float:
    """||actual - ref|| / ||ref|| in float64 (0 when both are zero)."""
    a, r = actual.detach().double(), ref.detach().double()
    den = r.norm().item()
    return (a - r).norm().item() / den if den else float((a - r).norm().item())


def sqnr_db(actual: torch.Tensor, ref: torch.Tensor) -> float:
    """Signal-to-quantisation-noise ratio in dB (higher is better)."""
    err = rel_err(actual, ref)
    return float("inf") if err == 0 else -20.0 * torch.log10(torch.tensor(err)).item()


def time_pairs(ctx: Ctx, variants: dict[str, Callable[[], object]], rounds: int,
               warmup: int = 2) -> dict[str, float]:
    """Median milliseconds of each variant, run in turns (A B A B ...) so drift hits all alike."""
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    ctx.sync()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            if ctx.cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def guarded(section: str, name: str, fn: Callable[[], Iterable[Row] | Row]) -> list[Row]:
    """Run one row function: its rows, a "skipped" row (``Skip``) or a FAIL row with the error.

    One failing row never hides the others (an out-of-memory error frees what it can first).
    """
    t0 = time.perf_counter()
    try:
        out = fn()
        rows = [out] if isinstance(out, Row) else list(out)
    except Skip as s:
        rows = [Row(section, name, "skipped", note=str(s))]
    except Exception as e:  # noqa: BLE001 -- reported in the table, the run goes on
        first = (str(e).strip().splitlines() or [""])[0][:200]
        tb = traceback.format_exc(limit=-3)
        rows = [Row(section, name, "FAIL", note=f"{type(e).__name__}: {first}",
                    data={"traceback": tb})]
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    took = time.perf_counter() - t0
    for r in rows:
        r.seconds = r.seconds or round(took / len(rows), 2)
    return rows
