"""Hugging Face safetensors checkpoints in and out of titanext models.

The names (titanext FQN -> HF tensor names) and the header-only checks that a checkpoint holds
a model are :mod:`titanext.models.hf_names`, which the config runs while loading.

- :func:`load_hf_weights`: fill a (meta-built, parallelized, materialised) model, or the
  pipeline stages one rank holds, from an HF directory under any layout (FSDP, TP, PP, EP).
  Each rank reads only its own shards: the 1:1 tensors through
  ``torch.distributed.checkpoint.HuggingFaceStorageReader`` (DCP plans the reads from the
  DTensor shards), stacked experts and permuted q/k projections by safetensors slice reads of
  this rank's chunk.
- :func:`save_hf_checkpoint`: write ``model*.safetensors`` (+ index), ``config.json`` and the
  tokenizer files, loadable by ``transformers.AutoModelForCausalLM.from_pretrained``.
  Collective: every rank calls it; each tensor is gathered once and written by the lowest
  rank that holds it.

RoPE: models with ``rope_layout="half"`` (the ``hf`` flavor) use HF's pairing and load
unchanged. For ``"interleaved"`` models (the named llama3 flavors), ``wq``/``wk`` rows are
permuted inside each head on the way in and out, as Meta's and HF's conversion scripts do.

>>> load_hf_weights([model], "path/to/hf_dir", args)   # an HF directory  # doctest: +SKIP
>>> save_hf_checkpoint([model], "out/step-10-hf", args, tokenizer=tok)  # same  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from titanext._safe_load import PlainBytesLoadPlanner
from titanext.data.hf_tokenizer import TOKENIZER_FILES
from titanext.models.args import ModelArgs
from titanext.models.hf_configs import hf_config_from_model_args
from titanext.models.hf_names import (
    _is_stacked,
    _permuted_heads,
    check_dcp_checkpoint,
    check_hf_checkpoint,
    hf_names,
)

__all__ = ["load_hf_weights", "load_initial_weights", "permute_for_rope", "save_hf_checkpoint",
           "to_hf_state_dict"]


def permute_for_rope(w: torch.Tensor, n_heads: int, *, to_hf: bool) -> torch.Tensor:
    """Rows of a q/k projection [n_heads * head_dim, ...] from titanext's interleaved RoPE
    pairing to HF's half pairing (``to_hf=True``) or back. Row 2j + c of a head is row
    c * head_dim/2 + j in HF's layout."""
    head_dim = w.shape[0] // n_heads
    if to_hf:
        return w.unflatten(0, (n_heads, head_dim // 2, 2)).transpose(1, 2).flatten(0, 2)
    return w.unflatten(0, (n_heads, 2, head_dim // 2)).transpose(1, 2).flatten(0, 2)


def _local(t: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
    """(local tensor, global offsets, sizes) of this rank's shard of ``t``."""
    if isinstance(t, DTensor):
        chunks = t.__create_chunk_list__()  # DCP's own protocol: this rank's shard
        assert len(chunks) == 1, "one chunk per rank expected"
        return t.to_local(), list(chunks[0].offsets), list(chunks[0].sizes)
    return t, [0] * t.dim(), list(t.shape)


def _read_slice(handles: dict[str, Any], index: dict, name: str,
                slices: Sequence[slice]) -> torch.Tensor:
    from safetensors import safe_open  # optional dependency (the HF path)

    file = index[name][0]
    if file not in handles:
        handles[file] = safe_open(file, framework="pt")
    return handles[file].get_slice(name)[tuple(slices)]


@torch.no_grad()
def _load_by_slices(fqn: str, param: torch.Tensor, args: ModelArgs, index: dict,
                    handles: dict[str, Any]) -> None:
    """Fill this rank's shard of ``param`` by safetensors slice reads (experts, permuted q/k)."""
    local, offsets, sizes = _local(param)
    if local.numel() == 0:
        return
    names = hf_names(fqn, args)
    if _is_stacked(fqn):  # dim 0 is the expert
        rest = [slice(o, o + s) for o, s in zip(offsets[1:], sizes[1:])]
        for i, e in enumerate(range(offsets[0], offsets[0] + sizes[0])):
            local[i].copy_(_read_slice(handles, index, names[e], rest))
        return
    heads = _permuted_heads(fqn, args)
    if heads is None:  # a 1:1 tensor (the reader when DCP's HF reader is not used)
        chunk = [slice(o, o + s) for o, s in zip(offsets, sizes)]
        local.copy_(_read_slice(handles, index, names[0], chunk))
        return
    head_dim = args.head_dim
    first, last = offsets[0] // head_dim, -(-(offsets[0] + sizes[0]) // head_dim)
    cols = [slice(o, o + s) for o, s in zip(offsets[1:], sizes[1:])]
    rows = _read_slice(handles, index, names[0], [slice(first * head_dim, last * head_dim), *cols])
    rows = permute_for_rope(rows, last - first, to_hf=False)
    start = offsets[0] - first * head_dim
    local.copy_(rows[start:start + sizes[0]])


def _dcp_load(state: dict[str, torch.Tensor], path: str) -> None:
    # newer torch only: probed where used
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    with warnings.catch_warnings():  # one process without a process group is intended
        warnings.filterwarnings("ignore", message="torch.distributed is .*uninitialized")
        dcp.load(state, storage_reader=HuggingFaceStorageReader(path))


def _dcp_hf_reader_available() -> bool:
    try:
        from torch.distributed.checkpoint import HuggingFaceStorageReader  # noqa: F401
    except ImportError:
        return False
    return True


@torch.no_grad()
def load_hf_weights(model_parts: Sequence[nn.Module], path: str, args: ModelArgs, *,
                    use_dcp: bool | None = None) -> None:
    """Load the HF checkpoint at ``path`` into ``model_parts`` (this rank's model or pipeline
    stages, already parallelized and materialised). Collective when torch.distributed is
    initialised: every rank calls it. ConfigError (the same on every rank) if the checkpoint
    does not match ``args``.

    ``use_dcp`` (default: when torch has it) reads the 1:1 tensors through DCP's
    ``HuggingFaceStorageReader``; with False every tensor goes through this module's
    safetensors slice reads of the rank's chunk (the same bytes, without DCP's planner)."""
    if use_dcp is None:
        use_dcp = _dcp_hf_reader_available()
    index = check_hf_checkpoint(path, args)
    direct: dict[str, torch.Tensor] = {}
    sliced: list[tuple[str, torch.Tensor]] = []
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    for part in model_parts:
        for fqn, param in part.state_dict(keep_vars=True).items():
            names = hf_names(fqn, args)
            if names is None:
                continue
            if not use_dcp or _is_stacked(fqn) or _permuted_heads(fqn, args) is not None:
                sliced.append((fqn, param))
            elif names[0] in direct:  # a second copy on this rank (MTP's embedding, PP)
                copies.append((param, direct[names[0]]))
            else:
                direct[names[0]] = param.data if isinstance(param, nn.Parameter) else param
    if use_dcp:
        _dcp_load(direct, path)  # in place into each rank's shards
    for param, loaded in copies:
        param.data.copy_(loaded) if isinstance(param, nn.Parameter) else param.copy_(loaded)
    handles: dict[str, Any] = {}
    for fqn, param in sliced:
        _load_by_slices(fqn, param.data if isinstance(param, nn.Parameter) else param, args,
                        index, handles)
    for part in model_parts:
        if hasattr(part, "tie_weights"):
            part.tie_weights()


# -- writing --------------------------------------------------------------------------------
def to_hf_state_dict(fqn: str, full: torch.Tensor, args: ModelArgs
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF (name, tensor) pairs of titanext tensor ``fqn`` with full value ``full``."""
    names = hf_names(fqn, args)
    if names is None:
        return
    if _is_stacked(fqn):
        for e, name in enumerate(names):
            yield name, full[e].contiguous()
        return
    heads = _permuted_heads(fqn, args)
    if heads is not None:
        full = permute_for_rope(full, heads, to_hf=True)
    yield names[0], full.contiguous()
    # DeepSeek-V3's MTP layers store their own copies of the embedding and the head
    extra = {"tok_embeddings.weight": "embed_tokens.weight",
             "output.weight": "shared_head.head.weight"}.get(fqn)
    for k in range(args.num_mtp_layers if extra else 0):
        yield f"model.layers.{args.n_layers + k}.{extra}", full.clone()  # not shared storage


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _all_gather_object(obj: Any) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def write_hf_assets(out: str, args: ModelArgs, *, dtype: torch.dtype,
                    tokenizer: Any = None, hf_assets_path: str | None = None) -> None:
    """config.json (from ``args``; the source config.json's other fields kept) and the
    tokenizer files (those of ``tokenizer.asset_files()``, or of ``hf_assets_path``)."""

    base = None
    if hf_assets_path and os.path.isfile(os.path.join(hf_assets_path, "config.json")):
        with open(os.path.join(hf_assets_path, "config.json"), encoding="utf-8") as f:
            base = json.load(f)
    cfg = hf_config_from_model_args(
        args, dtype=str(dtype).removeprefix("torch."), base=base,
        bos_id=getattr(tokenizer, "bos_id", None) if tokenizer is not None else None,
        eos_id=getattr(tokenizer, "eos_id", None) if tokenizer is not None else None)
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    files = list(tokenizer.asset_files()) if hasattr(tokenizer, "asset_files") else []
    if not files and hf_assets_path:
        files = [os.path.join(hf_assets_path, n) for n in TOKENIZER_FILES
                 if os.path.isfile(os.path.join(hf_assets_path, n))]
    for file in files:
        shutil.copy(file, os.path.join(out, os.path.basename(file)))


@torch.no_grad()
def save_hf_checkpoint(model_parts: Sequence[nn.Module], out: str, args: ModelArgs, *,
                       tokenizer: Any = None, hf_assets_path: str | None = None) -> None:
    """Write the model as an HF checkpoint into ``out`` (atomically: ``out.tmp``, then a
    rename). Collective: every rank calls it with its model parts. Each rank gathers the full
    tensors of its parts; the lowest rank holding a tensor writes it, one
    ``model-<k>-of-<n>.safetensors`` file per writing rank (a pipeline stage each), and rank 0
    writes the index, config.json and the tokenizer files."""
    from safetensors.torch import save_file  # optional dependency (the HF path)

    held: dict[str, torch.Tensor] = {}
    for part in model_parts:
        for fqn, t in part.state_dict().items():
            held[fqn] = t
    names = _all_gather_object(sorted(held))
    owner: dict[str, int] = {}
    for r, fqns in enumerate(names):
        for fqn in fqns:
            owner.setdefault(fqn, r)
    rank = _rank()
    tensors: dict[str, torch.Tensor] = {}
    dtype = torch.float32
    for fqn in sorted(held):  # the same order on every rank of a tensor's mesh
        t = held[fqn]
        full = t.full_tensor() if isinstance(t, DTensor) else t
        dtype = full.dtype
        if fqn.endswith("router.expert_bias") and owner[fqn] == rank and not args.mla \
                and bool(full.any()):
            warnings.warn(f"{fqn} (aux-loss-free routing bias) is not zero; transformers' Mixtral "
                          "has no such bias, so the export routes tokens differently",
                          stacklevel=2)
        if owner[fqn] == rank:
            for name, value in to_hf_state_dict(fqn, full, args):
                tensors[name] = value.detach().cpu().clone()
    writers = sorted(set(owner.values()))
    tmp = out + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    file_of: dict[str, str] = {}
    if rank in writers:
        k = writers.index(rank) + 1
        fname = ("model.safetensors" if len(writers) == 1
                 else f"model-{k:05d}-of-{len(writers):05d}.safetensors")
        save_file(tensors, os.path.join(tmp, fname), metadata={"format": "pt"})
        file_of = dict.fromkeys(tensors, fname)
    maps = _all_gather_object(file_of)
    if rank == 0:
        weight_map = {k: v for m in maps for k, v in m.items()}
        if len(writers) > 1:
            total = sum(os.path.getsize(os.path.join(tmp, f)) for f in set(weight_map.values()))
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total},
                           "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
        write_hf_assets(tmp, args, dtype=dtype, tokenizer=tokenizer,
                        hf_assets_path=hf_assets_path)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
        print(f"titanext: wrote the Hugging Face checkpoint {out}", flush=True)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


# -- initial weights ------------------------------------------------------------------------
@torch.no_grad()
def load_initial_weights(model_parts: Sequence[nn.Module], path: str, args: ModelArgs, *,
                         in_hf: bool) -> None:
    """Start from ``path`` (``[checkpoint] initial_load_path``): an HF directory with
    ``in_hf`` (:func:`load_hf_weights`), else the model of a titanext DCP checkpoint (a
    training ``step-N`` folder or ``titanext-convert hf-to-dcp`` output; optimizer
    and trainer state are not read). Collective; any layout."""

    if in_hf:
        load_hf_weights(model_parts, path, args)
        if _rank() == 0:
            print(f"titanext: initial weights from the Hugging Face checkpoint {path}", flush=True)
        return

    check_dcp_checkpoint(path, args)
    states = [get_model_state_dict(part) for part in model_parts]
    merged = {fqn: t for state in states for fqn, t in state.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*uninitialized")
        dcp.load({"model": merged}, checkpoint_id=path, planner=PlainBytesLoadPlanner())
    for part, state in zip(model_parts, states):
        set_model_state_dict(part, {fqn: merged[fqn] for fqn in state})
        if hasattr(part, "tie_weights"):
            part.tie_weights()
    if _rank() == 0:
        print(f"titanext: initial weights from the DCP checkpoint {path}", flush=True)
