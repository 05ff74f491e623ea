"""Fixture models whose matmuls come in every shape (issue 35, "every matmul is accounted for"):
transformers' GPT-2 (Conv1D projections, weight [in, out]), a subclassed nn.Linear, and a module
that calls F.linear on its own parameter. Written here, copied from none."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def tiny_gpt2(seed: int = 0, n_layer: int = 2):
    """A tiny GPT2LMHeadModel (fp32, no dropout), dims divisible by 16 for float8."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=n_layer, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                     eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def gpt2_tokens(seed: int = 1, batch: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(seed))


class ScaledInit(nn.Linear):
    """A library's Linear subclass that keeps nn.Linear.forward."""


class OwnWeightProjection(nn.Module):
    """A projection that holds its weight itself and calls F.linear on it."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / d_in ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class MixedMatmuls(nn.Module):
    """up: a subclassed Linear; mid: F.linear on its own parameter; down: nn.Linear."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.up = ScaledInit(d, 4 * d)
        self.mid = OwnWeightProjection(4 * d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.mid(F.gelu(self.up(x)))))
