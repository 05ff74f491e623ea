"""Fixture models in the styles of other libraries (written here, copied from none): what the
loud-or-correct tests (tests/unit/test_loud_or_correct.py, tests/multiprocess/) run plugins on."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titanext.plugins.expert_parallel import call_experts


class MyLinear(nn.Linear):
    """A library's Linear that keeps nn.Linear.forward (e.g. to add its own init)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.05)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class HalfLinear(nn.Linear):
    """A Linear subclass with its own forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * F.linear(x, self.weight, self.bias)


class SubclassMLP(nn.Module):
    def __init__(self, d: int = 32, own_forward_only: bool = False):
        super().__init__()
        cls = HalfLinear if own_forward_only else MyLinear
        self.up, self.down = cls(d, 4 * d), cls(4 * d, d)
        self.gate = HalfLinear(d, d)

    def forward(self, x):
        return self.gate(x) + self.down(F.gelu(self.up(x)))


class GroupedQKVAttention(nn.Module):
    """Fused qkv whose rows are grouped per KV head: [q heads of group g; k_g; v_g] for each g."""

    def __init__(self, dim: int = 32, n_heads: int = 4, n_kv_heads: int = 2):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = n_heads, n_kv_heads, dim // n_heads
        self.qkv = nn.Linear(dim, (n_heads + 2 * n_kv_heads) * self.hd)
        self.out = nn.Linear(n_heads * self.hd, dim)

    def forward(self, x):
        b, s, _ = x.shape
        per = self.n_heads // self.n_kv
        h = self.qkv(x).view(b, s, -1, per + 2, self.hd)  # -1: the local KV groups under TP
        q = h[..., :per, :].flatten(2, 3)
        k, v = h[..., per, :], h[..., per + 1, :]
        k, v = (t.repeat_interleave(per, dim=2) for t in (k, v))
        o = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
        return self.out(o.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class StackedSwiGLUExperts(nn.Module):
    """Experts as stacked weights, called as experts(tokens, top_k_index, top_k_weights).

    ``fused``: one gate_up_proj [E, 2h, d] (or [E, d, 2h] transposed) and down_proj; else
    w1/w3/w2. ``transposed``: [E, in, out] weights, else [E, out, in]."""

    def __init__(self, n_exp: int, d: int, h: int, *, fused: bool, transposed: bool):
        super().__init__()
        self.fused, self.is_transposed = fused, transposed

        def w(out, inp):
            return nn.Parameter(torch.randn(n_exp, *((inp, out) if transposed else (out, inp)))
                                / inp ** 0.5)
        if fused:
            self.gate_up_proj, self.down_proj = w(2 * h, d), w(d, h)
        else:
            self.w1, self.w3, self.w2 = w(h, d), w(h, d), w(d, h)

    def _mm(self, x, w):
        return x @ w if self.is_transposed else F.linear(x, w)

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x)
        for e in range(top_k_index.max().item() + 1 if top_k_index.numel() else 0):
            token, slot = torch.where(top_k_index == e)
            xe = x[token]
            if self.fused:
                gate, up = self._mm(xe, self.gate_up_proj[e]).chunk(2, dim=-1)
                down = self.down_proj[e]
            else:
                gate, up, down = self._mm(xe, self.w1[e]), self._mm(xe, self.w3[e]), self.w2[e]
            y = self._mm(F.silu(gate) * up, down) * top_k_weights[token, slot, None]
            out = out.index_add(0, token, y)
        return out


class RoutedMoE(nn.Module):
    """A softmax top-k router in front of ``experts`` (ModuleList: called via call_experts)."""

    def __init__(self, experts: nn.Module, d: int, n_exp: int, top_k: int = 2):
        super().__init__()
        self.router, self.experts, self.top_k = nn.Linear(d, n_exp, bias=False), experts, top_k

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        w, idx = self.router(x).softmax(-1).topk(self.top_k, dim=-1)
        return x + call_experts(self.experts, x, idx, w).reshape(shape)


class MoEModel(nn.Module):
    """Two MoE blocks in ``layers`` of one of the expert layouts."""

    def __init__(self, layout: str, d: int = 16, h: int = 24, n_exp: int = 4):
        super().__init__()

        def experts():
            if layout == "module_list":
                return nn.ModuleList(MLP(d, h) for _ in range(n_exp))
            return StackedSwiGLUExperts(n_exp, d, h, fused=layout.startswith("fused"),
                                        transposed=layout.endswith("in_out"))
        self.layers = nn.ModuleList(RoutedMoE(experts(), d, n_exp) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


EXPERT_LAYOUTS = ("module_list", "stacked_out_in", "stacked_in_out", "fused_out_in",
                  "fused_in_out")


class NoExpertsMoE(nn.Module):
    """A MoE whose experts are a ModuleDict: a layout titanext does not know."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.layers = nn.ModuleList([nn.Module()])
        self.layers[0].experts = nn.ModuleDict({str(i): MLP(d, d) for i in range(2)})

    def forward(self, x):
        return sum(e(x) for e in self.layers[0].experts.values())


class LlamaLikeModel(nn.Module):
    """Llama-like, but not titanext's layout: blocks in ``model.layers``, ``self_attn.q_proj``."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.model = nn.Module()
        self.model.embed = nn.Embedding(64, d)
        self.model.layers = nn.ModuleList(nn.Module() for _ in range(2))
        for block in self.model.layers:
            block.self_attn = nn.Module()
            block.self_attn.q_proj = nn.Linear(d, d)
        self.lm_head = nn.Linear(d, 64)

    def forward(self, ids):
        h = self.model.embed(ids)
        for block in self.model.layers:
            h = h + block.self_attn.q_proj(h)
        return self.lm_head(h)
