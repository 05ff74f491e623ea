"""Memory per rank: model state (parameters, gradients, optimizer) and activations.

Model state (bytes per parameter; Psi parameters, N ranks sharding them). The playbook's
mixed-precision accounting is :func:`zero_bytes_per_rank`: bf16 params 2 + bf16 grads 2 +
fp32 master 4 + Adam 8 = 16 bytes (20 with an fp32 gradient-accumulation copy); ZeRO-1 keeps
4 Psi + 12 Psi/N, ZeRO-2 2 Psi + 14 Psi/N, ZeRO-3 16 Psi/N. titanext's own runs are FSDP2:
the fp32 parameter is the master (sharded), gradients are sharded fp32 (reduce dtype), Adam
holds two fp32 moments and a step scalar per tensor, and the compute-dtype copy of a unit
exists only while it is gathered (two units in flight).

Activations (bytes per token per transformer layer, a = bytes of the activation dtype, h =
dim, h_kv = kv_heads x head_dim, f = FFN hidden, n = heads), derived for titanext's Llama
block (RMSNorm, SwiGLU, GQA, no dropout, flash-style SDPA so no s^2 term) and checked against
saved-tensor measurements (tests/test_plan.py)::

    none:       a (10 h + 4 f) + 4 (n + 2)        # K/V expanded to n heads for SDPA
    selective:  a (5 h + 2 h_kv + 2 f) + 4 n      # outputs of matmuls and attention + block input
    full:       a h                               # the block input only

The GPT layer of Korthikanti et al. (the playbook's figure) is :func:`gpt_activation_bytes`:
34 s b h + 5 a s^2 b bytes per layer in 16-bit. The Llama form drops the s^2 term (attention
scores are never stored), the dropout masks and the GELU input, and adds SwiGLU's gate.
Under TP the parts split by heads or FFN columns divide by tp, the norm parts only with SP,
and the all-gathered matmul inputs (2 h) never; under CP every part divides by cp and ring
attention keeps K/V un-expanded (a (2 h + 2 h_kv) instead of 4 a h). Ulysses (u ranks) saves
the head-sharded, whole-sequence q, k, v: as many bytes as the sequence shards, except that
kv heads per TP rank fewer than u are replicated up to u (h_kv x u tp / kv_heads).

>>> zero_bytes_per_rank(1e9, 8, 3) / 1e9       # ZeRO-3: 16 Psi / N
2.0
"""

from __future__ import annotations

from titanext.planning.layout import Layout
from titanext.planning.moe import moe_activation_extra
from titanext.planning.shapes import ModelShape

__all__ = ["activation_bytes_per_token_layer", "gpt_activation_bytes", "memory_per_pp_rank",
           "zero_bytes_per_rank"]


# -- the playbook's closed forms ------------------------------------------------------------------

def zero_bytes_per_rank(psi: float, n: int, stage: int, *,
                        fp32_grad_accum: bool = False) -> float:
    """Model-state bytes per rank under ZeRO-``stage`` (0 = plain DP) with bf16 mixed precision."""
    params, grads, rest = 2 * psi, (6 if fp32_grad_accum else 2) * psi, 12 * psi
    if stage >= 1:
        rest /= n
    if stage >= 2:
        grads /= n
    if stage >= 3:
        params /= n
    return params + grads + rest


def gpt_activation_bytes(s: int, b: int, h: int, heads: int) -> float:
    """Korthikanti et al.'s GPT layer without recomputation: 34 s b h + 5 a s^2 b (16-bit)."""
    return 34 * s * b * h + 5 * heads * s * s * b


# -- activations ----------------------------------------------------------------------------------

def activation_bytes_per_token_layer(shape: ModelShape, mode: str, *, a: int, tp: int = 1,
                                     sp: bool = True, cp: int = 1, moe: bool = False,
                                     ulysses: int = 1) -> float:
    """Saved activation bytes of one layer per token of the *whole* sequence (see module doc).

    ``moe``: a MoE block: the attention part (``f = 0``) plus the routed part of
    :func:`titanext.planning.moe.moe_activation_extra` (replicated over tp). ``ulysses``: CP's
    Ulysses degree (1: ring)."""
    if moe:
        return (_activation_bytes(shape, mode, a=a, tp=tp, sp=sp, cp=cp, ffn=0, ulysses=ulysses)
                + moe_activation_extra(shape.moe, mode, dim=shape.dim, a=a) / cp)
    return _activation_bytes(shape, mode, a=a, tp=tp, sp=sp, cp=cp, ffn=shape.ffn,
                             ulysses=ulysses)


def _activation_bytes(shape: ModelShape, mode: str, *, a: int, tp: int, sp: bool, cp: int,
                      ffn: int, ulysses: int = 1) -> float:
    h, hkv, f, n = shape.dim, shape.kv_dim, ffn, shape.n_heads
    if cp > 1:  # Ulysses replicates kv heads up to u per TP rank (see the module doc)
        kv_heads = hkv * n // h
        hkv = hkv * max(1.0, ulysses * tp / kv_heads)
    if mode == "full":
        return a * h / (tp if sp else 1) / cp
    # q, k, v, out (ring: K/V unexpanded)
    attention = a * (2 * h + 2 * hkv) if cp > 1 else a * 4 * h
    if mode == "selective":
        sharded = a * (3 * h + 2 * hkv + 2 * f) + 4 * n  # matmul and attention outputs
        if cp > 1:  # the ring is not an SDPA op: its output is recomputed
            sharded -= a * h + 4 * n
        return (sharded / tp + a * h / (tp if sp else 1)) / cp
    sharded = attention + a * 4 * f + 4 * n
    norms = a * 4 * h + 8  # residual inputs and normalised values of the two norms, rstds
    matmul_inputs = a * 2 * h  # gathered under TP, so never divided by tp
    return (sharded / tp + norms / (tp if sp else 1) + matmul_inputs) / cp


# -- per pp rank ----------------------------------------------------------------------------------

def state_elements(lo: Layout, psi_dense: float, psi_experts: float, ranks: int) -> float:
    """Elements on one rank when ``ranks`` data-parallel ranks shard the state: the ep ranks
    already split the experts, the other ``ranks / ep`` shard them further."""
    return psi_dense / ranks + psi_experts / max(1, ranks // lo.ep)


def memory_per_pp_rank(lo: Layout, in_flight: list[int]
                       ) -> tuple[list[dict[str, float]], list[tuple[float, float]]]:
    """(bytes by category, (dense, expert) parameters) of each pp rank.

    ``in_flight``: micro-batches whose activations a pp rank holds at its peak (the schedule's).
    """
    shape, moe, tp, ep, a = lo.shape, lo.shape.moe, lo.tp, lo.ep, lo.a
    p = lo.cfg.parallelism
    per_layer = activation_bytes_per_token_layer(shape, lo.ac, a=a, tp=tp, sp=lo.sp, cp=lo.cp,
                                                 ulysses=lo.ulysses)
    head_act = lo.tokens * (a * 3 * shape.dim / (tp if lo.sp else 1) + 4 * shape.vocab / tp + 16)
    # The loss's backward, on top of the saved activations, per token and local vocabulary
    # entry: the logits the train step still holds (a) and the fp32 gradients of the
    # log-softmax output and of the logits (8) (measured by the dry run, docs/dry_run.md)
    loss_backward = lo.tokens * (a + 8) * shape.vocab / tp
    per_moe_layer = (activation_bytes_per_token_layer(shape, lo.ac, a=a, tp=tp, sp=lo.sp,
                                                      cp=lo.cp, moe=True, ulysses=lo.ulysses)
                     if moe else 0.0)
    sharded = p.zero_stage >= 2 and lo.n_fsdp * lo.rep > 1
    memories, psis = [], []
    for r, rk in enumerate(lo.pipe.ranks):
        n_m = lo.n_moe(rk)
        psi_dense = ((rk.layers - n_m) * (shape.layer_sharded / tp + shape.layer_replicated)
                     + n_m * ((moe.sharded / tp + moe.replicated) if moe else 0)
                     + (shape.embedding / tp if rk.embedding else 0)
                     + (shape.output / tp + shape.final_norm if rk.head else 0))
        psi_experts = n_m * moe.experts / ep if moe else 0.0
        tensors = ((rk.layers - n_m) * shape.layer_tensors + n_m * (moe.tensors if moe else 0)
                   + rk.embedding + 2 * rk.head)
        state = state_elements(lo, psi_dense, psi_experts, lo.n_fsdp if sharded else 1)
        mem = {"params (fp32 master)": 4 * state, "grads (fp32)": 4 * state,
               # two fp32 moments per element, and a 4-byte step per parameter tensor
               "optimizer (Adam)": 8 * state_elements(lo, psi_dense, psi_experts, lo.zero_n)
               + 4 * tensors}
        if sharded and lo.n_fsdp > 1:  # gathered units: two in flight, or all without resharding
            mem["gathered params"] = lo.gathered_layer * (2 if lo.reshard else rk.layers)
        else:
            mem["gathered params"] = 0.0
        if sharded and lo.pp > 1:
            # PP x FSDP: the schedule reduce-scatters once per step, so FSDP accumulates the
            # unsharded gradients of this rank's stages over the micro-batches (in the reduce
            # dtype when it differs from the param dtype; measured by the dry run)
            mem["unsharded grads (pp)"] = lo.reduce_bytes * (psi_dense + psi_experts)
        stages = len(rk.stages)
        mem["activations"] = (in_flight[r] * lo.tokens_mb / stages
                              * ((rk.layers - n_m) * per_layer + n_m * per_moe_layer)
                              + (head_act if rk.head else 0.0))
        mem["loss backward"] = loss_backward if rk.head else 0.0
        memories.append(mem)
        psis.append((psi_dense, psi_experts))
    return memories, psis
