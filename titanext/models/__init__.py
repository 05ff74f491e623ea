"""Reference models and their flavors.

>>> from titanext.models import get_model_args, build_model
>>> args = get_model_args("llama3", "debugmodel")
>>> model = build_model("llama3", args)      # on the meta device: call to_empty + init_weights
"""

from __future__ import annotations

import torch
from torch import nn

from titanext._hints import did_you_mean
from titanext.models.args import LLAMA3_FLAVORS, ModelArgs

MODEL_FLAVORS: dict[str, dict[str, ModelArgs]] = {"llama3": LLAMA3_FLAVORS}


def _choices(value: str, choices) -> str:
    return f"choose one of {', '.join(map(repr, choices))}{did_you_mean(value, list(choices), fallback=False)}"


def get_model_args(name: str, flavor: str) -> ModelArgs:
    """The :class:`ModelArgs` of a named flavor; KeyError lists the choices."""
    if name not in MODEL_FLAVORS:
        raise KeyError(f"unknown model name {name!r}; {_choices(name, MODEL_FLAVORS)}")
    flavors = MODEL_FLAVORS[name]
    if flavor not in flavors:
        raise KeyError(f"unknown flavor {flavor!r} for model {name!r}; {_choices(flavor, flavors)}")
    return flavors[flavor]


def build_model(name: str, args: ModelArgs, device: str | torch.device = "meta") -> nn.Module:
    """Build model ``name`` with ``args`` on ``device`` (meta by default: no memory is used)."""
    from titanext.models.llama import Transformer

    if name not in MODEL_FLAVORS:
        raise KeyError(f"unknown model name {name!r}; {_choices(name, MODEL_FLAVORS)}")
    with torch.device(device):
        return Transformer(args)


__all__ = ["MODEL_FLAVORS", "ModelArgs", "build_model", "get_model_args"]
