"""Per-block ``torch.compile``.

Blocks are compiled in place with ``nn.Module.compile`` so parameter names do not change.
Compiling each repeated block (rather than the whole model) keeps the graphs small, lets FSDP
hooks sit between them, and reuses one compiled graph for all blocks of the same shape.

>>> apply_compile(model, backend="inductor")  # compiles on first call: seconds  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from titanext._compat import inductor_cache_options
from titanext.plugins._blocks import find_blocks

__all__ = ["apply_compile"]


def apply_compile(model: nn.Module, *, backend: str = "inductor", fullgraph: bool = True,
                  blocks: Iterable[nn.Module] | str | None = None) -> nn.Module:
    """Compile every block of ``model`` (``blocks`` or ``model.layers``) in place (inductor:
    with its cache keyed by the CPU vector ISA, :func:`titanext._compat.inductor_cache_options`)."""
    options = inductor_cache_options(backend)
    for block in find_blocks(model, blocks):
        block.compile(backend=backend, fullgraph=fullgraph, options=options)
    return model
