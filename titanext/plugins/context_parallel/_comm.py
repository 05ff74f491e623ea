"""Communication for context parallelism: the ring's neighbour exchange, collectives, the
Ulysses all-to-all (differentiable), and opt-in counters of traffic and attention work."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from titanext._compat import reduce_scatter_single
from titanext._profiler_ranges import CP, phase
from titanext.plugins._counting import Counters
from titanext.plugins._mesh import one_dim_group

Group = dist.ProcessGroup | DeviceMesh


# -- accounting -----------------------------------------------------------------------------------

@dataclass
class CommCounter:
    """Messages and bytes this rank sent (p2p) or contributed (collectives) in CP attention.

    An all-to-all counts the part of its buffer that leaves the rank ((W-1)/W of it); an
    all-gather or reduce-scatter counts this rank's input."""

    sends: int = 0
    send_bytes: int = 0
    collectives: dict[str, int] = field(default_factory=dict)
    collective_bytes: int = 0


@dataclass
class WorkCounter:
    """Attention work this rank planned in forward calls (backward repeats the same plan).

    ``blocks``: (query shard, KV block) pairs of the ring that needed any work; ``blocks_skipped``:
    pairs skipped whole (the causal mask or, with document ids, no query-key pair sharing a
    document); ``tiles``: kernel calls; ``pairs``: query-key pairs the kernels were given.
    """

    blocks: int = 0
    blocks_skipped: int = 0
    tiles: int = 0
    pairs: int = 0


_COUNTERS = Counters(CommCounter)
_WORK = Counters(WorkCounter)


def count_comm() -> contextlib.AbstractContextManager[CommCounter]:
    """Count CP-attention traffic issued inside the block (tests and benchmarks use it)."""
    return _COUNTERS.open()


def count_work() -> contextlib.AbstractContextManager[WorkCounter]:
    """Count the attention blocks computed and skipped inside the block (see WorkCounter)."""
    return _WORK.open()


def record_work(computed: bool, tiles: int = 0, pairs: int = 0) -> None:
    for c in _WORK:
        c.blocks += computed
        c.blocks_skipped += not computed
        c.tiles += tiles
        c.pairs += pairs


def _record_send(t: torch.Tensor) -> None:
    for c in _COUNTERS:
        c.sends += 1
        c.send_bytes += t.numel() * t.element_size()


def record_collective(name: str, t: torch.Tensor, fraction: float = 1.0) -> None:
    for c in _COUNTERS:
        c.collectives[name] = c.collectives.get(name, 0) + 1
        c.collective_bytes += int(t.numel() * t.element_size() * fraction)


# -- groups and the ring --------------------------------------------------------------------------

def as_group(group: Group | None) -> dist.ProcessGroup | None:
    return one_dim_group(group, "context parallel attention needs a 1D mesh, got a {ndim}D "
                                "mesh {names}; pass mesh['cp'] (or its sub-axes)")


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


class Ring:
    """Neighbour exchange on a CP group: every rank sends to r+1 and receives from r-1.
    ``group=None`` is a ring of one rank (local attention: nothing is sent)."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self.size, self.rank = group_size(group), group_rank(group)
        if group is not None:
            self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
            self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], offset: int = 1
              ) -> list[dist.Work]:
        """Post (send this to next, receive that from prev) pairs as one batch (NCCL-safe);
        ``offset`` = k sends to rank r+k and receives from r-k instead."""
        if not pairs:
            return []
        dst, src = self.next, self.prev
        if offset % self.size != 1:
            dst = dist.get_global_rank(self.group, (self.rank + offset) % self.size)
            src = dist.get_global_rank(self.group, (self.rank - offset) % self.size)
        ops = []
        for send, recv in pairs:
            _record_send(send)
            ops.append(dist.P2POp(dist.isend, send, dst, self.group))
            ops.append(dist.P2POp(dist.irecv, recv, src, self.group))
        with phase(CP):
            return dist.batch_isend_irecv(ops)


def wait(works: list[dist.Work]) -> None:
    if not works:
        return
    with phase(CP):
        for w in works:
            w.wait()


def all_gather(x: torch.Tensor, group: dist.ProcessGroup | None, name: str = "all_gather"
               ) -> list[torch.Tensor]:
    """Every rank's ``x``, in group-rank order (not differentiable)."""
    if group is None:
        return [x]
    blocks = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    record_collective(name, x)
    # The list form exists with the same meaning on every torch we support and backend.
    with phase(CP):
        dist.all_gather(blocks, x.contiguous(), group=group)
    return blocks


def reduce_scatter(out: torch.Tensor, stacked: torch.Tensor, group: dist.ProcessGroup) -> None:
    record_collective("reduce_scatter", stacked)
    with phase(CP):
        reduce_scatter_single(out, stacked, group=group)


# -- Ulysses: sequence-sharded <-> head-sharded ---------------------------------------------------

def _all_to_all(send: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """send [world, n]: row j goes to rank j; returns [world, n] with row i from rank i.
    gloo and nccl both implement all_to_all_single (equal splits along dim 0)."""
    recv = torch.empty_like(send)
    world = dist.get_world_size(group)
    record_collective("all_to_all", send, (world - 1) / world)  # row `rank` stays here
    with phase(CP):
        dist.all_to_all_single(recv, send.contiguous(), group=group)
    return recv


def seq_to_heads(xs: list[torch.Tensor], group: dist.ProcessGroup, order: torch.Tensor
                 ) -> list[torch.Tensor]:
    """[B, H, Ls, D] sequence shards -> [B, H/u, u*Ls, D] head shards, in one all-to-all.

    Rank j receives head group j of every rank's shard; the shards, concatenated in rank order,
    are put into ``order`` (the sequence layout the attention after it expects).
    """
    u = dist.get_world_size(group)
    shapes = [x.shape for x in xs]
    send = torch.cat([x.reshape(x.shape[0], u, -1).transpose(0, 1) for x in xs], dim=2)
    recv = _all_to_all(send.flatten(1), group).view(u, shapes[0][0], -1)
    out, offset = [], 0
    for b, h, ls, d in shapes:
        n = h // u * ls * d
        part = recv[:, :, offset:offset + n].reshape(u, b, h // u, ls, d)
        out.append(part.permute(1, 2, 0, 3, 4).reshape(b, h // u, u * ls, d)[:, :, order])
        offset += n
    return out


def heads_to_seq(ys: list[torch.Tensor], group: dist.ProcessGroup, order: torch.Tensor
                 ) -> list[torch.Tensor]:
    """The inverse (and the adjoint) of :func:`seq_to_heads`."""
    u = dist.get_world_size(group)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    shapes, parts = [], []
    for y in ys:
        b, hl, s, d = y.shape
        shapes.append((b, hl * u, s // u, d))
        # [B, H/u, u, Ls, D] -> [u (destination), B, H/u * Ls * D]
        parts.append(y[:, :, inverse].reshape(b, hl, u, -1).transpose(1, 2).transpose(0, 1)
                     .reshape(u, b, -1))
    recv = _all_to_all(torch.cat(parts, dim=2).flatten(1), group).view(u, shapes[0][0], -1)
    out, offset = [], 0
    for b, h, ls, d in shapes:
        n = h // u * ls * d
        part = recv[:, :, offset:offset + n].reshape(u, b, h // u, ls, d)
        out.append(part.transpose(0, 1).reshape(b, h, ls, d))
        offset += n
    return out


class SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, order, *xs):
        out = tuple(seq_to_heads(list(xs), group, order))
        ctx.group, ctx.order, ctx.like = group, order, [(o.shape, o.dtype, o.device) for o in out]
        return out

    @staticmethod
    def backward(ctx, *grads):
        return None, None, *heads_to_seq(_dense(grads, ctx.like), ctx.group, ctx.order)


class HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, order, *ys):
        out = tuple(heads_to_seq(list(ys), group, order))
        ctx.group, ctx.order, ctx.like = group, order, [(o.shape, o.dtype, o.device) for o in out]
        return out

    @staticmethod
    def backward(ctx, *grads):
        return None, None, *seq_to_heads(_dense(grads, ctx.like), ctx.group, ctx.order)


def _dense(grads, like) -> list[torch.Tensor]:
    """Gradients autograd left as None become zeros: every rank must join the all-to-all."""
    return [torch.zeros(shape, dtype=dtype, device=device) if g is None else g.contiguous()
            for g, (shape, dtype, device) in zip(grads, like)]
