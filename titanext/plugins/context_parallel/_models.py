"""Plugging CP attention into models: the ``attn_fn`` seam and the SDPA context manager."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.nn.functional as F
from torch import nn

from titanext.plugins._attention_kernels import KERNELS
from titanext.plugins.context_parallel._comm import Group, as_group
from titanext.plugins.context_parallel._layout import LAYOUTS
from titanext.plugins.context_parallel._ring import COMMS, ring_attention

# -- plugging into models -------------------------------------------------------------------------

class RingAttentionFn:
    """An ``attn_fn(q, k, v, *, causal, scale)`` that runs ring attention on a CP group."""

    def __init__(self, group: Group, layout: str, comm: str, kernel: str):
        self.group, self.layout, self.comm, self.kernel = as_group(group), layout, comm, kernel

    def __call__(self, q, k, v, *, causal: bool = True, scale: float | None = None):
        return ring_attention(q, k, v, self.group, causal=causal, layout=self.layout,
                              comm=self.comm, scale=scale, kernel=self.kernel)

    def __repr__(self) -> str:
        return (f"RingAttentionFn(layout={self.layout!r}, comm={self.comm!r}, "
                f"kernel={self.kernel!r})")


def check_options(layout: str, comm: str, kernel: str) -> None:
    """Raise a ValueError naming the option, the value and the choices, for any bad option."""
    for name, value, allowed in (("layout", layout, LAYOUTS), ("comm", comm, COMMS),
                                 ("kernel", kernel, KERNELS)):
        if value not in allowed:
            raise ValueError(f"{name} = {value!r} is not allowed; choose one of "
                             f"{', '.join(map(repr, allowed))}")


def apply_context_parallel(model: nn.Module, cp_mesh: Group, *, layout: str = "zigzag",
                           comm: str = "p2p", kernel: str = "auto",
                           attr: str = "attn_fn") -> int:
    """Make every attention module of ``model`` run ring attention on ``cp_mesh``.

    The protocol: an attention module exposes an attribute ``attn_fn`` (name set by ``attr``)
    that it calls as ``attn_fn(q, k, v, causal=..., scale=...)`` with q [B, H, S, D] and k, v
    [B, KVH, S, D]. The reference model does; so can yours. Returns how many modules were
    switched. Inputs must be sharded with :func:`shard_batch` (and ``position_ids`` passed on).
    For models that call ``F.scaled_dot_product_attention`` directly, use
    :func:`ring_attention_sdpa` instead.

    >>> # apply_context_parallel(model, mesh["cp"])                       # doctest: +SKIP
    >>> # tokens, labels, pos = shard_batch(tokens, labels, mesh["cp"])   # doctest: +SKIP
    >>> # loss = loss_fn(model(tokens, position_ids=pos), labels)         # doctest: +SKIP
    """
    check_options(layout, comm, kernel)
    fn = RingAttentionFn(cp_mesh, layout, comm, kernel)
    count = 0
    for module in model.modules():
        current = getattr(module, attr, None)
        if callable(current) and not isinstance(current, nn.Module):
            setattr(module, attr, fn)
            count += 1
    if count == 0:
        raise ValueError(f"apply_context_parallel: no module of {type(model).__name__} has an "
                         f"attention function attribute {attr!r}; expose one (called as "
                         f"{attr}(q, k, v, causal=..., scale=...)) or wrap the forward in "
                         "ring_attention_sdpa(cp_mesh)")
    return count


@contextlib.contextmanager
def ring_attention_sdpa(cp_mesh: Group, *, layout: str = "zigzag", comm: str = "p2p",
                        kernel: str = "auto") -> Iterator[None]:
    """Route ``torch.nn.functional.scaled_dot_product_attention`` calls to ring attention.

    For models you do not want to edit: calls made as ``F.scaled_dot_product_attention(...)``
    inside the block (forward and the backward that follows) become ring attention over
    ``cp_mesh``. Supported: ``is_causal`` True or False, no ``attn_mask``, ``dropout_p=0``,
    GQA with fewer KV heads. Anything else raises a ValueError rather than computing the
    wrong thing.

    >>> # with ring_attention_sdpa(mesh["cp"]):                           # doctest: +SKIP
    >>> #     loss = loss_fn(model(tokens, position_ids=pos), labels)      # doctest: +SKIP
    """
    check_options(layout, comm, kernel)
    fn = RingAttentionFn(cp_mesh, layout, comm, kernel)
    original = F.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
        if attn_mask is not None:
            raise ValueError("ring_attention_sdpa: an explicit attn_mask cannot be split across CP "
                             "ranks; use is_causal=True (or no mask) under context parallelism")
        if dropout_p:
            raise ValueError(f"ring_attention_sdpa: dropout_p = {dropout_p} is not supported "
                             "under context parallelism; set attention dropout to 0")
        return fn(query, key, value, causal=is_causal, scale=scale)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
