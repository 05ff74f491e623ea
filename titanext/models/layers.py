"""Layers shared by the dense decoder and the MoE layer, and the positions RoPE reads.

:class:`FeedForward` is the decoder's dense SwiGLU and also each MoE layer's shared expert, so it
lives here rather than in :mod:`~titanext.models.llama`, which imports the MoE layer.
:func:`document_positions` turns document ids into positions that restart at each document (the
data loader and context parallelism both hand them to the model).

>>> import torch
>>> FeedForward(dim=8, hidden_dim=16)(torch.randn(2, 8)).shape
torch.Size([2, 8])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["AddLossGradient", "FeedForward", "document_positions", "sum_rows"]


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class AddLossGradient(torch.autograd.Function):
    """Identity on ``out``; in backward, ``loss`` receives the gradient ``weight``: how a loss
    computed inside the forward (MoE's sequence aux loss, MTP's cross-entropy) joins the
    backward without changing what the model returns."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight = weight
        ctx.meta = (loss.shape, loss.dtype, loss.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype, device = ctx.meta
        return grad, torch.full(shape, ctx.weight, dtype=dtype, device=device), None


class _SumRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, index: torch.Tensor, num: int) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(index)
        ctx.dtype = rows.dtype
        out = torch.zeros(num, *rows.shape[1:], dtype=torch.float32, device=rows.device)
        return out.index_add_(0, index, rows.float())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (index,) = ctx.saved_tensors
        return grad.index_select(0, index).to(ctx.dtype), None, None


def sum_rows(rows: torch.Tensor, index: torch.Tensor, num: int) -> torch.Tensor:
    """``out[i] = sum of rows[j] with index[j] == i`` ([num, ...], fp32 sums): ``index_add``,
    whose backward reads only ``index``. (torch's own index_add keeps its source rows for the
    backward, e.g. a MoE's [tokens x top_k, dim] expert outputs, although only their shape is
    needed.)

    >>> sum_rows(torch.ones(3, 2), torch.tensor([0, 1, 0]), 2).tolist()
    [[2.0, 2.0], [1.0, 1.0]]
    """
    return _SumRows.apply(rows, index, num)


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """Positions that restart at 0 at each document start, from document ids [batch, seq]
    (:func:`titanext.data.document_ids`).

    >>> document_positions(torch.tensor([[0, 0, 1, 1, 1, 2, 3]])).tolist()
    [[0, 1, 0, 1, 2, 0, 0]]
    """
    seq = doc_ids.shape[-1]
    column = torch.arange(seq, device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[..., 1:] = doc_ids[..., 1:] != doc_ids[..., :-1]
    first = torch.where(starts, column, torch.zeros_like(column)).cummax(dim=-1).values
    return column - first
