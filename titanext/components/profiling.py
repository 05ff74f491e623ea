"""``[profiling]``: torch.profiler windows, memory snapshots and the step table (docs/profiling.md).

:class:`StepProfiler` is what the trainer calls: entered around the training loop,
:meth:`~StepProfiler.around_step` around each step and :meth:`~StepProfiler.step` after it.

- **Traces.** torch.profiler runs on a schedule: the last ``profiler_active`` steps of every
  ``profile_freq`` are traced, the ``profiler_warmup`` steps before them run the profiler
  untraced. At the end of each window every rank writes
  ``<dump>/<save_traces_folder>/iteration_<N>/rank<R>_trace.json`` (Perfetto, chrome://tracing),
  reads it back into :func:`titanext.components.step_table.step_breakdown`, and writes that as
  ``rank<R>_step_table.json`` next to it. The ranks' tables are gathered to rank 0, which
  prints one table with a column per rank (so a straggler or a heavy pipeline stage shows in
  one look), names the steps traced, and draws the ranks' traces as one ``timeline.svg``
  (:mod:`titanext.components.trace_svg`).
- **Memory.** On CUDA, the allocator's history is recorded from the start and dumped every
  ``profile_freq`` steps as ``rank<R>_memory_snapshot.pickle`` (https://pytorch.org/memory_viz).
  Without CUDA (or with ``memory_snapshot_kind = "breakdown"``) one step per period runs under
  torch's MemTracker (:func:`titanext._fake_backend.mem_tracker`, as the dry run does) and its
  peak breakdown is written as ``rank<R>_memory_breakdown.json`` and ``.svg``. That step is the
  last one before each window's traced steps (every ``profile_freq``-th step without
  ``enable_profiling``), so the tracker's own cost never lands in a trace.

Profiling changes no numerics: the profiler and the tracker only observe the ops.

>>> from titanext.config import PipelinePlan, Profiling
>>> window_steps(Profiling(profile_freq=5, profiler_warmup=1, profiler_active=2), 12)
[[4, 5], [9, 10]]
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerAction, ProfilerActivity, profile

from titanext._compat import cuda_memory_snapshot, record_cuda_memory_history
from titanext._fake_backend import mem_tracker
from titanext._text import format_table
from titanext.components.step_table import breakdown_rows, simulated_idle, step_breakdown
from titanext.components.trace_svg import write_timeline
from titanext.config import PipelinePlan, Profiling
from titanext.schedules._torch_ir import around_stage_init, record_p2p_waits

__all__ = ["PipelineShape", "StepProfiler", "dump_cuda_history", "memory_svg",
           "record_cuda_history", "window_steps"]

MEMORY_HISTORY_ENTRIES = 100_000  # allocation events the CUDA history keeps
GiB = 2**30
TIMELINE_RANKS = 32  # rank 0 draws the first 32 ranks' traces of each window


@dataclass
class PipelineShape:
    """What the step table needs to replay this rank's pipeline schedule: the job's resolved
    :class:`~titanext.config.layout.PipelinePlan`, this rank and the pp process group."""

    plan: PipelinePlan
    pp_rank: int
    group: Any  # the pp process group


def window_steps(cfg: Profiling, total_steps: int) -> list[list[int]]:
    """The traced steps (1-based) of every window that closes by ``total_steps``."""
    return [[s for s in range(k - cfg.profiler_active + 1, k + 1)]
            for k in range(cfg.profile_freq, total_steps + 1, cfg.profile_freq)]


def _action(cfg: Profiling, done: int) -> ProfilerAction:
    """torch.profiler's action for the step after ``done`` finished steps."""
    pos = done % cfg.profile_freq  # 0-based position of the next step in its period
    first_active = cfg.profile_freq - cfg.profiler_active
    if pos >= first_active:
        return (ProfilerAction.RECORD_AND_SAVE if pos == cfg.profile_freq - 1
                else ProfilerAction.RECORD)
    return ProfilerAction.WARMUP if pos >= first_active - cfg.profiler_warmup else \
        ProfilerAction.NONE


class StepProfiler:
    """Runs ``[profiling]`` for one training loop; every method is a no-op when it is off.

    ``start_step`` is the number of steps already done (a resumed run), ``parts`` and
    ``optimizer`` are what MemTracker attributes (parameters, gradients, optimizer state),
    ``pipeline`` describes this rank's pipeline for the bubble prediction (None without one).
    """

    def __init__(self, cfg: Profiling, *, dump_folder: str, rank: int, device: torch.device,
                 start_step: int = 0, parts: Sequence[torch.nn.Module] = (),
                 optimizer: Any = None, pipeline: PipelineShape | None = None,
                 pipeline_schedule: Any = None):
        self.cfg, self.rank, self.device = cfg, rank, device
        self.trace_root = os.path.join(dump_folder, cfg.save_traces_folder)
        self.memory_root = os.path.join(dump_folder, cfg.save_memory_snapshot_folder)
        self.parts, self.optimizer, self.pipeline = list(parts), optimizer, pipeline
        self._pipeline_schedule, self._start = pipeline_schedule, start_step
        self._prof: profile | None = None
        self.tables: list[dict[str, Any]] = []  # this rank's step tables, one per window
        kind = cfg.memory_snapshot_kind
        self.cuda_history = cfg.enable_memory_snapshot and device.type == "cuda" and \
            kind in ("auto", "cuda_history")
        self.breakdown = cfg.enable_memory_snapshot and not self.cuda_history
        if self.breakdown and kind == "auto" and rank == 0:
            print(f"titanext: profiling: INFO: no CUDA allocator history on {device.type}; "
                  "the memory snapshot is torch's MemTracker breakdown (JSON + SVG) instead",
                  flush=True)

    # -- the loop's three calls --------------------------------------------------------------

    def __enter__(self) -> StepProfiler:
        if self.cfg.enable_profiling:
            if self._pipeline_schedule is not None:  # torch's schedules' P2P waits, marked

                record_p2p_waits()
            activities = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self._prof = profile(activities=activities, on_trace_ready=self._window_done,
                                 schedule=lambda done: _action(self.cfg, done))
            self._prof.step_num = self._start  # a resumed run keeps its windows' steps
            self._prof.__enter__()
        if self.cuda_history:
            record_cuda_history(True)
        return self

    def __exit__(self, *exc) -> None:
        if self._prof is not None:
            self._prof.__exit__(*exc)
            self._prof = None
        if self.cuda_history:
            record_cuda_history(False)

    @contextlib.contextmanager
    def around_step(self, step: int) -> Iterator[None]:
        """Wrap training step ``step`` (1-based): MemTracker runs here on breakdown steps."""
        if not (self.breakdown and self._breakdown_step(step)):
            yield
            return

        tracker = mem_tracker()
        tracker.track_external(*self.parts, self.optimizer)
        with around_stage_init(self._pipeline_schedule, tracker.module_hooks_paused), tracker:
            yield
        snap = next(iter(tracker.get_tracker_snapshot("peak").values()), {})
        memory = {str(getattr(k, "value", k)): int(v) for k, v in snap.items()}
        self._write_breakdown(step, memory)

    def step(self, step: int) -> None:
        """After training step ``step``: advance the profiler (a window may close and write
        its trace and table) and dump the CUDA memory history on its period."""
        if self._prof is not None:
            with warnings.catch_warnings():  # each window is its own trace, by design
                warnings.filterwarnings("ignore", message=".*Profiler clears events")
                self._prof.step()
        if self.cuda_history and step % self.cfg.profile_freq == 0:
            folder = self._folder(self.memory_root, step)
            dump_cuda_history(os.path.join(folder, f"rank{self.rank}_memory_snapshot.pickle"))

    # -- memory ---------------------------------------------------------------------------

    def _breakdown_step(self, step: int) -> bool:
        freq = self.cfg.profile_freq
        lead = self.cfg.profiler_active if self.cfg.enable_profiling else 0
        return step >= 1 and (step + lead) % freq == 0

    def _write_breakdown(self, step: int, memory: dict[str, int]) -> None:
        folder = self._folder(self.memory_root, step)
        peak = memory.pop("Total", sum(memory.values()))
        record = {"rank": self.rank, "step": step, "peak_bytes": peak, "bytes": memory,
                  "source": "torch.distributed._tools.mem_tracker.MemTracker, at the step's peak"}
        base = os.path.join(folder, f"rank{self.rank}_memory_breakdown")
        with open(base + ".json", "w") as f:
            json.dump(record, f, indent=1)
        with open(base + ".svg", "w") as f:
            f.write(memory_svg(memory, title=f"rank {self.rank}, step {step}: peak "
                                               f"{peak / GiB:.3f} GiB"))
        if self.rank == 0:
            print(f"titanext: profiling: step {step} memory breakdown (rank 0 peak "
                  f"{peak / GiB:.3f} GiB) in {folder}", flush=True)

    # -- traces and the table -------------------------------------------------------------

    def _folder(self, root: str, step: int) -> str:
        folder = os.path.join(root, f"iteration_{step}")
        os.makedirs(folder, exist_ok=True)
        return folder

    def _window_done(self, prof: profile) -> None:
        step = prof.step_num
        folder = self._folder(self.trace_root, step)
        path = os.path.join(folder, f"rank{self.rank}_trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            table = step_breakdown(json.load(f))
        table["rank"] = self.rank
        self._predict_bubble(table)
        with open(os.path.join(folder, f"rank{self.rank}_step_table.json"), "w") as f:
            json.dump(table, f, indent=1)
        self.tables.append(table)
        gathered: list[Any] = [table]
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, table)
        if self.rank == 0:
            steps = table["steps"]
            print(f"titanext: profiling: steps {steps[0]}-{steps[-1]} traced ({len(steps)} "
                  f"step(s)); traces in {folder}", flush=True)
            print(format_table(breakdown_rows(gathered)), flush=True)
            self._draw_timeline(folder, len(gathered), steps)

    def _draw_timeline(self, folder: str, world: int, steps: list[int]) -> None:
        """Rank 0 draws every rank's trace of the window (after the gather above, so each is
        written) into ``timeline.svg``; a trace on another host's filesystem is left out."""
        ranks = range(min(world, TIMELINE_RANKS))
        which = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
        path, missing = write_timeline(folder, ranks, f"{which}, every rank (ms)")
        drawn = len(ranks) - len(missing)
        note = "" if not missing else (f"; no trace of rank(s) {', '.join(map(str, missing))} "
                                       "in this folder (on another host's filesystem?)")
        print(f"titanext: profiling: timeline of {drawn} of {world} rank(s) in {path}{note}"
              if drawn else f"titanext: profiling: no timeline{note}", flush=True)

    def _predict_bubble(self, table: dict[str, Any]) -> None:
        """The simulator's idle fraction for the measured per-stage chunk costs of every pp
        rank (gathered over the pp group)."""
        p = self.pipeline
        if p is None or "pipeline" not in table:
            return
        chunks: list[Any] = [table["chunks"]]
        if p.plan.pp > 1:
            chunks = [None] * p.plan.pp
            dist.all_gather_object(chunks, table["chunks"], group=p.group)
        merged = {int(s): c for part in chunks for s, c in part.items()}
        try:
            table["pipeline"]["idle_simulated"] = simulated_idle(p.plan, pp_rank=p.pp_rank,
                                                                 chunks=merged)
        except (ValueError, KeyError, ZeroDivisionError) as e:  # shown as a note, not a crash
            table["pipeline"]["idle_simulated_error"] = f"{type(e).__name__}: {e}"


def memory_svg(memory: dict[str, int], title: str = "") -> str:
    """A stacked bar of a memory breakdown (bytes per category), largest at the bottom.

    >>> memory_svg({"Parameter": 3 * 2**20, "Gradient": 2**20}).count("<rect")
    2
    """
    colours = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#9d755d"]
    parts = sorted(((k, v) for k, v in memory.items() if v > 0), key=lambda kv: -kv[1])
    total = sum(v for _, v in parts) or 1
    height, top = 300, 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="460" height="{height + top + 20}" '
           'font-family="sans-serif" font-size="12">',
           f'<text x="10" y="20" font-size="14">{title}</text>']
    y = top + height
    for i, (name, value) in enumerate(parts):
        h = height * value / total
        y -= h
        out.append(f'<rect x="40" y="{y:.1f}" width="120" height="{h:.1f}" '
                   f'fill="{colours[i % len(colours)]}"/>')
        out.append(f'<text x="175" y="{y + h / 2 + 4:.1f}">{name}: {value / 2**20:.2f} MiB '
                   f'({100 * value / total:.1f}%)</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


# -- CUDA's allocator history (torch's private names are in titanext._compat) ------------------

def record_cuda_history(on: bool) -> None:
    """Start (stop) recording CUDA's allocator history (the last 100,000 events)."""
    record_cuda_memory_history(on, max_entries=MEMORY_HISTORY_ENTRIES)


def dump_cuda_history(path: str) -> None:
    """Write the recorded history to ``path``: the pickle https://pytorch.org/memory_viz reads."""
    with open(path, "wb") as f:
        pickle.dump(cuda_memory_snapshot(), f)
