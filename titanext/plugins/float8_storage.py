"""Float8 activation storage (``[activation_checkpoint] float8_storage``): chosen inputs that the
backward reads are kept as float8 e4m3 with one power-of-two scale per 1 x 128 block of a row
(DeepSeek-V3's activation caching; the bytes of ``quantize_rows``, as float8 EP dispatch sends),
and dequantized when the backward reads them.

=========================  =====================================================================
``"expert_up_proj_input"``  the rows the routed experts' up-projections (``w1``, ``w3``) read:
                            the dispatched rows under expert parallelism
``"attention_out_input"``   the input of the linear after attention (``wo``)
``"expert_act_input"``      the routed experts' SwiGLU inputs (the ``w1`` and ``w3`` outputs:
                            ``gate`` and ``up`` of ``GroupedExperts.act``)
=========================  =====================================================================

For the first two, only the weight gradients of those GEMMs read the stored input, so they are
the only gradients that change (dW = dY^T x~ with x~ the dequantized rows); the forward, every
input gradient and every other weight gradient are bitwise those of high-precision storage.
SwiGLU's backward reads its stored inputs for its own input gradients (and, recomputed by
``moe_act``, w2's input is rebuilt from them), so with ``expert_act_input`` every gradient
upstream of the experts' SwiGLU changes, within the float8 error. The rows take
``dim + ceil(dim / 128)`` bytes instead of ``2 dim`` (bf16) or ``4 dim`` (fp32). They combine
with float8 linears and float8 routed experts (``[float8]``), whose GEMMs save their
high-precision inputs and quantize them again in the backward: those read the dequantized rows.

What DeepSeek-V3 does that this does not: its float8 GEMMs read the cached float8 tensors
directly (no dequantize, no second quantization), and it caches the MoE down-projection input
in float8 too (some in its custom E5M6 format); here the storage is separate from the compute
dtype.

>>> import torch
>>> from titanext.models import build_model, get_model_args
>>> model = build_model("llama3", get_model_args("llama3", "debugmoe"))
>>> apply_float8_storage(model, ["expert_up_proj_input", "attention_out_input"])
{'expert_up_proj_input': 2, 'attention_out_input': 3}
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titanext.models.moe import GroupedExperts
from titanext.plugins._blocks import find_blocks
from titanext.plugins.recompute_modules import prepare_blocks, store_in_float8
from titanext.plugins.rules import FLOAT8_STORAGE
from titanext.plugins.weight_grad import DeferredLinear

__all__ = ["FLOAT8_STORAGE", "apply_float8_storage"]


def _targets(block: nn.Module, name: str) -> list[nn.Module]:
    if name in ("expert_up_proj_input", "expert_act_input"):
        return [m for m in block.modules() if isinstance(m, GroupedExperts)]
    return [m.wo for m in block.modules()
            if callable(getattr(m, "attn_fn", None)) and isinstance(getattr(m, "wo", None),
                                                                      nn.Linear)]


def _problem(fqn: str, module: nn.Module) -> str | None:
    """Why the input of ``module`` cannot be stored in float8 here (its GEMM would save another
    tensor than its input, so storing would silently do nothing), or None."""
    weight = module.w1 if isinstance(module, GroupedExperts) else module.weight
    if isinstance(weight, DTensor) and not isinstance(module, GroupedExperts):
        return f"{fqn} is tensor-parallel (its input is a DTensor)"
    # torchao's Float8Linear saves its high-precision input, as nn.Linear does
    if isinstance(module, nn.Linear) and type(module) not in (nn.Linear,) and not isinstance(
            module, DeferredLinear) and type(module).__name__ != "Float8Linear":
        return f"{fqn} is a {type(module).__name__} (it may save other tensors than its input)"
    return None


def _to_autocast_dtype(module: nn.Module, args: tuple):
    """The input as autocast would cast it, so that what the GEMM saves is what was marked."""
    x = args[0]
    if x.is_floating_point() and torch.is_autocast_enabled(x.device.type):
        x = x.to(torch.get_autocast_dtype(x.device.type))
    store_in_float8(x)
    return (x, *args[1:])


def _mark_input(module: nn.Module, args: tuple):
    store_in_float8(args[0])


def _marking_act(act):
    """``act`` (a GroupedExperts' SwiGLU, or its recomputed region) with its inputs marked."""
    @torch.compiler.disable  # marks live in a weak dictionary of tensors
    @functools.wraps(act)
    def act_stored(gate, up, *rest):
        store_in_float8(gate)
        store_in_float8(up)
        return act(gate, up, *rest)

    return act_stored


def apply_float8_storage(model: nn.Module, names: Sequence[str], *,
                         blocks: Iterable[nn.Module] | str | None = None,
                         required: bool = True) -> dict[str, int]:
    """Keep the inputs ``names`` choose (:data:`FLOAT8_STORAGE`) in float8 for the backward, in
    every block of ``model`` (in place; after expert parallelism, before compile). Returns the
    modules per name. Raises a ValueError for an unknown name, a name with no module in any
    block (with ``required``; a pipeline stage passes False), and a module whose GEMM saves
    something else than its input (a tensor-parallel ``wo``, a linear subclass other than
    torchao's Float8Linear)."""
    unknown = [n for n in names if n not in FLOAT8_STORAGE]
    if unknown:
        raise ValueError(f"activation_checkpoint.float8_storage = {list(names)!r}: unknown "
                         f"{', '.join(map(repr, unknown))}; allowed: {', '.join(FLOAT8_STORAGE)}")
    block_list = find_blocks(model, blocks)
    found = {n: [m for b in block_list for m in _targets(b, n)] for n in names}
    missing = [n for n, ms in found.items() if not ms]
    if missing and required:
        raise ValueError("; ".join(f"activation_checkpoint.float8_storage names {n!r}, but no "
                                   f"block of {type(model).__name__} has one" for n in missing))
    fqns = {m: fqn for fqn, m in model.named_modules()}
    problems = [p for ms in found.values() for m in ms if (p := _problem(fqns[m], m))]
    if problems:
        raise ValueError(f"activation_checkpoint.float8_storage: {problems[0]}; remove it from "
                         "float8_storage")
    for name, modules in found.items():
        for m in modules:
            if name == "expert_act_input":
                m.act = _marking_act(m.act)
                continue
            hook = _mark_input if isinstance(m, GroupedExperts) else _to_autocast_dtype
            m.register_forward_pre_hook(hook)
    prepare_blocks(model, block_list)
    return {n: len(ms) for n, ms in found.items()}
