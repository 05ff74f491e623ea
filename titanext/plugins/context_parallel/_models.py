"""Plugging CP attention into models: the ``attn_fn`` seam and the SDPA context manager."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titanext.plugins._attention_kernels import KERNELS
from titanext.plugins.context_parallel._comm import Group, as_group
from titanext.plugins.context_parallel._layout import LAYOUTS
from titanext.plugins.context_parallel._ring import COMMS, ring_attention
from titanext.plugins.context_parallel._ulysses import hybrid_attention

MODEL_COMMS = (*COMMS, "alltoall")


class RingAttentionFn:
    """An ``attn_fn(q, k, v, *, causal, scale, document_ids=None, window=None, sinks=None)``
    running CP attention: the ring on ``group``, Ulysses on ``ulysses_group`` (``group=None``),
    or both (hybrid)."""

    def __init__(self, group: Group | None, layout: str, comm: str, kernel: str,
                 ulysses_group: Group | None = None):
        self.group, self.ulysses_group = as_group(group), as_group(ulysses_group)
        self.layout, self.comm, self.kernel = layout, comm, kernel

    def __call__(self, q, k, v, *, causal: bool = True, scale: float | None = None,
                 document_ids=None, window: int | None = None, sinks=None):
        if self.ulysses_group is None:
            return ring_attention(q, k, v, self.group, causal=causal, layout=self.layout,
                                  comm=self.comm, scale=scale, kernel=self.kernel,
                                  document_ids=document_ids, window=window, sinks=sinks)
        return hybrid_attention(q, k, v, self.ulysses_group, self.group, causal=causal,
                                scale=scale, layout=self.layout, comm=self.comm,
                                kernel=self.kernel, document_ids=document_ids, window=window,
                                sinks=sinks)

    def __repr__(self) -> str:
        kind = ("ring" if self.ulysses_group is None else
                "ulysses" if self.group is None else "hybrid")
        return (f"RingAttentionFn({kind}, layout={self.layout!r}, comm={self.comm!r}, "
                f"kernel={self.kernel!r})")


def check_options(layout: str, comm: str, kernel: str) -> None:
    """Raise a ValueError naming the option, the value and the choices, for any bad option."""
    for name, value, allowed in (("layout", layout, LAYOUTS), ("comm", comm, MODEL_COMMS),
                                 ("kernel", kernel, KERNELS)):
        if value not in allowed:
            raise ValueError(f"{name} = {value!r} is not allowed; choose one of "
                             f"{', '.join(map(repr, allowed))}")


def cp_attention_fn(cp_mesh: Group, *, layout: str = "zigzag", comm: str = "p2p",
                    kernel: str = "auto", ulysses_degree: int | None = None) -> RingAttentionFn:
    """The attention function for ``cp_mesh``: a 1D mesh or group runs the ring (``comm`` "p2p"
    or "allgather") or pure Ulysses (``comm="alltoall"``); a 2D mesh (ring axis, Ulysses axis),
    such as ``world_mesh["cp_ring", "cp_ulysses"]``, runs hybrid Ulysses x ring."""
    check_options(layout, comm, kernel)
    ring_comm = "p2p" if comm == "alltoall" else comm
    if isinstance(cp_mesh, DeviceMesh) and cp_mesh.ndim == 2:
        u = cp_mesh.size(1)
        if ulysses_degree not in (None, u):
            raise ValueError(f"ulysses_degree = {ulysses_degree} does not match the Ulysses axis "
                             f"of the 2D cp mesh {cp_mesh.mesh_dim_names} (size {u})")
        ring, ulysses = cp_mesh[cp_mesh.mesh_dim_names[0]], cp_mesh[cp_mesh.mesh_dim_names[1]]
        if cp_mesh.size(0) == 1:  # all of cp is Ulysses
            return RingAttentionFn(None, layout, ring_comm, kernel, ulysses)
        return RingAttentionFn(ring, layout, ring_comm, kernel, None if u == 1 else ulysses)
    world = None if cp_mesh is None else (cp_mesh.size() if isinstance(cp_mesh, DeviceMesh)
                                          else dist.get_world_size(as_group(cp_mesh)))
    if ulysses_degree not in (None, 1) and ulysses_degree != world:
        raise ValueError(f"ulysses_degree = {ulysses_degree} < cp = {world} needs a 2D cp mesh "
                         "(ring axis, Ulysses axis), e.g. world_mesh['cp_ring', 'cp_ulysses']")
    if comm == "alltoall" or (ulysses_degree or 1) > 1:
        return RingAttentionFn(None, layout, ring_comm, kernel, cp_mesh)
    return RingAttentionFn(cp_mesh, layout, comm, kernel)


def apply_context_parallel(model: nn.Module, cp_mesh: Group, *, layout: str = "zigzag",
                           comm: str = "p2p", kernel: str = "auto", attr: str = "attn_fn",
                           ulysses_degree: int | None = None) -> int:
    """Make every attention module of ``model`` run CP attention on ``cp_mesh``.

    ``cp_mesh`` is 1D (ring with ``comm`` "p2p" or "allgather"; pure Ulysses with
    ``comm="alltoall"`` or ``ulysses_degree`` = its size) or 2D (ring axis, Ulysses axis) for
    hybrid Ulysses x ring. The protocol: an attention module exposes an attribute ``attn_fn``
    (name set by ``attr``) that it calls as ``attn_fn(q, k, v, causal=..., scale=...)`` with
    q [B, H, S, D] and k, v [B, KVH, S, D], adding ``document_ids=`` ([B, S]) for packed
    documents. The reference model does; so can yours. Returns how many modules were switched.
    Inputs must be sharded with :func:`shard_batch` over the flattened cp ranks (and
    ``position_ids`` passed on). For models that call ``F.scaled_dot_product_attention``
    directly, use :func:`ring_attention_sdpa` instead.

    >>> apply_context_parallel(model, mesh["cp"])  # in a process group  # doctest: +SKIP
    >>> tokens, labels, pos = shard_batch(tokens, labels, mesh["cp"])  # torchrun  # doctest: +SKIP
    >>> loss = loss_fn(model(tokens, position_ids=pos), labels)  # torchrun  # doctest: +SKIP
    """
    fn = cp_attention_fn(cp_mesh, layout=layout, comm=comm, kernel=kernel,
                         ulysses_degree=ulysses_degree)
    holders = attention_fn_holders(model, attr)
    for module in holders:
        setattr(module, attr, fn)
    return len(holders)


def attention_fn_holders(model: nn.Module, attr: str = "attn_fn") -> list[nn.Module]:
    """The modules of ``model`` that expose an attention function ``attr`` (what
    :func:`apply_context_parallel` switches); ValueError naming the fix when there is none."""
    holders = [m for m in model.modules()
               if callable(getattr(m, attr, None)) and not isinstance(getattr(m, attr), nn.Module)]
    if not holders:
        raise ValueError(f"apply_context_parallel: no module of {type(model).__name__} has an "
                         f"attention function attribute {attr!r}; expose one (called as "
                         f"{attr}(q, k, v, causal=..., scale=...)) or wrap the forward in "
                         "ring_attention_sdpa(cp_mesh)")
    return holders


@contextlib.contextmanager
def ring_attention_sdpa(cp_mesh: Group, *, layout: str = "zigzag", comm: str = "p2p",
                        kernel: str = "auto") -> Iterator[None]:
    """Route ``torch.nn.functional.scaled_dot_product_attention`` calls to ring attention.

    For models you do not want to edit: calls made as ``F.scaled_dot_product_attention(...)``
    inside the block (forward and the backward that follows) become ring attention over
    ``cp_mesh``. Supported: ``is_causal`` True or False, no ``attn_mask``, ``dropout_p=0``,
    GQA with fewer KV heads. Anything else raises a ValueError rather than computing the
    wrong thing.

    >>> with ring_attention_sdpa(mesh["cp"]):  # in a process group  # doctest: +SKIP
    ...     loss = loss_fn(model(tokens, position_ids=pos), labels)
    """
    fn = cp_attention_fn(cp_mesh, layout=layout, comm=comm, kernel=kernel)
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
