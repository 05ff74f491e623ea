"""The logical matrices of a transformers model's fused projections, for Muon's per-matrix
orthogonalization (``MuonWithAdamW(..., splits=hf_muon_splits(model))``; the trainer's own
models take ``[optimizer] muon_split_params``, docs/muon.md).

Each split is read from the model in hand and checked before it is returned: the module's
forward source must take the parts apart contiguously, in the order and sizes given, and the
sizes must add up to the weight's dimension. What it cannot check it refuses by name.

- ``qkv_proj`` (Phi-3): ``[q; k; v]`` rows of ``num_attention_heads`` and twice
  ``num_key_value_heads`` heads, sliced in that order by the attention's forward;
- ``gate_up_proj`` as an ``nn.Linear`` (Phi-3's MLP) or a stacked ``[experts, 2 I, H]`` weight
  (Qwen3-MoE, Mixtral): ``[gate; up]`` halves, ``chunk(2, dim=-1)`` in the forward;
- ``c_attn`` (GPT-2's Conv1D, ``[in, 3 D]``): ``q | k | v`` columns, ``split(self.split_size,
  dim=2)`` in the forward.

Other fused projections (GPT-NeoX's and Falcon's ``query_key_value``, which interleave q, k
and v per head; ``Wqkv``, ``W_pack``) are refused with the fix: leave them whole
(``leave_whole``).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Sequence

from torch import nn

from titanext.hf._tp_checks import FUSED

__all__ = ["hf_muon_splits"]

_QKV_SLICES = re.compile(r"qkv\[\.\.\., :query_pos\]")
_HALVES = re.compile(r"\.chunk\(2, dim=-1\)")
_C_ATTN = re.compile(r"self\.c_attn\(hidden_states\)\.split\(self\.split_size, dim=2\)")


def _source(module: nn.Module) -> str:
    try:
        return inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return ""


def _split(name: str, owner: nn.Module, module: nn.Module | None, weight, config
           ) -> tuple[int, tuple[int, ...]] | None:
    """(axis, sizes) of one fused weight, or None where its layout is not the checked one."""
    leaf = name.rsplit(".", 1)[-1]
    src = _source(owner)
    if leaf == "qkv_proj" and isinstance(module, nn.Linear) and _QKV_SLICES.search(src):
        head_dim = getattr(owner, "head_dim", None)
        if head_dim is None:
            return None
        q = config.num_attention_heads * head_dim
        kv = getattr(owner, "num_key_value_heads", config.num_key_value_heads) * head_dim
        return 0, (q, kv, kv)
    if leaf == "gate_up_proj" and _HALVES.search(src):
        rows = weight.shape[-2]  # [out, in], or [experts, 2 I, H]
        return (0, (rows // 2, rows // 2)) if rows % 2 == 0 else None
    if leaf == "c_attn" and type(module).__name__ == "Conv1D" and _C_ATTN.search(src):
        size = getattr(owner, "split_size", 0)
        return 1, (size, size, size)
    return None


def hf_muon_splits(model: nn.Module, *, leave_whole: Sequence[str] = ()
                   ) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Parameter FQN -> ``(axis, sizes)`` of every fused projection of ``model`` whose layout
    is checked (the module docstring); a fused one that is not, and not in ``leave_whole``
    (FQN prefixes), raises ValueError naming it.

    >>> from transformers import GPT2Config, GPT2LMHeadModel
    >>> model = GPT2LMHeadModel(GPT2Config(n_embd=24, n_head=4, n_layer=1, vocab_size=64))
    >>> hf_muon_splits(model)
    {'transformer.h.0.attn.c_attn.weight': (1, (24, 24, 24))}
    >>> opt = MuonWithAdamW(groups, splits=hf_muon_splits(model))  # your groups  # doctest: +SKIP
    """
    config = getattr(model, "config", None)
    splits, refused = {}, []
    modules = dict(model.named_modules())
    for fqn, weight in model.named_parameters():
        module_name, _, attr = fqn.rpartition(".")
        leaf = module_name.rsplit(".", 1)[-1] if attr == "weight" else attr
        if leaf not in FUSED or fqn.startswith(tuple(leave_whole)):
            continue
        if attr == "weight":  # a Linear / Conv1D, sliced by its parent's forward
            owner, module = modules[module_name.rpartition(".")[0]], modules[module_name]
        else:  # a stacked expert weight, sliced by its own module's forward
            owner, module = modules[module_name], None
        split = _split(f"{module_name}.{leaf}", owner, module, weight, config)
        dim = weight.shape[-2:][split[0]] if split else 0
        if split is None or sum(split[1]) != dim:
            refused.append(fqn)
        else:
            splits[fqn] = split
    if refused:
        more = f" and {len(refused) - 1} more" if len(refused) > 1 else ""
        raise ValueError(
            f"hf_muon_splits: {refused[0]}{more} is a fused projection whose parts this adapter "
            "cannot check (e.g. q, k and v interleaved per head); pass leave_whole=[its prefix] "
            "to orthogonalize it whole")
    return splits
