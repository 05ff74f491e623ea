"""Reference models and their flavors.

>>> from titanext.models import get_model_args, build_model
>>> args = get_model_args("llama3", "debugmodel")
>>> model = build_model("llama3", args)      # on the meta device: call to_empty + init_weights
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from titanext._text import did_you_mean
from titanext.models.args import DEEPSEEK_FLAVORS, LLAMA3_FLAVORS, MOE_FLAVORS, ModelArgs

if TYPE_CHECKING:  # the registry stays torch-free: the config reads it while loading
    import torch
    from torch import nn

# The MoE flavors are the same decoder with MoE blocks, so they live under "llama3" too.
MODEL_FLAVORS: dict[str, dict[str, ModelArgs]] = {
    "llama3": {**LLAMA3_FLAVORS, **MOE_FLAVORS, **DEEPSEEK_FLAVORS}}

#: Keys of :func:`with_moe_overrides` that belong to ModelArgs (which blocks are MoE).
MOE_LAYER_KEYS = ("n_dense_layers", "moe_layer_interval")


def _choices(value: str, choices) -> str:
    hint = did_you_mean(value, list(choices), fallback=False)
    return f"choose one of {', '.join(map(repr, choices))}{hint}"


def get_model_args(name: str, flavor: str) -> ModelArgs:
    """The :class:`ModelArgs` of a named flavor; KeyError lists the choices. (Flavor ``"hf"``,
    a Hugging Face ``config.json``, is read by
    :func:`titanext.models.hf_configs.model_args_from_hf`; :func:`titanext.config.model_args`
    picks the one a job config names.)"""
    if name not in MODEL_FLAVORS:
        raise KeyError(f"unknown model name {name!r}; {_choices(name, MODEL_FLAVORS)}")
    flavors = MODEL_FLAVORS[name]
    if flavor not in flavors:
        raise KeyError(f"unknown flavor {flavor!r} for model {name!r}; {_choices(flavor, flavors)}")
    return flavors[flavor]


def with_moe_overrides(args: ModelArgs, **overrides: Any) -> ModelArgs:
    """``args`` with MoE settings replaced: :class:`~titanext.models.moe.MoEArgs` fields and
    ``n_dense_layers`` / ``moe_layer_interval``. ValueError if ``args`` has no MoE or a value
    is invalid (MoEArgs checks itself).

    >>> a = with_moe_overrides(get_model_args("llama3", "debugmoe"), num_experts=4, top_k=1)
    >>> a.moe.num_experts, a.moe.top_k
    (4, 1)
    """
    if not overrides:
        return args
    if args.moe is None:
        raise ValueError(f"MoE settings {sorted(overrides)} given for a dense model")
    layer = {k: overrides.pop(k) for k in MOE_LAYER_KEYS if k in overrides}
    return dataclasses.replace(args, moe=dataclasses.replace(args.moe, **overrides), **layer)


def build_model(name: str, args: ModelArgs, device: str | torch.device = "meta") -> nn.Module:
    """Build model ``name`` with ``args`` on ``device`` (meta by default: no memory is used)."""
    import torch  # torch-free at import: the config reads the flavors

    # torch-free at import: the config reads the flavors
    from titanext.models.llama import Transformer

    if name not in MODEL_FLAVORS:
        raise KeyError(f"unknown model name {name!r}; {_choices(name, MODEL_FLAVORS)}")
    with torch.device(device):
        return Transformer(args)


__all__ = ["MODEL_FLAVORS", "ModelArgs", "build_model", "get_model_args", "with_moe_overrides"]
