"""Kernel checks against an fp32 reference: ring-attention blocks, deferred weight gradients,
grouped GEMM and the float8 recipes."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from titanext.gpucheck._common import Ctx, Row, Skip, guarded, rel_err, sqnr_db
from titanext.models.moe import GroupedExperts, grouped_mm_supported
from titanext.plugins._attention_kernels import block_backward, block_forward, pick_kernel
from titanext.plugins.context_parallel._ring import _merge
from titanext.plugins.float8 import FLOAT8_RECIPES, apply_float8, has_float8_hardware
from titanext.plugins.float8_experts import (
    FLOAT8_EXPERT_RECIPES,
    apply_float8_experts,
    float8_experts_kernels_usable,
)
from titanext.plugins.weight_grad import WeightGradQueue, defer_weight_grads, weight_grad_deferral

__all__ = ["check_deferred_weight_grads", "check_float8", "check_grouped_gemm",
           "check_ring_kernels", "emulated_ring", "torchao_available"]

SECTION = "check"


# -- ring attention ------------------------------------------------------------------------------

def _visible(docs: torch.Tensor | None, i: slice, j: slice) -> torch.Tensor | None:
    """[B, Lq, Lk] same-document mask of a (query chunk, key chunk) block, None if all visible."""
    if docs is None:
        return None
    mask = docs[:, i, None] == docs[:, None, j]
    return None if bool(mask.all()) else mask


def _part(t: torch.Tensor, s: slice) -> torch.Tensor:
    """One rank's chunk along the sequence dim, contiguous as a rank would hold it."""
    return t[:, :, s].contiguous()


def emulated_ring(q, k, v, dout, *, world: int, kernel: str, docs: torch.Tensor | None = None):
    """Causal attention computed as ``world`` ring ranks would, in one process: the sequence in
    ``world`` contiguous chunks, one block-kernel call per (query chunk, earlier key chunk),
    merged by log-sum-exp, then every block's backward from the merged output (the kernels and
    the merge the ring runs; only the sends are missing). Returns (out, dq, dk, dv)."""
    s, scale = q.shape[2], q.shape[-1] ** -0.5
    size = s // world
    chunks = [slice(r * size, (r + 1) * size) for r in range(world)]
    out = q.new_zeros((*q.shape[:3], v.shape[-1]), dtype=torch.float32)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    pairs = []
    for a, i in enumerate(chunks):
        for j in chunks[:a + 1]:
            mask = _visible(docs, i, j)
            if mask is not None and not bool(mask.any()):
                continue
            pairs.append((i, j, i == j, mask))
            o, lb = block_forward(_part(q, i), _part(k, j), _part(v, j), causal=i == j,
                                  scale=scale, kernel=kernel, mask=mask)
            _merge(out[:, :, i], lse[:, :, i], o, lb)
    merged = out.to(q.dtype)
    delta = (dout.float() * merged.float()).sum(-1)
    dq, dk, dv = (torch.zeros_like(t, dtype=torch.float32) for t in (q, k, v))
    for i, j, causal, mask in pairs:
        gq, gk, gv = block_backward(_part(dout, i), _part(q, i), _part(k, j), _part(v, j),
                                    _part(merged, i), _part(lse, i), _part(delta, i),
                                    causal=causal, scale=scale, kernel=kernel, mask=mask)
        dq[:, :, i] += gq.float()
        dk[:, :, j] += gk.float()
        dv[:, :, j] += gv.float()
    return merged, dq, dk, dv


def _reference(q, k, v, dout, docs, dtype):
    """SDPA with an explicit causal (and document) mask in ``dtype``: out and input grads."""
    heads = q.shape[1]
    ts = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    qr, kr, vr = ts
    rep = heads // k.shape[1]
    ke, ve = kr.repeat_interleave(rep, 1), vr.repeat_interleave(rep, 1)
    s = q.shape[2]
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    if docs is not None:
        mask = mask & (docs[:, :, None] == docs[:, None, :])[:, None]
    out = F.scaled_dot_product_attention(qr, ke, ve, attn_mask=mask)
    out.backward(dout.to(dtype))
    return out.detach(), *(t.grad for t in ts)


def _v_head_dim_supported() -> bool:
    """Whether this build's block kernels take a value head dim other than q/k's (MLA)."""
    q = torch.randn(1, 2, 4, 8)
    try:
        out, _ = block_forward(q, q, q[..., :4], causal=True, scale=1.0, kernel="math")
        return out.shape[-1] == 4
    except RuntimeError:
        return False


RING_CASES = {  # name: heads, kv heads, q/k head dim, v head dim, document mask
    "causal MHA": (8, 8, 128, 128, False),
    "GQA 4:1": (16, 4, 128, 128, False),
    "GQA + document mask": (16, 4, 128, 128, True),
    "v head dim != q head dim": (16, 16, 192, 128, False),
}


def check_ring_kernels(ctx: Ctx) -> list[Row]:
    """The ring's block kernels, forward and backward, in bf16 against fp32: no worse than 2x
    torch's own bf16 SDPA error (the reference's rounding) and under 2e-2."""
    rows = []
    for name, (heads, kv_heads, dqk, dv_, docs_on) in RING_CASES.items():
        if dqk != dv_ and not _v_head_dim_supported():
            rows.append(Row(SECTION, f"ring kernels: {name}", "skipped",
                            note="this build's block kernels need v head dim == q head dim"))
            continue
        rows.append(_ring_row(ctx, name, heads, kv_heads, dqk, dv_, docs_on))
    return rows


def _ring_row(ctx, name, heads, kv_heads, dqk, dv_, docs_on) -> Row:
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    b, s, world = (1, 64, 4) if ctx.quick else (2, 4096, 4)
    if ctx.quick:
        dqk, dv_, heads, kv_heads = dqk // 8, dv_ // 8, heads // 4, max(kv_heads // 4, 1)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=ctx.device).to(torch.bfloat16)

    q, k, v = rnd(b, heads, s, dqk), rnd(b, kv_heads, s, dqk), rnd(b, kv_heads, s, dv_)
    dout = rnd(b, heads, s, dv_)
    docs = None
    if docs_on:  # three documents of uneven lengths per sample
        docs = torch.zeros(b, s, dtype=torch.int64, device=ctx.device)
        docs[:, s // 5:] += 1
        docs[:, (2 * s) // 3:] += 1
    kernel = pick_kernel("auto", q)
    got = emulated_ring(q, k, v, dout, world=world, kernel=kernel, docs=docs)
    ref = _reference(q, k, v, dout, docs, torch.float32)
    torch_bf16 = _reference(q, k, v, dout, docs, torch.bfloat16)
    names = ("out", "dq", "dk", "dv")
    errs = {n: rel_err(g, r) for n, g, r in zip(names, got, ref, strict=True)}
    base = {n: rel_err(g, r) for n, g, r in zip(names, torch_bf16, ref, strict=True)}
    ok = all(errs[n] <= max(2 * base[n], 1e-3) and errs[n] < 2e-2 for n in names)
    value = " ".join(f"{n} {errs[n]:.1e}" for n in names)
    return Row(SECTION, f"ring kernels: {name}", "pass" if ok else "FAIL", value=value,
               target="<= 2x torch bf16 SDPA, < 2e-2",
               note=f"kernel {kernel}, {world} chunks of {s // world}, bf16; torch bf16 SDPA: "
                    + " ".join(f"{base[n]:.1e}" for n in names),
               data={"errors": errs, "torch_bf16_errors": base, "kernel": kernel})


# -- deferred weight gradients -------------------------------------------------------------------

def _mlp(dim: int, device) -> nn.Module:
    return nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)).to(device)


def check_deferred_weight_grads(ctx: Ctx) -> list[Row]:
    """I then W (queued dW GEMMs) against one autograd backward: linears in fp32, and MoE grouped
    experts in bf16 (grouped GEMM where supported)."""
    torch.manual_seed(0)
    dim, rows_ = (32, 16) if ctx.quick else (1024, 4096)
    ref = _mlp(dim, ctx.device)
    test = copy.deepcopy(ref)
    defer_weight_grads(test)
    x = torch.randn(rows_, dim, device=ctx.device)
    ref(x).square().mean().backward()
    queue = WeightGradQueue()
    with weight_grad_deferral(queue):
        test(x).square().mean().backward()
    pending = len(queue)
    queue.run()
    err = max(rel_err(b.grad, a.grad) for a, b in zip(ref.parameters(), test.parameters(),
                                                         strict=True))
    out = [Row(SECTION, "deferred weight grads: linears fp32", "pass" if err <= 1e-6 else "FAIL",
               value=f"{err:.1e}", target="<= 1e-6", note=f"{pending} dW GEMMs queued")]
    dt = torch.bfloat16 if ctx.cuda else torch.float32
    experts, counts, x = _experts(ctx, dt)
    test_e = copy.deepcopy(experts)
    defer_weight_grads(test_e)
    experts(x, counts).float().square().mean().backward()
    queue = WeightGradQueue()
    with weight_grad_deferral(queue):
        test_e(x, counts).float().square().mean().backward()
    queue.run()
    err = max(rel_err(getattr(test_e, w).grad, getattr(experts, w).grad)
              for w in ("w1", "w2", "w3"))
    tol = 1e-2 if dt == torch.bfloat16 else 1e-6
    out.append(Row(SECTION, f"deferred weight grads: grouped experts {str(dt)[6:]}",
                   "pass" if err <= tol else "FAIL", value=f"{err:.1e}", target=f"<= {tol:g}",
                   note=f"grouped GEMM: {grouped_mm_supported(x, experts.w1)}"))
    return out


def _experts(ctx: Ctx, dtype: torch.dtype):
    """Grouped experts with uneven rows per expert (one expert empty), and their input."""
    torch.manual_seed(0)
    e, dim, hidden = (4, 32, 64) if ctx.quick else (8, 2048, 1408)
    mod = GroupedExperts(e, dim, hidden).to(ctx.device)
    for w in (mod.w1, mod.w2, mod.w3):
        nn.init.normal_(w, std=dim ** -0.5)
    mod = mod.to(dtype)
    per = [16 * (i % 3) * (1 if ctx.quick else 32) for i in range(e)]  # 0, 16, 32, 0, ...
    counts = torch.tensor(per, device=ctx.device, dtype=torch.int64)
    x = torch.randn(sum(per), dim, device=ctx.device, dtype=dtype, requires_grad=True)
    return mod, counts, x


def check_grouped_gemm(ctx: Ctx) -> Row:
    """``torch._grouped_mm`` experts in bf16 against the per-expert loop in fp32: output and
    every gradient."""
    dt = torch.bfloat16 if ctx.cuda else torch.float32
    mod, counts, x = _experts(ctx, dt)
    if not grouped_mm_supported(x, mod.w1, mod.w2, mod.w3):
        raise Skip(f"torch._grouped_mm does not run here ({ctx.device.type} {dt})")
    mod.use_grouped_mm = True
    ref = copy.deepcopy(mod).float()
    ref.use_grouped_mm = False
    xr = x.detach().float().requires_grad_()
    dy = torch.randn(x.shape[0], x.shape[1], device=ctx.device)
    y, yr = mod(x, counts), ref(xr, counts)
    y.backward(dy.to(dt))
    yr.backward(dy)
    errs = {"out": rel_err(y, yr), "dx": rel_err(x.grad, xr.grad),
            **{f"d{w}": rel_err(getattr(mod, w).grad, getattr(ref, w).grad)
               for w in ("w1", "w2", "w3")}}
    tol = 1e-2 if dt == torch.bfloat16 else 1e-5
    ok = all(v <= tol for v in errs.values())
    return Row(SECTION, f"grouped GEMM {str(dt)[6:]} vs fp32 loop", "pass" if ok else "FAIL",
               value=" ".join(f"{k} {v:.1e}" for k, v in errs.items()), target=f"<= {tol:g}",
               note=f"{len(counts)} experts, rows {counts.tolist()}", data=errs)


# -- float8 --------------------------------------------------------------------------------------

def torchao_available() -> bool:
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return False
    return True


def check_float8(ctx: Ctx) -> list[Row]:
    """Each recipe's linear (output, input and weight gradients) against fp32: SQNR >= 17 dB
    (torchao's own test threshold is 18 / 17 dB). Real float8 tensor cores on CUDA 8.9+, else
    emulated."""
    rows = []
    hw = has_float8_hardware(ctx.device)
    for recipe in FLOAT8_RECIPES:
        name = f"float8 {recipe}"
        if recipe != "blockwise" and not torchao_available():
            rows.append(Row(SECTION, name, "skipped",
                            note="skipped: torchao missing (pip install torchao; "
                                 "docs/launching.md)"))
            continue
        rows += guarded(SECTION, name, lambda recipe=recipe: _float8_row(ctx, recipe, hw))
    for recipe in FLOAT8_EXPERT_RECIPES:  # one failing row never hides the others
        rows += guarded(SECTION, f"float8 experts {recipe} emulated",
                        lambda recipe=recipe: _float8_experts_row(ctx, recipe, kernels=False))
    if not float8_experts_kernels_usable(ctx.device):
        rows.append(Row(SECTION, "float8 experts rowwise kernels", "skipped",
                        note="skipped: needs a CUDA GPU of compute capability 9.0+ with triton "
                             "and torchao's prototype.moe_training"))
    else:
        rows += guarded(SECTION, "float8 experts rowwise kernels",
                        lambda: _float8_experts_row(ctx, "rowwise", kernels=True))
    return rows


def _float8_experts_row(ctx: Ctx, recipe: str, *, kernels: bool) -> Row:
    """Grouped experts with float8 GEMMs (output, dx and every dW) against fp32 experts: SQNR
    >= 17 dB. Expert row counts are not multiples of 16 (the kernel path pads them)."""
    torch.manual_seed(0)
    dim, hidden = (64, 96) if ctx.quick else (2048, 1408)
    counts = torch.tensor([70, 0, 203, 33] if ctx.quick else [1000, 0, 3001, 1191],
                          device=ctx.device)
    ref = GroupedExperts(len(counts), dim, hidden).to(ctx.device)
    for w in ref.parameters():
        nn.init.normal_(w, std=0.02)
    f8 = copy.deepcopy(ref)
    apply_float8_experts(f8, recipe=recipe, emulate=not kernels, device=ctx.device)
    dt = torch.bfloat16 if kernels else torch.float32
    f8 = f8.to(dt)
    x = torch.randn(int(counts.sum()), dim, device=ctx.device)
    dy = torch.randn(int(counts.sum()), dim, device=ctx.device)
    xr, xf = x.clone().requires_grad_(), x.to(dt).requires_grad_()
    yr, yf = ref(xr, counts), f8(xf, counts)
    yr.backward(dy)
    yf.backward(dy.to(dt))
    db = {"out": sqnr_db(yf.float(), yr), "dx": sqnr_db(xf.grad.float(), xr.grad)}
    db |= {f"d{n}": sqnr_db(getattr(f8, n).grad.float(), getattr(ref, n).grad)
           for n in ("w1", "w2", "w3")}
    ok = all(v >= 17 for v in db.values())
    name = f"float8 experts {recipe} {'kernels' if kernels else 'emulated'}"
    return Row(SECTION, name, "pass" if ok else "FAIL",
               value=" ".join(f"{k_} {v:.1f} dB" for k_, v in db.items()), target=">= 17 dB",
               note=("torchao float8 grouped GEMMs, bf16 params" if kernels
                     else "quantize-dequantize, fp32 params"), data=db)


def _float8_row(ctx: Ctx, recipe: str, hw: bool) -> Row:
    torch.manual_seed(0)
    m, k, n = (64, 128, 64) if ctx.quick else (4096, 4096, 4096)
    ref = nn.Sequential(nn.Linear(k, n, bias=False)).to(ctx.device)
    f8 = copy.deepcopy(ref)
    apply_float8(f8, recipe=recipe, emulate=not hw, device=ctx.device)
    dt = torch.bfloat16 if hw else torch.float32
    f8 = f8.to(dt)
    x = torch.randn(m, k, device=ctx.device)
    xr, xf = x.clone().requires_grad_(), x.to(dt).requires_grad_()
    dy = torch.randn(m, n, device=ctx.device)
    yr, yf = ref(xr), f8(xf)
    yr.backward(dy)
    yf.backward(dy.to(dt))
    db = {"out": sqnr_db(yf, yr), "dx": sqnr_db(xf.grad, xr.grad),
          "dw": sqnr_db(f8[0].weight.grad, ref[0].weight.grad)}
    ok = all(v >= 17 for v in db.values())
    return Row(SECTION, f"float8 {recipe}", "pass" if ok else "FAIL",
               value=" ".join(f"{k_} {v:.1f} dB" for k_, v in db.items()), target=">= 17 dB",
               note=("float8 tensor cores, bf16 params" if hw else "emulated, fp32 params"),
               data=db)
