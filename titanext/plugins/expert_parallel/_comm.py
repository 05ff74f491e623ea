"""Expert parallelism's differentiable all-to-all, its float8 wire format and its opt-in
traffic counters.

Shared by :mod:`titanext.plugins.expert_parallel` (token dispatch / combine, flat or two-level:
``_dispatch``) and :mod:`titanext.plugins.expert_parallel.replication` (hot-expert weight
copies), which re-export :class:`CommCounter` and :func:`count_comm` through
``expert_parallel``.

Float8 dispatch (:class:`Wire` ``float8=True``): the rows a dispatch sends travel as float8 e4m3
with one power-of-two scale per 1 x 128 block of a row, stored as its exponent in one byte, so a
row of ``dim`` values costs ``dim + ceil(dim / 128)`` bytes instead of ``2 dim`` (bf16). The
payload moves as uint8 (NCCL and gloo have no float8 collectives everywhere) and is dequantized
on arrival to the rows' own dtype. Power-of-two scales make the dequantized values exact in
bf16, so a second hop (two-level dispatch) re-quantizes them to the same bytes. The backward
sends the gradients in their own dtype (straight-through: the quantization is treated as the
identity), and the combine is never quantized.

Recompute without re-dispatch (:class:`CommTape`): inside ``with tape.session()``, the first
run records what every EP collective of the forward received (token rows, routing, expert
copies, the split sizes); every later run of the same code, activation checkpointing's
recompute, gets those results back instead of communicating. The backward's all-to-alls are
not recorded: they run outside the session.

>>> x = torch.randn(3, 256)
>>> payload = quantize_rows(x)
>>> payload.dtype, tuple(payload.shape)
(torch.uint8, (3, 258))
>>> bool(((dequantize_rows(payload, 256, x.dtype) - x).abs() <= x.abs() / 8 + 1e-6).all())
True
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titanext._compat import assert_on_device
from titanext._fake_backend import is_fake
from titanext._profiler_ranges import EP_ALL_TO_ALL, phase
from titanext.plugins._baton_threads import comm_point
from titanext.plugins._counting import Counters

__all__ = ["PLAIN", "CommCounter", "CommTape", "Wire", "count_comm", "dequantize_rows",
           "quantize_rows", "swap_counts", "taped"]

FLOAT8_BLOCK = 128  # values per scale along a row (DeepSeek-V3's 1 x 128 activation tiles)
_F8 = torch.float8_e4m3fn
_F8_MAX = 448.0


@dataclass
class CommCounter:
    """What this rank sent to *other* ranks in the EP all-to-alls (forward and backward).

    ``all_to_alls`` / ``rows_sent`` / ``bytes_sent``: token rows (dispatch and combine, both
    directions, every level); ``dispatch_bytes_sent``: the forward dispatches' token rows only
    (what float8 dispatch halves); ``inter_node_bytes_sent`` / ``inter_node_dispatch_bytes_sent``:
    the same to ranks on other nodes (counted where the node size is known:
    ``apply_expert_parallel(..., ranks_per_node=N)``); ``routing_bytes_sent``: the routing
    (expert ids and weights) that two-level dispatch sends beside each row;
    ``weight_all_to_alls`` / ``weight_bytes_sent``: hot-expert copies (their weights forward,
    their gradients back in backward); ``replicas``: expert copies planned by this rank's
    dispatches (inside ``copies_per_step``: once per layer and step); ``count_exchanges`` /
    ``host_syncs``: per dispatch (two per two-level one).
    """

    all_to_alls: int = 0
    rows_sent: int = 0
    bytes_sent: int = 0
    count_exchanges: int = 0
    host_syncs: int = 0
    replicas: int = 0
    weight_all_to_alls: int = 0
    weight_bytes_sent: int = 0
    dispatch_bytes_sent: int = 0
    inter_node_bytes_sent: int = 0
    inter_node_dispatch_bytes_sent: int = 0
    routing_bytes_sent: int = 0


COUNTERS = Counters(CommCounter)


def count_comm() -> contextlib.AbstractContextManager[CommCounter]:
    """Count EP traffic issued inside the block (tests and ``benchmarks/moe_dispatch.py``)."""
    return COUNTERS.open()


@dataclass(frozen=True)
class Wire:
    """How one all-to-all's rows travel and are counted: ``ranks_per_node`` (consecutive ranks
    of the group that share a node; 0 = unknown, no inter-node counts) and ``float8`` (the rows
    as float8 with 1 x 128 scales, forward only)."""

    ranks_per_node: int = 0
    float8: bool = False


PLAIN = Wire()  # unknown node size, rows in their own dtype


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` [rows, dim] as uint8 [rows, dim + ceil(dim / 128)]: the float8 e4m3 bytes, then one
    signed exponent byte per 1 x 128 block (scale = 2 ** exponent, amax / scale <= 448)."""
    rows, dim = x.shape
    blocks = -(-dim // FLOAT8_BLOCK)
    padded = torch.nn.functional.pad(x.float(), (0, blocks * FLOAT8_BLOCK - dim))
    tiles = padded.view(rows, blocks, FLOAT8_BLOCK)
    amax = tiles.abs().amax(-1).clamp(min=2.0 ** -100)
    exponent = torch.ceil(torch.log2(amax / _F8_MAX)).clamp(-126, 127)
    q = (tiles / torch.exp2(exponent).unsqueeze(-1)).clamp(-_F8_MAX, _F8_MAX).to(_F8)
    data = q.view(rows, blocks * FLOAT8_BLOCK)[:, :dim].view(torch.uint8)
    return torch.cat([data, exponent.to(torch.int8).view(torch.uint8)], 1)


def dequantize_rows(payload: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_rows`: [rows, dim] in ``dtype``."""
    rows = payload.shape[0]
    blocks = -(-dim // FLOAT8_BLOCK)
    q = payload[:, :dim].contiguous().view(_F8).float()
    # (explicit sizes: a rank that receives no rows has 0-element tensors, which -1 cannot size)
    q = torch.nn.functional.pad(q, (0, blocks * FLOAT8_BLOCK - dim)).view(rows, blocks,
                                                                           FLOAT8_BLOCK)
    exponent = payload[:, dim:].contiguous().view(torch.int8).float()
    return ((q * torch.exp2(exponent).unsqueeze(-1)).view(rows, blocks * FLOAT8_BLOCK)[:, :dim]
            .to(dtype))


# -- recompute without re-dispatch ---------------------------------------------------------------

_TAPE = threading.local()  # the tape of the session running on this thread (pipeline overlap
# runs two micro-batches on two threads; the autograd engine may recompute on its own thread)


def _versions(value) -> tuple:
    if isinstance(value, torch.Tensor):
        return (value._version,)
    return sum((_versions(v) for v in value), ()) if isinstance(value, tuple) else ()


def _detach(value):
    if isinstance(value, torch.Tensor):
        return value.detach()  # a new tensor object: autograd sets its history, not the kept one's
    if isinstance(value, tuple):
        return tuple(_detach(v) for v in value)
    return value


class CommTape:
    """What the EP collectives of one checkpointed call received, replayed in its recompute.

    ``session()`` wraps each run of the call: the first records, every later one replays in
    the same order. A replayed collective must be the one recorded (same kind and split sizes),
    and a complete replay must use every record, and the per-expert counts a replayed exchange
    would send must be the recorded ones (checked on the device): anything else means the
    recompute took another path than the forward, and raises instead of giving rows to the
    wrong tokens. The
    tape lives as long as the autograd graph that holds the checkpoint (a split backward
    recomputes twice, and replays twice)."""

    def __init__(self) -> None:
        self.records: list[tuple[tuple, object]] = []
        self.runs = 0
        self._pos = 0

    @contextlib.contextmanager
    def session(self) -> Iterator[CommTape]:
        previous, self._pos = getattr(_TAPE, "tape", None), 0
        _TAPE.tape = self
        try:
            yield self
        finally:
            _TAPE.tape = previous
            self.runs += 1
        # reached only without an exception (checkpoint's early stop raises through here)
        if self.runs > 1 and self._pos != len(self.records):
            raise RuntimeError(f"recompute without re-dispatch: the recomputed forward issued "
                               f"{self._pos} EP collectives, the forward {len(self.records)}; "
                               "it took another path (the routing changed?)")

    def take(self, key: tuple, issue: Callable[[], object], check: torch.Tensor | None = None):
        if self.runs == 0:
            value = issue()
            kept = None if check is None or is_fake(check) else check.detach().clone()
            kept_value = _detach(value)  # shares the version counter: in-place writes show
            self.records.append((key, (kept_value, kept, _versions(kept_value))))
            return value
        if self._pos >= len(self.records) or self.records[self._pos][0] != key:
            recorded = (self.records[self._pos][0] if self._pos < len(self.records)
                        else "nothing more")
            raise RuntimeError(f"recompute without re-dispatch: the recomputed forward's EP "
                               f"collective #{self._pos} is {key}, the forward's was "
                               f"{recorded}; the recompute took another path than the forward")
        value, kept, versions = self.records[self._pos][1]
        if _versions(value) != versions:
            raise RuntimeError(f"recompute without re-dispatch: what EP collective {key} received "
                               "was modified in place after the forward; keep_all_to_all needs "
                               "the block to leave it unchanged (write out of place)")
        if kept is not None:  # the routing the recompute sends must be the forward's; checked
            # on the device, without a sync (CUDA: a device-side assert)
            assert_on_device((check.detach() == kept).all(), _DIVERGED.format(key=key))
        self._pos += 1
        return _detach(value)


_DIVERGED = ("recompute without re-dispatch: the recomputed forward routes other rows than the "
             "forward at EP collective {key} (a nondeterministic router?)")


def taped(key: tuple, issue: Callable[[], object], check: torch.Tensor | None = None):
    """``issue()``, recorded or replayed by the :class:`CommTape` of this thread's session;
    ``check`` (the counts it sends): a replay's must equal the recorded one's."""
    tape = getattr(_TAPE, "tape", None)
    return issue() if tape is None else tape.take(key, issue, check)


def swap_counts(send: torch.Tensor, group: dist.ProcessGroup
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(``recv``, the host copy of ``send`` and ``recv`` flattened, or None in a dry run):
    ``all_to_all_single`` of equal splits of ``send`` along dim 0, then the one device-to-host
    sync of a dispatch. Replayed by a :class:`CommTape`."""
    def issue():
        recv = torch.empty_like(send)
        with phase(EP_ALL_TO_ALL):
            comm_point(lambda async_op: dist.all_to_all_single(recv, send, group=group,
                                                               async_op=async_op),
                       hand_over=False)
        if is_fake(send):  # a dry run has no counts
            return recv, None
        host = torch.cat([send.reshape(-1), recv.reshape(-1)]).cpu()  # the sync
        for c in COUNTERS:
            c.count_exchanges += 1
            c.host_syncs += 1
        return recv, host

    return taped(("counts", tuple(send.shape)), issue, check=send)


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
               group: dist.ProcessGroup, kind: str = "tokens", wire: Wire = PLAIN
               ) -> torch.Tensor:
    """``all_to_all_single`` of rows (not differentiable). ``kind`` says how it is counted:
    "dispatch" (forward token rows), "tokens" (other token rows), "routing" or "weights".
    Inside a :class:`CommTape` session it is recorded (its output, on the wire's dtype) or
    replayed."""
    key = (kind, tuple(out_splits), tuple(in_splits), tuple(x.shape[1:]), x.dtype)
    return taped(key, lambda: _all_to_all(x, out_splits, in_splits, group, kind, wire))


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup, kind: str, wire: Wire) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    with phase(EP_ALL_TO_ALL):  # forward and backward; overlapped inside run_interleaved
        comm_point(lambda async_op: dist.all_to_all_single(out, x, out_splits, in_splits,
                                                           group=group, async_op=async_op),
                   nbytes=x.numel() * x.element_size())
    if COUNTERS:
        _count(x, in_splits, group, kind, wire)
    return out


def _count(x: torch.Tensor, in_splits: list[int], group: dist.ProcessGroup, kind: str,
           wire: Wire) -> None:
    me = dist.get_rank(group)
    rows = sum(in_splits) - in_splits[me]
    row_bytes = x[0:1].numel() * x.element_size() if x.dim() > 1 else x.element_size()
    rpn = wire.ranks_per_node
    far = (sum(n for r, n in enumerate(in_splits) if r // rpn != me // rpn) * row_bytes
           if rpn else 0)
    for c in COUNTERS:
        if kind == "weights":
            c.weight_all_to_alls += 1
            c.weight_bytes_sent += rows * row_bytes
        elif kind == "routing":
            c.routing_bytes_sent += rows * row_bytes
        else:
            c.all_to_alls += 1
            c.rows_sent += rows
            c.bytes_sent += rows * row_bytes
            c.inter_node_bytes_sent += far
            if kind == "dispatch":
                c.dispatch_bytes_sent += rows * row_bytes
                c.inter_node_dispatch_bytes_sent += far


class AllToAll(torch.autograd.Function):
    """Rows ``in_splits[r]`` go to rank r; ``out_splits[r]`` rows come from rank r. The
    backward sends the gradients back with the splits swapped (host lists, no sync), in their
    own dtype. With ``wire.float8`` the forward rows travel as :func:`quantize_rows` bytes."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, kind="tokens",  # type: ignore[override]
                wire=PLAIN):
        ctx.splits, ctx.group, ctx.kind, ctx.wire = (out_splits, in_splits), group, kind, wire
        if not wire.float8:
            return all_to_all(x, out_splits, in_splits, group, kind, wire)
        payload = all_to_all(quantize_rows(x), out_splits, in_splits, group, kind, wire)
        return dequantize_rows(payload, x.shape[1], x.dtype)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        kind = "tokens" if ctx.kind == "dispatch" else ctx.kind
        wire = Wire(ctx.wire.ranks_per_node)  # gradients stay in their dtype
        return (AllToAll.apply(grad, in_splits, out_splits, ctx.group, kind, wire),
                None, None, None, None, None)
