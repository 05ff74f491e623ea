"""Which parameters a tensor-parallel plan leaves without a rule inside a sharded region.

A *sharded region* is the parent module of a module whose weight a plan shards
(``ColwiseParallel`` / ``RowwiseParallel`` and their subclasses), inside one of the model's
repeated blocks: the attention module around ``q_proj`` ... ``o_proj``, the MLP around
``gate_proj`` ... ``down_proj``. Between the column- and the row-parallel linears every rank sees
only its heads (or its hidden slice), so a replicated weight there without a rule (Qwen3's
``q_norm`` under a Llama plan) gets a per-rank partial gradient: the loss matches one process,
the gradients do not. Weights outside the regions (the block's norms, a replicated MoE beside
the attention) see full activations and are right replicated.

>>> from torch import nn
>>> from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
>>> attn = nn.Module()
>>> attn.q, attn.o, attn.q_norm = nn.Linear(8, 8), nn.Linear(8, 8), nn.RMSNorm(4)
>>> model = nn.Module(); model.layers = nn.ModuleList([nn.Module()]); model.layers[0].attn = attn
>>> unruled_parameters(model, {"layers.*.attn.q": ColwiseParallel(),
...                            "layers.*.attn.o": RowwiseParallel()})
['layers.0.attn.q_norm.weight']
"""

from __future__ import annotations

import fnmatch

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

__all__ = ["fqn_matches", "unruled_parameters"]


def fqn_matches(pattern: str, name: str) -> bool:
    """Whether module FQN ``name`` matches a plan key (``*`` / fnmatch per dotted component)."""
    parts, got = pattern.split("."), name.split(".")
    return len(parts) == len(got) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(got, parts))


def unruled_parameters(model: nn.Module, plan: dict[str, ParallelStyle],
                       blocks: str = "layers") -> list[str]:
    """FQNs of the parameters inside a sharded region of a block that no rule of ``plan``
    covers (a rule covers its module's parameters and those of its submodules). Blocks are
    the modules ``<...>.<blocks>.<i>`` (``layers.3``, ``model.layers.3``)."""
    names = [n for n, _ in model.named_modules()]
    ruled = {n for n in names for key in plan if fqn_matches(key, n)}
    sharding = {n for n in names for key, style in plan.items()
                if isinstance(style, ColwiseParallel | RowwiseParallel) and fqn_matches(key, n)}

    def in_block(fqn: str) -> bool:
        parts = fqn.split(".")
        # strictly inside a block: <...>.layers.<i>.<child>[...]
        return any(p == blocks and len(parts) > i + 2 and parts[i + 1].isdigit()
                   for i, p in enumerate(parts))

    regions = {n.rpartition(".")[0] for n in sharding}
    regions = {r for r in regions if r and in_block(r)}
    out = []
    for pname, _ in model.named_parameters():
        owner = pname.rpartition(".")[0]
        region = next((r for r in regions if owner == r or owner.startswith(r + ".")), None)
        if region is None:
            continue
        chain, covered = owner, False
        while chain and len(chain) >= len(region):
            if chain in ruled and chain != region:
                covered = True
                break
            chain = chain.rpartition(".")[0]
        if not covered:
            out.append(pname)
    return out
