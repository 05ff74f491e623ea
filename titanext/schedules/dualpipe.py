"""DualPipe and DualPipeV (DeepSeek-V3's bidirectional schedules) as per-rank action lists.

Each rank holds two stage chunks and, in the steady state, runs a forward chunk of one
together with a backward chunk of the other as one OVERLAP_F_B action: the handler in
:mod:`titanext.schedules._torch_ir` sends the forward's activation before it starts the
backward, so one chunk's communication runs while the other chunk computes.

The order on each rank is eight phases whose lengths are formulas of the rank, as in the
DualPipe paper (phase 0/1 are the rank's two chunks; ``x`` below is ``pp - rank - 1``):

1. ``2x`` forwards of chunk 0 (warm-up)
2. ``rank + 1`` pairs: forward chunk 0, forward chunk 1
3. ``x`` times: input-grad of chunk 1, a deferred weight-grad, forward chunk 1 (zero bubble)
4. ``m - 2pp + rank + 1`` times: [F0 with B1] and [F1 with B0], both overlapped (main phase)
5. ``x`` times: B1, then [F1 with B0]
6. ``rank + 1`` times: B1, B0; the later half split into I and a deferred W
7. ``x`` times: a deferred W, then I of chunk 0
8. ``rank + 1`` deferred W's

**DualPipeV** (V placement): rank r holds stages r (chunk 0) and 2pp-1-r (chunk 1) of one
chain of 2pp stages; every micro-batch goes down and back up. Needs ``m >= 2pp``.

**DualPipe** (placement "dualpipe"): the model has pp stages and two copies of it run in
opposite directions. Rank r holds stage r of the down copy and stage pp-1-r of the up copy,
built as ``PipelineStage(stage_index=r, num_stages=pp)`` and
``PipelineStage(stage_index=pp-1-r, num_stages=pp)``. Micro-batches ``0..m/2-1`` enter at
rank 0 and go down, ``m/2..m-1`` enter at rank pp-1 and go up. Ranks in the lower half run the
phases above with chunk 0 = down copy; ranks in the upper half mirror them (``rank`` becomes
``min(r, pp-1-r)``, ``pp`` becomes ``pp/2`` and ``m`` becomes ``m/2``). After the step the
two copies of each stage hold the summed gradient (see :func:`sum_mirrored_grads`). Needs
even ``pp`` and even ``m >= 2pp``.

>>> from titanext.schedules.dualpipe import dualpipev_order
>>> " ".join(str(a) for a in dualpipev_order(2, 4)[1][:4])
'1F0 2F0 1F1 2F1'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from titanext._profiler_ranges import PP_WAIT, phase
from titanext.schedules._torch_ir import (
    Action,
    B,
    ChainRuntime,
    F,
    I,
    W,
    action,
    add_comms,
    microbatch_count,
    overlapped,
    schedule_loss_fn,
    set_pipeline_order,
    stages_of,
)


class _Phases:
    """Builds one rank's list: per-chunk forward/backward micro-batch counters, W queue."""

    def __init__(self, stages: tuple[int, int], microbatches: tuple[range, range]):
        self.stages, self.mbs = stages, microbatches
        self.nf, self.nb = [0, 0], [0, 0]
        self.wq: list[Action] = []
        self.out: list[Action] = []

    def _f(self, c: int) -> Action:
        a = action(self.stages[c], F, self.mbs[c][self.nf[c]])
        self.nf[c] += 1
        return a

    def _b(self, c: int, zb: bool = False) -> Action:
        j = self.mbs[c][self.nb[c]]
        self.nb[c] += 1
        if zb:
            self.wq.append(action(self.stages[c], W, j))
            return action(self.stages[c], I, j)
        return action(self.stages[c], B, j)

    def f(self, c: int) -> None:
        self.out.append(self._f(c))

    def b(self, c: int, zb: bool = False) -> None:
        self.out.append(self._b(c, zb))

    def w(self) -> None:
        self.out.append(self.wq.pop(0))

    def fb(self, cf: int, cb: int) -> None:
        self.out.append(overlapped(self._f(cf), self._b(cb)))


def _phase_order(p: _Phases, rank: int, ranks: int, chunks: int, middle: bool) -> list[Action]:
    """The eight phases for ``rank`` of ``ranks`` (half-rank counts for DualPipe)."""
    x = ranks - rank - 1
    for _ in range(2 * x):
        p.f(0)
    for _ in range(rank + 1):
        p.f(0)
        p.f(1)
    for _ in range(x):
        p.b(1, zb=True)
        p.w()
        p.f(1)
    for i in range(chunks - 2 * ranks + rank + 1):
        if i == 0 and middle:  # the turn-around rank runs these two apart: a shorter bubble
            p.f(0)
            p.b(1)
        else:
            p.fb(0, 1)
        p.fb(1, 0)
    for _ in range(x):
        p.b(1)
        p.fb(1, 0)
    zb = False
    for i in range(rank + 1):
        if i == (rank + 1) // 2 and rank % 2 == 1:
            zb = True
        p.b(1, zb)
        if i == (rank + 1) // 2 and rank % 2 == 0:
            zb = True
        p.b(0, zb)
    for _ in range(x):
        p.w()
        p.b(0, zb=True)
    for _ in range(rank + 1):
        p.w()
    assert not p.wq and p.nf == [len(p.mbs[0]), len(p.mbs[1])], "phase counts are inconsistent"
    return p.out


def dualpipev_order(pp: int, microbatches: int) -> dict[int, list]:
    """DualPipeV's per-rank compute lists (V placement, 2pp stages, ``m >= 2pp``)."""
    _check(pp, microbatches, even=False)
    mbs = range(microbatches)
    return {r: _phase_order(_Phases((r, 2 * pp - 1 - r), (mbs, mbs)), r, pp, microbatches,
                            middle=r == pp - 1) for r in range(pp)}


def dualpipe_order(pp: int, microbatches: int) -> dict[int, list]:
    """DualPipe's per-rank compute lists (stage indices are the model's 0..pp-1; the
    micro-batch index tells the direction: below m/2 down, from m/2 up)."""
    _check(pp, microbatches, even=True)
    half_m, half_p = microbatches // 2, pp // 2
    down, up = range(half_m), range(half_m, microbatches)
    order = {}
    for r in range(pp):
        h = min(r, pp - 1 - r)
        # chunk 0 is the copy whose micro-batches reach this rank first
        chunks = ((r, down), (pp - 1 - r, up)) if r < half_p else ((pp - 1 - r, up), (r, down))
        p = _Phases((chunks[0][0], chunks[1][0]), (chunks[0][1], chunks[1][1]))
        order[r] = _phase_order(p, h, half_p, half_m, middle=h == half_p - 1)
    return order


def _check(pp: int, m: int, *, even: bool) -> None:
    if even and pp % 2:
        raise ValueError(f"DualPipe needs an even pipeline_parallel_degree, got {pp}")
    if m < 2 * pp or (even and m % 2):
        need = "an even number >= 2 x pp" if even else ">= 2 x pp"
        raise ValueError(f"{'DualPipe' if even else 'DualPipeV'} needs microbatches {need} "
                         f"= {2 * pp}, got {m}")


def dualpipe_owner(pp: int, microbatches: int):
    """``owner(stage, mb) -> rank`` for DualPipe: down copy on rank s, up copy on pp-1-s."""
    return lambda s, j: s if j < microbatches // 2 else pp - 1 - s


class DualPipeV(ChainRuntime):
    """DualPipeV: V placement, overlapped F&B chunks. ``cls(stages, n_microbatches, loss_fn)``
    with this rank's two stages [r, 2pp-1-r] of a 2pp-stage chain."""

    placement = "v"
    stages_per_rank = 2
    splits_backward = True  # phases 6-7 split B into I and a deferred W
    min_microbatches_per_rank = 2  # m >= 2pp
    generate = staticmethod(dualpipev_order)

    def __init__(self, stages, n_microbatches: int, loss_fn=None, **kwargs):
        super().__init__(stages=stages, n_microbatches=n_microbatches, loss_fn=loss_fn, **kwargs)
        pp = stages[0].group_size
        mapping = {s: r for r in range(pp) for s in (r, 2 * pp - 1 - r)}
        self._install_handlers()
        order = self.generate(pp, n_microbatches)  # a capped class's lists (memory_cap)
        set_pipeline_order(self, order, mapping)
        self._set_lowered(order, self.pipeline_order_with_comms)

    def _chain(self, s: int, j: int):
        mine = {st.stage_index for st in stages_of(self)}
        return (s - 1 if s - 1 in mine else None), (s + 1 if s + 1 in mine else None)

    def _seen(self, s: int) -> int:
        return microbatch_count(self)


class DualPipe(ChainRuntime):
    """DualPipe: two model copies in opposite directions, overlapped F&B chunks.

    ``cls(stages, n_microbatches, loss_fn)`` with this rank's [down stage r, up stage pp-1-r]
    (both built with ``num_stages=pp``). Rank 0 and rank pp-1 each hold a first and a last
    stage: give both the inputs and targets. After ``step`` both copies of every stage hold
    the gradient summed over all micro-batches: a copy's exchange with its partner starts as
    soon as its last backward has run (:class:`MirroredGradSum`). The attribute
    ``sum_mirrored_grads`` (constructor keyword, default True) may change between steps: set
    it False to sum yourself, e.g. only in the last of several accumulation steps.
    """

    placement = "dualpipe"
    stages_per_rank = 2
    splits_backward = True
    generate = staticmethod(dualpipe_order)

    def __init__(self, stages, n_microbatches: int, loss_fn=None, *,
                 sum_mirrored_grads: bool = True, **kwargs):
        super().__init__(stages=stages, n_microbatches=n_microbatches, loss_fn=loss_fn, **kwargs)
        pp, rank = stages[0].group_size, stages[0].group_rank
        if [s.stage_index for s in stages] != [rank, pp - 1 - rank] or stages[0].num_stages != pp:
            raise ValueError(f"DualPipe rank {rank} needs stages [{rank}, {pp - 1 - rank}] built "
                             f"with num_stages={pp}; got "
                             f"{[(s.stage_index, s.num_stages) for s in stages]}")
        stages[0].stage_index_to_group_rank = {s: s for s in range(pp)}
        stages[1].stage_index_to_group_rank = {s: pp - 1 - s for s in range(pp)}
        self.sum_mirrored_grads = sum_mirrored_grads
        self._mirror = MirroredGradSum(stages)
        self._final: list = []  # copies whose gradients are final, to start at the next chunk
        # An early start needs P2P messages matched by tag, which gloo does and NCCL does not
        # (NCCL matches a pair's messages in issue order, and the partner reaches that copy's
        # last chunk at another point of its own order); and FSDP reduce-scatters a copy's
        # gradient after its last chunk. Otherwise every copy is summed at the end.
        self._early = dist.get_backend(stages[0].group) == "gloo" and not any(
            isinstance(m, FSDPModule) for st in stages for m in st.submod.modules())
        self._install_handlers()
        order = self.generate(pp, n_microbatches)  # a capped class's lists (memory_cap)
        owner = dualpipe_owner(pp, n_microbatches)
        self._set_lowered(order, add_comms(order, owner, pp, n_microbatches // 2))

    def _chain(self, s: int, j: int):
        return None, None  # neighbours along either direction always live on another rank

    def _seen(self, s: int) -> int:
        return microbatch_count(self) // 2

    def _start_final(self) -> None:
        """Start the exchange of copies finished by the previous chunk (its sends are out)."""
        for stage in self._final:
            self._mirror.start(stage)
        self._final.clear()

    def _mark_final(self, index: int) -> None:
        if self.sum_mirrored_grads and self._early and self._done_count[index] == self._seen(index):
            self._final.append(self._stage(index))

    def _forward(self, a, ctx) -> None:
        self._start_final()
        super()._forward(a, ctx)

    def _backward(self, a, *, full: bool) -> None:
        self._start_final()
        super()._backward(a, full=full)
        self._mark_final(a.stage_index)

    def _weight(self, a) -> None:
        self._start_final()
        stage = self._stage(a.stage_index)
        queue = getattr(stage, "weight_grad_queue", None)
        last = (self.sum_mirrored_grads and self._early and queue is not None
                and self._done_count[a.stage_index] + 1 == self._seen(a.stage_index))
        if last:  # the copy's last W: send each weight's gradient once its last GEMM is in
            queue.after_each = partial(self._mirror.start_param, stage)
        try:
            super()._weight(a)
        finally:
            if last:
                queue.after_each = None
        self._mark_final(a.stage_index)

    def _step_microbatches(self, *args, **kwargs):
        self._final.clear()
        self._mirror.pending.clear()
        out = super()._step_microbatches(*args, **kwargs)
        if self.sum_mirrored_grads:
            self._mirror.finish()
        return out

    def _merge_losses(self, mine):
        """Rank 0 computed the up copy's losses, rank pp-1 the down copy's: swap them."""
        stage = stages_of(self)[0]
        pp, rank = stage.group_size, stage.group_rank
        if rank not in (0, pp - 1) or schedule_loss_fn(self) is None:
            return mine
        if pp == 1:
            return mine
        m = microbatch_count(self)
        half = m // 2
        theirs_ids = range(half) if rank == 0 else range(half, m)
        send = torch.stack([mine[j].detach().float() for j in sorted(mine)])
        recv = torch.empty(len(theirs_ids), dtype=send.dtype)
        _exchange(stage.group, pp - 1 - rank, [send], [recv])
        return {**mine, **{j: recv[i] for i, j in enumerate(theirs_ids)}}


def _exchange(group, peer: int, send: list[torch.Tensor], recv: list[torch.Tensor]) -> None:
    dst = dist.get_global_rank(group, peer) if group is not None else peer
    ops = [dist.P2POp(dist.isend, t, dst, group) for t in send]
    ops += [dist.P2POp(dist.irecv, t, dst, group) for t in recv]
    with phase(PP_WAIT):
        for w in dist.batch_isend_irecv(ops):
            w.wait()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


#: P2P tags of a stage's mirrored-gradient messages: tag + stage index x _TAGS_PER_STAGE +
#: the parameter's index (the schedule's own activation messages use tag 0, so the two never
#: match each other)
_MIRROR_TAG, _TAGS_PER_STAGE = 7_000, 100_000


@dataclass
class _Exchange:
    """One stage copy's exchange in flight: its parameters, the gradients sent so far (by
    parameter index), the receive buffers and the P2P works."""

    params: list
    sent: dict[int, torch.Tensor]
    recv: list[torch.Tensor]
    works: list
    #: id(parameter) -> its position in ``params`` (its tag offset)
    index: dict[int, int] = field(init=False)

    def __post_init__(self) -> None:
        self.index = {id(p): i for i, p in enumerate(self.params)}


class MirroredGradSum:
    """The exchange behind :func:`sum_mirrored_grads`, startable one stage copy, or one
    parameter, at a time.

    ``start(stage)`` posts the sends of that copy's gradients (each parameter's own tensor, no
    flattening copy) and the receives of the partner's copy of the same stage, each message
    tagged by stage and parameter; ``start_param(stage, p)`` posts that copy's receives and
    the send of one parameter whose gradient is final; ``finish()`` starts what is left, waits
    for everything and adds the partner's gradients. Summing is a + b on one rank and b + a on
    the other, so the copies stay bitwise equal. ``DualPipe`` (on gloo, which matches messages
    by tag) starts a copy as soon as its last backward has run, and during a copy's last W
    sends each weight's gradient as soon as its last GEMM is added, so the transfer overlaps
    the remaining chunks.
    """

    def __init__(self, stages) -> None:
        down = stages[0]
        self.stages, self.group = list(stages), down.group
        peer = down.group_size - 1 - down.group_rank
        self.peer = dist.get_global_rank(self.group, peer) if self.group is not None else peer
        self.pending: dict[int, _Exchange] = {}  # by stage index
        #: receive buffers kept from step to step on CPU, where a fresh tensor of a stage's
        #: gradient size is fresh pages from the OS (a CUDA caching allocator reuses blocks)
        self._buffers: dict[int, list[torch.Tensor]] = {}

    def _ops(self, stage, kind, tensors: dict[int, torch.Tensor]) -> list:
        base = _MIRROR_TAG + stage.stage_index * _TAGS_PER_STAGE
        return [dist.P2POp(kind, t, self.peer, self.group, base + i) for i, t in tensors.items()]

    def _entry(self, stage) -> _Exchange:
        params = list(stage.submod.parameters())
        if len(params) >= _TAGS_PER_STAGE:
            raise ValueError(f"a DualPipe stage with {len(params)} parameter tensors; at most "
                             f"{_TAGS_PER_STAGE - 1}")
        recv = self._buffers.get(stage.stage_index)
        if recv is None or len(recv) != len(params) or any(
                r.shape != _local(p).shape or r.dtype != p.dtype
                for r, p in zip(recv, params, strict=True)):
            recv = [torch.empty_like(_local(p)) for p in params]
            if all(r.device.type == "cpu" for r in recv):
                self._buffers[stage.stage_index] = recv
        return _Exchange(params, {}, recv, [])

    @staticmethod
    def _grad(entry: _Exchange, i: int) -> torch.Tensor:
        """Parameter i's gradient as sent (kept alive in ``entry.sent`` until the send is done)."""
        p = entry.params[i]
        g = _local(p.grad) if p.grad is not None else torch.zeros_like(_local(p))
        entry.sent[i] = g.contiguous()
        return entry.sent[i]

    def start(self, stage) -> None:
        entry = self.pending.get(stage.stage_index)
        if entry is None:  # one batch of every send and receive (NCCL groups it)
            entry = self.pending[stage.stage_index] = self._entry(stage)
            sends = {i: self._grad(entry, i) for i in range(len(entry.params))}
            ops = (self._ops(stage, dist.isend, sends)
                   + self._ops(stage, dist.irecv, dict(enumerate(entry.recv))))
        else:  # receives are out (start_param): the sends not made yet
            ops = self._ops(stage, dist.isend, {i: self._grad(entry, i)
                                                for i in range(len(entry.params))
                                                if i not in entry.sent})
        if ops:
            entry.works += dist.batch_isend_irecv(ops)

    def start_param(self, stage, param) -> None:
        """Send ``param``'s final gradient now (receives for the whole copy are posted first);
        needs a backend that matches P2P messages by tag (gloo)."""
        entry = self.pending.get(stage.stage_index)
        if entry is None:
            entry = self.pending[stage.stage_index] = self._entry(stage)
            entry.works += dist.batch_isend_irecv(
                self._ops(stage, dist.irecv, dict(enumerate(entry.recv))))
        i = entry.index[id(param)]
        if i not in entry.sent:
            entry.works += dist.batch_isend_irecv(
                self._ops(stage, dist.isend, {i: self._grad(entry, i)}))

    def finish(self) -> None:
        # by stage index, the same order on both partners (rank r holds [r, pp-1-r], its
        # partner [pp-1-r, r]): a backend that matches messages in issue order pairs them right
        for stage in sorted(self.stages, key=lambda s: s.stage_index):
            self.start(stage)
        pending, self.pending = self.pending, {}
        with phase(PP_WAIT):
            for entry in pending.values():  # every send is done before a gradient changes
                for w in entry.works:
                    w.wait()
        for entry in pending.values():
            for p, theirs in zip(entry.params, entry.recv, strict=True):
                _add_partner(p, theirs)


def sum_mirrored_grads(stages) -> None:
    """Give both DualPipe copies of every stage the sum of their gradients.

    Rank r holds [down copy of stage r, up copy of stage pp-1-r]; rank pp-1-r holds the other
    copy of both. Each rank sends its two copies' gradients (parameter by parameter) to that
    partner and adds the partner's: a + b is computed from the same two operands on both
    sides, so the copies stay bitwise equal (and so do their optimizer updates). Works on FSDP
    shards too (the partner shares the data-parallel coordinates). Call it after the
    micro-batches of one optimizer step, before clipping; ``DualPipe`` does it during and at
    the end of ``step`` by default (see :class:`MirroredGradSum`).
    """
    MirroredGradSum(stages).finish()


def _add_partner(p: torch.Tensor, theirs: torch.Tensor) -> None:
    """grad += the partner's gradient (a + b == b + a bitwise: copies stay equal)."""
    if p.grad is None:
        if _local(p) is not p:
            raise ValueError("sum_mirrored_grads: a DTensor parameter without a gradient")
        p.grad = theirs.clone()  # the receive buffer may be reused next step
    else:
        _local(p.grad).add_(theirs)
