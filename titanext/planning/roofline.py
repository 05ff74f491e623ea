"""Roofline time of one micro-batch through one rank's share of the model.

Every matmul runs at whichever roof it hits first: ``2 T k n`` FLOPs at ``efficiency`` x the
dense peak (float8 peak for float8 linears), or its bytes (weight + input + output) at the
HBM bandwidth. Large-token matmuls are compute-bound; a micro-batch of a few hundred tokens
per rank, or a float8 weight cast, is where the memory roof shows. Work that is elementwise by
nature (RMSNorm, residual adds, RoPE, SwiGLU, the loss' softmax, float8 casts and amax) runs at
the memory roof. Attention is FlashAttention: causal, so half the score FLOPs of
``num_flops_per_token``'s non-causal count, and a backward of 2.5 forwards (it recomputes the
scores).

A micro-batch's time splits as the pipeline schedules see it: ``f`` (forward), ``i`` (input
gradients, including any recomputation, which happens just before it) and ``w`` (weight
gradients). Recompute: selective keeps matmul and attention outputs, so it reruns only the
elementwise work; full reruns the whole forward.

Elementwise bytes per token and layer in a forward, ``a`` bytes per value (the derivation:
each norm reads h and writes h, each residual add reads 2h and writes h, RoPE reads and writes
q and k, SwiGLU reads 2f and writes f)::

    a (4 h + 6 h) / (tp if SP else 1)  +  a (2 (h + h_kv) + 3 f) / tp

and a backward moves about twice that.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from titanext.planning.hardware import Device

#: fraction of HBM bandwidth that streaming kernels reach
MEMORY_EFFICIENCY = 0.8
#: bytes an AdamW step (plus the grad-norm pass) moves per fp32 parameter element: reads
#: param, grad, exp_avg, exp_avg_sq (16) and the grad again for the norm (4), writes param and
#: both moments (12)
OPTIMIZER_BYTES_PER_PARAM = 32


@dataclass(frozen=True)
class Linear:
    """One matmul of a layer: ``in_features`` x ``out_features`` weight; ``rowwise``: TP splits
    the input dimension (else the output one); ``float8``: runs as a float8 linear.

    MoE matmuls: ``tp_split=False`` for weights replicated over tp (the router, shared and
    routed experts); ``token_factor`` rows per token (``top_k`` for the routed experts) and
    ``weights`` weight matrices read (the rank's local experts)."""

    name: str
    in_features: int
    out_features: int
    rowwise: bool = False
    float8: bool = False
    tp_split: bool = True
    token_factor: float = 1.0
    weights: float = 1.0


@dataclass
class MicrobatchTime:
    """Seconds of one micro-batch: forward, input gradients (with recomputation), weight
    gradients, and the attention part of the forward (what the CP ring hides behind)."""

    f: float
    i: float
    w: float
    attention_f: float

    @property
    def total(self) -> float:
        return self.f + self.i + self.w

    def __add__(self, other: MicrobatchTime) -> MicrobatchTime:
        return MicrobatchTime(self.f + other.f, self.i + other.i, self.w + other.w,
                              self.attention_f + other.attention_f)


def matmul_seconds(tokens: float, k: float, n: float, *, rate: float, bw: float,
                   weight_bytes: float, io_bytes: float, weights: float = 1.0) -> float:
    """Seconds of a ``tokens`` x ``k`` -> ``n`` matmul at whichever roof it hits first."""
    flops = 2 * tokens * k * n
    moved = weight_bytes * k * n * weights + io_bytes * tokens * (k + n)
    return max(flops / rate, moved / bw)


def microbatch_time(device: Device, *, tokens: float, seq_len: int, dim: int, kv_dim: int,
                    ffn: int, vocab: int, linears: Sequence[Linear], layers: int, tp: int,
                    sp: bool, a: int, ac: str, efficiency: float, embedding: bool = False,
                    head: bool = False, head_float8: bool = False,
                    ffn_replicated: float = 0.0) -> MicrobatchTime:
    """Roofline time of ``tokens`` tokens (this rank's, after CP) through ``layers`` layers.

    ``linears`` are one layer's matmuls; ``embedding`` / ``head``: this rank also runs the
    token embedding / the final norm, output matmul and loss. ``ffn_replicated``: SwiGLU width
    per token that TP does not split (a MoE block's routed ``top_k x hidden`` plus shared
    experts, replicated over tp); pass ``ffn=0`` for such blocks.

    >>> from titanext.planning.hardware import DEVICES
    >>> t = microbatch_time(DEVICES["h100"], tokens=8192, seq_len=8192, dim=4096, kv_dim=1024,
    ...                     ffn=14336, vocab=128256, linears=[Linear("w", 4096, 4096)], layers=1,
    ...                     tp=1, sp=False, a=2, ac="none", efficiency=0.5)
    >>> round(t.w / (2 * 8192 * 4096 * 4096 / (0.5 * DEVICES["h100"].bf16_flops)), 3)
    1.0
    """
    bw = device.hbm_bw * MEMORY_EFFICIENCY
    bf16_rate = device.bf16_flops * efficiency
    fp8_rate = (device.fp8_flops or device.bf16_flops) * efficiency
    fwd_mm = bwd_mm = cast = 0.0
    for lin in linears:
        split = tp if lin.tp_split else 1
        k, n = (lin.in_features / split, lin.out_features) if lin.rowwise else (
            lin.in_features, lin.out_features / split)
        rows = tokens * lin.token_factor
        if lin.float8:
            fwd_mm += matmul_seconds(rows, k, n, rate=fp8_rate, bw=bw, weight_bytes=1, io_bytes=1,
                              weights=lin.weights)
            # casting the input and the weight: amax read, read, 1-byte write (per pass)
            cast += (2 * a + 1) * (rows * k + k * n * lin.weights)
        else:
            fwd_mm += matmul_seconds(rows, k, n, rate=bf16_rate, bw=bw, weight_bytes=a, io_bytes=a,
                              weights=lin.weights)
    fwd_mm *= layers
    cast *= layers
    bwd_mm = fwd_mm  # dgrad and wgrad each have the forward's shapes
    sp_div = tp if sp else 1
    elementwise = a * (10 * dim / sp_div + (2 * (dim + kv_dim) + 3 * ffn) / tp
                       + 3 * ffn_replicated) * tokens * layers
    # causal flash attention: 2 T S h FLOPs forward (QK^T and PV, half the square)
    attn_f = layers * 2 * tokens * seq_len * dim / tp / bf16_rate
    f = fwd_mm + attn_f + (elementwise + cast) / bw
    i = bwd_mm + 2.5 * attn_f + (2 * elementwise + cast) / bw
    w = bwd_mm + cast / bw
    if ac == "selective":
        i += elementwise / bw
    elif ac == "full":
        i += f
    if embedding:  # gather forward, fp32 scatter-add backward
        f += a * tokens * dim / sp_div / bw
        i += 4 * tokens * dim / sp_div / bw
    if head:
        out = vocab / tp
        weight_bytes = io = 1 if head_float8 else a
        rate = fp8_rate if head_float8 else bf16_rate
        mm = matmul_seconds(tokens, dim, out, rate=rate, bw=bw, weight_bytes=weight_bytes,
                            io_bytes=io)
        # logits (a) -> fp32 log-softmax (4) forward; its gradient back (4 + a)
        f += mm + tokens * out * (a + 4) / bw + 3 * a * tokens * dim / sp_div / bw
        i += mm + tokens * out * (a + 4) / bw
        w += mm
    return MicrobatchTime(f=f, i=i, w=w, attention_f=attn_f)


def optimizer_time(device: Device, elements: float) -> float:
    """Seconds of a fused AdamW step (and the grad-norm pass) over ``elements`` fp32 values."""
    return OPTIMIZER_BYTES_PER_PARAM * elements / (device.hbm_bw * MEMORY_EFFICIENCY)
