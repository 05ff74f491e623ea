"""A MoE in torchtitan's layout, written here from its shape (no code copied): a top-k router, a
token reorderer that sorts the token rows by expert, and an inner grouped-experts module with
stacked w1 / w2 / w3 called as ``experts(rows_sorted_by_expert, num_tokens_per_expert)``.

``names="v0.3"`` uses torchtitan 0.3's shape-suffixed parameter names (``w1_EFD``, ``w2_EDF``,
``w3_EFD``, the call's ``num_tokens_per_expert_E``); ``names="v0.2"``: plain ``w1``, ``w2``,
``w3``.
The inner module converts its DTensor parameters to local shards, as torchtitan's does."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

_NAMES = {"v0.2": ("w1", "w2", "w3"), "v0.3": ("w1_EFD", "w2_EDF", "w3_EFD")}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class TTGroupedExperts(nn.Module):
    """Stacked SwiGLU experts: w1, w3 [E, hidden, dim] and w2 [E, dim, hidden]."""

    def __init__(self, dim: int, hidden: int, num_experts: int, names: str = "v0.3"):
        super().__init__()
        self.num_experts, self._names = num_experts, _NAMES[names]
        n1, n2, n3 = self._names
        for name, shape in ((n1, (hidden, dim)), (n2, (dim, hidden)), (n3, (hidden, dim))):
            self.register_parameter(name, nn.Parameter(
                torch.randn(num_experts, *shape) / shape[1] ** 0.5))

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (_local(getattr(self, n)) for n in self._names)
        outs = []
        for e, rows in enumerate(torch.split(x_RD, num_tokens_per_expert_E.tolist())):
            h = F.silu(rows @ w1[e].t()) * (rows @ w3[e].t())
            outs.append(h @ w2[e].t())
        return torch.cat(outs) if outs else x_RD.new_zeros(0, w2.shape[1])


class TTRouter(nn.Module):
    """Sigmoid top-k token-choice routing: (scores [T, K], expert ids [T, K], counts [E])."""

    def __init__(self, dim: int, num_experts: int, top_k: int):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.num_experts, self.top_k = num_experts, top_k

    def forward(self, x_TD: torch.Tensor):
        scores = torch.sigmoid(self.gate(x_TD).float())
        top_scores, ids = scores.topk(self.top_k, dim=-1)
        counts = torch.bincount(ids.reshape(-1), minlength=self.num_experts)
        return top_scores, ids, counts


class TTTokenReorderer:
    """Sorts the token rows by expert (stable), and scatters the weighted outputs back."""

    def __init__(self, top_k: int):
        self.top_k = top_k

    def dispatch(self, x_TD, scores_TK, ids_TK):
        order = torch.argsort(ids_TK.reshape(-1), stable=True)
        token = order // self.top_k
        return x_TD[token], token, scores_TK.reshape(-1)[order]

    def combine(self, out_RD, token, scores, x_TD):
        out = (out_RD.float() * scores[:, None]).to(out_RD.dtype)
        return torch.zeros_like(x_TD).index_add_(0, token, out)


class TTRoutedExperts(nn.Module):
    """The reorderer around the inner grouped experts."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, names: str):
        super().__init__()
        self.inner_experts = TTGroupedExperts(dim, hidden, num_experts, names)
        self.token_dispatcher = TTTokenReorderer(top_k)

    def forward(self, x_TD, scores_TK, ids_TK, counts_E):
        rows, token, scores = self.token_dispatcher.dispatch(x_TD, scores_TK, ids_TK)
        out = self.inner_experts(rows, counts_E)
        return self.token_dispatcher.combine(out, token, scores, x_TD)


class TTMoE(nn.Module):
    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, names: str):
        super().__init__()
        self.router = TTRouter(dim, num_experts, top_k)
        self.routed_experts = TTRoutedExperts(dim, hidden, num_experts, top_k, names)
        self.shared_experts = nn.Sequential(nn.Linear(dim, hidden), nn.SiLU(),
                                            nn.Linear(hidden, dim))

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        x = x_BSD.reshape(-1, x_BSD.shape[-1])
        scores, ids, counts = self.router(x)
        out = self.routed_experts(x, scores, ids, counts) + self.shared_experts(x)
        return out.reshape(x_BSD.shape)


class TTBlock(nn.Module):
    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, names: str):
        super().__init__()
        self.moe_norm = nn.RMSNorm(dim)
        self.moe = TTMoE(dim, hidden, num_experts, top_k, names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.moe_norm(x))


class TTMoEModel(nn.Module):
    """Blocks of norm + MoE with a residual, in ``layers``."""

    def __init__(self, names: str = "v0.3", dim: int = 16, hidden: int = 24,
                 num_experts: int = 4, top_k: int = 2, n_layers: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(TTBlock(dim, hidden, num_experts, top_k, names)
                                    for _ in range(n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return x
