"""Expert parallelism's differentiable all-to-all and its opt-in traffic counters.

Shared by :mod:`titanext.plugins.expert_parallel` (token dispatch / combine) and
:mod:`titanext.plugins.expert_replication` (hot-expert weight copies), which re-export
:class:`CommCounter` and :func:`count_comm` through ``expert_parallel``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titanext._profiler_ranges import EP_ALL_TO_ALL, phase
from titanext.plugins._baton_threads import comm_point
from titanext.plugins._counting import Counters

__all__ = ["CommCounter", "count_comm"]


@dataclass
class CommCounter:
    """What this rank sent to *other* ranks in the EP all-to-alls (forward and backward).

    ``all_to_alls`` / ``rows_sent`` / ``bytes_sent``: token rows (dispatch and combine);
    ``weight_all_to_alls`` / ``weight_bytes_sent``: hot-expert copies (their weights forward,
    their gradients back in backward); ``replicas``: expert copies planned by this rank's
    dispatches; ``count_exchanges`` / ``host_syncs``: per dispatch.
    """

    all_to_alls: int = 0
    rows_sent: int = 0
    bytes_sent: int = 0
    count_exchanges: int = 0
    host_syncs: int = 0
    replicas: int = 0
    weight_all_to_alls: int = 0
    weight_bytes_sent: int = 0


COUNTERS = Counters(CommCounter)


def count_comm() -> contextlib.AbstractContextManager[CommCounter]:
    """Count EP traffic issued inside the block (tests and ``benchmarks/moe_dispatch.py``)."""
    return COUNTERS.open()


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
               group: dist.ProcessGroup, weights: bool = False) -> torch.Tensor:
    """``all_to_all_single`` of rows (not differentiable; counted as token or weight bytes)."""
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    with phase(EP_ALL_TO_ALL):  # forward and backward; overlapped inside run_interleaved
        comm_point(lambda async_op: dist.all_to_all_single(out, x, out_splits, in_splits,
                                                           group=group, async_op=async_op),
                   nbytes=x.numel() * x.element_size())
    if COUNTERS:
        me = dist.get_rank(group)
        rows = sum(in_splits) - in_splits[me]
        row_bytes = x[0:1].numel() * x.element_size() if x.dim() > 1 else x.element_size()
        for c in COUNTERS:
            if weights:
                c.weight_all_to_alls += 1
                c.weight_bytes_sent += rows * row_bytes
            else:
                c.all_to_alls += 1
                c.rows_sent += rows
                c.bytes_sent += rows * row_bytes
    return out


class AllToAll(torch.autograd.Function):
    """Rows ``in_splits[r]`` go to rank r; ``out_splits[r]`` rows come from rank r. The
    backward sends the gradients back with the splits swapped (host lists, no sync)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, weights=False):  # type: ignore[override]
        ctx.splits, ctx.group, ctx.weights = (out_splits, in_splits), group, weights
        return all_to_all(x, out_splits, in_splits, group, weights)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        return (AllToAll.apply(grad, in_splits, out_splits, ctx.group, ctx.weights),
                None, None, None, None)
