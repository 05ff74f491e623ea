"""What a MoE block means for the planner: its parameters by sharding role, its matmuls, its
saved activations and its expert-parallel all-to-all traffic.

Sharding roles of a MoE block's parameters (titanext's TP plan replicates the MoE over tp;
expert parallelism splits the routed experts over ep, and FSDP shards them over the remaining
``dp_shard x cp / ep`` ranks):

- ``sharded``: the attention matmuls, split by TP like a dense block's;
- ``replicated``: norms, the router gate and the shared experts (replicated over tp);
- ``experts``: the routed experts ``3 x num_experts x dim x hidden`` (split by ep, not by tp).

Saved activations per token of a MoE block (``a`` bytes per value; measured with saved-tensor
hooks on ``debugmoe`` and ``debugdeepseek``, counting what the graph still holds after the
forward: tests/unit/test_moe.py), on top of the block's attention part (the dense
formula with ``f = 0``)::

    none:       a (k h + 3 k f_e + 4 f_s) + 4 E + 28 k (+ 4 k + 4 with route_norm)
                # expert inputs (k h); the routed experts' weighted SwiGLU keeps gate and up
                # and w2 its weighted output (3 k f_e), no expert output is kept (the routing
                # weight multiplies SwiGLU's output before w2: titanext.models.moe.
                # WeightedSwiGLU); the shared experts' SwiGLU (4 f_s); the fp32 scores (4 E),
                # the int64 expert ids the weights were gathered with (8 k), each row's fp32
                # weight and its two int64 sort indices (20 k); route_norm keeps the gathered
                # fp32 weights and their sum (4 k + 4). The router keeps the block's 16-bit
                # input, not an fp32 copy (titanext.models.moe.RouterGate); the expert choice,
                # group-limited routing included, runs without autograd and keeps nothing
    selective:  a 2 f_s + 4 E        # matmul outputs kept: shared w1/w3, the fp32 router scores
    full:       0                    # the block input only, already in the dense part

with ``k = top_k``, ``f_e`` the expert hidden size, ``f_s = num_shared_experts x f_e``, ``E``
experts and ``G`` expert groups (group-limited routing; 0 without). Under expert parallelism a
rank computes ``k`` expert rows per token on average (balanced routing), so the same formula
holds; an imbalance of ``max/mean`` load scales the routed terms.

All-to-all bytes per MoE block and micro-batch, per rank: dispatch and combine each move
``T k (ep-1)/ep x h x a`` (forward), and again in backward (and in the recomputed forward under
full AC). Float8 dispatch (``[parallelism] expert_parallel_float8_dispatch``) sends the forward
dispatches' rows as ``h + ceil(h / 128)`` bytes (:func:`row_bytes`); the combine and the backward
keep ``h x a``. Two-level dispatch (``expert_parallel_dispatch = "two_level"`` over nodes of
``r = expert_parallel_ranks_per_node`` ep ranks, ``n = ep / r`` nodes) sends each token once to
each of its ``d`` destination nodes (``d = min(n, top_k, num_limited_groups)`` when each node holds
whole expert groups, else ``min(n, top_k)``: the bound, reached by most tokens), with ``8 k``
bytes of routing per row, then fans it out inside the node: per all-to-all
``T d (n-1)/n x (row + 8 k)`` bytes cross the network and ``T k (r-1)/r x row`` stay on NVLink
(:func:`two_level_bytes`). Hot-expert replication (``[moe] replicate_hot_experts = N``) adds at
most ``N`` experts' weights, ``N x 3 h f_e x a``, per MoE block and optimizer step (not per
micro-batch: the copies are fixed, sent and returned once per step), and their summed gradients
once per step (:func:`expert_copy_bytes`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from titanext.planning.roofline import Linear


@dataclass(frozen=True)
class MoEShape:
    """One MoE block of the reference model, counted on the meta device."""

    layer_ids: frozenset[int]
    num_experts: int
    top_k: int
    hidden: int  # one routed expert's SwiGLU hidden size
    shared_hidden: int  # the shared experts' SwiGLU hidden size (0 without)
    groups: int  # expert groups of group-limited routing (1 = off)
    sharded: int  # attention matmuls (TP-split)
    replicated: int  # norms, router gate, shared experts
    experts: int  # routed expert parameters
    tensors: int  # parameter tensors of the block
    linears: tuple[Linear, ...]  # attention from the TP plan; router, shared, routed experts
    limited: int = 0  # groups a token's experts may come from (group-limited routing; 0 = off)
    route_norm: bool = True  # the top-k weights are normalized to sum to one


def moe_shape(model, dense_linears: tuple[Linear, ...]) -> MoEShape | None:
    """The MoE blocks of ``model`` (a titanext Transformer on meta), or None for a dense model."""
    moe_ids = [int(i) for i, blk in model.layers.items() if hasattr(blk, "moe")]
    if not moe_ids:
        return None
    block = model.layers[str(moe_ids[0])]
    moe, args = block.moe, block.moe.args
    experts = sum(p.numel() for p in moe.experts.parameters())
    attention = sum(p.numel() for p in block.attention.parameters())
    total = sum(p.numel() for p in block.parameters())
    dim, shared = moe.dim, args.num_shared_experts * args.hidden_dim
    attn_linears = tuple(lin for lin in dense_linears if lin.name.startswith("attention."))
    linears = (*attn_linears,
               Linear("moe.router.gate", dim, args.num_experts, tp_split=False),
               *((Linear("moe.shared_experts.w1", dim, shared, tp_split=False),
                  Linear("moe.shared_experts.w3", dim, shared, tp_split=False),
                  Linear("moe.shared_experts.w2", shared, dim, tp_split=False)) if shared else ()),
               # k rows per token; the memory roof reads every local expert's weights (set per
               # layout by ``with_ep``)
               Linear("moe.experts.w1", dim, args.hidden_dim, tp_split=False,
                      token_factor=args.top_k, weights=args.num_experts),
               Linear("moe.experts.w3", dim, args.hidden_dim, tp_split=False,
                      token_factor=args.top_k, weights=args.num_experts),
               Linear("moe.experts.w2", args.hidden_dim, dim, tp_split=False,
                      token_factor=args.top_k, weights=args.num_experts))
    return MoEShape(layer_ids=frozenset(moe_ids), num_experts=args.num_experts, top_k=args.top_k,
                    hidden=args.hidden_dim, shared_hidden=shared, groups=args.num_expert_groups,
                    sharded=attention, replicated=total - attention - experts, experts=experts,
                    tensors=len(list(block.parameters())), linears=linears,
                    limited=args.num_limited_groups if args.num_limited_groups
                    < args.num_expert_groups else 0, route_norm=args.route_norm)


def with_ep(linears: tuple[Linear, ...], num_experts: int, ep: int) -> list[Linear]:
    """The block's matmuls on one rank of ``ep``: each reads ``num_experts / ep`` experts."""
    return [dataclasses.replace(lin, weights=num_experts / ep)
            if lin.name.startswith("moe.experts.") else lin for lin in linears]


def float8_experts(linears: list[Linear], recipe: str, *, kernels: bool = True) -> list[Linear]:
    """``[float8] moe_experts``: the routed experts' GEMMs at the measured rowwise float8 speed
    with 1-byte operands and a cast of their input and weights per pass (the roofline's float8
    linear, :data:`~titanext.planning.roofline.FLOAT8_GEMM_SPEEDUP`), for
    the ``rowwise`` recipe, which runs torchao's float8 grouped GEMMs. ``blockwise`` has no
    float8 grouped GEMM (it is emulated: float8 numerics at high-precision speed), so it stays
    at the bf16 peak. No float8 copy or scale outlives a GEMM (the kernels and the emulation
    cast per call and save the high-precision inputs), so memory is unchanged. ``kernels``:
    torchao's kernels run them (rowwise on a float8 GPU, not forced to emulate): they keep their
    own backward, so a split backward computes their dW at I (``Linear.dw_at_i``); emulated
    experts defer it to W.

    >>> from titanext.planning.roofline import Linear
    >>> [lin.float8 for lin in float8_experts([Linear("moe.experts.w1", 8, 8),
    ...                                         Linear("moe.router.gate", 8, 4)], "rowwise")]
    [True, False]
    """
    if recipe != "rowwise":
        return list(linears)
    return [dataclasses.replace(lin, float8=True, float8_recipe="rowwise", dw_at_i=kernels)
            if lin.name.startswith("moe.experts.") else lin for lin in linears]


def moe_activation_extra(shape: MoEShape, mode: str, *, dim: int, a: int) -> float:
    """Saved bytes per token of a MoE block's routed part, beyond its attention part (see the
    module docstring; TP replicates it, CP divides it like everything else)."""
    k, h_e, h_s, e = shape.top_k, shape.hidden, shape.shared_hidden, shape.num_experts
    if mode == "full":
        return 0.0
    if mode == "selective":
        return a * 2 * h_s + 4 * e
    norm = 4 * k + 4 if shape.route_norm else 0
    return a * (k * dim + 3 * k * h_e + 4 * h_s) + 4 * e + 28 * k + norm


def all_to_all_bytes(tokens: float, *, dim: int, top_k: int, ep: int, a: int) -> float:
    """Bytes one rank sends in one all-to-all (dispatch or combine) of ``tokens`` tokens."""
    return tokens * top_k * (ep - 1) / ep * dim * a


def row_bytes(dim: int, a: int, float8: bool = False) -> int:
    """Bytes of one token row on the wire: ``dim x a``, or float8 with one exponent byte per
    1 x 128 block (``titanext.plugins.expert_parallel._comm.quantize_rows``).

    >>> row_bytes(7168, 2), row_bytes(7168, 2, float8=True)
    (14336, 7224)
    """
    return dim + -(-dim // 128) if float8 else dim * a


def destination_nodes(shape: MoEShape, nodes: int) -> int:
    """The most nodes one token's experts sit on: ``num_limited_groups`` when each node holds
    whole expert groups (node-limited routing), else ``top_k``; at most ``nodes``."""
    limit = shape.top_k
    if shape.limited and shape.groups % nodes == 0:
        limit = min(limit, shape.limited)
    return min(limit, nodes)


def two_level_bytes(tokens: float, *, row: float, top_k: int, nodes: int, ranks_per_node: int,
                    dest_nodes: int, routing: bool) -> tuple[float, float]:
    """(inter-node, intra-node) bytes one rank sends in one two-level all-to-all of ``tokens``
    tokens and ``row`` bytes a row: each token to ``dest_nodes`` nodes (``routing``: with its
    ``2 top_k`` fp32 ids and weights), then to its ``top_k`` experts inside each node.

    >>> two_level_bytes(1000, row=100, top_k=8, nodes=8, ranks_per_node=8, dest_nodes=4,
    ...                 routing=True)
    (574000.0, 700000.0)
    """
    inter = tokens * dest_nodes * (nodes - 1) / nodes * (row + (8 * top_k if routing else 0))
    return inter, tokens * top_k * (ranks_per_node - 1) / ranks_per_node * row


def expert_copy_bytes(expert_params: int, num_experts: int, *, copies: int, a: int) -> float:
    """Bytes one rank sends in one hot-expert copy all-to-all (weights forward or gradients
    backward): at most ``copies`` experts of ``expert_params / num_experts`` elements each.

    >>> expert_copy_bytes(3 * 8 * 64 * 32, 8, copies=2, a=2)  # 2 SwiGLU experts, bf16
    24576.0
    """
    return float(copies * expert_params / num_experts * a)
