"""Experts modules that already follow the experts protocol by their call, whatever their names.

torchtitan's MoE (and the torch-native MoE code that copies it) splits a layer into a router
that picks the top-k experts per token, a token reorderer / dispatcher that sorts the token rows
by expert, and an inner *grouped experts* module holding stacked ``w1`` / ``w2`` / ``w3`` weights
(``[E, hidden, dim]``, ``[E, dim, hidden]``, ``[E, hidden, dim]``; torchtitan 0.3 names them
``w1_EFD``, ``w2_EDF``, ``w3_EFD``) and called as ``experts(rows_sorted_by_expert,
num_tokens_per_expert)``. That call is titanext's experts protocol
(:mod:`titanext.plugins.expert_parallel`): :class:`~titanext.plugins.expert_parallel.ExpertParallel`
wraps such a module in place, the router and the sorting stay on each rank, and dispatch /
combine run around the inner module, so its own forward (grouped GEMM included) computes the
local experts on their ``to_local()`` shards, as torchtitan's does under its own EP.

>>> import torch
>>> from torch import nn
>>> class Experts(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.w1_EFD = nn.Parameter(torch.zeros(4, 8, 2))
...     def forward(self, x_RD, num_tokens_per_expert_E):
...         return x_RD
>>> follows_experts_protocol(Experts()), follows_experts_protocol(nn.Linear(2, 2))
(True, False)
"""

from __future__ import annotations

import inspect

from torch import nn

__all__ = ["follows_experts_protocol"]

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def follows_experts_protocol(module: nn.Module) -> bool:
    """Whether ``module`` holds its expert weights directly (every parameter has the expert
    count as dim 0 and at least 2 dims; no submodule has parameters) and its forward takes
    ``(x, num_tokens_per_expert...)``: the second argument's name starts with
    ``num_tokens_per_expert`` (torchtitan's ``num_tokens_per_expert_E`` included); any further
    positional argument has a default (titanext's ``row_weights``)."""
    params = [p for _, p in module.named_parameters(recurse=False)]
    if not params or len(params) != sum(1 for _ in module.parameters()):
        return False
    if any(p.dim() < 2 for p in params) or len({p.shape[0] for p in params}) != 1:
        return False
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return False
    params = [q for q in signature.parameters.values() if q.kind in _POSITIONAL]
    extra = params[2:]  # titanext's row_weights: optional
    return (len(params) >= 2 and params[1].name.startswith("num_tokens_per_expert")
            and all(q.default is not q.empty for q in extra))
