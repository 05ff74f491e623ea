"""Recompute by module (``[activation_checkpoint] mode = "modules"``): what each choice of
``recompute_modules`` stops saving, and what it costs to rerun (:mod:`titanext.plugins.
recompute_modules` is the runtime).

Saved bytes per token of a multi-head latent attention block without recompute (``a`` bytes
of the activation dtype, ``h`` dim, ``r_q`` / ``r_kv`` the low-rank latents, ``n`` heads of
``d_qk`` query/key and ``d_v`` value features, ``f`` a dense block's FFN width), read off
titanext's own code and checked against the dry run's tracker (bf16 under FSDP: debugdeepseek
and copies with h, n, the latents, the expert and FFN widths doubled, each term exact)::

    norms:    2 ((4 + 2 a) h + 4)               # RMSNorm: fp32 x, x * rsqrt cast to a, output
    latents:  sum over r_q, r_kv of (4 + 2 a) r + 4   # q_norm / kv_norm; wq_b / wkv_b input
    heads:    n (2 a d_qk + 2 a max(d_qk, d_v) + a d_v + 4)  # q, k; v and the output padded to
                                                # d_qk for the fused kernel; wo's input; lse
    FFN:      a 4 f (dense), or titanext.planning.moe.moe_activation_extra (MoE)

What a choice stops saving, per block and token (the region's inputs stay saved)::

    layernorm:       2 ((4 + a) h + 4)          # fp32 x, x * rsqrt, rsqrt of both norms
    mla_up_proj:     sum over r_q, r_kv of (4 + a) r - 4
                     + n a (2 d_qk + d_v [d_v = d_qk])   # the region ends after RoPE: q, k and
                                                # v are recomputed; a v that the kernel pads to
                                                # d_qk stays as the kernel's own copy; with
                                                # core_attn, n a (2 d_qk + d_v): the recomputed
                                                # core keeps q, k, v as handles
    core_attn:       n (a max(d_qk, d_v) + 4)   # the output and lse (v padded: - 8 a head)
    moe_act:         a k f_e                    # the weighted silu(gate) * up (w2's input),
                                                # k routed rows; gate, up and weights stay
    mlp:             4 a f                      # a dense block's w1, w3 outputs and SwiGLU
    shared_experts:  4 a f_s

less ``a h`` when layernorm and the FFN side that reads ffn_norm's output (mlp in a dense block,
shared_experts in a MoE block) are both recomputed. Single choices and DeepSeek-V3's default
(layernorm, mla_up_proj, moe_act) put the planner's peak within 8-10% of the dry run's on
debugdeepseek; all six together within 25% (core_attn with the others frees less than its
own share: not modeled).

and what it reruns before the block's backward (the roofline's rates; ``T`` tokens): the norms'
elementwise passes, wq_b and wkv_b with their norms, the attention core's forward, SwiGLU over
``k T`` routed rows, a dense FFN's three matmuls, the shared experts' three matmuls. No
all-to-all runs twice.

>>> drop_bytes(("moe_act",), h=7168, a=2, mla=(1536, 512, 128, 64, 128), heads=128, ffn=0,
...            moe=(8, 2048, 2048))
32768.0
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["backward_walk", "drop_bytes", "float8_storage_saving", "mla_saved_bytes",
           "recompute_flops_bytes"]


def mla_saved_bytes(*, h: int, a: int, mla: tuple[int, int, int, int, int], heads: float,
                    ffn: float) -> float:
    """Saved bytes per token of an MLA block's norms, latents, heads (``heads`` per TP rank)
    and a dense FFN of width ``ffn`` (0 for a MoE block: its routed part is separate)."""
    r_q, r_kv, d_nope, d_rope, d_v = mla
    d_qk = d_nope + d_rope
    norms = 2 * ((4 + 2 * a) * h + 4)
    latents = sum((4 + 2 * a) * r + 4 for r in (r_q, r_kv) if r)
    per_head = 2 * a * d_qk + 2 * a * max(d_qk, d_v) + a * d_v + 4
    return norms + latents + heads * per_head + 4 * a * ffn


def drop_bytes(modules: tuple[str, ...], *, h: int, a: int, mla: tuple[int, int, int, int, int],
               heads: float, ffn: float, moe: tuple[int, int, int] | None) -> float:
    """Bytes per token one block stops saving when ``modules`` are recomputed. ``ffn``: a dense
    block's FFN width per TP rank (0 in a MoE block); ``moe``: (top_k, expert hidden, shared
    hidden) in a MoE block, else None; ``heads``: attention heads per TP rank."""
    r_q, r_kv, d_nope, d_rope, d_v = mla
    d_qk = d_nope + d_rope
    out = 0.0
    for name in modules:
        if name == "layernorm":
            out += 2 * ((4 + a) * h + 4)
        elif name == "mla_up_proj":
            out += sum((4 + a) * r - 4 for r in (r_q, r_kv) if r)
            if "core_attn" in modules:  # the recomputed core's inputs: handles too
                out += heads * a * (2 * d_qk + d_v)
            else:  # what the attention kernel saves of them (a v it pads is its own copy)
                out += heads * a * (2 * d_qk * (d_qk >= d_v) + d_v * (d_v >= d_qk))
        elif name == "core_attn":
            width = max(d_qk, d_v) if d_qk else h / max(1.0, heads)
            out += heads * (a * width + (-4 if d_qk and d_v != d_qk else 4))
        elif name == "moe_act" and moe:
            out += a * moe[0] * moe[1]
        elif name == "mlp":
            out += 4 * a * ffn
        elif name == "shared_experts" and moe:
            out += 4 * a * moe[2]
    consumer = "shared_experts" if moe else "mlp"
    if "layernorm" in modules and consumer in modules:
        out -= a * h  # the recomputed FFN side keeps ffn_norm's output as its own input
    return out


def recompute_flops_bytes(modules: Iterable[str], *, h: int, a: int,
                          mla: tuple[int, int, int, int, int], heads: float, ffn: float,
                          moe: tuple[int, int, int] | None, seq_len: int
                          ) -> tuple[float, float, float]:
    """(matmul FLOPs, attention FLOPs, elementwise bytes) per token that rerunning ``modules``
    of one block costs before its backward (the roofline turns them into seconds)."""
    r_q, r_kv, d_nope, d_rope, d_v = mla
    d_qk = d_nope + d_rope
    mm = attn = moved = 0.0
    for name in modules:
        if name == "layernorm":
            moved += 2 * 2 * a * h  # each norm reads h and writes h
        elif name == "mla_up_proj":
            mm += 2 * (r_q * heads * d_qk + r_kv * heads * (d_nope + d_v))
            moved += sum(2 * a * r for r in (r_q, r_kv) if r)
        elif name == "core_attn":
            attn += 2 * seq_len * (heads * d_qk if d_qk else h)  # causal: half the scores
        elif name == "moe_act" and moe:
            moved += 3 * a * moe[0] * moe[1]  # reads gate and up, writes the product
        elif name == "mlp":
            mm += 2 * 3 * h * ffn
            moved += 3 * a * ffn
        elif name == "shared_experts" and moe:
            mm += 2 * 3 * h * moe[2]
            moved += 3 * a * moe[2]
    return mm, attn, moved



def float8_storage_saving(names: tuple[str, ...], *, a: int, wo_in: float, h: int,
                          top_k: int, expert_hidden: int = 0) -> float:
    """Bytes per token one block stops saving with ``[activation_checkpoint] float8_storage``
    (:mod:`titanext.plugins.float8_storage`): each stored row of ``d`` values keeps ``d`` float8
    bytes and one exponent byte per 1 x 128 block instead of ``a d``. ``wo_in``: the width of
    wo's input (heads x v features per TP rank); ``top_k``: routed rows per token in a MoE
    block (0 in a dense one); ``expert_hidden``: a routed expert's SwiGLU width (its two
    inputs, gate and up, per routed row: ``expert_act_input``).

    >>> float8_storage_saving(("expert_up_proj_input",), a=2, wo_in=16384, h=7168, top_k=8)
    56896.0
    >>> float8_storage_saving(("expert_act_input",), a=2, wo_in=16384, h=7168, top_k=8,
    ...                       expert_hidden=2048)
    32512.0
    """
    def row(d: float) -> float:
        return a * d - (d + -(-d // 128))

    out = 0.0
    if "attention_out_input" in names:
        out += row(wo_in)
    if "expert_up_proj_input" in names and top_k:
        out += top_k * row(h)
    if "expert_act_input" in names and top_k:
        out += 2 * top_k * row(expert_hidden)
    return out


def backward_walk(held: Sequence[float], reruns: Sequence[float]) -> float:
    """The largest moment of one micro-batch's blocks' backward, the last block first: block
    ``i``'s recompute (``reruns[i]``) beside what blocks ``0..i`` still hold (``held``; the
    later ones have freed theirs)."""
    total, peak = 0.0, 0.0
    for kept, rerun in zip(held, reruns, strict=True):
        total += kept
        peak = max(peak, total + rerun)
    return peak
