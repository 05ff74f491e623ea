"""Fixture models for the invariants and the parity check (written here, copied from none): QK-norm
inside attention, a fused qkv whose ``state_dict`` hooks rename it (as torchtitan's does), and
dropout in train mode. Tiny: vocab 64, dim 32, 2 blocks, 4 heads of 8."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

VOCAB, DIM, HEADS = 64, 32, 4
HD = DIM // HEADS


class Attention(nn.Module):
    """Causal attention; ``qk_norm`` adds Qwen3-style RMSNorms over each head's features."""

    def __init__(self, qk_norm: bool = False, dropout: float = 0.0):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.q_norm = nn.RMSNorm(HD) if qk_norm else None
        self.k_norm = nn.RMSNorm(HD) if qk_norm else None
        self.attn_dropout = dropout  # functional, as transformers' attention_dropout

    def qkv(self, x):
        return self.wq(x), self.wk(x), self.wv(x)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, -1, HD) for t in self.qkv(x))  # -1: the local heads under TP
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        o = F.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True,
            dropout_p=self.attn_dropout if self.training else 0.0)
        return self.wo(o.transpose(1, 2).flatten(2))


class FusedQKV(nn.Module):
    """One ``wqkv`` Linear whose ``state_dict`` says wq / wk / wv (hooks split and join it)."""

    def __init__(self):
        super().__init__()
        self.wqkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.register_state_dict_post_hook(self._split)
        self.register_load_state_dict_pre_hook(self._join)

    @staticmethod
    def _split(module, state_dict, prefix, local_metadata):
        for name, part in zip(("wq", "wk", "wv"), state_dict.pop(prefix + "wqkv.weight").chunk(3)):
            state_dict[f"{prefix}{name}.weight"] = part

    @staticmethod
    def _join(module, state_dict, prefix, *args):
        parts = [state_dict.pop(f"{prefix}{n}.weight") for n in ("wq", "wk", "wv")]
        state_dict[prefix + "wqkv.weight"] = torch.cat(parts)

    def forward(self, x):
        return self.wqkv(x)


class FusedAttention(Attention):
    def __init__(self):
        super().__init__()
        del self.wq, self.wk, self.wv
        self.qkv_linear = FusedQKV()

    def qkv(self, x):
        return self.qkv_linear(x).chunk(3, dim=-1)


class Block(nn.Module):
    def __init__(self, attention: nn.Module, dropout: float = 0.0):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attention = attention
        self.up, self.down = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        x = x + self.drop(self.attention(self.attention_norm(x)))
        return x + self.drop(self.down(F.gelu(self.up(self.ffn_norm(x)))))


class TinyLM(nn.Module):
    def __init__(self, make_attention, dropout: float = 0.0, layers: int = 2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(make_attention(), dropout) for _ in range(layers))
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for block in self.layers:
            h = block(h)
        return self.output(self.norm(h))


def qk_norm_lm() -> TinyLM:
    """QK-norm inside attention (Qwen3's layout)."""
    return TinyLM(lambda: Attention(qk_norm=True))


def fused_qkv_lm() -> TinyLM:
    """A fused qkv whose state_dict hooks rename it to wq / wk / wv (torchtitan's style)."""
    return TinyLM(FusedAttention)


def dropout_lm() -> TinyLM:
    """Dropout 0.1 in train mode: nn.Dropout modules and a functional attention dropout."""
    return TinyLM(lambda: Attention(dropout=0.1), dropout=0.1)


def tp_plan(*, qk_norm_rule: bool = True) -> dict:
    """Megatron-style TP for TinyLM: heads and the MLP hidden dim split; QK-norm on the head dim
    (dim 2 of [b, s, heads, hd]) unless ``qk_norm_rule`` is False (the bug to catch)."""
    plan = {
        "layers.*.attention.wq": ColwiseParallel(), "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(), "layers.*.attention.wo": RowwiseParallel(),
        "layers.*.up": ColwiseParallel(), "layers.*.down": RowwiseParallel(),
        "output": ColwiseParallel(output_layouts=Replicate()),
    }
    if qk_norm_rule:
        for name in ("q_norm", "k_norm"):
            plan[f"layers.*.attention.{name}"] = SequenceParallel(sequence_dim=2,
                                                                  use_local_output=True)
    return plan
