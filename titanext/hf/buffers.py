"""Non-persistent buffers of a ``transformers`` model built on the meta device.

A non-persistent buffer is in no checkpoint: after a meta-device build and ``to_empty`` it holds
whatever memory it was given, and loading a state dict leaves it so. transformers models hold
many: every rotary embedding's ``inv_freq``, Gemma's and MiniCPM3's ``embed_scale``, GPT-J's
and CodeGen's sinusoid tables, GPT-1's and GPTBigCode's causal masks, CTRL's and XGLM's
positional tables, RecurrentGemma's ``normalizer``. A model with a garbage ``embed_scale``
trains without an error, on wrong numbers.

:func:`restore_buffers` recomputes them with the model's own initializer (``_init_weights``,
which transformers runs for the same purpose when it loads a model onto a device), on a stand-in
of each module whose parameters and persistent buffers are meta tensors, so nothing else is
touched. It checks what it did: it runs twice, from buffers filled with 0 and with 1, and
raises naming every buffer whose value depends on that fill (one the initializer did not write).

>>> import transformers
>>> cfg = transformers.Gemma3TextConfig(vocab_size=64, hidden_size=64, intermediate_size=64,
...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
>>> with torch.device("meta"):
...     model = transformers.Gemma3ForCausalLM(cfg)
>>> _ = model.to_empty(device="cpu")
>>> restore_buffers(model)[0], float(model.model.embed_tokens.embed_scale)  # sqrt(64)
('model.embed_tokens.embed_scale', 8.0)
"""

from __future__ import annotations

import copy

import torch
from torch import nn

__all__ = ["non_persistent_buffers", "restore_buffers"]


def non_persistent_buffers(module: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """``{qualified name: (owning module, buffer name)}`` of every non-persistent buffer."""
    return {f"{prefix}.{name}" if prefix else name: (owner, name)
            for prefix, owner in module.named_modules()
            for name in sorted(owner._non_persistent_buffers_set)
            if owner._buffers.get(name) is not None}


def _stand_in(module: nn.Module) -> nn.Module:
    """``module``'s class and attributes, its non-persistent buffers shared, every parameter and
    persistent buffer a meta tensor of the same shape, no children: what an initializer writes
    to lands only in the non-persistent buffers."""
    def meta(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device="meta")

    stand_in = copy.copy(module)  # a new __dict__; the dicts inside it are rebuilt below
    stand_in._parameters = {
        k: None if p is None else nn.Parameter(meta(p), requires_grad=p.requires_grad)
        for k, p in module._parameters.items()}
    keep = module._non_persistent_buffers_set
    stand_in._buffers = {k: b if b is None or k in keep else meta(b)
                         for k, b in module._buffers.items()}
    stand_in._modules = {}
    return stand_in


def restore_buffers(module: nn.Module, model: nn.Module | None = None) -> list[str]:
    """Recompute every non-persistent buffer of ``module`` in place; return their names.

    ``model``: the ``transformers`` model whose ``_init_weights`` computes them (default:
    ``module`` itself; pass the whole model when ``module`` is a pipeline stage cut from it). Call
    after ``to_empty``, before or after loading the weights. Raises a ValueError naming the
    buffers when ``model`` has no ``_init_weights``, when a buffer is still on the meta device,
    or when the initializer leaves a buffer (or part of it) unwritten.
    """
    buffers = non_persistent_buffers(module)
    if not buffers:
        return []
    source = module if model is None else model
    init = getattr(source, "_init_weights", None)
    names = ", ".join(buffers)
    if init is None:
        raise ValueError(f"{type(source).__name__} has no _init_weights (not a transformers "
                         f"model), so its non-persistent buffers ({names}) cannot be recomputed; "
                         "they are in no checkpoint: set them yourself after to_empty")
    on_meta = [n for n, (owner, b) in buffers.items() if owner._buffers[b].is_meta]
    if on_meta:
        raise ValueError(f"non-persistent buffers still on the meta device: {', '.join(on_meta)}"
                         "; call to_empty(device=...) first")
    seen: dict[int, dict[str, torch.Tensor]] = {}
    with torch.no_grad():
        for fill in (0, 1):
            for owner, b in buffers.values():
                owner._buffers[b].fill_(fill)
            for owner in {id(o): o for o, _ in buffers.values()}.values():
                init(_stand_in(owner))
            seen[fill] = {n: owner._buffers[b].clone() for n, (owner, b) in buffers.items()}
    unwritten = [n for n in buffers if not torch.equal(seen[0][n], seen[1][n])]
    if unwritten:
        raise ValueError(f"{type(source).__name__}._init_weights does not (fully) write the "
                         f"non-persistent buffers {', '.join(unwritten)}; they are in no "
                         "checkpoint: build that module on the target device and copy them")
    return list(buffers)
