"""DeepSeek-V3-style blockwise float8 linears: 1x128 activation tiles, 128x128 weight blocks.

Every operand of the three matmuls of a linear gets one float8_e4m3fn scale per small block
instead of one per tensor, so an outlier only spoils the precision of its own block:

==============  ==========================  =====================================
matmul          left operand                right operand
==============  ==========================  =====================================
y  = x W^T      x: 1 x 128 tiles along K    W: 128 x 128 blocks
dx = dy W       dy: 1 x 128 tiles along N   W: 128 x 128 blocks
dW = dy^T x     dy: 128 x 1 tiles along M   x: 128 x 1 tiles along M (tokens)
==============  ==========================  =====================================

The reference path is plain PyTorch and runs anywhere: each operand is quantized to
float8_e4m3fn and dequantized per block, then multiplied in float32 ("quantize-dequantize";
the numerics of a float8 GEMM that accumulates in fp32, without its speed). On Hopper GPUs
with torchao's blockwise Triton kernels (bf16 inputs, dimensions multiple of 128) the real
float8 GEMMs are used instead; ``emulate=True`` forces the reference path.

>>> import torch
>>> from torch import nn
>>> lin = Float8BlockwiseLinear.from_float(nn.Linear(256, 128, bias=False))
>>> lin(torch.randn(4, 256)).shape
torch.Size([4, 128])
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["BLOCK_SIZE", "Float8BlockwiseLinear", "blockwise_qdq", "float8_blockwise_linear"]

BLOCK_SIZE = 128
_E4M3 = torch.float8_e4m3fn
_E4M3_MAX = torch.finfo(_E4M3).max  # 448
_EPS = 1e-12


def blockwise_qdq(t: torch.Tensor, block_rows: int, block_cols: int) -> torch.Tensor:
    """Quantize the 2D ``t`` to float8_e4m3fn with one scale per ``block_rows x block_cols``
    block, then dequantize; returns float32 of ``t``'s shape.

    Dimensions that are not multiples of the block are zero-padded (zeros do not change a
    block's amax), so any shape works.
    """
    rows, cols = t.shape
    pr, pc = -rows % block_rows, -cols % block_cols
    x = t.float()
    if pr or pc:
        x = F.pad(x, (0, pc, 0, pr))
    r, c = x.shape
    blocks = x.reshape(r // block_rows, block_rows, c // block_cols, block_cols)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=_EPS)
    scale = _E4M3_MAX / amax
    q = (blocks * scale).clamp(-_E4M3_MAX, _E4M3_MAX).to(_E4M3)
    out = (q.float() / scale).reshape(r, c)
    return out[:rows, :cols] if pr or pc else out


@functools.cache
def _kernels_usable(device_index: int) -> bool:
    """torchao's blockwise Triton kernels need SM90+ and triton."""
    try:
        import triton  # noqa: F401
        from torchao.prototype.blockwise_fp8_training.linear import fp8_blockwise_mm  # noqa: F401
    except Exception:  # ImportError, or a torchao build without the prototype
        return False
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def _use_kernels(x: torch.Tensor, weight: torch.Tensor, emulate: bool) -> bool:
    if emulate or not x.is_cuda or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        return False
    n, k = weight.shape
    m = x.numel() // max(k, 1)  # tokens: the weight-gradient tiles run along them
    if k % BLOCK_SIZE or n % BLOCK_SIZE or m % BLOCK_SIZE:
        return False
    return _kernels_usable(x.device.index or 0)


class _BlockwiseQDQMatmul(torch.autograd.Function):
    """``x @ weight.T`` with every operand of forward and backward blockwise float8."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, block: int) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.block = block
        x2 = x.reshape(-1, x.shape[-1])                                   # [M, K]
        y = blockwise_qdq(x2, 1, block) @ blockwise_qdq(weight, block, block).t()
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x, weight = ctx.saved_tensors
        b = ctx.block
        x2 = x.reshape(-1, x.shape[-1])                                   # [M, K]
        gy = grad_y.reshape(-1, grad_y.shape[-1])                         # [M, N]
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = blockwise_qdq(gy, 1, b) @ blockwise_qdq(weight, b, b)
            grad_x = grad_x.to(x.dtype).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            # Contraction over tokens: tiles run along M for both operands.
            grad_w = (blockwise_qdq(gy, b, 1).t() @ blockwise_qdq(x2, b, 1)).to(weight.dtype)
        return grad_x, grad_w, None


@torch.compiler.disable
def _kernel_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """torchao's blockwise Triton GEMMs, run eagerly: Inductor on torch 2.11 (H200, checked by
    ``python -m titanext.gpucheck``) writes these kernels' ``torch.bfloat16`` constexpr into
    generated code that does not import torch ("NameError: name 'torch' is not defined")."""
    # optional dependency (torchao)
    from torchao.prototype.blockwise_fp8_training.linear import fp8_blockwise_mm

    return fp8_blockwise_mm.apply(x, weight, BLOCK_SIZE, torch.bfloat16, True)


def float8_blockwise_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                            *, emulate: bool = False) -> torch.Tensor:
    """``F.linear`` with DeepSeek-style blockwise float8 operands (see the module docstring)."""
    if _use_kernels(x, weight, emulate):
        y = _kernel_matmul(x, weight)
    else:
        y = _BlockwiseQDQMatmul.apply(x, weight, BLOCK_SIZE)
    return y if bias is None else y + bias.to(y.dtype)


class Float8BlockwiseLinear(nn.Linear):
    """An ``nn.Linear`` whose matmuls use blockwise float8 scaling; same parameters and names."""

    emulate: bool = False
    titanext_convert = False  # already converted: converters leave it alone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return float8_blockwise_linear(x, self.weight, self.bias, emulate=self.emulate)

    @classmethod
    def from_float(cls, mod: nn.Linear, *, emulate: bool = False) -> Float8BlockwiseLinear:
        """Swap ``mod`` for a blockwise float8 linear that shares its parameter objects."""
        with torch.device("meta"):
            new = cls(mod.in_features, mod.out_features, bias=False)
        new.weight = mod.weight
        new.bias = mod.bias
        new.emulate = emulate
        return new

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, blockwise=1x{BLOCK_SIZE}/{BLOCK_SIZE}x{BLOCK_SIZE}"
