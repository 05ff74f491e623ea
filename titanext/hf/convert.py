"""Offline checkpoint conversion: ``titanext-convert hf-to-dcp | dcp-to-hf SRC DST``.

- ``hf-to-dcp SRC DST``: an HF model directory (config.json + safetensors) to a titanext DCP
  checkpoint of the ``hf`` flavor, ``{"model": ...}`` keyed by titanext FQNs, in the source
  dtype. config.json and the tokenizer files are copied along, so DST works as
  ``[model] hf_assets_path`` and as ``[checkpoint] initial_load_path`` (without
  ``initial_load_in_hf``).
- ``dcp-to-hf SRC DST``: a titanext DCP checkpoint (one made by hf-to-dcp, or a training
  checkpoint ``<folder>/step-N``) to an HF directory that ``transformers`` loads. The model's
  shape comes from ``--config FILE`` (the training config), ``--hf-assets DIR`` (an HF
  directory's config.json), or SRC/config.json, in that order. Tensors are converted a few
  at a time (``--max-shard-gb``), so memory stays near one shard.

A round trip HF -> DCP -> HF is bitwise (same names, dtypes and values). The command line is
:mod:`titanext.launch.convert` (``titanext-convert``, or ``python -m titanext.launch.convert``).

    titanext-convert hf-to-dcp ./tiny_hf ./tiny_dcp
    titanext-convert dcp-to-hf ./tiny_dcp ./tiny_hf_again
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from titanext._safe_load import PlainBytesLoadPlanner, check_dcp_metadata
from titanext.data.hf_tokenizer import TOKENIZER_FILES
from titanext.errors import ConfigError
from titanext.hf.checkpoint import to_hf_state_dict, write_hf_assets
from titanext.models import build_model
from titanext.models.args import ModelArgs
from titanext.models.hf_configs import model_args_from_hf
from titanext.models.hf_names import _expected, _is_stacked, check_hf_checkpoint, hf_names

__all__ = ["dcp_to_hf", "hf_to_dcp"]


class Progress:
    """A one-line text progress bar on stderr (no dependency): ``label [####----] 3/8 name``."""

    def __init__(self, label: str, total: int, stream=None, width: int = 30):
        self.label, self.total, self.width = label, max(total, 1), width
        self.stream = stream or sys.stderr
        self.done, self.start = 0, time.monotonic()

    def update(self, n: int = 1, note: str = "") -> None:
        self.done += n
        filled = self.width * self.done // self.total
        bar = "#" * filled + "-" * (self.width - filled)
        end = "\n" if self.done >= self.total else ""
        self.stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total} "
                          f"{time.monotonic() - self.start:.1f}s {note[:40]:<40}{end}")
        self.stream.flush()


def _quiet_dcp():
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.filterwarnings("ignore", message="torch.distributed is .*uninitialized")
    return ctx


def _copy_assets(src: str, dst: str) -> None:
    for name in ("config.json", *TOKENIZER_FILES):
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))


def hf_to_dcp(src: str, dst: str, *, progress: bool = True) -> int:
    """Convert the HF directory ``src`` into the DCP checkpoint ``dst``; returns the number of
    tensors written. ConfigError for a bad config.json or mismatched safetensors."""
    from safetensors import safe_open  # optional dependency (the HF path)


    args = model_args_from_hf(src)
    index = check_hf_checkpoint(src, args)
    groups: dict[str, list[str]] = {}
    for fqn, name, _ in _expected(args):
        groups.setdefault(fqn, []).append(name)
    bar = Progress("hf-to-dcp", len(groups)) if progress else None
    handles = {}
    state: dict[str, torch.Tensor] = {}
    for fqn, names in groups.items():
        tensors = []
        for name in names:
            file = index[name][0]
            if file not in handles:
                handles[file] = safe_open(file, framework="pt")
            tensors.append(handles[file].get_tensor(name))
        state[fqn] = torch.stack(tensors) if _is_stacked(fqn) else tensors[0]
        if bar:
            bar.update(note=fqn)
    if args.tie_embeddings:  # a training checkpoint of a tied model names it under both FQNs
        state["output.weight"] = state["tok_embeddings.weight"]
    os.makedirs(dst, exist_ok=True)
    ctx = _quiet_dcp()
    try:
        dcp.save({"model": state}, checkpoint_id=dst)
    finally:
        ctx.__exit__(None, None, None)
    _copy_assets(src, dst)
    return len(state)


def _args_for(src: str, model_args: ModelArgs | None,
              hf_assets: str | None) -> tuple[ModelArgs, str | None]:
    """(model args, directory with config.json / tokenizer files or None) for dcp-to-hf."""

    if model_args is not None:
        return model_args, hf_assets
    for directory in (hf_assets, src):
        if directory and os.path.isfile(os.path.join(directory, "config.json")):
            return model_args_from_hf(directory), directory
    raise ConfigError(f"dcp-to-hf: {os.path.join(src, 'config.json')} does not exist; pass "
                      "--config FILE (the training config) or --hf-assets DIR (an HF directory "
                      "with the model's config.json)")


def dcp_to_hf(src: str, dst: str, *, model_args: ModelArgs | None = None,
              hf_assets: str | None = None, max_shard_gb: float = 5.0,
              progress: bool = True) -> int:
    """Convert the titanext DCP checkpoint ``src`` into the HF directory ``dst``; returns the
    number of HF tensors written. The model's shape is ``model_args`` (a training config's:
    ``titanext.config.model_args(cfg)``, with ``hf_assets`` its ``[model] hf_assets_path``),
    else ``hf_assets/config.json``, else ``src/config.json``."""
    from safetensors.torch import save_file  # optional dependency (the HF path)

    args, assets = _args_for(src, model_args, hf_assets)
    if not os.path.isfile(os.path.join(src, ".metadata")):
        raise ConfigError(f"dcp-to-hf: {src!r} is not a DCP checkpoint (no .metadata file)")

    check_dcp_metadata(os.path.join(src, ".metadata"))  # a pickle: nothing in it may run
    meta = FileSystemReader(src).read_metadata().state_dict_metadata
    saved = {k.removeprefix("model."): v for k, v in meta.items() if k.startswith("model.")}
    wanted = [(fqn, shape) for fqn, shape in _model_shapes(args) if hf_names(fqn, args)]
    for fqn, shape in wanted:
        if fqn not in saved:
            raise ConfigError(f"dcp-to-hf: {src}: tensor model.{fqn} is missing; the checkpoint "
                              "does not match the model")
        if list(saved[fqn].size) != shape:
            raise ConfigError(f"dcp-to-hf: {src}: tensor model.{fqn} has shape "
                              f"{list(saved[fqn].size)}, but the model needs {shape}")
    # Shards of at most max_shard_gb, in model order.
    limit = max_shard_gb * 2**30
    shards: list[list[str]] = [[]]
    size = 0
    for fqn, shape in wanted:
        nbytes = torch.Size(shape).numel() * saved[fqn].properties.dtype.itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(fqn)
        size += nbytes
    tmp = dst + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    bar = Progress("dcp-to-hf", len(wanted)) if progress else None
    weight_map: dict[str, str] = {}
    dtype = torch.float32
    for k, fqns in enumerate(shards, start=1):
        state = {fqn: torch.empty(saved[fqn].size, dtype=saved[fqn].properties.dtype)
                 for fqn in fqns}
        ctx = _quiet_dcp()
        try:
            dcp.load({"model": state}, checkpoint_id=src, planner=PlainBytesLoadPlanner())
        finally:
            ctx.__exit__(None, None, None)
        fname = ("model.safetensors" if len(shards) == 1
                 else f"model-{k:05d}-of-{len(shards):05d}.safetensors")
        tensors: dict[str, torch.Tensor] = {}
        for fqn in fqns:
            dtype = state[fqn].dtype
            tensors.update(to_hf_state_dict(fqn, state[fqn], args))
            if bar:
                bar.update(note=fqn)
        save_file(tensors, os.path.join(tmp, fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
        del state, tensors
    if len(shards) > 1:
        total = sum(os.path.getsize(os.path.join(tmp, f)) for f in set(weight_map.values()))
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total},
                       "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    write_hf_assets(tmp, args, dtype=dtype, hf_assets_path=assets)
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(tmp, dst)
    return len(weight_map)


def _model_shapes(args: ModelArgs) -> list[tuple[str, list[int]]]:

    model = build_model("llama3", args, device="meta")
    return [(fqn, list(t.shape)) for fqn, t in model.state_dict().items()]
