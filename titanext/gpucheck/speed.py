"""Speed on one GPU, variants side by side in turns: float8 against bf16 (one linear, one 1B
block) and the deferred split's (I+W)/B."""

from __future__ import annotations

import copy
import logging

import torch
from torch import nn

from titanext.gpucheck._common import Ctx, Row, Skip, time_pairs
from titanext.gpucheck.kernels import torchao_available
from titanext.models import get_model_args
from titanext.models.llama import TransformerBlock, rope_cos_sin, rope_inv_freq
from titanext.models.moe import GroupedExperts
from titanext.plugins.float8 import apply_float8, has_float8_hardware
from titanext.plugins.float8_experts import (
    apply_float8_experts,
    float8_experts_kernels_usable,
)
from titanext.plugins.weight_grad import WeightGradQueue, defer_weight_grads, weight_grad_deferral

__all__ = ["TORCHAO_PUBLISHED", "block_inputs", "measure_deferred_split", "measure_float8"]

SECTION = "measure"
#: torchao's published float8 training speedup that the linear and block rows are held against
TORCHAO_PUBLISHED = 1.39


def block_inputs(ctx: Ctx, batch: int, seq: int, dtype: torch.dtype):
    """A 1B-flavor transformer block (or the debug flavor's, quick) and its inputs."""

    args = get_model_args("llama3", "debugmodel" if ctx.quick else "1B")
    torch.manual_seed(0)
    block = TransformerBlock(0, args).to(ctx.device)
    for p in block.parameters():
        nn.init.normal_(p, std=0.02)
    block = block.to(dtype)
    cos, sin = rope_cos_sin(torch.arange(seq, device=ctx.device),
                            rope_inv_freq(args).to(ctx.device))
    x = torch.randn(batch, seq, args.dim, device=ctx.device, dtype=dtype, requires_grad=True)
    return block, x, cos, sin


def _recipes(ctx: Ctx) -> list[str]:
    return (["tensorwise", "rowwise"] if torchao_available() else []) + ["blockwise"]


def measure_float8(ctx: Ctx) -> list[Row]:
    """Forward+backward of one compiled linear and one compiled 1B block: bf16 against each
    float8 recipe, in turns. Needs float8 tensor cores (compute capability 8.9+)."""
    ctx.need_cuda("float8 tensor cores")
    if not has_float8_hardware(ctx.device):
        raise Skip("this GPU has no float8 tensor cores (compute capability < 8.9)")
    logging.getLogger("titanext").setLevel(logging.ERROR)
    rows = []
    m, k, n = 8192, 8192, 8192
    x = torch.randn(m, k, device=ctx.device, dtype=torch.bfloat16, requires_grad=True)
    lin = nn.Linear(k, n, bias=False, device=ctx.device, dtype=torch.bfloat16)
    variants = {}
    for recipe in (None, *_recipes(ctx)):
        mod = copy.deepcopy(lin)
        if recipe:
            mod = nn.Sequential(mod)
            apply_float8(mod, recipe=recipe, emulate=False, device=ctx.device)
        variants[recipe or "bf16"] = torch.compile(lambda mod=mod: mod(x).sum().backward())
        if recipe == "blockwise":  # titanext's own kernels: eager too
            variants["blockwise eager"] = lambda mod=mod: mod(x).sum().backward()
    rows += _speed_rows(f"linear {m}x{k}x{n}", ctx, variants)
    block, xb, cos, sin = block_inputs(ctx, 2, 4096, torch.bfloat16)
    variants = {}
    for recipe in (None, *_recipes(ctx)[:2]):  # the recipes torchao publishes figures for
        b = copy.deepcopy(block)
        if recipe:
            apply_float8(b, recipe=recipe, emulate=False, device=ctx.device)
        b.compile()
        variants[recipe or "bf16"] = lambda b=b: b(xb, cos, sin).sum().backward()
    rows += _speed_rows("1B block 2x4096", ctx, variants)
    rows += _experts_speed_rows(ctx)
    return rows


def _experts_speed_rows(ctx: Ctx) -> list[Row]:
    """Forward+backward of 8 grouped SwiGLU experts of DeepSeek-V3's shape (dim 7168, hidden
    2048, 16384 rows in uneven groups), eager: bf16 grouped GEMMs against torchao's float8
    rowwise ones ([float8] moe_experts). Needs SM90 and torchao's prototype.moe_training."""

    what = "MoE experts 8x(7168->2048) 16384 rows"
    if not float8_experts_kernels_usable(ctx.device):
        return [Row(SECTION, f"{what} float8 rowwise", "skipped",
                    note="skipped: needs compute capability 9.0+ with triton and torchao's "
                         "prototype.moe_training")]
    counts = torch.tensor([2500, 1800, 2200, 1900, 2100, 2000, 1700, 2184], device=ctx.device)
    experts = GroupedExperts(8, 7168, 2048).to(ctx.device, torch.bfloat16)
    for w in experts.parameters():
        nn.init.normal_(w, std=0.02)
    f8 = copy.deepcopy(experts)
    apply_float8_experts(f8, recipe="rowwise", emulate=False, device=ctx.device)
    x = torch.randn(int(counts.sum()), 7168, device=ctx.device, dtype=torch.bfloat16,
                    requires_grad=True)
    variants = {"bf16": lambda: experts(x, counts).sum().backward(),
                "rowwise": lambda: f8(x, counts).sum().backward()}
    rows = _speed_rows(what, ctx, variants)
    for r in rows:  # torchao's published figure is for linears, not grouped GEMMs
        r.target, r.note = "> 1x bf16", "eager, median of 10 in turns"
    return rows


def _speed_rows(what: str, ctx: Ctx, variants: dict) -> list[Row]:
    """Time the variants that run (each is tried once first: a recipe failing to build or
    compile becomes its own FAIL row instead of hiding the others)."""
    rows = []
    for recipe, fn in list(variants.items()):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 -- reported in the table
            del variants[recipe]
            lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
            rows.append(Row(SECTION, f"{what} float8 {recipe}", "FAIL",
                            note=f"{type(e).__name__}: {' | '.join(lines[-3:])[:300]}",
                            data={"error": str(e)[-4000:]}))
    ms = time_pairs(ctx, variants, rounds=10, warmup=2)
    base = ms["bf16"]
    rows += [Row(SECTION, f"{what} fwd+bwd bf16", "measured", value=f"{base:.2f} ms",
                note="compiled, median of 10 in turns", data={"ms": base})]
    for recipe, t in ms.items():
        if recipe == "bf16":
            continue
        rows.append(Row(SECTION, f"{what} float8 {recipe}", "measured",
                        value=f"{t:.2f} ms, {base / t:.2f}x bf16",
                        target=f"torchao published {TORCHAO_PUBLISHED}x",
                        data={"ms": t, "speedup": base / t}))
    return rows


def measure_deferred_split(ctx: Ctx) -> Row:
    """(I+W)/B of one block: the input-gradient pass plus the queued weight GEMMs against one
    autograd backward (B). Zero-bubble schedules need it near 1."""
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    batch, seq = (2, 64) if ctx.quick else (2, 4096)
    block, x, cos, sin = block_inputs(ctx, batch, seq, dtype)
    defer_weight_grads(block)  # plain nn.Linear numerics outside a deferral context
    queue = WeightGradQueue()

    def fwd():
        return block(x, cos, sin).float().square().mean()

    def f_only():
        fwd()

    def f_b():
        fwd().backward()

    def f_i():
        with weight_grad_deferral(queue):
            fwd().backward()
        queue.clear()

    def f_i_w():
        with weight_grad_deferral(queue):
            fwd().backward()
        queue.run()

    ms = time_pairs(ctx, {"F": f_only, "FB": f_b, "FI": f_i, "FIW": f_i_w},
                    rounds=5 if ctx.quick else 20)
    b, i, w = ms["FB"] - ms["F"], ms["FI"] - ms["F"], ms["FIW"] - ms["FI"]
    ratio = (i + w) / b
    return Row(SECTION, "deferred split (I+W)/B, one block", "measured",
               value=f"{ratio:.2f} (I {i:.2f} + W {w:.2f} ms, B {b:.2f} ms)", target="<= 1.05",
               note=f"{'1B' if not ctx.quick else 'debug'} block {batch}x{seq} {str(dtype)[6:]}",
               data={"ratio": ratio, "I_ms": i, "W_ms": w, "B_ms": b, "F_ms": ms["F"]})
