"""How plugins find a model's repeated blocks.

Plugins that act per block (FSDP units, activation checkpointing, compile, TP plans with
wildcards) accept an explicit ``blocks``: a list of modules, or the dotted path of their
container (``"transformer.h"``, ``"model.layers"``). When it is omitted they use the model's
``layers`` container (an ``nn.ModuleDict`` or ``nn.ModuleList``), the convention of
titanext's reference model and of most decoder libraries.

>>> from torch import nn
>>> model = nn.Module()
>>> model.transformer = nn.Module()
>>> model.transformer.h = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))
>>> len(find_blocks(model, "transformer.h"))
3
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

__all__ = ["block_container", "find_blocks", "mtp_modules"]


def block_container(model: nn.Module, path: str) -> nn.ModuleDict | nn.ModuleList:
    """``model``'s submodule at the dotted ``path``, checked to be a ModuleDict / ModuleList
    (a ``Sequential`` counts as a list)."""
    try:
        container = model.get_submodule(path)
    except AttributeError:
        raise ValueError(f"{type(model).__name__} has no submodule {path!r}; pass blocks= as the "
                         "dotted path of the container of its transformer blocks (for example "
                         "'layers', 'model.layers' or 'transformer.h')") from None
    if not isinstance(container, nn.ModuleDict | nn.ModuleList | nn.Sequential):
        raise ValueError(f"{type(model).__name__}.{path} is a {type(container).__name__}; blocks= "
                         "must name an nn.ModuleDict or nn.ModuleList of blocks in order")
    return container


def find_blocks(model: nn.Module, blocks: Iterable[nn.Module] | str | None = None
                ) -> list[nn.Module]:
    """The blocks of ``model``: ``blocks`` itself (modules), the container at a dotted path
    (``"transformer.h"``), or ``model.layers`` when ``blocks`` is None."""
    if isinstance(blocks, str):
        container = block_container(model, blocks)
        return list(container.values() if isinstance(container, nn.ModuleDict) else container)
    if blocks is not None:
        return list(blocks)
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleDict):
        return list(layers.values())
    if isinstance(layers, (nn.ModuleList, nn.Sequential)):
        return list(layers)
    raise ValueError(
        f"{type(model).__name__} has no 'layers' ModuleDict/ModuleList; pass blocks=[...] "
        "(the modules to treat as transformer blocks) or blocks='path.to.container'"
    )


def mtp_modules(model: nn.Module) -> list[nn.Module]:
    """The multi-token prediction modules of ``model`` (``model.mtp.layers``, an
    ``nn.ModuleDict`` as :class:`titanext.models.mtp.MultiTokenPrediction` holds them; empty
    without). They run after the blocks, each on the previous one's output."""
    layers = getattr(getattr(model, "mtp", None), "layers", None)
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else []
