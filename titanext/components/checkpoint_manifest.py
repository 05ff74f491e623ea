"""The checkpoint manifest and the checks made before anything is loaded.

Local, not collective: :func:`resume_problems` runs before any process starts
(``titanext-run`` and ``titanext.train`` exit 2 on its lines), and
:class:`~titanext.components.checkpoint.CheckpointManager`
resolves the step to load on each rank with the same functions, then raises the error class
named here on every rank alike. ``manifest.json`` (rank 0, written last) holds the resolved
config, the model name and flavor, every tensor's global shape, the layout, the titanext and
torch versions and the size of every other file; :func:`_damage` checks a step folder against
it, and :func:`_commit` publishes a written ``.tmp`` folder. Every public name here is also
importable from :mod:`titanext.components.checkpoint`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch

from titanext.errors import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointMismatch,
    CheckpointNotFound,
)

__all__ = ["config_changes", "interrupted_saves", "manifest_info", "read_manifest",
           "resume_problems", "step_folders"]

_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_DIR = re.compile(r"^step-(\d+)\.tmp$")
_METADATA = ".metadata"  # written last by DCP's coordinator
_TRAINER_STATE = "trainer_state.pt"
_MANIFEST = "manifest.json"
_MANIFEST_FORMAT = 1
_ERRORS = {cls.__name__: cls for cls in (CheckpointCorrupt, CheckpointMismatch,
                                         CheckpointNotFound, CheckpointError)}


def _save_file(obj: Any, path: str) -> None:
    """``torch.save`` and fsync, so the commit rename never publishes a file still in cache."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    """Make a rename inside ``path`` durable; best effort (not every file system allows it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _commit(tmp: str, final: str) -> None:
    """Publish a written ``step-<N>.tmp`` folder as ``step-<N>`` (rank 0, last)."""
    folder = os.path.dirname(final)
    if os.path.exists(final):
        # A directory cannot be replaced by rename while it is non-empty: move the old copy
        # aside first. A crash between the two renames loses only this step, never leaves
        # a partial step-<N>; the ".old" folder is cleaned up by the next save.
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(folder)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
        _fsync_dir(folder)


def _write_manifest(tmp: str, manifest: dict[str, Any]) -> None:
    """``manifest`` plus the size of every file in ``tmp`` (so a truncated copy is caught before
    DCP reads it), written last into ``tmp`` (rank 0, after every rank has written)."""
    files = {}
    for root, _dirs, names in os.walk(tmp):
        for name in names:
            full = os.path.join(root, name)
            files[os.path.relpath(full, tmp)] = os.path.getsize(full)
    with open(os.path.join(tmp, _MANIFEST), "w") as f:
        json.dump({**manifest, "files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def manifest_info(cfg: Any, layout: Any = None) -> dict[str, Any]:
    """What a trainer adds to every checkpoint's manifest: the resolved config (a dict), the
    model's name and flavor, and the parallel layout: a dict of degrees, or a ParallelDims.

    >>> from titanext.config import JobConfig
    >>> manifest_info(JobConfig(), {"tp": 2})["model"]
    {'name': 'llama3', 'flavor': 'debugmodel'}
    """
    config = json.loads(json.dumps(dataclasses.asdict(cfg), default=str))
    if layout is not None and not isinstance(layout, dict):
        layout = {axis: getattr(layout, axis)
                  for axis in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")}
    return {"config": config, "model": {"name": cfg.model.name, "flavor": cfg.model.flavor},
            "layout": dict(layout or {})}


def _versions() -> dict[str, str]:

    try:
        titanext_version = version("titanext")
    except PackageNotFoundError:
        titanext_version = "unknown"
    return {"titanext": titanext_version, "torch": torch.__version__}


def read_manifest(step_dir: str) -> dict[str, Any] | None:
    """The manifest of a step folder; None for a checkpoint saved before manifests existed.

    Raises :class:`CheckpointCorrupt` when the file exists but cannot be read.
    """
    path = os.path.join(step_dir, _MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            manifest = json.load(f)
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
            raise ValueError("not a titanext manifest")
    except (OSError, ValueError) as e:
        raise CheckpointCorrupt(f"checkpoint {step_dir!r}: file {_MANIFEST!r} is unreadable "
                                f"({e})") from None
    return manifest


def step_folders(folder: str) -> list[int]:
    """Every committed ``step-<N>`` folder, complete or not, ascending (``.tmp`` never counts)."""
    if not os.path.isdir(folder):
        return []
    return sorted(int(m.group(1)) for m in map(_STEP_DIR.match, os.listdir(folder)) if m)


def interrupted_saves(folder: str) -> list[int]:
    """Steps whose save started but was never committed (a ``step-<N>.tmp`` folder newer than
    every committed step: the job stopped during the save, e.g. with an async write in flight),
    ascending. Loading skips them; the next save removes them."""
    if not os.path.isdir(folder):
        return []
    newest = max(step_folders(folder), default=-1)
    return sorted(s for s in (int(m.group(1)) for m in map(_TMP_DIR.match, os.listdir(folder))
                              if m) if s > newest)


def _damage(step_dir: str) -> str | None:
    """How a committed step folder is incomplete ("file X is missing", ...), or None if intact.

    With a manifest every file is checked against the size recorded at save time (a truncated
    shard is caught here, before DCP reads it); without one (an older checkpoint) only the two
    files a load needs first.
    """
    try:
        manifest = read_manifest(step_dir)
    except CheckpointCorrupt:
        return f"file {_MANIFEST!r} is unreadable"
    if manifest is None:
        for name in (_METADATA, _TRAINER_STATE):
            if not os.path.exists(os.path.join(step_dir, name)):
                return f"file {name!r} is missing"
        return None
    for name, size in sorted(manifest["files"].items()):
        path = os.path.join(step_dir, name)
        if not os.path.isfile(path):
            return f"file {name!r} is missing"
        actual = os.path.getsize(path)
        if actual != size:
            return (f"file {name!r} has {actual} bytes, {size} were saved"
                    + (" (truncated)" if actual < size else ""))
    return None


def _flavor_of(model: dict[str, Any] | None) -> str:
    return f"{model['name']}/{model['flavor']}" if model else "an unrecorded model"


def _resolve(folder: str, load_step: int | str) -> tuple[int | None, str | None, str | None]:
    """(step to load or None, error class name, message) from this process's view of ``folder``.

    "latest" is the newest committed step folder: if it is damaged that is an error naming the
    folder, the file and the explicit fallback, never a silent step back to an older one.
    """
    if load_step == "none":
        return None, None, None
    steps = step_folders(folder)
    latest = load_step == "latest" or int(load_step) == -1
    if latest and not steps:
        return None, None, None
    step = steps[-1] if latest else int(load_step)
    shown = "'latest'" if latest else str(step)
    intact = [s for s in steps if _damage(os.path.join(folder, f"step-{s}")) is None]
    if step not in steps:
        return None, "CheckpointNotFound", (
            f"checkpoint.load_step = {shown}: there is no checkpoint step-{step} in {folder!r}; "
            f"available steps: {', '.join(map(str, intact)) if intact else 'none'}")
    path = os.path.join(folder, f"step-{step}")
    damage = _damage(path)
    if damage:
        older = [s for s in intact if s < step]
        fallback = (f"resume from an older step with --checkpoint.load_step={older[-1]}" if older
                    else "there is no older complete step: start fresh with "
                         "--checkpoint.load_step=none")
        return None, "CheckpointCorrupt", (
            f"checkpoint.load_step = {shown}: checkpoint {path!r} is incomplete or damaged: "
            f"{damage}; nothing was loaded. Either {fallback}, or move {path!r} aside")
    return step, None, None


def resume_problems(cfg: Any) -> list[str]:
    """What can be checked about the checkpoint to resume before any process starts: the step
    exists, its files are intact, and it was saved for the same model name and flavor.

    One line per problem (empty when there is nothing to resume); ``titanext.launch.run`` and
    ``titanext.train`` exit 2 on them.
    """
    c = cfg.checkpoint
    if not c.enable or c.load_step == "none":
        return []
    folder = os.path.join(cfg.job.dump_folder, c.folder)
    step, error, message = _resolve(folder, c.load_step)
    if error:
        return [message]
    if step is None:
        return []
    path = os.path.join(folder, f"step-{step}")
    manifest = read_manifest(path) or {}
    saved = manifest.get("model")
    if "weights_only" in manifest:
        return [f"checkpoint.load_step = {c.load_step!r}: {_weights_only(path)}"]
    current = {"name": cfg.model.name, "flavor": cfg.model.flavor}
    if saved and saved != current:
        return [f"model.flavor = {cfg.model.flavor!r}: {_mismatch(path, saved, current)}"]
    return []


def _weights_only(path: str) -> str:
    return (f"checkpoint {path!r} holds model weights only (checkpoint.model_weights_only = "
            "true at its save) and cannot resume training; start a new run from it with "
            f"--checkpoint.initial_load_path={path}, or resume an older full step with "
            "--checkpoint.load_step=<step>")


def _mismatch(path: str, saved: dict[str, Any] | None, current: dict[str, Any] | None,
              detail: str = "") -> str:
    return (f"checkpoint {path!r} was saved for {_flavor_of(saved)} and this run builds "
            f"{_flavor_of(current)}{detail}; resume with the [model] it was saved with, or start "
            "fresh with --checkpoint.load_step=none (or another --checkpoint.folder)")


def config_changes(saved: dict[str, Any] | None, current: dict[str, Any] | None) -> list[str]:
    """``section.key old -> new`` for every value that differs between two config dicts.

    >>> config_changes({"training": {"steps": 10}}, {"training": {"steps": 20}})
    ['training.steps 10 -> 20']
    """
    if not saved or not current:
        return []
    changes = []
    for section in sorted(saved.keys() | current.keys()):
        old, new = saved.get(section) or {}, current.get(section) or {}
        if not isinstance(old, dict) or not isinstance(new, dict):
            continue
        for key in sorted(old.keys() | new.keys()):
            if old.get(key) != new.get(key):
                changes.append(f"{section}.{key} {old.get(key)!r} -> {new.get(key)!r}")
    return changes
