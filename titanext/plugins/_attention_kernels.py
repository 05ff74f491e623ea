"""Block attention kernels that return the log-sum-exp, for ring attention.

``block_forward`` computes one (query block, KV block) attention and its LSE; ``block_backward``
computes that block's gradients from the *merged* output and LSE (the flash-attention
backward: P = exp(S - lse), dS = P * (dP - rowsum(dO * O))), which is what makes the ring's
gradients exact. Kernels:

- ``math``: plain matmuls in fp32 (fp64 for fp64 inputs), GQA without expanding K/V. Any device.
- ``flash_cpu``: ATen's CPU flash-attention kernels (fp32, fp64, bf16, fp16).
- ``flash_cuda``: ATen's CUDA flash-attention kernels (fp16, bf16).

The ATen ops are the ones ``F.scaled_dot_product_attention`` dispatches to; they are reached
through ``torch.ops.aten`` here and nowhere else.

The value head dim may differ from the query/key one (MLA): ``math`` handles it directly; the
flash kernels need one head size, so the smaller side is zero-padded (padded q/k features add
nothing to the scores, padded v features give output columns that are cut off).

Both functions take an optional ``mask`` ([batch, Lq, Lk] bool, True = may attend; the same for
every head) for document masking. ``math`` applies it to the scores and ``flash_cpu`` passes it
as an additive mask; the CUDA flash kernel has no mask argument, so masked blocks run ``math``
there. A query row with no visible key in the block gets lse = -inf and a zero output (the
ring's merge then ignores the block for that row).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from titanext._compat import (
    flash_attention_cpu,
    flash_attention_cpu_backward,
    flash_attention_cuda,
    flash_attention_cuda_backward,
)

KERNELS = ("auto", "math", "flash_cpu", "flash_cuda")
_HALF = (torch.float16, torch.bfloat16)


def pick_kernel(kernel: str, q: torch.Tensor, v_head_dim: int | None = None) -> str:
    """Resolve "auto" for ``q``'s device and dtype; check an explicit choice can run. The flash
    kernels run at the larger of q's and v's head dims (``v_head_dim``, default q's)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel = {kernel!r} is not one of {KERNELS}")
    dev, dt, hd = q.device.type, q.dtype, max(q.shape[-1], v_head_dim or 0)
    cuda_ok = dev == "cuda" and dt in _HALF and hd % 8 == 0 and hd <= 256
    cpu_ok = dev == "cpu" and dt in (torch.float32, torch.float64, *_HALF)
    if kernel == "auto":
        return "flash_cuda" if cuda_ok else "flash_cpu" if cpu_ok else "math"
    if kernel == "flash_cuda" and not cuda_ok:
        raise ValueError(f"kernel = 'flash_cuda' needs CUDA fp16/bf16 inputs with head_dim a "
                         f"multiple of 8 up to 256; got {dev} {dt} head_dim {hd}; use 'auto'")
    if kernel == "flash_cpu" and not cpu_ok:
        raise ValueError(f"kernel = 'flash_cpu' needs CPU inputs; got {dev} {dt}; use 'auto'")
    return kernel


def _pad_heads(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Zero-pad the last dim of each tensor to the largest (the flash kernels need one head
    size for q, k and v)."""
    d = max(t.shape[-1] for t in ts)
    return tuple(t if t.shape[-1] == d else F.pad(t, (0, d - t.shape[-1])) for t in ts)


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _expand(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _fold(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Sum expanded-head gradients back onto their KV head."""
    b, h, s, d = t.shape
    return t if h == kv_heads else t.view(b, kv_heads, h // kv_heads, s, d).sum(2)


def _scores(q, k, scale, causal, mask=None):
    """S = q k^T * scale in the accumulation dtype, grouped: [B, KVH, G, Lq, Lk]."""
    b, h, lq, d = q.shape
    kvh, lk = k.shape[1], k.shape[2]
    acc = _acc(q.dtype)
    qg = q.reshape(b, kvh, h // kvh, lq, d).to(acc)
    s = torch.matmul(qg * scale, k.to(acc).unsqueeze(2).transpose(-1, -2))
    if causal:  # only diagonal blocks are causal, and those are square
        upper = torch.ones(lq, lk, dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(upper, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask[:, None, None], float("-inf"))
    return qg, s


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, Lq, Lk] bool -> [B, 1, Lq, Lk] additive mask (0 or -inf) for the ATen kernels."""
    zeros = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return zeros.masked_fill_(~mask, float("-inf")).unsqueeze(1)


def block_forward(q, k, v, *, causal: bool, scale: float, kernel: str, mask=None):
    """(out [B, H, Lq, D], lse [B, H, Lq] in the accumulation dtype) of one block."""
    b, h, lq, _ = q.shape
    dv = v.shape[-1]
    if kernel == "flash_cpu":
        qp, kp, vp = _pad_heads(q, _expand(k, h), _expand(v, h))
        out, lse = flash_attention_cpu(
            qp, kp, vp, 0.0, causal, scale=scale,
            attn_mask=None if mask is None else _additive(mask, q.dtype))
        lse = lse.to(_acc(q.dtype))
        if mask is not None:  # the kernel reports lse = 0 for a row with nothing visible
            lse = lse.masked_fill(~mask.any(-1).unsqueeze(1), float("-inf"))
        return out[..., :dv], lse
    if kernel == "flash_cuda" and mask is None:
        res = flash_attention_cuda(
            *_pad_heads(q, _expand(k, h), _expand(v, h)), 0.0, causal, False, scale=scale)
        return res[0][..., :dv], res[1].to(_acc(q.dtype))
    _, s = _scores(q, k, scale, causal, mask)
    lse = torch.logsumexp(s, dim=-1)
    # a fully masked row has lse = -inf: exponentiate against 0 instead, which gives p = 0
    p = torch.exp(s - lse.nan_to_num(neginf=0.0).unsqueeze(-1))
    out = torch.matmul(p, v.to(s.dtype).unsqueeze(2))
    return out.reshape(b, h, lq, dv), lse.reshape(b, h, lq)


def block_backward(dout, q, k, v, out, lse, delta, *, causal: bool, scale: float, kernel: str,
                   mask=None):
    """(dq [B, H, Lq, D], dk [B, KVH, Lk, D], dv [B, KVH, Lk, Dv]) of one block, given the
    merged out and lse.

    ``delta`` is rowsum(dout * out) [B, H, Lq], shared by all blocks (used by ``math``; the
    flash kernels recompute it from ``out``).
    """
    b, h, lq, d = q.shape
    kvh, dv = k.shape[1], v.shape[-1]
    if kernel == "flash_cpu" or (kernel == "flash_cuda" and mask is None):
        q, ke, ve, o, dout = _pad_heads(q, _expand(k, h), _expand(v, h), out.to(q.dtype), dout)
        if kernel == "flash_cpu":
            lse_k = lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
            dq, dk, dv_ = flash_attention_cpu_backward(
                dout, q, ke, ve, o, lse_k, 0.0, causal, scale=scale,
                attn_mask=None if mask is None else _additive(mask, q.dtype))
        else:
            # No cumulative sequence lengths (None: not varlen; an empty tensor would be read
            # as varlen and refused); the philox state is unused without dropout.
            unused = torch.empty(0, device=q.device, dtype=torch.int64)
            dq, dk, dv_ = flash_attention_cuda_backward(
                dout, q, ke, ve, o, lse.float().contiguous(), None, None, lq, k.shape[2], 0.0,
                causal, unused, unused, scale=scale)
        return dq[..., :d], _fold(dk[..., :d], kvh), _fold(dv_[..., :dv], kvh)
    qg, s = _scores(q, k, scale, causal, mask)
    acc = s.dtype
    p = torch.exp(s - lse.reshape(b, kvh, h // kvh, lq, 1).to(acc))
    dout_g = dout.reshape(b, kvh, h // kvh, lq, dv).to(acc)
    dv = torch.matmul(p.transpose(-1, -2), dout_g).sum(2)
    dp = torch.matmul(dout_g, v.to(acc).unsqueeze(2).transpose(-1, -2))
    ds = p * (dp - delta.reshape(b, kvh, h // kvh, lq, 1).to(acc))
    dq = torch.matmul(ds, k.to(acc).unsqueeze(2)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qg).sum(2) * scale
    return dq.reshape(b, h, lq, d), dk, dv
