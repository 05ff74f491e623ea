"""Ring attention: KV blocks travel round the CP group, partial results merge with an online
softmax, and with document ids or a sliding window only the (query, key) tiles that hold a
visible pair are computed."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from titanext.plugins._attention_kernels import block_backward, block_forward, pick_kernel
from titanext.plugins.context_parallel._comm import (
    Group,
    Ring,
    all_gather,
    as_group,
    record_work,
    reduce_scatter,
    wait,
)
from titanext.plugins.context_parallel._layout import LAYOUTS, layout_positions

COMMS = ("p2p", "allgather")
# Document-masked blocks are cut into tiles of at most this many queries x keys: a tile in which
# no pair shares a document is skipped, and the masks stay small.
_DOC_TILE = 1024
# Under a sliding window of w, tiles are cut to max(w, this) (at most _DOC_TILE), so that a query
# tile meets about two key tiles and the rest of a block is skipped without building masks.
_WINDOW_TILE = 128

# (query rows, key rows, causal, mask [batch, rows, keys] or None): one kernel call
Item = tuple[slice, slice, bool, torch.Tensor | None]


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


def _visible(layout: str, world: int, local_seq: int, rank: int, source: int,
             window: int | None) -> bool:
    """Whether any query of ``rank`` may see a key of ``source``'s block under a causal mask of
    ``window`` (None: plain causal), from the chunks' position ranges alone."""
    q_pos = layout_positions(layout, rank, world, local_seq)
    k_pos = layout_positions(layout, source, world, local_seq)
    per = 2 if layout == "zigzag" else 1
    for qc in q_pos.chunk(per):
        for kc in k_pos.chunk(per):
            gap_lo, gap_hi = int(qc[0] - kc[-1]), int(qc[-1] - kc[0])  # range of q - k
            if gap_hi >= 0 and (window is None or gap_lo < window):
                return True
    return False


def ring_steps(layout: str, causal: bool, world: int, local_seq: int,
               window: int | None) -> int:
    """Ring steps the p2p ring must run: 1 + the farthest (rank - source) % world of any block
    some rank may see. Below ``world`` only when a window cuts off the far blocks, which the
    contiguous layout allows (zigzag needs its neighbours on both sides for any window > 1).

    >>> ring_steps("contiguous", True, 4, 16, window=8), ring_steps("zigzag", True, 4, 16, 8)
    (2, 4)
    """
    if not causal or window is None:
        return world
    return 1 + max((r - s) % world for r in range(world) for s in range(world)
                   if _visible(layout, world, local_seq, r, s, window))


class RingPlan:
    """The kernel calls of rank ``rank`` for each source's KV block.

    Without document ids or a window this is :func:`_step_slices`. With them (``docs``: every
    rank's ids, [world, batch, local_seq]; ``window``: a query at global position i sees keys
    i - window < j <= i, transformers' sliding-window mask) a block is cut into tiles; a tile is
    skipped when no query-key pair in it is visible, runs unmasked when every pair is, runs
    causal when it is a diagonal tile whose visible pairs are exactly the causal ones, and runs
    masked otherwise. Pure function of its arguments: forward and backward build the same plan.
    """

    def __init__(self, layout: str, causal: bool, rank: int, world: int, local_seq: int,
                 docs: torch.Tensor | None = None, tile: int | None = None,
                 window: int | None = None, device: torch.device | None = None):
        self.layout, self.causal, self.rank, self.world = layout, causal, rank, world
        self.local_seq, self.docs, self.window = local_seq, docs, window
        if tile is None:
            tile = _DOC_TILE if window is None else min(_DOC_TILE, max(_WINDOW_TILE, window))
        self.tile = tile
        self._items: dict[int, list[Item]] = {}
        if docs is not None or window is not None:
            device = device if docs is None else docs.device
            self.pos = [layout_positions(layout, s, world, local_seq, device)
                        for s in range(world)]

    def items(self, source: int) -> list[Item]:
        if source not in self._items:
            self._items[source] = self._plan(source)
        return self._items[source]

    def _plan(self, source: int) -> list[Item]:
        step = _step_slices(self.layout, self.causal, self.rank, source, self.local_seq)
        if step is None:
            return []
        if self.docs is None and self.window is None:
            return [(*step, None)]
        if self.window is not None and not _visible(self.layout, self.world, self.local_seq,
                                                    self.rank, source, self.window):
            return []
        items = []
        for qs in _tiles(step[0], self.tile):
            for ks in _tiles(step[1], self.tile):
                item = self._tile(source, qs, ks)
                if item is not None:
                    items.append(item)
        return items

    def _tile(self, source: int, qs: slice, ks: slice) -> Item | None:
        qp, kp = self.pos[self.rank][qs], self.pos[source][ks]
        q_lo, q_hi, k_lo, k_hi = int(qp[0]), int(qp[-1]), int(kp[0]), int(kp[-1])
        if self.causal and k_lo > q_hi:
            return None  # every key comes after every query
        if self.window is not None and q_lo - k_hi >= self.window:
            return None  # every key is older than every query's window
        one_doc = True
        if self.docs is not None:
            qdoc, kdoc = self.docs[self.rank][:, qs], self.docs[source][:, ks]
            d_lo, d_hi, kd_lo, kd_hi = (int(qdoc.min()), int(qdoc.max()), int(kdoc.min()),
                                        int(kdoc.max()))
            if kd_lo > d_hi or kd_hi < d_lo:
                return None  # no document id in common
            one_doc = d_lo == d_hi == kd_lo == kd_hi  # one document fills the tile in every row
        before = not self.causal or k_hi <= q_lo
        inside = self.window is None or q_hi - k_lo < self.window
        if one_doc and inside:
            if before:
                return qs, ks, False, None
            if torch.equal(qp, kp):
                return qs, ks, True, None
        if self.docs is None:
            mask = torch.ones(1, len(qp), len(kp), dtype=torch.bool, device=qp.device)
        else:
            mask = qdoc[:, :, None] == kdoc[:, None, :]
        if not before:
            mask &= kp[None, None, :] <= qp[None, :, None]
        if not inside:
            mask &= kp[None, None, :] > qp[None, :, None] - self.window
        if not mask.any():
            return None
        if mask.all():
            return qs, ks, False, None
        if self.causal and torch.equal(qp, kp) and torch.equal(
                mask, torch.ones_like(mask[0]).tril().expand_as(mask)):
            return qs, ks, True, None
        return qs, ks, False, mask


def _tiles(s: slice, tile: int) -> Iterator[slice]:
    for a in range(s.start, s.stop, tile):
        yield slice(a, min(a + tile, s.stop))


def _pairs(items: list[Item]) -> int:
    return sum((q.stop - q.start) * (k.stop - k.start) for q, k, _, _ in items)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, docs, group, causal, layout, comm, scale, kernel, window):
        ring = Ring(group)
        B, H, L, _ = q.shape
        dk = k.shape[-1]  # v may have another head dim (MLA): K and V travel as [K | V]
        if docs is not None:  # ids are tiny next to K/V: gather them once
            docs = torch.stack(all_gather(docs, group, "all_gather_document_ids"))
        plan = RingPlan(layout, causal, ring.rank, ring.size, L, docs, window=window,
                        device=q.device)
        steps = ring.size if comm == "allgather" else ring_steps(layout, causal, ring.size, L,
                                                                 window)
        acc = torch.promote_types(q.dtype, torch.float32)
        out = torch.zeros(B, H, L, v.shape[-1], dtype=acc, device=q.device)
        # The running log-sum-exps are merged in fp64: they are only [B, H, L], and logits in
        # the thousands would otherwise lose ~1e-4 of relative accuracy in every rescaling.
        lse = torch.full((B, H, L), -math.inf, dtype=torch.float64, device=q.device)
        if sinks is not None:  # a sink is one more logit per head whose value is zero
            lse.copy_(sinks.to(torch.float64)[None, :, None].expand(B, H, L))
        kv = torch.cat([k, v], dim=-1)  # [batch, kv_heads, local_seq, dk + dv]: one message
        for source, kv_block in _kv_blocks(ring, kv, comm, steps):
            items = plan.items(source)
            record_work(bool(items), len(items), _pairs(items))
            for qs, ks, blk_causal, mask in items:
                o_blk, lse_blk = block_forward(q[:, :, qs], kv_block[:, :, ks, :dk],
                                               kv_block[:, :, ks, dk:], causal=blk_causal,
                                               scale=scale, kernel=kernel, mask=mask)
                _merge(out[:, :, qs], lse[:, :, qs], o_blk, lse_blk)
        for _ in range(ring.size - steps):
            record_work(False)  # blocks the window cuts off: not even sent
        out, lse = out.to(q.dtype), lse.to(acc)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.plan, ctx.args = plan, (group, comm, scale, kernel, steps)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        group, comm, scale, kernel, steps = ctx.args
        plan: RingPlan = ctx.plan
        ring = Ring(group)
        acc = torch.promote_types(q.dtype, torch.float32)
        dout = dout.contiguous()
        # rowsum(dO * O) is the same for every KV block: compute it once.
        delta = (dout.to(acc) * out.to(acc)).sum(-1)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = k.shape[-1]
        kv = torch.cat([k, v], dim=-1)

        def grads_for(source: int, kv_block: torch.Tensor) -> torch.Tensor:
            """This rank's contribution to dK/dV of ``source``'s block (fp32/fp64)."""
            dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
            for qs, ks, blk_causal, mask in plan.items(source):
                dq_b, dk_b, dv_b = block_backward(
                    dout[:, :, qs], q[:, :, qs], kv_block[:, :, ks, :dk], kv_block[:, :, ks, dk:],
                    out[:, :, qs], lse[:, :, qs], delta[:, :, qs],
                    causal=blk_causal, scale=scale, kernel=kernel, mask=mask)
                dq[:, :, qs] += dq_b
                dkv[:, :, ks, :dk] += dk_b
                dkv[:, :, ks, dk:] += dv_b
            return dkv

        if ring.size == 1:
            dkv = grads_for(0, kv)
        elif comm == "allgather":
            blocks = all_gather(kv, ring.group)
            dkv_all = torch.stack([grads_for(s, blocks[s]) for s in range(ring.size)])
            dkv = torch.empty(kv.shape, dtype=acc, device=q.device)
            reduce_scatter(dkv, dkv_all.flatten(0, 1), ring.group)
        else:
            dkv = _backward_ring(ring, kv, grads_for, acc, steps)
        dsinks = None
        if sinks is not None:  # dS of the sink column: P_sink * (0 - delta), summed per head
            p_sink = torch.exp(sinks.to(acc)[None, :, None] - lse)
            dsinks = -(p_sink * delta).sum((0, 2)).to(sinks.dtype)
        return (dq.to(q.dtype), dkv[..., :dk].to(k.dtype), dkv[..., dk:].to(v.dtype), dsinks,
                None, None, None, None, None, None, None, None)


def _kv_blocks(ring: Ring, kv: torch.Tensor, comm: str, steps: int
               ) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (source rank, its KV block) for the first ``steps`` ring steps, own block first.
    p2p posts the next block's transfer before yielding the current one, so the transfer
    overlaps its compute; blocks past ``steps`` (cut off by a window) are never sent."""
    W, r = ring.size, ring.rank
    if comm == "allgather" and W > 1:
        blocks = all_gather(kv, ring.group)
        for step in range(W):
            source = (r - step) % W
            yield source, blocks[source]
        return
    current = kv
    for step in range(steps):
        works, incoming = [], None
        if step < steps - 1:
            incoming = torch.empty_like(kv)
            works = ring.start([(current, incoming)])
        yield (r - step) % W, current
        wait(works)
        current = incoming


def _backward_ring(ring: Ring, kv: torch.Tensor, grads_for, acc: torch.dtype,
                   steps: int) -> torch.Tensor:
    """KV goes round again (``steps`` steps); each block's dK/dV accumulator follows it one step
    behind. Step i posts, in one batch, the KV for step i+1 and the accumulator finished at step
    i-1, then computes while they travel. The last accumulator, of the block that came
    ``steps - 1`` ranks from behind, then goes straight home (to the next rank for a full
    ring)."""
    W, r = ring.size, ring.rank
    current, finished = kv, None
    for step in range(steps):
        pairs, incoming_kv, incoming_acc = [], None, None
        if step < steps - 1:
            incoming_kv = torch.empty_like(kv)
            pairs.append((current, incoming_kv))
        if finished is not None:
            incoming_acc = torch.empty(kv.shape, dtype=acc, device=kv.device)
            pairs.append((finished, incoming_acc))
        works = ring.start(pairs)
        contribution = grads_for((r - step) % W, current)
        wait(works)
        finished = contribution if incoming_acc is None else incoming_acc.add_(contribution)
        current = incoming_kv
    if steps == 1:
        return finished
    own = torch.empty(kv.shape, dtype=acc, device=kv.device)
    wait(ring.start([(finished, own)], offset=W - steps + 1))
    return own


def _merge(out: torch.Tensor, lse: torch.Tensor, o_blk: torch.Tensor,
           lse_blk: torch.Tensor) -> None:
    """Fold a block's (output, log-sum-exp) into the running ones, in place and in fp32.

    Only differences of log-sum-exps are exponentiated, so large logits cannot overflow. A row
    that has seen nothing yet (lse = -inf on both sides, possible with document masks) stays
    empty instead of turning into NaN.
    """
    new = torch.logaddexp(lse, lse_blk.to(lse.dtype))
    base = new.nan_to_num(neginf=0.0)
    out.mul_(torch.exp(lse - base).unsqueeze(-1))
    out.add_(o_blk.to(out.dtype) * torch.exp(lse_blk.to(lse.dtype) - base).unsqueeze(-1))
    lse.copy_(new)


def check_qkv(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              document_ids: torch.Tensor | None) -> None:
    if (q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or v.shape[:-1] != k.shape[:-1]
            or q.shape[-1] != k.shape[-1]):
        raise ValueError(f"{name}: q must be [batch, heads, local_seq, head_dim], k "
                         f"[batch, kv_heads, local_seq, head_dim] and v [batch, kv_heads, "
                         f"local_seq, v_head_dim]; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1] or q.shape[2] != k.shape[2] or q.shape[0] != k.shape[0]:
        raise ValueError(f"{name}: heads ({q.shape[1]}) must be a multiple of kv_heads "
                         f"({k.shape[1]}) and q, k must share batch and local_seq; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}")
    want = (q.shape[0], q.shape[2])
    if document_ids is not None and (tuple(document_ids.shape) != want
                                     or document_ids.is_floating_point()):
        raise ValueError(f"{name}: document_ids must be integers of shape [batch, local_seq] = "
                         f"{list(want)} in q's layout; got {document_ids.dtype} "
                         f"{list(document_ids.shape)}")


def check_window(name: str, causal: bool, window: int | None, sinks: torch.Tensor | None,
                 heads: int) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise ValueError(f"{name}: window = {window!r} must be a positive int (a query at "
                         f"position i sees keys i - window < j <= i) or None")
    if window is not None and not causal:
        raise ValueError(f"{name}: a sliding window needs causal=True (got causal=False)")
    if sinks is not None and tuple(sinks.shape) != (heads,):
        raise ValueError(f"{name}: sinks must have shape [heads] = [{heads}]; got "
                         f"{list(sinks.shape)}")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group | None, *,
                   causal: bool = True, layout: str = "zigzag", comm: str = "p2p",
                   scale: float | None = None, kernel: str = "auto",
                   document_ids: torch.Tensor | None = None, window: int | None = None,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Exact attention over a sequence sharded across the ranks of ``group``. Differentiable.

    q: [batch, heads, local_seq, head_dim]; k: [batch, kv_heads, local_seq, head_dim], v: [batch,
    kv_heads, local_seq, v_head_dim] (v_head_dim may differ from head_dim, as in MLA) with
    heads % kv_heads == 0; returns [batch, heads, local_seq, v_head_dim]. Every rank must hold its
    shard in ``layout`` order (see :func:`zigzag_shard`). ``kernel`` picks the block kernel:
    "auto", "math", "flash_cpu", "flash_cuda" (see titanext.plugins._attention_kernels).

    ``document_ids`` ([batch, local_seq] integers, in q's layout) restrict attention to tokens
    of the same document (causal within it when ``causal``); the ring then skips every block
    and tile in which no pair of tokens shares a document. ``group=None`` runs on one rank.

    ``window`` (causal only) is a sliding window as transformers defines it: the query at global
    position i sees keys j with i - window < j <= i. Blocks and tiles outside every query's
    window are skipped; with ``comm="p2p"`` the ring also stops sending once no rank needs a
    farther block (the contiguous layout; zigzag needs both neighbours). ``sinks`` ([heads],
    differentiable) are per-head attention sinks (GPT-OSS): one extra logit per head whose
    value vector is zero, so each row's weights sum to less than one.

    >>> import torch, torch.distributed as dist
    >>> from titanext.plugins.context_parallel import ring_attention, zigzag_shard

    Inside each rank of a CP group ``g`` of size W, with full q, k, v of shape [B, H, S, D]:

    >>> shards = [zigzag_shard(t, 2, g) for t in (q, k, v)]  # torchrun  # doctest: +SKIP
    >>> out = ring_attention(*shards, g, window=128)  # torchrun  # doctest: +SKIP
    """
    if layout not in LAYOUTS:
        raise ValueError(f"ring_attention: layout = {layout!r} is not one of {LAYOUTS}")
    if comm not in COMMS:
        raise ValueError(f"ring_attention: comm = {comm!r} is not one of {COMMS}")
    check_qkv("ring_attention", q, k, v, document_ids)
    check_window("ring_attention", causal, window, sinks, q.shape[1])
    pg = as_group(group)
    if causal and layout == "zigzag" and q.shape[2] % 2:
        raise ValueError(f"ring_attention: the zigzag layout holds two equal chunks per rank, so "
                         f"local_seq must be even; got {q.shape[2]}")
    kernel = pick_kernel(kernel, q, v.shape[-1])
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    docs = None if document_ids is None else document_ids.to(torch.int64).contiguous()
    return _RingAttention.apply(q, k, v, sinks, docs, pg, causal, layout, comm, scale, kernel,
                                window)


def plan_work(layout: str, causal: bool, world: int, document_ids: torch.Tensor | None,
              local_seq: int, tile: int | None = None, window: int | None = None
              ) -> list[list[list[Item]]]:
    """Every rank's kernel calls for every source block, without processes (for benchmarks):
    ``document_ids`` are the shards of all ranks, [world, batch, local_seq], or None."""
    return [[RingPlan(layout, causal, r, world, local_seq, document_ids, tile, window).items(s)
             for s in range(world)] for r in range(world)]
