"""The config rules of ``[profiling]`` (docs/profiling.md), one owner for each.

:func:`profiling_problems` checks that a profiling window fits the run and its own period,
that the trace and memory folders can be written, and that a CUDA memory history is asked for
only where CUDA exists. :mod:`titanext.config.rules` calls it while loading.

>>> from titanext.config.schema import JobConfig
>>> cfg = JobConfig()
>>> cfg.profiling.enable_profiling, cfg.training.steps, cfg.profiling.profile_freq = True, 5, 10
>>> profiling_problems(cfg, set())[0][:60]
'profiling.profile_freq = 10 is longer than the run (training'
"""

from __future__ import annotations

import os

from titanext.config.field_rules import writable_folder_problem
from titanext.config.schema import JobConfig

__all__ = ["profiling_problems"]


def profiling_problems(cfg: JobConfig, skip: set[str]) -> list[str]:
    """One line per problem of ``[profiling]`` (nothing when it is off); keys in ``skip``
    failed their own check and are left out."""
    pr, steps = cfg.profiling, cfg.training.steps
    if not (pr.enable_profiling or pr.enable_memory_snapshot):
        return []
    problems: list[str] = []
    keys = {"profiling.profile_freq", "profiling.profiler_warmup", "profiling.profiler_active",
            "training.steps"}
    if not keys & skip and pr.profile_freq > steps:
        problems.append(
            f"profiling.profile_freq = {pr.profile_freq} is longer than the run (training.steps "
            f"= {steps}): no profiling window or memory snapshot would close; set "
            f"profile_freq <= {steps}")
    if not keys & skip and pr.enable_profiling \
            and pr.profiler_warmup + pr.profiler_active > pr.profile_freq:
        problems.append(
            f"profiling.profiler_warmup ({pr.profiler_warmup}) + profiling.profiler_active "
            f"({pr.profiler_active}) = {pr.profiler_warmup + pr.profiler_active} must be <= "
            f"profiling.profile_freq = {pr.profile_freq} (a window is the last warmup + active "
            "steps of every profile_freq steps)")
    folders = [("save_traces_folder", pr.enable_profiling),
               ("save_memory_snapshot_folder", pr.enable_memory_snapshot)]
    for key, used in folders:
        if used and f"profiling.{key}" not in skip and "job.dump_folder" not in skip:
            folder = getattr(pr, key)
            why = writable_folder_problem(os.path.join(cfg.job.dump_folder, folder))
            if why:
                problems.append(
                    f"profiling.{key} = {folder!r} (under job.dump_folder = "
                    f"{cfg.job.dump_folder!r}) cannot be written: {why}; choose a writable "
                    "folder")
    if pr.enable_memory_snapshot and pr.memory_snapshot_kind == "cuda_history" \
            and "profiling.memory_snapshot_kind" not in skip and not _cuda_available():
        problems.append(
            "profiling.memory_snapshot_kind = 'cuda_history' needs CUDA's allocator history "
            "recorder, and this machine has no CUDA device; use 'auto' or 'breakdown' "
            "(torch's MemTracker breakdown as JSON and SVG)")
    return problems


def _cuda_available() -> bool:
    import torch  # lazy: only a config that insists on the CUDA history pays for it

    return torch.cuda.is_available()
