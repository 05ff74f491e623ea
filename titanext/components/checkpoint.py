"""Distributed checkpoints with torch.distributed.checkpoint (DCP): atomic, prunable, reshardable.

Layout of one checkpoint, ``<folder>/step-<N>/``:

- DCP shards and ``.metadata`` for ``{"model": ..., "optimizer": ...}``: the model state of
  every model part merged into one dict keyed by FQN, and the optimizer state in the
  flattened per-parameter form (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``). Both are
  stored as global tensors by name, so a checkpoint saved under one layout loads under
  another (FSDP 4 -> FSDP 2 x TP 2, a different number of param groups, ...).
- ``trainer_state.pt`` (rank 0, ``torch.save``): step, world size, LR scheduler, data loader
  and ``extra_states``. These are small, plain and the same on every rank.

Nothing a resume reads runs code (:mod:`titanext._safe_load`): the ``.pt`` files hold
plain data only (tensors, numbers, strings, lists, dicts; other state refuses to save) and are
read with ``torch.load(weights_only=True)``, DCP's ``.metadata`` pickle is read by an unpickler
that builds only DCP's metadata classes, and DCP's non-tensor entries with
``weights_only=True``. A file that asks for anything else raises
:class:`~titanext.errors.CheckpointUnsafe` before anything is loaded, and its payload never
runs. Checkpoints written before this rule load unchanged when they hold plain data (titanext's
own state always did).
- ``rng-<rank>.pt``: each rank's CPU (and CUDA) RNG state; restored only under the same world
  size.
- ``zero1_optimizer.pt``: with a ``ZeroRedundancyOptimizer`` (ZeRO-1), whose state DCP's
  helpers cannot read, the consolidated optimizer state dict instead of DCP's "optimizer".
- ``manifest.json`` (rank 0, written last): the resolved config, the model name, flavor and
  every tensor's global shape, the layout it was saved under, the titanext and torch versions,
  and the size of every other file. Resuming checks it first: a missing or truncated file
  raises :class:`~titanext.errors.CheckpointCorrupt` naming the step folder and the file, and
  another model raises :class:`~titanext.errors.CheckpointMismatch` naming both flavors.

The manifest and the checks made before loading live in
:mod:`titanext.components.checkpoint_manifest`; their public names import from here too.

``async_mode`` ("async", "async_with_pinned_mem") writes in the background
(:mod:`titanext.components.checkpoint_async`): the manifest is written and the folder renamed
only once every rank's write has finished, at the next save, a resume or :meth:`wait`.
``model_weights_only`` makes the last save (``maybe_save(step, last=True)``) hold the model
only, in ``export_dtype``: a start for ``initial_load_path`` or an HF conversion, not a resume.

Which step ``load_step = "latest"`` resumes is the newest ``step-<N>`` folder; a damaged one
is an error, never silently skipped (its message names ``--checkpoint.load_step=<older step>``).

A save is written into ``step-<N>.tmp/`` and renamed to ``step-<N>`` by rank 0 only after
every rank has finished writing, so an interrupted save never looks like a checkpoint. Stale
``.tmp`` folders are ignored when loading and removed by the next save.

>>> ckpt = CheckpointManager(folder="outputs/ckpt", interval=100, keep_latest_k=2,
...                          load_step="latest", last_save=True, enable=True,
...                          model_parts=[model], optimizer=opt, lr_scheduler=sched,
...                          dataloader=loader)         # in a training job  # doctest: +SKIP
>>> step = ckpt.load()         # 0 when there is nothing to resume  # doctest: +SKIP
>>> ckpt.maybe_save(step + 1)  # saves when step % interval == 0    # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from titanext._safe_load import (
    PlainBytesLoadPlanner,
    check_dcp_metadata,
    load_plain,
    plain_state,
)
from titanext.components.checkpoint_async import (
    ASYNC_MODES,
    EXPORT_DTYPES,
    AsyncSaver,
    cast_for_export,
)
from titanext.components.checkpoint_manifest import (
    _ERRORS,
    _MANIFEST_FORMAT,
    _TRAINER_STATE,
    _commit,
    _damage,
    _mismatch,
    _resolve,
    _save_file,
    _versions,
    _weights_only,
    _write_manifest,
    config_changes,
    interrupted_saves,
    manifest_info,
    read_manifest,
    resume_problems,
    step_folders,
)
from titanext.errors import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointMismatch,
    CheckpointUnsafe,
)

__all__ = ["CheckpointManager", "config_changes", "interrupted_saves", "manifest_info",
           "read_manifest", "resume_problems"]

logger = logging.getLogger("titanext")

# Leftovers of interrupted saves (".tmp") and of an interrupted re-save swap (".old").
_STALE_DIR = re.compile(r"^step-\d+\.(tmp|old)$")
_ZERO1_OPTIMIZER = "zero1_optimizer.pt"
# The flattened form keys optimizer state by parameter FQN, not by param-group position, so it
# survives layouts that group parameters differently (TP alone puts DTensors and plain
# tensors in separate groups; FSDP puts everything in one).
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _is_zero1(optimizer: Any) -> bool:
    # Looked up instead of imported: importing torch.distributed.optim costs time and scripts
    # functional optimizers, and an instance cannot exist unless its module is loaded.
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    return zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer)


@contextlib.contextmanager
def _single_process_is_intended() -> Iterator[None]:
    """Silence DCP's warning that it runs in one process: without a process group we mean to."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*uninitialized",
                                category=UserWarning)
        yield


def _local_tensor(t: Any) -> Any:
    return t.to_local() if isinstance(t, DTensor) else t


def _load_file(path: str) -> Any:
    # Plain data only (plain_state at save): a file that needs code raises CheckpointUnsafe.
    return load_plain(path)


def _follow_current_schedule(scheduler: Any, optimizer: Any, current_lrs: list[float]) -> None:
    """After loading a LambdaLR's state: the current config's peak LRs and schedule at the saved
    step, so that the first resumed step runs at the LR an uninterrupted run with the current
    config would use (the saved LRs would otherwise win until the scheduler's next step)."""
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if lambdas is None or len(current_lrs) != len(optimizer.param_groups):
        return
    scheduler.base_lrs = list(current_lrs)
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(current_lrs, lambdas, strict=True)]
    for group, base, lr in zip(optimizer.param_groups, current_lrs, lrs, strict=True):
        group["initial_lr"], group["lr"] = base, lr
    scheduler._last_lr = lrs  # what get_last_lr() reports (no public setter)


def _saved_shapes(path: str, manifest: dict[str, Any] | None) -> dict[str, list[int]]:
    """Global shape of every saved model tensor, from the manifest or else DCP's metadata."""
    if manifest is not None and "shapes" in manifest:
        return manifest["shapes"]
    metadata = dcp.FileSystemReader(path).read_metadata()
    return {key[len("model."):]: list(meta.size)
            for key, meta in metadata.state_dict_metadata.items()
            if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}


class CheckpointManager:
    """Save every ``interval`` steps (and after the last one with ``last_save``); resume on load.

    Args:
        folder: where the ``step-<N>`` folders live (created on the first save).
        interval: save when ``step % interval == 0``.
        keep_latest_k: keep only the newest k complete checkpoints (0 keeps all).
        load_step: "latest" (or -1) resumes from the highest complete step, "none" starts
            fresh, a step number loads exactly that step (ValueError if it is missing).
        last_save: :meth:`maybe_save` with ``last=True`` saves whatever the interval.
        enable: with False every method is a no-op (``load`` returns 0).
        model_parts: the model, or its pipeline stages on this rank; their FQNs must be unique
            across parts (pipeline stages keep the full model's names).
        optimizer: one optimizer over the parameters of all parts; a ZeroRedundancyOptimizer
            is saved consolidated (see the module docstring).
        lr_scheduler, dataloader: objects with ``state_dict``/``load_state_dict`` (or None).
            Their state must be the same on every rank: only rank 0's copy is saved.
        extra_states: more such objects by name (same rule).
        process_group: the ranks that save and load together (default: the world).
        manifest: what to record about the run in each checkpoint's manifest and check on
            load (see :func:`manifest_info`): ``config``, ``model`` (name, flavor), ``layout``.
        async_mode: "disabled", "async" or "async_with_pinned_mem" (module docstring).
        model_weights_only: the last save holds the model only, cast to ``export_dtype``
            ("float32", "bfloat16" or "float16").

    Every method except :meth:`latest_step` / :meth:`complete_steps` is collective: all ranks
    of ``process_group`` call it.
    """

    def __init__(self, *, folder: str, interval: int, keep_latest_k: int, load_step: int | str,
                 last_save: bool, enable: bool, model_parts: list[nn.Module],
                 optimizer: torch.optim.Optimizer, lr_scheduler: Any, dataloader: Any,
                 extra_states: dict[str, Any] | None = None,
                 process_group: dist.ProcessGroup | None = None,
                 manifest: dict[str, Any] | None = None, async_mode: str = "disabled",
                 model_weights_only: bool = False, export_dtype: str = "float32"):
        self.folder, self.interval, self.keep_latest_k = folder, interval, keep_latest_k
        self.load_step, self.last_save, self.enable = load_step, last_save, enable
        self.model_parts = list(model_parts)
        self.optimizer, self.lr_scheduler, self.dataloader = optimizer, lr_scheduler, dataloader
        self.extra_states = dict(extra_states or {})
        self.process_group = process_group
        self.manifest = dict(manifest or {})
        self.model_weights_only, self.export_dtype = model_weights_only, export_dtype
        self._async: AsyncSaver | None = None
        self._pending: tuple[int, bool, float] | None = None  # (step, weights only, start)
        if not enable:
            return
        if async_mode not in ASYNC_MODES:
            raise ValueError(f"checkpoint.async_mode = {async_mode!r}; it must be one of "
                             f"{', '.join(map(repr, ASYNC_MODES))}")
        if export_dtype not in EXPORT_DTYPES:
            raise ValueError(f"checkpoint.export_dtype = {export_dtype!r}; it must be one of "
                             f"{', '.join(map(repr, EXPORT_DTYPES))}")
        if interval < 1:
            raise ValueError(f"checkpoint.interval = {interval}; it must be >= 1")
        if keep_latest_k < 0:
            raise ValueError(f"checkpoint.keep_latest_k = {keep_latest_k}; use 0 to keep all")
        if not self.model_parts:
            raise ValueError("CheckpointManager needs at least one model part")
        self._check_load_step(load_step)
        # A container lets DCP's optimizer helpers map one optimizer over several parts to
        # FQNs; the "<part index>." prefix it adds is stripped again (see _optimizer_state).
        self._parts = nn.ModuleList(self.model_parts)
        zero1_size = dist.get_world_size(optimizer.process_group) if _is_zero1(optimizer) else 0
        if zero1_size and self._world_size() != zero1_size:
            raise ValueError(
                "a ZeroRedundancyOptimizer is checkpointed through one consolidated file, so its "
                "process group must span the checkpoint's process group (got "
                f"{dist.get_world_size(optimizer.process_group)} vs {self._world_size()} ranks)")
        if async_mode != "disabled":
            self._async = AsyncSaver(async_mode, process_group)  # collective: a gloo group

    # -- process group ---------------------------------------------------------------------------
    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def _rank(self) -> int:
        return dist.get_rank(self.process_group) if self._distributed() else 0

    def _world_size(self) -> int:
        return dist.get_world_size(self.process_group) if self._distributed() else 1

    def _barrier(self) -> None:
        if self._distributed():
            dist.barrier(group=self.process_group)

    # -- discovery (local, not collective) -------------------------------------------------------
    def _path(self, step: int) -> str:
        return os.path.join(self.folder, f"step-{step}")

    def complete_steps(self) -> list[int]:
        """Steps with a complete (committed, intact) checkpoint, ascending (never ``.tmp``)."""
        # The rename already makes step-<N> complete; the file checks also reject a folder
        # that was copied, truncated or deleted only in part by hand.
        return [s for s in step_folders(self.folder) if _damage(self._path(s)) is None]

    def latest_step(self) -> int | None:
        """The highest complete step, or None when there is none."""
        steps = self.complete_steps()
        return steps[-1] if steps else None

    # -- state -----------------------------------------------------------------------------------
    def _model_state(self) -> dict[str, Any]:
        """Every part's model state under one FQN each. Two parts of this rank may hold
        bitwise-equal copies of a tensor (MTP's embedding on the last pipeline stage): it is
        saved once and loaded into both."""
        merged: dict[str, Any] = {}
        for part in self.model_parts:
            part_state = get_model_state_dict(part)
            differ = [n for n in merged.keys() & part_state.keys()
                      if not torch.equal(_local_tensor(merged[n]), _local_tensor(part_state[n]))]
            if differ:
                raise ValueError(f"model parts share state names {sorted(differ)[:3]} with "
                                 "different values; each FQN must belong to one part (or hold "
                                 "equal copies)")
            merged.update({n: t for n, t in part_state.items() if n not in merged})
        return merged

    def _optimizer_state(self) -> tuple[dict[str, Any], dict[str, list[str]]]:
        """Flattened optimizer state keyed without the container's part index, and the map back.

        Keys are "state.<part>.<fqn>.<name>" / "param_groups.<part>.<fqn>.<name>"; dropping
        "<part>." keeps the checkpoint independent of how the model is split into parts. A
        parameter copied in two parts (see :meth:`_model_state`) maps back to both keys.
        """
        prefixed = get_optimizer_state_dict(self._parts, self.optimizer, options=_OPTIM_OPTIONS)
        state: dict[str, Any] = {}
        original_keys: dict[str, list[str]] = {}
        for key, value in prefixed.items():
            section, _part, rest = key.split(".", 2)
            name = f"{section}.{rest}"
            state.setdefault(name, value)
            original_keys.setdefault(name, []).append(key)
        return state, original_keys

    def _trainer_state(self, step: int) -> dict[str, Any]:
        """Plain data (CheckpointUnsafe naming the object otherwise), so that a resume reads it
        with ``torch.load(weights_only=True)``."""
        def state(obj, name: str):
            return None if obj is None else plain_state(obj.state_dict(), f"{name}.state_dict()")

        return {
            "step": step,
            "world_size": self._world_size(),
            "lr_scheduler": state(self.lr_scheduler, "lr_scheduler"),
            "dataloader": state(self.dataloader, "dataloader"),
            "extra": {name: state(obj, f"extra_states[{name!r}]")
                      for name, obj in self.extra_states.items()},
        }

    @staticmethod
    def _rng_state() -> dict[str, torch.Tensor]:
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.get_rng_state()
        return rng

    # -- save ------------------------------------------------------------------------------------
    def maybe_save(self, step: int, *, last: bool = False) -> bool:
        """Save if ``step`` is on the interval, or if ``last`` and ``last_save``; True if saved."""
        if not self.enable:
            return False
        if step % self.interval == 0 or (last and self.last_save):
            self.save(step, weights_only=last and self.model_weights_only)
            return True
        return False

    def save(self, step: int, *, weights_only: bool = False) -> None:
        """Write step ``step`` atomically, replacing an existing ``step-<step>`` (collective).

        With ``weights_only`` only the model, in ``export_dtype``. With an ``async_mode`` this
        returns once the state is staged; the step is committed by the next :meth:`wait`.
        """
        if not self.enable:
            return
        self.wait()  # the previous async save is committed (or fails) before this one starts
        start = time.monotonic()
        tmp = self._path(step) + ".tmp"
        rank = self._rank()
        if rank == 0:
            os.makedirs(self.folder, exist_ok=True)
            self._remove_stale()
        self._barrier()  # nobody writes into a tmp folder that rank 0 is still removing
        os.makedirs(tmp, exist_ok=True)

        zero1 = _is_zero1(self.optimizer) and not weights_only
        if weights_only:
            state: dict[str, Any] = {"model": cast_for_export(self._model_state(),
                                                              self.export_dtype)}
        else:
            # Every rank checks the trainer state is plain data before anything is written:
            # state that would need code to load raises alike on every rank (CheckpointUnsafe).
            trainer_state = self._trainer_state(step)
            state = {"model": self._model_state()}
            if not zero1:
                state["optimizer"] = self._optimizer_state()[0]
        with _single_process_is_intended():
            if self._async is not None:
                self._async.start(state, tmp)
            else:
                dcp.save(state, checkpoint_id=tmp, process_group=self.process_group)
        if zero1:
            self.optimizer.consolidate_state_dict(to=0)  # collective over the ZeRO group
            if dist.get_rank(self.optimizer.process_group) == 0:
                _save_file(plain_state(self.optimizer.state_dict(), "the ZeRO-1 optimizer"),
                           os.path.join(tmp, _ZERO1_OPTIMIZER))
        if not weights_only:
            _save_file(self._rng_state(), os.path.join(tmp, f"rng-{rank}.pt"))
            if rank == 0:
                _save_file(trainer_state, os.path.join(tmp, _TRAINER_STATE))
        self._pending = (step, weights_only, start)
        if self._async is None:
            self.wait()

    def wait(self) -> None:
        """Commit the save in flight, if any (collective): wait until every rank's write has
        finished, then rank 0 writes the manifest and renames ``step-<N>.tmp``. An async write
        that failed on any rank raises :class:`CheckpointError` on every rank, and the step
        stays uncommitted."""
        if self._pending is None:
            return
        (step, weights_only, start), self._pending = self._pending, None
        error = self._async.finish() if self._async is not None else None
        if self._distributed():
            errors: list[Any] = [None] * self._world_size()
            dist.all_gather_object(errors, error, group=self.process_group)
        else:
            errors = [error]
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        final, tmp = self._path(step), self._path(step) + ".tmp"
        if failed:
            raise CheckpointError(f"the async save of step {step} failed on rank {failed[0][0]} "
                                  f"({failed[0][1]}); {final!r} was not committed")
        if self._rank() == 0:  # every rank's files are in tmp: commit
            self._write_manifest(tmp, step, weights_only)
            _commit(tmp, final)
            self._prune()
            logger.info("saved checkpoint %s in %.1fs", final, time.monotonic() - start)
        self._barrier()  # nobody reads the folder (or saves again) before the commit

    def close(self) -> None:
        """:meth:`wait`, then release the async writers' stager and gloo group (collective)."""
        self.wait()
        if self._async is not None:
            self._async.close()
            self._async = None

    def _write_manifest(self, tmp: str, step: int, weights_only: bool) -> None:
        """The saved tensor shapes and the run's description (file sizes: _write_manifest)."""
        manifest = {"format": _MANIFEST_FORMAT, "step": step, "versions": _versions(),
                    "model": self.manifest.get("model"),
                    "layout": {"world_size": self._world_size(), **self.manifest.get("layout", {})},
                    "shapes": _saved_shapes(tmp, None), "config": self.manifest.get("config")}
        if weights_only:
            manifest["weights_only"] = {"dtype": self.export_dtype}
        _write_manifest(tmp, manifest)

    def _remove_stale(self) -> None:
        for name in os.listdir(self.folder):
            if _STALE_DIR.match(name):
                shutil.rmtree(os.path.join(self.folder, name), ignore_errors=True)

    def _prune(self) -> None:
        if self.keep_latest_k <= 0:
            return
        for step in self.complete_steps()[: -self.keep_latest_k]:
            shutil.rmtree(self._path(step), ignore_errors=True)

    # -- load ------------------------------------------------------------------------------------
    @staticmethod
    def _check_load_step(load_step: int | str) -> None:
        if isinstance(load_step, bool) or not (
                load_step in ("latest", "none") or isinstance(load_step, int)
                or (isinstance(load_step, str) and load_step.lstrip("-").isdigit())):
            raise ValueError(f"checkpoint.load_step = {load_step!r}; use 'latest', 'none' or a "
                             "step number")

    def _resolve_load_step(self) -> tuple[int | None, dict[str, Any] | None]:
        """(step to load, its manifest); raises the same named error on every rank.

        Rank 0 decides for everyone, so that ranks with a lagging view of a network file system
        cannot pick different steps, and a damaged checkpoint fails every rank at once.
        """
        decision: list[Any] = [None]
        if self._rank() == 0:
            try:
                step, error, message = _resolve(self.folder, self.load_step)
                manifest = None
                if step is not None:
                    path = self._path(step)
                    manifest = read_manifest(path) or {}
                    saved, current = manifest.get("model"), self.manifest.get("model")
                    if saved and current and saved != current:
                        error, message = "CheckpointMismatch", _mismatch(path, saved, current)
                    elif "weights_only" in manifest:
                        error, message = "CheckpointMismatch", _weights_only(path)
                    else:
                        manifest["shapes"] = _saved_shapes(path, manifest or None)
                decision = [(step, error, message, manifest)]
                for stale in interrupted_saves(self.folder):
                    print(f"titanext: skipping {self._path(stale)}.tmp: its save never "
                          "completed (the job stopped before every rank had written it); "
                          f"{'resuming step ' + str(step) if step else 'nothing to resume'}",
                          flush=True)
            except Exception as e:  # noqa: BLE001 - every rank must learn that rank 0 failed
                decision = [(None, "CheckpointCorrupt", f"reading {self.folder!r} failed: "
                             f"{type(e).__name__}: {e}", None)]
        if self._distributed():
            src = 0 if self.process_group is None else dist.get_global_rank(self.process_group, 0)
            dist.broadcast_object_list(decision, src=src, group=self.process_group)
        step, error, message, manifest = decision[0]
        if error is not None:
            raise _ERRORS[error](message)
        return step, manifest

    def _check_shapes(self, path: str, manifest: dict[str, Any]) -> None:
        """Every rank compares its tensors' global shapes with the saved ones; the union of
        the differences (pipeline ranks hold different tensors) fails every rank alike."""
        saved = manifest["shapes"]
        problems = []
        for name, value in self._model_state().items():
            shape = list(value.shape)
            if name not in saved:
                problems.append(f"{name} is not in the checkpoint")
            elif list(saved[name]) != shape:
                problems.append(f"{name} has shape {list(saved[name])} in the checkpoint and "
                                f"{shape} in this model")
        if self._distributed():
            gathered: list[Any] = [None] * self._world_size()
            dist.all_gather_object(gathered, problems, group=self.process_group)
            problems = sorted({p for rank_problems in gathered for p in rank_problems})
        if problems:
            detail = f": {len(problems)} tensors differ, e.g. {problems[0]}"
            raise CheckpointMismatch(_mismatch(path, manifest.get("model"),
                                               self.manifest.get("model"), detail))

    def load(self) -> int:
        """Restore the checkpoint chosen by ``load_step``; its step (0 if none was loaded).

        Raises :class:`CheckpointNotFound`, :class:`CheckpointCorrupt` or
        :class:`CheckpointMismatch` before anything is loaded, alike on every rank.
        """
        if not self.enable:
            return 0
        self.wait()
        step, manifest = self._resolve_load_step()
        if step is None:
            return 0
        path = self._path(step)
        check_dcp_metadata(os.path.join(path, ".metadata"))  # before anything unpickles it
        self._check_shapes(path, manifest)
        try:
            step = self._load(path)
        except CheckpointError:
            raise
        except Exception as e:
            # The files were all there with their saved sizes, yet reading failed: damaged
            # content. DCP raises on every rank when one rank's read fails.
            first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise CheckpointCorrupt(
                f"checkpoint {path!r} could not be read ({type(e).__name__}: {first_line}); "
                "resume from an older step with --checkpoint.load_step=<step>, or start fresh "
                "with --checkpoint.load_step=none") from e
        changes = config_changes(manifest.get("config"), self.manifest.get("config"))
        if changes and self._rank() == 0:
            print(f"titanext: resuming {path} with a changed config (the current values apply, "
                  f"the LR schedule too): {'; '.join(changes)}", flush=True)
        return step

    def _load(self, path: str) -> int:
        trainer = _load_file(os.path.join(path, _TRAINER_STATE))
        rng = self._read_rng(path, trainer["world_size"])  # before anything is loaded
        # The current config's peak LRs, before the saved scheduler and param groups overwrite them.
        current_lrs = list(getattr(self.lr_scheduler, "base_lrs", []))

        zero1 = _is_zero1(self.optimizer)
        # DCP loads in place into a state dict of the current layout: it reads each rank's
        # shards of the saved global tensors, whatever layout wrote them.
        state: dict[str, Any] = {"model": self._model_state()}
        if not zero1:
            state["optimizer"], original_keys = self._optimizer_state()
        with _single_process_is_intended():
            dcp.load(state, checkpoint_id=path, process_group=self.process_group,
                     planner=PlainBytesLoadPlanner())
        for part in self.model_parts:
            names = get_model_state_dict(part).keys()
            set_model_state_dict(part, {name: state["model"][name] for name in names})
        if zero1:
            # Every rank reads the full state; load_state_dict keeps this rank's partition, so
            # another data-parallel size works too.
            self.optimizer.load_state_dict(_load_file(os.path.join(path, _ZERO1_OPTIMIZER)))
        else:
            optim_state = {key: value if i == 0 or not isinstance(value, torch.Tensor)
                           else value.clone()  # a copy's own state, never a shared tensor
                           for name, value in state["optimizer"].items()
                           for i, key in enumerate(original_keys[name])}
            set_optimizer_state_dict(self._parts, self.optimizer, optim_state,
                                     options=_OPTIM_OPTIONS)

        if self.lr_scheduler is not None and trainer["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(trainer["lr_scheduler"])
            _follow_current_schedule(self.lr_scheduler, self.optimizer, current_lrs)
        if self.dataloader is not None and trainer["dataloader"] is not None:
            self.dataloader.load_state_dict(trainer["dataloader"])
        for name, obj in self.extra_states.items():
            if name in trainer["extra"]:
                obj.load_state_dict(trainer["extra"][name])
            elif self._rank() == 0:
                logger.warning("checkpoint %s has no state for %r; it keeps its current state",
                               path, name)
        self._load_rng(path, trainer["world_size"], rng)
        if self._rank() == 0:
            print(f"titanext: resumed from {path} (step {trainer['step']})", flush=True)
        return trainer["step"]

    def _read_rng(self, path: str, saved_world_size: int) -> dict | None:
        """This rank's saved RNG state (None where it is not restored), read as plain data; a
        rank's file that needs code raises CheckpointUnsafe on every rank alike."""
        rng_file = os.path.join(path, f"rng-{self._rank()}.pt")
        if saved_world_size != self._world_size():  # alike on every rank
            return None
        rng = unsafe = None
        try:
            rng = _load_file(rng_file) if os.path.exists(rng_file) else None
        except CheckpointUnsafe as e:
            unsafe = e
        if not self._distributed():
            if unsafe is not None:
                raise unsafe
            return rng
        bad: list = [None] * self._world_size()
        dist.all_gather_object(bad, unsafe is not None, group=self.process_group)
        if any(bad):
            files = ", ".join(f"rng-{r}.pt" for r, b in enumerate(bad) if b)
            raise CheckpointUnsafe(f"checkpoint {path!r}: {files} need code to load "
                                   "(torch.load(weights_only=True) refused them); titanext never "
                                   "runs code from a checkpoint: resume from another step "
                                   "(--checkpoint.load_step=<step>) or start fresh "
                                   "(--checkpoint.load_step=none)")
        return rng

    def _load_rng(self, path: str, saved_world_size: int, rng: dict | None) -> None:
        if rng is None:
            # Rank r of another layout is not the same worker, so its stream would be wrong
            # anyway; data order does not depend on the RNG, so the loss curve continues.
            if self._rank() == 0:
                logger.warning("checkpoint %s was saved by %d ranks and this run has %d: RNG "
                               "state is not restored (model, optimizer, scheduler and data "
                               "position are)", path, saved_world_size, self._world_size())
            return
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
