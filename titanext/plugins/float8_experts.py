"""Float8 routed experts: the grouped GEMMs of :class:`~titanext.models.moe.GroupedExperts`.

:func:`apply_float8_experts` makes every ``GroupedExperts`` of a model run its three grouped
matmuls (w1, w3, w2) with float8_e4m3fn operands in forward and backward. Recipes
(:data:`FLOAT8_EXPERT_RECIPES`):

- ``rowwise``: y = x W^T with a scale per token row of x and per (expert, output row) of W;
  dx = dy W with a scale per row of dy and per (expert, input column) of W; dW = dy^T x per
  expert with a scale per column of dy and of x over that expert's rows. Powers of two.
- ``blockwise``: x and dy in 1x128 tiles along the contraction, W in 128x128 blocks per expert;
  for dW, dy and x in 128x1 tiles along each expert's rows.

``rowwise`` is torchao's ``moe_training`` FP8 rowwise recipe (power-of-two scales); on CUDA
GPUs of compute capability 9.0+ with torchao's ``moe_training`` (and triton) and bf16 experts
it runs torchao's float8 grouped GEMMs. ``blockwise`` is DeepSeek-V3's 1x128 / 128x128 tiling
(as the ``blockwise`` linear recipe, :mod:`titanext.plugins.float8_blockwise`); torchao has no
blockwise grouped GEMM, so it is always emulated. Emulation ("quantize-dequantize"): each
operand is quantized to float8 with the recipe's scales and dequantized, then the same grouped
matmul runs in float32 -- float8's numerics at high-precision speed. Every scale is computed
inside one expert's rows, so a row's result does not depend on which other experts share the
batch (expert parallelism gives one process's numbers when the ranks see the same rows).

Deferred weight gradients (:func:`~titanext.plugins.weight_grad.defer_weight_grads`, the
zero-bubble W step) use the same recipe for the queued dW (:meth:`Float8GroupedMM.weight_grad`).

>>> import torch
>>> from titanext.models.moe import GroupedExperts
>>> experts = GroupedExperts(4, dim=32, hidden_dim=64)
>>> for w in experts.parameters(): _ = torch.nn.init.normal_(w, std=0.02)
>>> apply_float8_experts(experts, recipe="rowwise", emulate=True)
['']
>>> experts(torch.randn(10, 32), torch.tensor([3, 0, 5, 2])).shape
torch.Size([10, 32])
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from titanext._compat import grouped_mm
from titanext._fake_backend import is_fake
from titanext.models.moe import GroupedExperts
from titanext.plugins._loud import log_rank0, stacked_experts, stacked_experts_line
from titanext.plugins.recompute_modules import store_in_float8, stored_in_float8
from titanext.plugins.rules import FLOAT8_EXPERT_RECIPES

__all__ = ["FLOAT8_EXPERT_RECIPES", "Float8GroupedMM", "apply_float8_experts",
           "float8_experts_kernels_usable", "has_emulated_float8_experts"]

_E4M3 = torch.float8_e4m3fn
_E4M3_MAX = torch.finfo(_E4M3).max  # 448
_EPS = 1e-12
BLOCK = 128
_KERNEL_ALIGN = 16  # torchao's float8 grouped GEMM: rows per expert a multiple of 16


# -- scales and quantize-dequantize ---------------------------------------------------------------

def _scale(amax: torch.Tensor, pow2: bool) -> torch.Tensor:
    scale = _E4M3_MAX / amax.clamp(min=_EPS)
    return torch.exp2(torch.floor(torch.log2(scale))) if pow2 else scale


def _qdq(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (t * scale).clamp(-_E4M3_MAX, _E4M3_MAX).to(_E4M3).float() / scale


def _rowwise(t: torch.Tensor, dim: int) -> torch.Tensor:
    """One power-of-two scale per slice along ``dim`` (the contraction dim)."""
    t = t.float()
    return _qdq(t, _scale(t.abs().amax(dim=dim, keepdim=True), pow2=True))


def _blocks_3d(w: torch.Tensor, b: int = BLOCK) -> torch.Tensor:
    """[E, N, K] with one scale per b x b block of each expert (zero-padded edges)."""
    e, n, k = w.shape
    pn, pk = -n % b, -k % b
    x = F.pad(w.float(), (0, pk, 0, pn))
    blocks = x.reshape(e, (n + pn) // b, b, (k + pk) // b, b)
    out = _qdq(blocks, _scale(blocks.abs().amax(dim=(2, 4), keepdim=True), pow2=False))
    return out.reshape(e, n + pn, k + pk)[:, :n, :k]


def _tiles_1xb(t: torch.Tensor, b: int = BLOCK) -> torch.Tensor:
    """[T, C] with one scale per 1 x b tile along C."""
    rows, cols = t.shape
    pc = -cols % b
    x = F.pad(t.float(), (0, pc)).reshape(rows, (cols + pc) // b, b)
    out = _qdq(x, _scale(x.abs().amax(dim=2, keepdim=True), pow2=False))
    return out.reshape(rows, cols + pc)[:, :cols]


def _group_ids(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """The expert (group) of every row, from the end offsets; no host sync."""
    return torch.searchsorted(offs, torch.arange(rows, device=offs.device, dtype=offs.dtype),
                              right=True).clamp(max=offs.numel() - 1)


def _per_group_columns(t: torch.Tensor, offs: torch.Tensor, tile: int | None) -> torch.Tensor:
    """[T, C] with one scale per column over each group's rows (``tile=None``, power-of-two,
    rowwise) or per ``tile`` x 1 tile of each group's rows (blockwise); rows past the last
    offset keep their values (no group owns them)."""
    rows, cols = t.shape
    t = t.float()
    gid = _group_ids(offs, rows)
    if tile is None:
        slot, slots = gid, offs.numel()
    else:
        starts = torch.cat([offs.new_zeros(1), offs[:-1]])
        per_group = rows // tile + 1  # a static bound on the tiles in one group
        local = torch.arange(rows, device=t.device) - starts[gid].long()
        slot, slots = gid.long() * per_group + local // tile, offs.numel() * per_group
    slot = slot.long()
    amax = t.new_zeros(slots, cols).scatter_reduce_(0, slot[:, None].expand(-1, cols), t.abs(),
                                                    "amax")
    return _qdq(t, _scale(amax, pow2=tile is None)[slot])


# -- grouped matmuls on dequantized operands (float32) ---------------------------------------------

def _counts(offs: torch.Tensor) -> list[int]:
    return torch.diff(offs, prepend=offs.new_zeros(1)).tolist()


def _grouped_mm_runs(a: torch.Tensor, *dims: int) -> bool:
    """torch's grouped GEMM here: CPU float32 in eager mode, rows of 16 bytes' multiples."""
    return (grouped_mm is not None and a.device.type == "cpu" and not torch.compiler.is_compiling()
            and all(d % 4 == 0 for d in dims))


def _fake_gmm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor | None:
    """The dry run's fake tensors (``[comm] mode = "fake_backend"``): only shapes matter, and the
    grouped GEMM's meta function takes bf16 only."""
    if grouped_mm is None or not is_fake(a):
        return None
    return grouped_mm(a.bfloat16(), b.bfloat16(), offs=offs).float()


def _gmm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows of ``a`` [T, K] grouped by ``offs`` times ``b`` [E, K, N]: float32 [T, N]."""
    fake = _fake_gmm(a, b, offs)
    if fake is not None:
        return fake
    if _grouped_mm_runs(a, *b.shape[1:]):
        return grouped_mm(a, b, offs=offs)
    outs = [ae @ b[e] for e, ae in enumerate(torch.split(a, _counts(offs)))]  # one host sync
    return torch.cat(outs) if outs else a.new_zeros(0, b.shape[-1])


def _gmm_weight(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Per group: dy_g^T x_g, float32 [E, N, K]."""
    fake = _fake_gmm(dy.t(), x, offs)
    if fake is not None:
        return fake
    if _grouped_mm_runs(x, dy.shape[1], x.shape[1]):
        return grouped_mm(dy.t(), x, offs=offs)
    parts = zip(torch.split(dy, _counts(offs)), torch.split(x, _counts(offs)), strict=True)
    return torch.stack([dye.t() @ xe for dye, xe in parts])


# -- the recipe object ----------------------------------------------------------------------------

@functools.cache
def _kernels_importable() -> bool:
    try:
        import triton  # noqa: F401
        from torchao.prototype.moe_training import (  # noqa: F401
            _to_fp8_rowwise_then_scaled_grouped_mm,
        )
    except Exception:  # ImportError, a CPU build, or a torchao without the prototype
        return False
    return True


def float8_experts_kernels_usable(device: torch.device | str | None = None) -> bool:
    """True where torchao's float8 rowwise grouped GEMMs run: CUDA compute capability 9.0+,
    triton and ``torchao.prototype.moe_training`` importable."""
    device = torch.device(device if device is not None else
                          ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0) and _kernels_importable()


class Float8GroupedMM:
    """``x [T, K]`` rows grouped by expert (end offsets ``offs`` [E], int32) times each expert's
    ``w [E, N, K]`` transposed -> ``[T, N]`` in ``x``'s dtype, differentiable, with the
    ``recipe``'s float8 operands. ``emulate``: quantize-dequantize instead of torchao's kernels
    (always for ``blockwise``). The pieces :meth:`forward`, :meth:`input_grad` and
    :meth:`weight_grad` are what the deferred-W path of ``weight_grad`` runs."""

    def __init__(self, recipe: str, emulate: bool, *, own_backward: bool | None = None):
        if recipe not in FLOAT8_EXPERT_RECIPES:
            raise ValueError(f"float8 experts: recipe = {recipe!r}; allowed: "
                             f"{', '.join(FLOAT8_EXPERT_RECIPES)}")
        self.recipe, self.emulate = recipe, emulate or recipe != "rowwise"
        #: torchao's kernels: one autograd function computes dx and dW in the same backward, so
        #: the experts keep it (weight_grad does not defer them: their dW runs at I, as torchao's
        #: Float8Linear's). The dry run sets it on emulated experts to plan a float8 GPU's run.
        self.own_backward = not self.emulate if own_backward is None else own_backward

    def __repr__(self) -> str:
        return (f"Float8GroupedMM({self.recipe!r}, emulate={self.emulate}, "
                f"own_backward={self.own_backward})")

    def __call__(self, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        aligned = (x.dtype == torch.bfloat16 and x.shape[-1] % _KERNEL_ALIGN == 0
                   and w.shape[-2] % _KERNEL_ALIGN == 0)
        if not self.emulate and x.is_cuda and aligned:
            return _kernel_grouped_mm(x, w, offs)  # else (fp32, odd dims): the emulation
        if self.own_backward and aligned and is_fake(x):  # a dry run of a float8 GPU's run
            return _kernel_grouped_mm(x, w, offs, scaled_grouped_mm=_fake_scaled_grouped_mm)
        return _emulated(x, w, offs, self)

    # y = x W^T
    def forward(self, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        if self.recipe == "rowwise":
            xq, wq = _rowwise(x, -1), _rowwise(w, -1)
        else:
            xq, wq = _tiles_1xb(x), _blocks_3d(w)
        return _gmm(xq, wq.transpose(-2, -1), offs).to(x.dtype)

    # dx = dy W
    def input_grad(self, dy: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        if self.recipe == "rowwise":
            dyq, wq = _rowwise(dy, -1), _rowwise(w, -2)
        else:
            dyq, wq = _tiles_1xb(dy), _blocks_3d(w)
        return _gmm(dyq, wq, offs)

    # dW_e = dy_e^T x_e
    def weight_grad(self, x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        tile = None if self.recipe == "rowwise" else BLOCK
        return _gmm_weight(_per_group_columns(dy, offs, tile), _per_group_columns(x, offs, tile),
                           offs)


class _EmulatedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offs, mm: Float8GroupedMM):
        ctx.save_for_backward(x, w, offs)
        ctx.mm = mm
        return mm.forward(x, w, offs)

    @staticmethod
    def backward(ctx, dy):
        x, w, offs = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = ctx.mm.input_grad(dy, w, offs).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dw = ctx.mm.weight_grad(x, dy, offs).to(w.dtype)
        return dx, dw, None, None


@torch.compiler.disable
def _emulated(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, mm: Float8GroupedMM
              ) -> torch.Tensor:
    """Eager under torch.compile: the per-expert loop (CUDA) reads host counts, and the traced
    float32 grouped GEMM takes bf16 only; the emulation is for numerics, not speed."""
    return _EmulatedFn.apply(x, w, offs, mm)


class _FakeKernelFn(torch.autograd.Function):
    """The dry run's stand-in for torchao's float8 rowwise grouped GEMM on fake tensors: what
    that function saves (the padded input and the weight) and allocates (a float8 copy of each
    operand of each GEMM, products in ``out_dtype``); only shapes and bytes matter there."""

    @staticmethod
    def forward(ctx, a, b_t, offs, out_dtype):
        ctx.save_for_backward(a, b_t, offs)
        ctx.out_dtype = out_dtype
        a8, b8 = a.to(_E4M3), b_t.to(_E4M3)  # noqa: F841 -- alive during the GEMM, as torchao's
        return grouped_mm(a, b_t.to(a.dtype), offs=offs).to(out_dtype)

    @staticmethod
    def backward(ctx, dy):
        a, b_t, offs = ctx.saved_tensors
        dy8, b8 = dy.to(_E4M3), b_t.to(_E4M3)  # noqa: F841
        da = grouped_mm(dy.to(a.dtype), b_t.transpose(-2, -1).to(a.dtype), offs=offs)
        del dy8, b8
        dy8, a8 = dy.to(_E4M3), a.to(_E4M3)  # noqa: F841 -- per-group column scales
        db = grouped_mm(dy.to(a.dtype).t(), a, offs=offs)
        return da.to(ctx.out_dtype), db.transpose(-2, -1).to(b_t.dtype), None, None


def _fake_scaled_grouped_mm(a, b_t, offs, *, out_dtype, pad_token_groups_for_grouped_mm):
    return _FakeKernelFn.apply(a, b_t, offs, out_dtype)


def _kernel_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, *,
                       scaled_grouped_mm=None) -> torch.Tensor:
    """torchao's FP8 rowwise grouped GEMM (``scaled_grouped_mm``: the dry run's stand-in). It
    needs each expert's rows to be a multiple of 16, so the rows are padded per expert (zeros,
    which change no amax and no dW) and gathered back; all with static shapes, no host sync."""
    if scaled_grouped_mm is None:
        # optional dependency (torchao)
        from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

        scaled_grouped_mm = _to_fp8_rowwise_then_scaled_grouped_mm
    rows = x.shape[0]
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    padded = (counts + _KERNEL_ALIGN - 1) // _KERNEL_ALIGN * _KERNEL_ALIGN
    padded_ends = torch.cumsum(padded, 0, dtype=torch.int32)
    gid = _group_ids(offs, rows)
    shift = (padded_ends - padded - (offs - counts)).long()  # padded start - start, per group
    dst = torch.arange(rows, device=x.device) + shift[gid]
    # static: at most 15 pad rows per expert, and a multiple of 16 rows in all (the weight
    # gradient's float8 grouped GEMM reads the rows' dimension as a stride of 16 bytes' multiples)
    bound = -(-rows // _KERNEL_ALIGN) * _KERNEL_ALIGN + _KERNEL_ALIGN * offs.numel()
    xp = x.new_zeros(bound, x.shape[1]).index_copy(0, dst, x)
    if stored_in_float8(x):  # the GEMM saves its padded copy: stored as x would have been
        store_in_float8(xp)
    y = scaled_grouped_mm(xp, w.transpose(-2, -1), padded_ends, out_dtype=x.dtype,
                          pad_token_groups_for_grouped_mm=False)
    return y.index_select(0, dst)


# -- the converter --------------------------------------------------------------------------------

def apply_float8_experts(model: nn.Module, *, recipe: str = "rowwise",
                         emulate: bool | str = "auto",
                         device: torch.device | str | None = None,
                         target_kernels: bool = False) -> list[str]:
    """Make every :class:`~titanext.models.moe.GroupedExperts` of ``model`` (the model itself
    included) run its grouped GEMMs in float8 with ``recipe`` (one of
    :data:`FLOAT8_EXPERT_RECIPES`), in place; parameters, names and state dict are unchanged.
    Run it with the other converters, on the meta model, before expert parallelism.

    ``emulate``: True, False or "auto" (emulate unless ``device`` -- default CUDA if available,
    else CPU -- runs torchao's float8 grouped GEMMs, :func:`float8_experts_kernels_usable`).
    ``blockwise`` is always emulated (torchao has no blockwise grouped GEMM).

    With the kernels the experts keep their own backward (dW with dx, never deferred to a
    split backward's W). ``target_kernels``: the dry run's plan of a float8 GPU's run on this
    CPU: rowwise experts that are not forced to emulate behave as the kernels do (their own
    backward; on fake tensors, the kernels' saved tensors and allocations), with emulated math.

    Returns the converted FQNs. Raises ``ValueError`` when ``model`` has no ``GroupedExperts``,
    or when ``emulate=False`` and this device cannot run the kernels.
    """

    if recipe not in FLOAT8_EXPERT_RECIPES:
        raise ValueError(f"apply_float8_experts: recipe = {recipe!r}; allowed: "
                         f"{', '.join(FLOAT8_EXPERT_RECIPES)}")
    if emulate not in (True, False, "auto"):
        raise ValueError(f"apply_float8_experts: emulate = {emulate!r}; allowed: true, false, "
                         "'auto'")
    kernels = recipe == "rowwise" and float8_experts_kernels_usable(device)
    planned = recipe == "rowwise" and emulate is not True and (kernels or target_kernels)
    if emulate is False and not kernels and not planned:
        raise ValueError(
            f"apply_float8_experts: emulate = false, but recipe {recipe!r} has no float8 grouped "
            "GEMM here (rowwise needs a CUDA GPU of compute capability 9.0+ with triton and "
            "torchao's prototype.moe_training; blockwise is emulated everywhere); set emulate = "
            "'auto' or true")
    mm = Float8GroupedMM(recipe, emulate=emulate is True or not kernels, own_backward=planned)
    fqns = [fqn for fqn, m in model.named_modules() if isinstance(m, GroupedExperts)]
    other = stacked_experts_line(
        "apply_float8_experts", stacked_experts(model, (GroupedExperts,)),
        "Only titanext's GroupedExperts (titanext.models.moe) run float8 grouped GEMMs; these "
        "would stay in high precision. Turn float8 moe_experts off for this model (or build its "
        "MoE layers from GroupedExperts)")
    if other:
        raise ValueError(other)
    if not fqns:
        raise ValueError(f"apply_float8_experts: {type(model).__name__} has no GroupedExperts "
                         "(titanext.models.moe) to convert; turn float8 moe_experts off for this "
                         "model")
    for fqn in fqns:
        model.get_submodule(fqn).float8_grouped_mm = mm
    log_rank0(logging.INFO if kernels or emulate is True else logging.WARNING,
              "float8: %d grouped experts module(s) run their GEMMs in float8 (%s%s)", len(fqns),
              recipe, "" if not mm.emulate else ", emulated: float8 numerics at high-precision "
              "speed")
    return fqns


def has_emulated_float8_experts(model: nn.Module) -> bool:
    """Whether ``model`` holds float8 experts that run emulated (eagerly under torch.compile: a
    graph break, so their blocks cannot compile with ``fullgraph=True``)."""
    return any(getattr(getattr(m, "float8_grouped_mm", None), "emulate", False)
               for m in model.modules())
