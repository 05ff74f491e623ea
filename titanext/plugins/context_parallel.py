"""Context parallelism: exact ring attention over a sequence split across ranks.

Each of the W ranks of a CP group holds a slice of every sequence. Attention needs all keys
and values, so KV blocks travel around the ring while each rank merges the partial results
with an online softmax (outputs in fp32, log-sum-exps in fp64; as flash attention does
across tiles).

- ``layout="zigzag"`` (the default) cuts the sequence into 2W equal chunks and gives rank r
  chunks r and 2W-1-r. Under a causal mask every ring step then costs every rank exactly half
  a block: the fully masked half is skipped. ``"contiguous"`` (rank r holds chunk r) is kept for
  comparison; its last rank does W times the work of its first.
- ``comm="p2p"`` sends KV to the next rank with ``batch_isend_irecv`` while the current block
  is computed; backward runs the same ring plus a travelling dK/dV accumulator that ends at
  its owner. ``comm="allgather"`` gathers all KV at once and reduce-scatters dK/dV.
- K and V travel with their own (kv_heads) head count, so GQA/MQA models move
  heads/kv_heads times fewer bytes than an expanded implementation.

Nothing here depends on a particular SDPA backend, so it runs on CPU (gloo) and CUDA (nccl).

>>> # under torchrun with 2 ranks:  q, k, v are this rank's zigzag shards
>>> # out = ring_attention(q, k, v, cp_mesh.get_group())            # doctest: +SKIP

See ``apply_context_parallel`` for models and ``ring_attention_sdpa`` for code that calls
``F.scaled_dot_product_attention`` directly.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titanext.plugins._attention_kernels import KERNELS, block_backward, block_forward, pick_kernel
from titanext.plugins._counting import Counters

__all__ = [
    "LAYOUTS", "COMMS", "KERNELS", "ring_attention", "zigzag_shard", "zigzag_unshard",
    "shard_sequence", "unshard_sequence", "shard_batch", "apply_context_parallel",
    "ring_attention_sdpa", "CommCounter", "count_comm",
]

LAYOUTS = ("zigzag", "contiguous")
COMMS = ("p2p", "allgather")

Group = dist.ProcessGroup | DeviceMesh
# torch 2.13 renamed reduce_scatter_tensor (and deprecated the old name); 2.11 has only that.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# -- communication accounting ----------------------------------------------------------------------

@dataclass
class CommCounter:
    """Messages and bytes this rank sent (p2p) or contributed (collectives) in ring attention."""

    sends: int = 0
    send_bytes: int = 0
    collectives: dict[str, int] = field(default_factory=dict)
    collective_bytes: int = 0


_COUNTERS = Counters(CommCounter)


def count_comm() -> contextlib.AbstractContextManager[CommCounter]:
    """Count ring-attention traffic issued inside the block (tests and benchmarks use it)."""
    return _COUNTERS.open()


def _record_send(t: torch.Tensor) -> None:
    for c in _COUNTERS:
        c.sends += 1
        c.send_bytes += t.numel() * t.element_size()


def _record_collective(name: str, t: torch.Tensor) -> None:
    for c in _COUNTERS:
        c.collectives[name] = c.collectives.get(name, 0) + 1
        c.collective_bytes += t.numel() * t.element_size()


# -- the ring ---------------------------------------------------------------------------------------

def _as_group(group: Group) -> dist.ProcessGroup:
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"ring attention needs a 1D cp mesh, got a {group.ndim}D mesh "
                             f"{group.mesh_dim_names}; pass mesh['cp']")
        return group.get_group()
    return group


class _Ring:
    """Neighbour exchange on a CP group: every rank sends to r+1 and receives from r-1."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[dist.Work]:
        """Post (send this to next, receive that from prev) pairs as one batch (NCCL-safe)."""
        ops = []
        for send, recv in pairs:
            _record_send(send)
            ops.append(dist.P2POp(dist.isend, send, self.next, self.group))
            ops.append(dist.P2POp(dist.irecv, recv, self.prev, self.group))
        return dist.batch_isend_irecv(ops) if ops else []


def _wait(works: list[dist.Work]) -> None:
    for w in works:
        w.wait()


def _step_slices(layout: str, causal: bool, rank: int, source: int, seq: int
                 ) -> tuple[slice, slice, bool] | None:
    """(query rows, KV rows, causal) of the work at one ring step, or None to skip it.

    ``source`` is the rank whose KV block is at hand. Zigzag: rank r holds chunks (r, 2W-1-r),
    so an earlier source's first chunk is fully visible to all our rows and its second chunk
    to none, while a later source's whole block is visible to our second chunk only.
    """
    whole = slice(0, seq)
    if not causal:
        return whole, whole, False
    if source == rank:
        return whole, whole, True
    if layout == "contiguous":
        return (whole, whole, False) if source < rank else None
    half = seq // 2
    if source < rank:
        return whole, slice(0, half), False
    return slice(half, seq), whole, False


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout, comm, scale, kernel):
        ring = _Ring(group)
        r = ring.rank
        B, H, L, D = q.shape
        acc = torch.promote_types(q.dtype, torch.float32)
        out = torch.zeros(B, H, L, D, dtype=acc, device=q.device)
        # The running log-sum-exps are merged in fp64: they are only [B, H, L], and logits in
        # the thousands would otherwise lose ~1e-4 of relative accuracy in every rescaling.
        lse = torch.full((B, H, L), -math.inf, dtype=torch.float64, device=q.device)
        kv = torch.stack([k, v])  # [2, batch, kv_heads, local_seq, head_dim]: one message
        for source, kv_block in _kv_blocks(ring, kv, comm):
            step = _step_slices(layout, causal, r, source, L)
            if step is None:
                continue
            qs, ks, blk_causal = step
            o_blk, lse_blk = block_forward(q[:, :, qs], kv_block[0, :, :, ks], kv_block[1, :, :, ks],
                                           causal=blk_causal, scale=scale, kernel=kernel)
            _merge(out[:, :, qs], lse[:, :, qs], o_blk, lse_blk)
        out, lse = out.to(q.dtype), lse.to(acc)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, causal, layout, comm, scale, kernel)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, layout, comm, scale, kernel = ctx.args
        ring = _Ring(group)
        W, r = ring.size, ring.rank
        L = q.shape[2]
        acc = torch.promote_types(q.dtype, torch.float32)
        dout = dout.contiguous()
        # rowsum(dO * O) is the same for every KV block: compute it once.
        delta = (dout.to(acc) * out.to(acc)).sum(-1)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v])

        def grads_for(source: int, kv_block: torch.Tensor) -> torch.Tensor:
            """This rank's contribution to dK/dV of ``source``'s block (fp32/fp64)."""
            dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
            step = _step_slices(layout, causal, r, source, L)
            if step is not None:
                qs, ks, blk_causal = step
                dq_b, dk_b, dv_b = block_backward(
                    dout[:, :, qs], q[:, :, qs], kv_block[0, :, :, ks], kv_block[1, :, :, ks],
                    out[:, :, qs], lse[:, :, qs], delta[:, :, qs],
                    causal=blk_causal, scale=scale, kernel=kernel)
                dq[:, :, qs] += dq_b
                dkv[0, :, :, ks] += dk_b
                dkv[1, :, :, ks] += dv_b
            return dkv

        if comm == "allgather":
            blocks = _all_gather(kv, ring)
            dkv_all = torch.stack([grads_for(s, blocks[s]) for s in range(W)])
            dkv = torch.empty(kv.shape, dtype=acc, device=q.device)
            _record_collective("reduce_scatter", dkv_all)
            _reduce_scatter(dkv, dkv_all.flatten(0, 1), group=ring.group)
        else:
            dkv = _backward_ring(ring, kv, grads_for, acc)
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype),
                None, None, None, None, None, None)


def _kv_blocks(ring: _Ring, kv: torch.Tensor, comm: str) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (source rank, its KV block), own block first. p2p posts the next block's
    transfer before yielding the current one, so the transfer overlaps its compute."""
    W, r = ring.size, ring.rank
    if comm == "allgather":
        blocks = _all_gather(kv, ring)
        for step in range(W):
            source = (r - step) % W
            yield source, blocks[source]
        return
    current = kv
    for step in range(W):
        works, incoming = [], None
        if step < W - 1:
            incoming = torch.empty_like(kv)
            works = ring.start([(current, incoming)])
        yield (r - step) % W, current
        _wait(works)
        current = incoming


def _backward_ring(ring: _Ring, kv: torch.Tensor, grads_for, acc: torch.dtype) -> torch.Tensor:
    """KV goes round again; each block's dK/dV accumulator follows it one step behind and is
    back at its owner after W sends. Step i posts, in one batch, the KV for step i+1 and the
    accumulator finished at step i-1, then computes while they travel."""
    W, r = ring.size, ring.rank
    current, finished = kv, None
    for step in range(W):
        pairs, incoming_kv, incoming_acc = [], None, None
        if step < W - 1:
            incoming_kv = torch.empty_like(kv)
            pairs.append((current, incoming_kv))
        if finished is not None:
            incoming_acc = torch.empty(kv.shape, dtype=acc, device=kv.device)
            pairs.append((finished, incoming_acc))
        works = ring.start(pairs)
        contribution = grads_for((r - step) % W, current)
        _wait(works)
        finished = contribution if incoming_acc is None else incoming_acc.add_(contribution)
        current = incoming_kv
    own = torch.empty(kv.shape, dtype=acc, device=kv.device)
    _wait(ring.start([(finished, own)]))  # the last accumulator goes home
    return own


def _all_gather(kv: torch.Tensor, ring: _Ring) -> list[torch.Tensor]:
    blocks = [torch.empty_like(kv) for _ in range(ring.size)]
    _record_collective("all_gather", kv)
    # The list form exists with the same meaning on every torch we support and backend.
    dist.all_gather(blocks, kv.contiguous(), group=ring.group)
    return blocks


def _merge(out: torch.Tensor, lse: torch.Tensor, o_blk: torch.Tensor, lse_blk: torch.Tensor) -> None:
    """Fold a block's (output, log-sum-exp) into the running ones, in place and in fp32.

    Only differences of log-sum-exps are exponentiated, so large logits cannot overflow.
    """
    new = torch.logaddexp(lse, lse_blk.to(lse.dtype))
    out.mul_(torch.exp(lse - new).unsqueeze(-1))
    out.add_(o_blk.to(out.dtype) * torch.exp(lse_blk.to(lse.dtype) - new).unsqueeze(-1))
    lse.copy_(new)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group, *,
                   causal: bool = True, layout: str = "zigzag", comm: str = "p2p",
                   scale: float | None = None, kernel: str = "auto") -> torch.Tensor:
    """Exact attention over a sequence sharded across the ranks of ``group``. Differentiable.

    q: [batch, heads, local_seq, head_dim]; k, v: [batch, kv_heads, local_seq, head_dim] with
    heads % kv_heads == 0; returns [batch, heads, local_seq, head_dim]. Every rank must hold its
    shard in ``layout`` order (see :func:`zigzag_shard`). ``kernel`` picks the block kernel:
    "auto", "math", "flash_cpu", "flash_cuda" (see titanext.plugins._attention_kernels).

    >>> import torch, torch.distributed as dist
    >>> from titanext.plugins.context_parallel import ring_attention, zigzag_shard
    >>> # inside each rank of a CP group `g` of size W, with full q, k, v of shape [B, H, S, D]:
    >>> # out = ring_attention(*(zigzag_shard(t, 2, g) for t in (q, k, v)), g)  # doctest: +SKIP
    """
    if layout not in LAYOUTS:
        raise ValueError(f"ring_attention: layout = {layout!r} is not one of {LAYOUTS}")
    if comm not in COMMS:
        raise ValueError(f"ring_attention: comm = {comm!r} is not one of {COMMS}")
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError("ring_attention: q must be [batch, heads, local_seq, head_dim] and k, v "
                         f"[batch, kv_heads, local_seq, head_dim]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1] or q.shape[2] != k.shape[2] or q.shape[0] != k.shape[0]:
        raise ValueError(f"ring_attention: heads ({q.shape[1]}) must be a multiple of kv_heads "
                         f"({k.shape[1]}) and q, k must share batch and local_seq; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}")
    pg = _as_group(group)
    if causal and layout == "zigzag" and q.shape[2] % 2:
        raise ValueError(f"ring_attention: the zigzag layout holds two equal chunks per rank, so "
                         f"local_seq must be even; got {q.shape[2]}")
    kernel = pick_kernel(kernel, q)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _RingAttention.apply(q, k, v, pg, causal, layout, comm, scale, kernel)


# -- sharding the sequence ------------------------------------------------------------------------

def _chunks_for(layout: str, rank: int, world: int) -> tuple[int, int, list[int]]:
    """(number of chunks, chunks per rank, this rank's chunk ids)."""
    if layout == "zigzag":
        return 2 * world, 2, [rank, 2 * world - 1 - rank]
    if layout == "contiguous":
        return world, 1, [rank]
    raise ValueError(f"layout = {layout!r} is not one of {LAYOUTS}")


def shard_sequence(x: torch.Tensor, dim: int, group: Group, layout: str = "zigzag") -> torch.Tensor:
    """This rank's part of ``x`` along ``dim`` in ``layout`` order (differentiable slicing)."""
    pg = _as_group(group)
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    n, _, mine = _chunks_for(layout, rank, world)
    if x.shape[dim] % n:
        raise ValueError(f"cannot shard a length-{x.shape[dim]} dimension {dim} into {n} equal "
                         f"{layout} chunks for {world} CP ranks; make it a multiple of {n}")
    chunks = x.chunk(n, dim)
    return torch.cat([chunks[i] for i in mine], dim)


def unshard_sequence(x: torch.Tensor, dim: int, group: Group, layout: str = "zigzag") -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: all-gather the shards and restore the order.
    Not differentiable (for outputs, checks and logging)."""
    pg = _as_group(group)
    world = dist.get_world_size(pg)
    n, per_rank, _ = _chunks_for(layout, 0, world)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=pg)
    ordered: list[torch.Tensor | None] = [None] * n
    for rank, part in enumerate(parts):
        ids = _chunks_for(layout, rank, world)[2]
        for i, piece in zip(ids, part.chunk(per_rank, dim)):
            ordered[i] = piece
    return torch.cat(ordered, dim)


def zigzag_shard(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Rank r of W keeps chunks r and 2W-1-r of the 2W equal chunks of ``x`` along ``dim``.

    >>> # W = 2, x = [c0 c1 c2 c3] -> rank 0: [c0 c3], rank 1: [c1 c2]   # doctest: +SKIP
    """
    return shard_sequence(x, dim, group, "zigzag")


def zigzag_unshard(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """The full tensor back from every rank's :func:`zigzag_shard` part (all-gather)."""
    return unshard_sequence(x, dim, group, "zigzag")


def shard_batch(inputs: torch.Tensor, labels: torch.Tensor | None, group: Group, *,
                layout: str = "zigzag", seq_dim: int = 1
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Shard a batch for CP: (inputs, labels, position_ids), all in the same order.

    ``position_ids`` ([local_seq], int64) are the global positions of the kept tokens, so RoPE
    rotates each token by its true position. Pass them to the model's forward.
    """
    positions = torch.arange(inputs.shape[seq_dim], device=inputs.device)
    shard = [shard_sequence(t, seq_dim if t is not positions else 0, group, layout)
             if t is not None else None for t in (inputs, labels, positions)]
    return shard[0], shard[1], shard[2]


# -- plugging into models -----------------------------------------------------------------------

class RingAttentionFn:
    """An ``attn_fn(q, k, v, *, causal, scale)`` that runs ring attention on a CP group."""

    def __init__(self, group: Group, layout: str, comm: str, kernel: str):
        self.group, self.layout, self.comm, self.kernel = _as_group(group), layout, comm, kernel

    def __call__(self, q, k, v, *, causal: bool = True, scale: float | None = None):
        return ring_attention(q, k, v, self.group, causal=causal, layout=self.layout,
                              comm=self.comm, scale=scale, kernel=self.kernel)

    def __repr__(self) -> str:
        return f"RingAttentionFn(layout={self.layout!r}, comm={self.comm!r}, kernel={self.kernel!r})"


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
        if callable(getattr(module, attr, None)) and not isinstance(getattr(module, attr), nn.Module):
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
