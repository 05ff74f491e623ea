"""Layers shared by the dense decoder and the MoE layer.

:class:`FeedForward` is the decoder's dense SwiGLU and also each MoE layer's shared expert, so it
lives here rather than in :mod:`~titanext.models.llama`, which imports the MoE layer.

>>> import torch
>>> FeedForward(dim=8, hidden_dim=16)(torch.randn(2, 8)).shape
torch.Size([2, 8])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FeedForward"]


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
