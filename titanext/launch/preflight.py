"""Checks that run before any work starts: in the launcher (``titanext.launch.run``, before torchrun
spawns a worker) and again in ``titanext.train.main`` (before the process group exists).

- Output folders: ``job.dump_folder``, the checkpoint folder (with ``checkpoint.enable``) and the
  TensorBoard folder (with ``metrics.enable_tensorboard``) must be creatable and writable.
- The checkpoint to resume from (see :func:`titanext.components.checkpoint.resume_problems`):
  the step that ``checkpoint.load_step`` names exists, is complete and was saved for the same model.

Each problem is one line naming the key and the path; the caller exits 2.

>>> from titanext.config import JobConfig
>>> cfg = JobConfig()
>>> cfg.job.dump_folder = "/proc/no/such/place"
>>> preflight_problems(cfg)[0].startswith("job.dump_folder = '/proc/no/such/place'")
True
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from titanext.errors import ConfigError

__all__ = ["check_preflight", "folder_problem", "output_folders", "preflight_problems"]


def output_folders(cfg: Any) -> list[tuple[str, str]]:
    """(config key, path) of every folder the run writes to."""
    dump = cfg.job.dump_folder
    folders = [("job.dump_folder", dump)]
    if cfg.checkpoint.enable:
        folders.append(("checkpoint.folder", os.path.join(dump, cfg.checkpoint.folder)))
    if cfg.metrics.enable_tensorboard:
        folders.append(("metrics.save_tb_folder", os.path.join(dump, cfg.metrics.save_tb_folder)))
    return folders


def folder_problem(key: str, path: str) -> str | None:
    """Create ``path`` if needed and write a probe file into it; the problem line, or None."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        reason = e.strerror or str(e)
        return (f"{key} = {path!r}: cannot create this folder ({reason}); choose a path "
                "whose parent folders exist or can be created, and that are folders")
    try:
        fd, probe = tempfile.mkstemp(prefix=".titanext-write-check-", dir=path)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        return (f"{key} = {path!r}: the folder is not writable ({e.strerror or e}); "
                "fix its permissions or choose another path")
    return None


def preflight_problems(cfg: Any) -> list[str]:
    """Every problem found before start-up (checkpoint first: it writes nothing), one per line."""
    # titanext-run's checks stay torch-free
    from titanext.components.checkpoint import resume_problems

    problems = resume_problems(cfg)
    if problems:
        return problems
    for key, path in output_folders(cfg):
        problem = folder_problem(key, path)
        if problem:
            return [problem]  # the folders below a bad one would fail for the same reason
    return []


def check_preflight(cfg: Any) -> None:
    """Raise a ConfigError with :func:`preflight_problems`' lines, if any."""

    problems = preflight_problems(cfg)
    if problems:
        raise ConfigError(problems)
