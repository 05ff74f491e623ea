"""Recompute by module (``[activation_checkpoint] mode = "modules"``): only the named parts of
each block are recomputed in the backward; every other tensor the backward needs is saved as
without activation checkpointing, and nothing outside the named parts runs twice (no
all-to-all, no router, no dispatch).

The named parts (:data:`~titanext.plugins.rules.RECOMPUTE_MODULES`) are regions of a block's
forward, each a callable of the model: a module's ``forward`` or one of its methods.

======================  ==========================================================================
``"layernorm"``         the block's own norms (its direct children named ``*Norm``: titanext's
                        ``attention_norm`` and ``ffn_norm``)
``"mla_up_proj"``       MLA's up-projections with their norms, through RoPE (``MLAttention.q_up``,
                        ``MLAttention.kv_up``): q, k and v are recomputed; the low-rank latents
                        they start from are kept
``"core_attn"``         the attention core (``attn_fn``: scores, softmax, SDPA); q, k, v are kept
                        (as its inputs, also with ``mla_up_proj``)
``"moe_act"``           the routed experts' weighted SwiGLU (``GroupedExperts.act``): its inputs
                        (gate, up, routing weights) are kept, w2's input is recomputed
``"mlp"``               a dense block's whole feed-forward (``feed_forward``)
``"shared_experts"``    a MoE block's shared experts
======================  ==========================================================================

How a region is recomputed: while it runs, what autograd saves inside it is replaced by a
handle (:class:`_Region`); its output, and any view of it, is replaced by a handle too when the
block saves it later (the consumer's saved input: ``wq`` saves the norm's output). The first
backward access reruns the region once from its kept inputs, with the same parameters, and
hands out the recomputed tensors; they live as long as the autograd graph needs them (a split
backward reads them twice). Recomputation reruns the same kernels on the same inputs, so the
losses and gradients are bitwise those without recompute.

>>> import torch
>>> from titanext.models import build_model, get_model_args
>>> model = build_model("llama3", get_model_args("llama3", "debugtiny"))
>>> sorted(recompute_modules(model, ["layernorm", "mlp"]))
['layernorm', 'mlp']
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.weak import WeakIdKeyDictionary

from titanext._compat import pytree, view_base
from titanext.models.layers import FeedForward
from titanext.models.moe import GroupedExperts, MoE
from titanext.plugins._blocks import find_blocks
from titanext.plugins.expert_parallel._comm import dequantize_rows, quantize_rows
from titanext.plugins.rules import RECOMPUTE_MODULES

__all__ = ["RECOMPUTE_MODULES", "module_regions", "prepare_blocks", "recompute_modules",
           "recompute_region", "store_in_float8", "stored_in_float8"]


class _Region:
    """One call of a recomputed region: its callable, its kept inputs, and after the first
    backward access the tensors its recompute saved (in the forward's order) and its output."""

    __slots__ = ("args", "fn", "kwargs", "out", "saved", "lock")

    def __init__(self, fn: Callable, args: tuple, kwargs: dict):
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.saved: list | None = None
        self.out = None
        self.lock = threading.Lock()  # two backward threads (DualPipe's overlap) may ask

    def recomputed(self) -> tuple[list, torch.Tensor]:
        with self.lock:
            if self.saved is None:
                saved: list = []

                def pack(t):
                    # detached, as torch.utils.checkpoint keeps its recomputed tensors: a saved
                    # tensor's graph holds this hook, which holds the list, which held the
                    # tensor: a cycle freed only by Python's GC (memory kept past the backward)
                    saved.append(t.detach())
                    return len(saved) - 1

                args, kwargs = pytree.tree_map_only(
                    (torch.Tensor, _Arg), _detached, (self.args, self.kwargs),
                    is_leaf=lambda v: isinstance(v, _Arg))
                _ACTIVE.on = True  # a region inside (none of titanext's) runs plainly
                try:
                    with torch.enable_grad(), saved_tensors_hooks(pack, saved.__getitem__):
                        out = self.fn(*args, **kwargs)
                finally:
                    _ACTIVE.on = False
                self.saved, self.out = saved, out.detach()
                self.args = self.kwargs = None  # the recompute was their only use
            return self.saved, self.out


def _detached(t: torch.Tensor | _Arg) -> torch.Tensor:
    if isinstance(t, _Arg):
        return _unpack(t.packed).detach().requires_grad_(t.requires_grad)
    return t.detach().requires_grad_(t.requires_grad)


class _Arg:
    """A region's kept input that is another region's output (its handle: recomputed, not kept)
    or stored in float8 (its bytes), and whether it required grad (the recompute must save what
    the forward saved)."""

    __slots__ = ("packed", "requires_grad")

    def __init__(self, packed, requires_grad: bool):
        self.packed, self.requires_grad = packed, requires_grad


def _kept_arg(t: torch.Tensor):
    packed = _pack_outside(t)
    return t if packed is t else _Arg(packed, t.requires_grad)


class _Internal:
    """What a region's forward saved: index ``i`` of what its recompute saves."""

    __slots__ = ("i", "region")

    def __init__(self, region: _Region, i: int):
        self.region, self.i = region, i


class _Output:
    """A region's output (or a view of it) that the rest of the block saved."""

    __slots__ = ("geometry", "region")

    def __init__(self, region: _Region, geometry):
        self.region, self.geometry = region, geometry


# region output's storage root -> (region, root's storage offset); alive as long as the output
_OUTPUTS: WeakIdKeyDictionary = WeakIdKeyDictionary()
# roots whose saved views are kept in float8 (titanext.plugins.float8_storage), and what a saved
# tensor was packed to (two GEMMs that save the same input share one payload)
_FLOAT8: WeakIdKeyDictionary = WeakIdKeyDictionary()
_PACKED: WeakIdKeyDictionary = WeakIdKeyDictionary()
_ACTIVE = threading.local()  # inside a region's forward on this thread


def _root(t: torch.Tensor) -> torch.Tensor:
    base = view_base(t)
    return t if base is None else base


class _Float8:
    """A saved tensor kept as :func:`quantize_rows` bytes (float8 e4m3, 1 x 128 scales)."""

    __slots__ = ("dtype", "payload", "shape")

    def __init__(self, t: torch.Tensor):
        self.shape, self.dtype = t.shape, t.dtype
        self.payload = quantize_rows(t.detach().reshape(-1, t.shape[-1]))

    def value(self) -> torch.Tensor:
        return dequantize_rows(self.payload, self.shape[-1], self.dtype).view(self.shape)


def store_in_float8(t: torch.Tensor) -> None:
    """Keep what a prepared block saves of ``t`` (or of a view of it) in float8 (see
    :mod:`titanext.plugins.float8_storage`), while ``t`` lives."""
    _FLOAT8[_root(t)] = True


def stored_in_float8(t: torch.Tensor) -> bool:
    """Whether :func:`store_in_float8` marked ``t`` (or the tensor it is a view of)."""
    return _root(t) in _FLOAT8


def _unpack(packed):
    if isinstance(packed, _Float8):
        return packed.value()
    if isinstance(packed, _Internal):
        return packed.region.recomputed()[0][packed.i]
    if isinstance(packed, _Output):
        out = packed.region.recomputed()[1]
        size, stride, offset = packed.geometry
        root = _root(out)
        if (size, stride, offset) == (out.shape, out.stride(), out.storage_offset()):
            return out
        return root.as_strided(size, stride, root.storage_offset() + offset)
    return packed


def _pack_outside(t: torch.Tensor):
    """The block's saved tensors: a region's output becomes a handle, a float8-stored one its
    bytes, the rest stays."""
    root = _root(t)
    hit = _OUTPUTS.get(root)
    if hit is None:
        if root not in _FLOAT8 or t.dim() == 0:
            return t
        if t not in _PACKED:
            _PACKED[t] = _Float8(t)
        return _PACKED[t]
    region, root_offset = hit
    return _Output(region, (t.shape, t.stride(), t.storage_offset() - root_offset))


def _run_region(fn: Callable, *args, **kwargs):
    if not torch.is_grad_enabled() or getattr(_ACTIVE, "on", False):
        return fn(*args, **kwargs)
    region = _Region(fn, args, kwargs)
    count = iter(range(1 << 62))

    def pack(t):
        return _Internal(region, next(count))

    _ACTIVE.on = True
    try:
        with saved_tensors_hooks(pack, _unpack):
            out = fn(*args, **kwargs)
    finally:
        _ACTIVE.on = False
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"recompute by module: {fn!r} returned {type(out).__name__}; a "
                        "recomputed region must return one tensor")
    # inputs that another region recomputes or that are stored in float8 are kept as such
    region.args, region.kwargs = pytree.tree_map_only(torch.Tensor, _kept_arg, (args, kwargs))
    root = _root(out)
    _OUTPUTS[root] = (region, root.storage_offset())
    return out


def recompute_region(fn: Callable) -> Callable:
    """``fn`` as a recomputed region (its ``__wrapped__``): inside a block prepared by
    :func:`recompute_modules`, what it saves and its output are recomputed in the backward.
    ``fn`` must return one tensor and compute the same from the same inputs every time."""
    if getattr(fn, "_titanext_region", False):
        return fn

    # compiled blocks run each region eagerly, between graphs: a compiled graph saves other
    # tensors than the eager recompute would
    @torch.compiler.disable
    @functools.wraps(fn)
    def region(*args, **kwargs):
        return _run_region(fn, *args, **kwargs)

    region._titanext_region = True
    return region


def _wrap(owner: object, name: str) -> None:
    setattr(owner, name, recompute_region(getattr(owner, name)))


def prepare_blocks(model: nn.Module, blocks: Iterable[nn.Module] | str | None = None) -> None:
    """Make each block's saved tensors go through the recompute and float8 handles (once)."""
    for block in find_blocks(model, blocks):
        if not getattr(block, "_titanext_saved_hooks", False):
            _block_forward(block)
            block._titanext_saved_hooks = True


def _block_forward(block: nn.Module) -> None:
    inner = block.forward

    # this frame only stays eager (the hooks must see what compiled graphs save); the block's
    # own forward, called inside, is compiled
    @functools.partial(torch.compiler.disable, recursive=False)
    @functools.wraps(inner)
    def forward(*args, **kwargs):
        with saved_tensors_hooks(_pack_outside, _unpack):
            return inner(*args, **kwargs)

    block.forward = forward


def module_regions(block: nn.Module, name: str) -> list[tuple[object, str]]:
    """The (owner, attribute) callables of ``block`` that ``name`` recomputes (see the module
    docstring); empty when the block has none."""
    if name == "layernorm":
        return [(m, "forward") for m in block.children() if type(m).__name__.endswith("Norm")]
    if name == "mla_up_proj":
        return [(m, attr) for m in block.modules() for attr in ("q_up", "kv_up")
                if callable(getattr(m, attr, None)) and hasattr(m, attr.replace("_up", "_norm"))]
    if name == "core_attn":
        return [(m, "attn_fn") for m in block.modules() if callable(getattr(m, "attn_fn", None))]
    if name == "moe_act":
        return [(m, "act") for m in block.modules() if isinstance(m, GroupedExperts)]
    if name == "mlp":
        return [(m, "forward") for m in block.children() if isinstance(m, FeedForward)]
    if name == "shared_experts":
        return [(m.shared_experts, "forward") for m in block.modules()
                if isinstance(m, MoE) and m.shared_experts is not None]
    raise ValueError(f"activation_checkpoint.recompute_modules: unknown {name!r}; allowed: "
                     f"{', '.join(RECOMPUTE_MODULES)}")


_LOOKED_FOR = {
    "layernorm": "norms (a child module named *Norm) directly in a block",
    "mla_up_proj": "MLA attention (q_up / kv_up with q_norm / kv_norm: model.q_lora_rank, "
                   "kv_lora_rank)",
    "core_attn": "attention modules with an attn_fn",
    "moe_act": "routed experts (titanext.models.moe.GroupedExperts)",
    "mlp": "a dense block's feed_forward (titanext.models.layers.FeedForward)",
    "shared_experts": "a MoE block's shared_experts (moe.num_shared_experts > 0)",
}


def recompute_modules(model: nn.Module, names: Sequence[str], *,
                      blocks: Iterable[nn.Module] | str | None = None,
                      required: bool = True, apply: bool = False) -> dict[str, int]:
    """The regions of ``model``'s blocks that ``names`` choose, counted per name; with
    ``apply`` they are made recomputed regions (in place; parameter names unchanged).

    Loud: an unknown name, and (with ``required``; a pipeline stage passes False, as one may
    hold no MoE block) a name that matches nothing in any block, raise a ValueError naming what
    was looked for.
    """
    unknown = [n for n in names if n not in RECOMPUTE_MODULES]
    if unknown:
        raise ValueError(f"activation_checkpoint.recompute_modules = {list(names)!r}: unknown "
                         f"{', '.join(map(repr, unknown))}; allowed: "
                         f"{', '.join(RECOMPUTE_MODULES)}")
    block_list = find_blocks(model, blocks)
    found = {n: [r for b in block_list for r in module_regions(b, n)] for n in names}
    missing = [n for n, regions in found.items() if not regions]
    if missing and required:
        raise ValueError("; ".join(
            f"activation_checkpoint.recompute_modules names {n!r}, but no block of "
            f"{type(model).__name__} has it (looked for {_LOOKED_FOR[n]}); remove it"
            for n in missing))
    if apply:
        for regions in found.values():
            for owner, attr in regions:
                _wrap(owner, attr)
        prepare_blocks(model, block_list)
    return {n: len(r) for n, r in found.items()}
