"""Ulysses (all-to-all) context parallelism, alone or inside a ring (hybrid, USP-style).

Ulysses trades the sequence split for a head split: one all-to-all gives every rank of a group
of u ranks all u sequence shards of H/u heads, attention runs over the whole (group's) sequence,
and a second all-to-all brings the output back to sequence shards. Hybrid runs Ulysses inside
groups of u ranks and the zigzag ring across the r = cp/u groups: after the all-to-all a
group's ranks hold the ring shard of its group, so the ring moves u-times-longer, H/u-head
blocks among r ranks instead of W ranks.

The input layout is the same as for the ring over all cp = u x r ranks, with cp rank
c = ring_rank * u + ulysses_rank (the row-major flattening of a ("cp_ring", "cp_ulysses")
mesh): zigzag over cp gives every ring member its zigzag ring shard after the all-to-all, so
the data sharding does not depend on how cp is split.
"""

from __future__ import annotations

import torch

from titanext.plugins._attention_kernels import pick_kernel
from titanext.plugins.context_parallel._comm import (
    Group,
    HeadsToSeq,
    SeqToHeads,
    all_gather,
    as_group,
    group_rank,
    group_size,
)
from titanext.plugins.context_parallel._layout import LAYOUTS, layout_positions
from titanext.plugins.context_parallel._ring import (
    COMMS,
    _RingAttention,
    check_qkv,
    check_window,
)


def ulysses_order(layout: str, ulysses: int, ring: int, ring_rank: int, local_seq: int,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """Index that puts the u gathered shards (concatenated in Ulysses-rank order) into the ring
    layout of ring rank ``ring_rank``: ``ring_shard = gathered[..., order]``."""
    world = ulysses * ring
    gathered = torch.cat([layout_positions(layout, ring_rank * ulysses + i, world, local_seq)
                          for i in range(ulysses)])
    target = layout_positions(layout, ring_rank, ring, ulysses * local_seq)
    ranked, index = gathered.sort()
    where = torch.searchsorted(ranked, target)
    assert torch.equal(ranked[where], target), "Ulysses shards do not make up the ring shard"
    return index[where].to(device)


def check_heads(name: str, heads: int, kv_heads: int, degree: int) -> None:
    """ValueError unless ``heads`` and ``kv_heads`` can be split over ``degree`` Ulysses ranks."""
    if heads % degree:
        raise ValueError(f"{name}: heads ({heads}) must be divisible by the Ulysses degree "
                         f"({degree}); pick a degree that divides {heads}")
    if (kv_heads % degree) if kv_heads >= degree else (degree % kv_heads):
        raise ValueError(f"{name}: kv_heads ({kv_heads}) must be a multiple of the Ulysses "
                         f"degree ({degree}) or divide it (kv heads are then replicated)")


def hybrid_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     ulysses_group: Group, ring_group: Group | None, *, causal: bool = True,
                     scale: float | None = None, layout: str = "zigzag", comm: str = "p2p",
                     document_ids: torch.Tensor | None = None, kernel: str = "auto",
                     window: int | None = None, sinks: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """Ulysses inside ``ulysses_group`` (u ranks), ring attention across ``ring_group`` (r
    ranks); ``ring_group=None`` is pure Ulysses. Exact and differentiable.

    Shapes and ``document_ids`` as :func:`ring_attention`; the shards are in ``layout`` over all
    u x r ranks with cp rank = ring_rank * u + ulysses_rank. heads must divide by u; kv_heads
    must be a multiple of u or divide it (then each kv head is replicated to u / kv_heads ranks).
    ``window`` and ``sinks`` as :func:`ring_attention` (each rank applies its heads' sinks).

    On 4 ranks:

    >>> names = ("cp_ring", "cp_ulysses")
    >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)  # torchrun  # doctest: +SKIP
    >>> cp = mesh._flatten("cp").get_group()  # torchrun  # doctest: +SKIP
    >>> q, k, v = (zigzag_shard(t, 2, cp) for t in (q, k, v))  # torchrun  # doctest: +SKIP
    >>> out = hybrid_attention(q, k, v, mesh["cp_ulysses"],
    ...                        mesh["cp_ring"])  # torchrun  # doctest: +SKIP
    """
    name = "ulysses_attention" if ring_group is None else "hybrid_attention"
    if layout not in LAYOUTS:
        raise ValueError(f"{name}: layout = {layout!r} is not one of {LAYOUTS}")
    if comm not in COMMS:
        raise ValueError(f"{name}: comm = {comm!r} is not one of {COMMS}")
    check_qkv(name, q, k, v, document_ids)
    check_window(name, causal, window, sinks, q.shape[1])
    ug, rg = as_group(ulysses_group), as_group(ring_group)
    if ug is None:
        raise ValueError(f"{name}: needs a process group (or 1D mesh) for the Ulysses ranks")
    u, r = group_size(ug), group_size(rg)
    check_heads(name, q.shape[1], k.shape[1], u)
    if layout == "zigzag" and q.shape[2] % 2:
        raise ValueError(f"{name}: the zigzag layout holds two equal chunks per rank, so "
                         f"local_seq must be even; got {q.shape[2]}")
    kernel = pick_kernel(kernel, q, v.shape[-1])
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if k.shape[1] < u:  # replicate: every rank must receive the kv head its q heads use
        k, v = (t.repeat_interleave(u // t.shape[1], dim=1) for t in (k, v))
    order = ulysses_order(layout, u, r, group_rank(rg), q.shape[2], q.device)
    docs = None
    if document_ids is not None:
        ids = document_ids.to(torch.int64)
        docs = torch.cat(all_gather(ids, ug, "all_gather_document_ids"), dim=1)[:, order]
    if u > 1:
        q, k, v = SeqToHeads.apply(ug, order, q, k, v)
        if sinks is not None:  # this rank now holds head group ``rank`` of every shard
            hl = q.shape[1]
            sinks = sinks[group_rank(ug) * hl:(group_rank(ug) + 1) * hl]
    out = _RingAttention.apply(q, k, v, sinks, docs, rg, causal, layout, comm, scale, kernel,
                               window)
    if u > 1:
        (out,) = HeadsToSeq.apply(ug, order, out)
    return out


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group, *,
                      causal: bool = True, scale: float | None = None, layout: str = "zigzag",
                      document_ids: torch.Tensor | None = None, kernel: str = "auto",
                      window: int | None = None, sinks: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """Exact attention over a sequence sharded across ``group`` via two all-to-alls (Ulysses).

    q: [batch, heads, local_seq, head_dim], k, v: [batch, kv_heads, local_seq, head_dim], in
    ``layout`` ("zigzag" or "contiguous") over the group, as for :func:`ring_attention`; returns
    [batch, heads, local_seq, head_dim]. heads must divide by the group size W; kv_heads must be a
    multiple of W or divide it. ``document_ids`` ([batch, local_seq]) mask attention across
    documents; ``window`` and ``sinks`` as :func:`ring_attention`. Differentiable; every
    all-to-all's backward is the inverse all-to-all.

    Inside each rank of a CP group ``g`` of size W, with full q, k, v of shape [B, H, S, D]:

    >>> shards = [zigzag_shard(t, 2, g) for t in (q, k, v)]  # torchrun  # doctest: +SKIP
    >>> out = ulysses_attention(*shards, g)  # torchrun  # doctest: +SKIP
    """
    return hybrid_attention(q, k, v, group, None, causal=causal, scale=scale, layout=layout,
                            document_ids=document_ids, kernel=kernel, window=window, sinks=sinks)

