"""Expert parallelism: the experts of MoE layers split over ranks, tokens sent by all-to-all.

``apply_expert_parallel(model, ep_mesh)`` finds every *experts module* and turns it into an
``ExpertParallel`` module (a ``ParallelStyle`` built on ``distribute_module``): each of its
parameters becomes a DTensor ``Shard(0)`` over ``ep_mesh`` (rank r of W holds experts
``r*E/W .. (r+1)*E/W - 1``) and its call is wrapped in dispatch / combine.

The experts-module protocol (``titanext.models.moe.GroupedExperts`` follows it, so does
torchtitan's ``GroupedExperts`` inside its router / reorderer MoE, found by its call:
:mod:`titanext.plugins.expert_parallel._layouts`; so can yours):

- every parameter has the expert index as its first dimension (e.g. w1/w2/w3 of shape
  [num_experts, ...]);
- ``forward(x, num_tokens_per_expert)`` is called with positional arguments: x [N, dim] with
  rows grouped by expert in expert order, ``num_tokens_per_expert`` a LongTensor [experts]
  (rows per expert, summing to N); it returns [N, out_dim] in the same row order, and computes
  as many experts as its parameters' *local* first dimension (use ``p.to_local()`` for DTensor
  parameters). Routing weights are applied by the caller, after the experts module returns;
  or, where the module's ``takes_row_weights`` is set (titanext's ``GroupedExperts``), it is
  called as ``experts(x, num_tokens_per_expert, row_weights)`` and applies them itself (before
  w2): the weights then travel beside the rows (``_dispatch.dispatch_row_values``).

Dispatch (forward pre-hook), for W = ep ranks and L = E / W local experts:

1. ``all_to_all_single`` of the per-expert counts [E] (equal splits of L): rank r learns how
   many rows every source rank sends to each of its experts;
2. **the one device-to-host sync**: both count vectors are copied to the host at once, since
   ``all_to_all_single`` takes its split sizes as Python lists;
3. ``all_to_all_single`` of the token rows with those uneven splits (the rows arrive in
   (source rank, local expert) order);
4. a local permutation into local-expert order (``repeat_interleave`` with a known output
   size and a stable ``argsort``, on the device: no sync).

Combine (forward hook) is the exact inverse: inverse permutation, then the reverse
``all_to_all_single`` with the two split lists swapped. Backward of each all-to-all is the
all-to-all with swapped splits, and reuses the host lists kept from the forward: the backward
has no sync at all. Where syncs remain: one per dispatch (step 2), once more when activation
checkpointing recomputes the layer (not with ``keep_all_to_all``, which replays the forward's
collectives: :mod:`titanext.plugins.activation_checkpoint`), and inside the experts module if it
needs host counts (``GroupedExperts``' per-expert loop does ``tolist()``; its grouped-GEMM path
does not).

Two other wires (``apply_expert_parallel`` arguments; docs/moe_ep.md): ``dispatch="two_level"``
sends each token once to every node holding one of its experts, then to the experts inside it,
and sums each node's weighted outputs there (``_dispatch``: the module then takes the routing,
``experts(tokens, TokenRouting(ids, weights))``); ``float8_dispatch`` sends the dispatched rows
as float8 with 1 x 128 scales (``_comm``).

Under torchrun, with ``ep_mesh`` a 1D DeviceMesh over the ranks that split the experts:

>>> apply_expert_parallel(model, ep_mesh)  # in a process group  # doctest: +SKIP
['layers.1.moe.experts', 'layers.3.moe.experts']

Runnable example with a user's own model: ``examples/expert_parallel.py``.

The package: ``_apply`` (the style, the adapters for other expert layouts, the entry point),
``_dispatch`` (flat and two-level dispatch / combine), ``_comm`` (the all-to-alls, their counter
and float8 wire), ``_layouts`` (experts modules found by their call), ``replication`` (hot-expert
copies) and ``rules`` (the config rules, torch-free). Names load on first use, so that the config
can import ``rules`` without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module of this package that defines it
_EXPORTS = {name: "_apply" for name in (
    "ExpertParallel", "apply_expert_parallel", "dispatch_tokens", "combine_tokens", "Route",
    "CommCounter", "count_comm", "is_grouped_experts", "ExpertsLayout", "StackedExperts",
    "ModuleListExperts", "ExpertParallelExperts", "call_experts", "detect_experts_layout",
    "expert_parallel_targets")}
_EXPORTS["EP_DISPATCH_MODES"] = "rules"

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
