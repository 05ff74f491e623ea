"""A checkpoint never runs code: what a resume reads is data, whoever wrote the folder.

``torch.load(..., weights_only=False)`` and plain ``pickle`` call whatever a file names, so a
resume folder from anywhere else could execute arbitrary code (torch's own default refuses it
since 2.6). :class:`~titanext.components.checkpoint.CheckpointManager` therefore:

- stores its per-rank extra state (scheduler, data loader, ``extra_states``, RNG, ZeRO-1
  optimizer) as plain data (:func:`plain_state`: tensors, numbers, strings, bytes, lists, tuples,
  dicts, dtypes) and reads it back with ``torch.load(weights_only=True)`` (:func:`load_plain`);
- reads DCP's ``.metadata`` (a plain pickle) only after an unpickler that resolves nothing but
  DCP's metadata classes has read it (:func:`check_dcp_metadata`), and DCP's non-tensor entries
  with ``weights_only=True`` (:class:`PlainBytesLoadPlanner`).

A file that would need code to load is refused with :class:`~titanext.errors.CheckpointUnsafe`
naming it and what it asked for, before anything is loaded; the payload never runs.

>>> plain_state({"position": 8, "lrs": (0.1, 0.2)}, "dataloader")
{'position': 8, 'lrs': (0.1, 0.2)}
"""

from __future__ import annotations

import dataclasses
import enum
import io
import os
import pathlib
import pickle
from collections import OrderedDict
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner

from titanext.errors import CheckpointCorrupt, CheckpointUnsafe

__all__ = ["PlainBytesLoadPlanner", "check_dcp_metadata", "load_plain", "plain_state"]

_SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
            torch.Size)

_FIX = ("titanext never runs code from a checkpoint. If you wrote this checkpoint yourself and "
        "trust it, allow the named class with torch.serialization.add_safe_globals([...]) before "
        "resuming, or resume from another step (--checkpoint.load_step=<step>) or start fresh "
        "(--checkpoint.load_step=none)")


def plain_state(obj: Any, where: str) -> Any:
    """``obj`` as data that ``torch.load(weights_only=True)`` reads back: tensors (plain, on
    CPU), numbers, strings, bytes, lists, tuples and dicts of them as they are; numpy scalars and
    arrays as Python numbers and tensors. Anything else raises
    :class:`~titanext.errors.CheckpointUnsafe` naming ``where`` and the path inside it."""
    if isinstance(obj, _SCALARS):
        return obj
    if type(obj) in (torch.Tensor, torch.nn.Parameter):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        kind = OrderedDict if isinstance(obj, OrderedDict) else dict
        for key in obj:
            if not isinstance(key, _SCALARS):
                _refuse(key, f"{where} (a key)")
        return kind((k, plain_state(v, f"{where}[{k!r}]")) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(plain_state(v, f"{where}[{i}]") for i, v in enumerate(obj))
    numpy_value = _from_numpy(obj)
    if numpy_value is not None:
        return numpy_value
    return _refuse(obj, where)


def _from_numpy(obj: Any) -> Any:
    if type(obj).__module__ != "numpy":
        return None
    if hasattr(obj, "item") and getattr(obj, "ndim", 1) == 0:
        return obj.item()
    if hasattr(obj, "dtype") and hasattr(obj, "shape"):
        return torch.from_numpy(obj.copy())
    return None


def _refuse(obj: Any, where: str):
    raise CheckpointUnsafe(
        f"checkpoint: {where} holds a {type(obj).__module__}.{type(obj).__qualname__}; a "
        "checkpoint stores tensors, numbers, strings, lists and dicts (it is read with "
        "torch.load(weights_only=True), which runs no code): return plain values from its "
        "state_dict() and rebuild the object in load_state_dict()")


def load_plain(file: str | io.BytesIO, what: str | None = None) -> Any:
    """``torch.load(file, weights_only=True)`` on CPU; a file that asks for anything else (a
    pickled class, a function to call) raises :class:`~titanext.errors.CheckpointUnsafe` naming
    it and the global it asked for, and nothing in it runs."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        asked = next((line.strip() for line in str(e).splitlines()
                      if "GLOBAL" in line or "Unsupported" in line), str(e).splitlines()[0])
        raise CheckpointUnsafe(f"checkpoint file {what or file!r} needs code to load "
                               f"(torch.load(weights_only=True) refused it: {asked}); "
                               f"{_FIX}") from None


class _MetadataOnly(pickle.Unpickler):
    """Resolves only what DCP's ``.metadata`` holds: its dataclasses and enums, ``torch.Size``,
    dtypes, layouts and paths."""

    def __init__(self, file, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        obj = super().find_class(module, name) if _known_module(module) else None
        if obj is not None and _data_class(module, name, obj):
            return obj
        raise CheckpointUnsafe(f"checkpoint file {self.path!r} needs code to load (it names "
                               f"{module}.{name}, which DCP's metadata never holds): titanext "
                               "never runs code from a checkpoint, and torch.distributed."
                               "checkpoint did not write this file; resume from another step "
                               "(--checkpoint.load_step=<step>) or start fresh "
                               "(--checkpoint.load_step=none)")


def _known_module(module: str) -> bool:
    return module in ("torch", "torch.serialization", "pathlib", "collections") or \
        module.startswith("torch.distributed.checkpoint.")


def _data_class(module: str, name: str, obj: Any) -> bool:
    if module.startswith("torch.distributed.checkpoint."):
        return isinstance(obj, type) and (dataclasses.is_dataclass(obj)
                                          or issubclass(obj, enum.Enum))
    if module == "torch":
        return obj is torch.Size or isinstance(obj, torch.dtype)
    if module == "pathlib":
        return isinstance(obj, type) and issubclass(obj, pathlib.PurePath)
    return (module, name) in {("torch.serialization", "_get_layout"),
                              ("collections", "OrderedDict")}


def check_dcp_metadata(path: str) -> None:
    """Read DCP's ``.metadata`` file at ``path`` with an unpickler that builds only DCP's
    metadata classes; :class:`~titanext.errors.CheckpointUnsafe` if it names anything else."""
    if not os.path.exists(path):
        return  # a missing file is named by the checks that follow (CheckpointCorrupt)
    try:
        with open(path, "rb") as f:
            _MetadataOnly(f, path).load()
    except CheckpointUnsafe:
        raise
    except Exception as e:  # noqa: BLE001 - truncated or garbled: damaged, not unsafe
        raise CheckpointCorrupt(f"checkpoint file {path!r} could not be read "
                                f"({type(e).__name__}: {e}); resume from an older step with "
                                "--checkpoint.load_step=<step>, or start fresh with "
                                "--checkpoint.load_step=none") from None


class PlainBytesLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor entries (optimizer hyper-parameters) with
    ``weights_only=True`` instead of torch's ``weights_only=False``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = load_plain(value, f"entry {read_item.dest_index.fqn}")
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        super().load_bytes(read_item, buf)
