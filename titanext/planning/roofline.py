"""Roofline time of one micro-batch through one rank's share of the model.

Every matmul runs at whichever roof it hits first: ``2 T k n`` FLOPs at ``efficiency`` x the
dense peak (float8 linears: that rate times their recipe's measured speed-up,
:data:`FLOAT8_GEMM_SPEEDUP`), or its bytes (weight + input + output) at the
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
#: bytes torch's multi-tensor (foreach) Adam step moves per fp32 parameter element, pass by pass
#: (torch.optim.adam._multi_tensor_adam, capturable off; the for-loop runs the same kernels
#: tensor by tensor): lerp of exp_avg towards the grad (read 2, write 1), exp_avg_sq's mul and
#: addcmul (2 + 4 values), sqrt(exp_avg_sq) into a new list (2), its div and + eps (2 + 2), the
#: addcdiv into the param (4): 19 values of 4 bytes. Weight decay adds a pass: AdamW's
#: decoupled mul of the param (2 values), Adam's grad + wd x param into a new list (3).
FOREACH_ADAM_BYTES = 4 * 19
#: the fused kernel reads param, grad and both moments and writes param and both moments
FUSED_ADAM_BYTES = 4 * 7
#: bf16 moments: each step reads them (2 + 2) and writes fp32 copies (4 + 4), and after the
#: update reads the copies (4 + 4) and writes them back as bf16 (2 + 2)
BF16_STATE_CAST_BYTES = 24
#: gradient clipping (titanext.distributed.grad_clip.clip_grad_norm_): the norm reads each
#: gradient (4), the clip multiplies it in place (8); max_norm = 0 only measures
CLIP_BYTES, NORM_BYTES = 12, 4
#: float8 GEMM speed over bf16's at the same shape, by recipe, net of the casts (which the
#: roofline adds itself): an 8192^3 linear's forward + backward on one H200 (gpucheck, torch
#: 2.11 with torchao, 2026-11-26; docs/benchmarks.md): bf16 4.69 ms; tensorwise 3.04-3.33 ms,
#: rowwise 3.81-4.16, blockwise (torchao's Triton GEMMs) 7.13-7.38, each with about 0.3 ms of
#: casts. Below the 2x of the float8 peak: float8 GEMMs reach a smaller fraction of theirs.
#: rowwise_with_gw_hp runs its weight-gradient GEMM in bf16.
FLOAT8_GEMM_SPEEDUP = {"tensorwise": 1.6, "rowwise": 1.25, "rowwise_with_gw_hp": 1.25,
                       "blockwise": 0.65}
#: autocast: a matmul's fp32 weight cast to 16 bits in each forward (read 4, write 2) and its
#: 16-bit gradient cast back in W (read 2, write 4)
AUTOCAST_CAST_BYTES = 6


@dataclass(frozen=True)
class Linear:
    """One matmul of a layer: ``in_features`` x ``out_features`` weight; ``rowwise``: TP splits
    the input dimension (else the output one); ``float8``: runs as a float8 linear.

    MoE matmuls: ``tp_split=False`` for weights replicated over tp (the router, shared and
    routed experts); ``token_factor`` rows per token (``top_k`` for the routed experts) and
    ``weights`` weight matrices read (the rank's local experts). ``float8_recipe``: the
    float8 linear's scaling recipe (:data:`FLOAT8_GEMM_SPEEDUP`). ``dw_at_i``: its weight
    gradient runs in the input-gradient pass of a split backward, not in W (torchao's float8
    linears and float8 grouped GEMM kernels keep their own backward, nothing is deferred)."""

    name: str
    in_features: int
    out_features: int
    rowwise: bool = False
    float8: bool = False
    float8_recipe: str = "tensorwise"
    tp_split: bool = True
    token_factor: float = 1.0
    weights: float = 1.0
    dw_at_i: bool = False


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
                    ffn_replicated: float = 0.0, autocast: bool = False,
                    float8_recipe: str = "tensorwise") -> MicrobatchTime:
    """Roofline time of ``tokens`` tokens (this rank's, after CP) through ``layers`` layers.

    ``linears`` are one layer's matmuls; ``embedding`` / ``head``: this rank also runs the
    token embedding / the final norm, output matmul and loss. ``ffn_replicated``: SwiGLU width
    per token that TP does not split (a MoE block's routed ``top_k x hidden`` plus shared
    experts, replicated over tp); pass ``ffn=0`` for such blocks. ``autocast``: the forward
    runs under torch.autocast over fp32 weights, so each bf16 matmul casts its weight in the
    forward and its weight gradient back in W (:data:`AUTOCAST_CAST_BYTES`).
    ``float8_recipe``: the head's, when ``head_float8``.

    >>> from titanext.planning.hardware import DEVICES
    >>> t = microbatch_time(DEVICES["h100"], tokens=8192, seq_len=8192, dim=4096, kv_dim=1024,
    ...                     ffn=14336, vocab=128256, linears=[Linear("w", 4096, 4096)], layers=1,
    ...                     tp=1, sp=False, a=2, ac="none", efficiency=0.5)
    >>> round(t.w / (2 * 8192 * 4096 * 4096 / (0.5 * DEVICES["h100"].bf16_flops)), 3)
    1.0
    """
    bw = device.hbm_bw * MEMORY_EFFICIENCY
    bf16_rate = device.bf16_flops * efficiency
    # float8 tensor cores at twice the bf16 peak (H100, H200), at each recipe's measured speed
    fp8_scale = device.fp8_flops / (2 * device.bf16_flops) if device.fp8_flops else 0.0

    def fp8_rate(recipe: str) -> float:  # without float8 tensor cores: emulated, bf16 speed
        return bf16_rate * FLOAT8_GEMM_SPEEDUP[recipe] * fp8_scale if fp8_scale else bf16_rate

    fwd_mm, w_mm, w_at_i, cast, autocast_cast = _linears_cost(
        linears, tokens, tp=tp, a=a, bw=bw, bf16_rate=bf16_rate, fp8_rate=fp8_rate,
        autocast=autocast)
    fwd_mm *= layers
    w_mm *= layers
    w_at_i *= layers
    cast *= layers
    autocast_cast *= layers
    bwd_mm = fwd_mm  # dgrad has the forward's shapes
    sp_div = tp if sp else 1
    elementwise = a * (10 * dim / sp_div + (2 * (dim + kv_dim) + 3 * ffn) / tp
                       + 3 * ffn_replicated) * tokens * layers
    # causal flash attention: 2 T S h FLOPs forward (QK^T and PV, half the square)
    attn_f = layers * 2 * tokens * seq_len * dim / tp / bf16_rate
    f = fwd_mm + attn_f + (elementwise + cast + autocast_cast) / bw
    i = bwd_mm + w_at_i + 2.5 * attn_f + (2 * elementwise + cast) / bw
    w = w_mm + (cast + autocast_cast) / bw
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
        rate = fp8_rate(float8_recipe) if head_float8 else bf16_rate
        mm = matmul_seconds(tokens, dim, out, rate=rate, bw=bw, weight_bytes=weight_bytes,
                            io_bytes=io)
        # the output weight's cast in F and its gradient's in W under autocast
        head_cast = AUTOCAST_CAST_BYTES * dim * out / bw if autocast and not head_float8 else 0.0
        # logits (a) -> fp32 log-softmax (4) forward; its gradient back (4 + a)
        f += mm + head_cast + tokens * out * (a + 4) / bw + 3 * a * tokens * dim / sp_div / bw
        i += mm + tokens * out * (a + 4) / bw
        w += mm + head_cast
    return MicrobatchTime(f=f, i=i, w=w, attention_f=attn_f)


def _linears_cost(linears: Sequence[Linear], tokens: float, *, tp: int, a: int, bw: float,
                  bf16_rate: float, fp8_rate, autocast: bool
                  ) -> tuple[float, float, float, float, float]:
    """One layer's matmuls: (forward (= dgrad) seconds, wgrad seconds in W, wgrad seconds in I
    (``Linear.dw_at_i``), float8 cast bytes, autocast's weight-cast bytes)."""
    fwd_mm = w_mm = w_at_i = cast = autocast_cast = 0.0
    for lin in linears:
        split = tp if lin.tp_split else 1
        k, n = (lin.in_features / split, lin.out_features) if lin.rowwise else (
            lin.in_features, lin.out_features / split)
        rows = tokens * lin.token_factor
        bf16_mm = matmul_seconds(rows, k, n, rate=bf16_rate, bw=bw, weight_bytes=a, io_bytes=a,
                                 weights=lin.weights)
        if lin.float8:
            mm = matmul_seconds(rows, k, n, rate=fp8_rate(lin.float8_recipe), bw=bw,
                                weight_bytes=1, io_bytes=1, weights=lin.weights)
            fwd_mm += mm
            dw = bf16_mm if lin.float8_recipe == "rowwise_with_gw_hp" else mm
            if lin.dw_at_i:
                w_at_i += dw
            else:
                w_mm += dw
            # casting the input and the weight: amax read, read, 1-byte write (per pass)
            cast += (2 * a + 1) * (rows * k + k * n * lin.weights)
        else:
            fwd_mm += bf16_mm
            w_mm += bf16_mm
            autocast_cast += AUTOCAST_CAST_BYTES * k * n * lin.weights if autocast else 0.0
    return fwd_mm, w_mm, w_at_i, cast, autocast_cast


def optimizer_bytes_per_param(*, implementation: str = "fused", name: str = "AdamW",
                               weight_decay: bool = True, clip: bool = True,
                               state_dtype: str = "float32") -> int:
    """Bytes the step moves per fp32 parameter element: the gradient-norm pass (and clip) and
    the Adam step of ``implementation`` (``[optimizer] implementation``). bf16 moments
    (``state_dtype``, :mod:`titanext.components.lowp_adam`) run torch's for-loop step on fp32
    copies of them, whatever the implementation: :data:`BF16_STATE_CAST_BYTES` more.

    >>> optimizer_bytes_per_param(implementation="foreach"), optimizer_bytes_per_param()
    (96, 40)
    >>> optimizer_bytes_per_param(state_dtype="bfloat16")  # slower than fused fp32 moments
    120
    """
    if implementation == "fused" and state_dtype == "float32":
        adam = FUSED_ADAM_BYTES
    else:
        adam = FOREACH_ADAM_BYTES + (0 if not weight_decay else 8 if name == "AdamW" else 12)
    if state_dtype != "float32":
        adam += BF16_STATE_CAST_BYTES
    return adam + (CLIP_BYTES if clip else NORM_BYTES)


def optimizer_time(device: Device, elements: float, **kwargs) -> float:
    """Seconds of the optimizer step (and the grad-norm pass) over ``elements`` fp32 values
    (``kwargs``: :func:`optimizer_bytes_per_param`'s). Against the 1B on one H200 (torch 2.11,
    foreach, 1.5B parameters): the planner's step is 5% short of the measured one at 2 x 2048
    and 2 x 8192, where a fused step's figure left it 31% short at 2 x 2048
    (tests/unit/test_plan_calibration.py)."""
    return optimizer_bytes_per_param(**kwargs) * elements / (device.hbm_bw * MEMORY_EFFICIENCY)
