"""How plugins find a model's repeated blocks.

Plugins that act per block (FSDP units, activation checkpointing, compile, TP plans with
wildcards) accept an explicit ``blocks`` list. When it is omitted they use the model's
``layers`` container (an ``nn.ModuleDict`` or ``nn.ModuleList``), the convention of
titanext's reference model and of most decoder libraries.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn


def find_blocks(model: nn.Module, blocks: Iterable[nn.Module] | None = None) -> list[nn.Module]:
    if blocks is not None:
        return list(blocks)
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleDict):
        return list(layers.values())
    if isinstance(layers, (nn.ModuleList, nn.Sequential)):
        return list(layers)
    raise ValueError(
        f"{type(model).__name__} has no 'layers' ModuleDict/ModuleList; pass blocks=[...] "
        "(the modules to treat as transformer blocks)"
    )
