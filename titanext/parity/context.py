"""What a wiring and a loss function see on one rank: :class:`ParityContext`, and the default
per-rank loss of a causal LM (:func:`lm_loss`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from titanext.plugins.context_parallel import layout_positions, shard_sequence

#: Mesh dimension names that split the batch (each of their ranks feeds its own rows).
DATA_DIMS = ("dp", "dp_replicate", "dp_shard", "fsdp", "ddp", "hsdp", "ep", "batch")

__all__ = ["DATA_DIMS", "ParityContext", "lm_loss", "reference_lm_loss"]


@dataclass
class ParityContext:
    """One rank's view of a parity run, handed to the wiring and to the loss function.

    ``mesh`` is the DeviceMesh the check built (``mesh_shape`` x ``mesh_names``); the batch is
    split by rows over ``data_dims`` and by sequence (zigzag) over ``cp_dim``. A wiring may set
    ``forward_context`` (e.g. ``lambda: ring_attention_sdpa(ctx.mesh["cp"])``): every step's
    forward and backward then run inside it.
    """

    rank: int
    world_size: int
    mesh: DeviceMesh
    batch_size: int
    seq_len: int
    data_dims: tuple[str, ...]
    cp_dim: str | None
    layout: str = "zigzag"
    forward_context: Callable[[], AbstractContextManager] = field(default=nullcontext)

    def _coords(self, dims: tuple[str, ...]) -> tuple[int, int]:
        """(index, size) of this rank over ``dims`` (mixed radix in mesh order)."""
        names = self.mesh.mesh_dim_names or ()
        coord = self.mesh.get_coordinate() or [0] * len(names)
        index, size = 0, 1
        for i, name in enumerate(names):
            if name in dims:
                index, size = index * self.mesh.size(i) + coord[i], size * self.mesh.size(i)
        return index, size

    @property
    def data_rank(self) -> int:
        """This rank's index among the ranks that split the batch rows."""
        return self._coords(self.data_dims)[0]

    @property
    def data_size(self) -> int:
        """How many row shards the batch is cut into."""
        return self._coords(self.data_dims)[1]

    @property
    def cp_mesh(self) -> DeviceMesh | None:
        """The 1D context-parallel mesh, or None."""
        return self.mesh[self.cp_dim] if self.cp_dim else None

    def positions(self) -> torch.Tensor:
        """The global positions ([local_seq]) of the tokens this rank holds: what RoPE must
        rotate by (index a positions-free rotary's tables with them in the wiring)."""
        cp = self.cp_mesh
        if cp is None or cp.size() == 1:
            return torch.arange(self.seq_len)
        return layout_positions(self.layout, cp.get_local_rank(), cp.size(),
                                self.seq_len // cp.size())

    def local_batch(self, inputs: torch.Tensor, labels: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """This rank's (inputs, labels, positions) of the global [batch, seq] batch: its rows
        over the data dims, then its sequence shard over cp (positions None without cp)."""
        rows = inputs.shape[0] // self.data_size
        lo = self.data_rank * rows
        inputs, labels = inputs[lo:lo + rows], labels[lo:lo + rows]
        cp = self.cp_mesh
        if cp is None or cp.size() == 1:
            return inputs, labels, None
        inputs, labels = (shard_sequence(t, 1, cp, self.layout) for t in (inputs, labels))
        return inputs, labels, self.positions()


def _takes(module: nn.Module, name: str) -> bool:
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _from_transformers(model: nn.Module) -> bool:
    """Whether ``model`` is a ``transformers`` model (by class, without importing the library)."""
    return any(c.__module__.startswith("transformers.") for c in type(model).__mro__)


def _logits(out) -> torch.Tensor:
    out = getattr(out, "logits", out)  # an output object (Hugging Face style) or a tensor
    if isinstance(out, tuple | list):
        out = out[0]
    return out.full_tensor() if isinstance(out, DTensor) else out


def lm_loss(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor,
            ctx: ParityContext) -> torch.Tensor:
    """The default per-rank loss: a causal LM taking token ids and returning logits.

    Takes this rank's share of the batch (:meth:`ParityContext.local_batch`), calls
    ``model(tokens)`` (plus ``position_ids=`` under cp when the forward accepts it) and returns
    the mean cross entropy over the tokens it saw (a ``transformers`` model gets the positions
    as [rows, local_seq], as its rotary embedding wants them); with equal shares, averaging
    gradients over the data and cp ranks (what FSDP does) gives the one-process gradient.
    """
    tokens, labels, positions = ctx.local_batch(inputs, labels)
    if positions is not None and _takes(model, "position_ids"):
        if _from_transformers(model):  # their rotary wants [batch, seq], sharded like the tokens
            positions = positions.expand(tokens.shape[0], -1)
        out = model(tokens, position_ids=positions)
    else:
        out = model(tokens)
    logits = _logits(out)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def reference_lm_loss(model: nn.Module, inputs: torch.Tensor,
                      labels: torch.Tensor) -> torch.Tensor:
    """The one-process reference: mean cross entropy of ``model(inputs)`` over every token."""
    return F.cross_entropy(_logits(model(inputs)).flatten(0, 1).float(), labels.flatten())
