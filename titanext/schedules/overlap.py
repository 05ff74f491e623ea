"""Expert-parallel all-to-all overlap: which schedules pair a forward with a backward chunk.

With ``[parallelism] expert_parallel_comm_overlap = true`` a rank runs the two chunks of every
overlapped pair interleaved (:mod:`titanext.plugins._baton_threads`): each side's dispatch and
combine all-to-alls travel while the other side computes.

- **DualPipe, DualPipeV**: their steady state is made of such pairs already (OVERLAP_F_B
  actions); overlap switches their handler to the interleaved one.
- **1F1B, Interleaved1F1B** (Megatron's *combined 1F1B*): the steady state alternates a forward
  and a backward of different micro-batches; :func:`fuse_pairs` turns each such neighbour pair
  into one OVERLAP_F_B action (1F1B with more warm-up forwards: :func:`combined_order`), and
  :class:`CombinedOneFOneB` runs the lists on titanext's chain runtime (the receives of both
  chunks are waited before the pair, the sends follow it).

Any other schedule has no paired chunks: :func:`overlap_problems` says so at config load.

>>> " ".join(str(a) for a in combined_order("1F1B", 2, 6, 1)[1])
'1F0 (1F1;1B0)OVERLAP_F_B (1F2;1B1)OVERLAP_F_B (1F3;1B2)OVERLAP_F_B (1F4;1B3)OVERLAP_F_B \
(1F5;1B4)OVERLAP_F_B 1B5'
"""

from __future__ import annotations

from titanext.schedules._torch_ir import (
    OVERLAP,
    B,
    ChainRuntime,
    F,
    I,
    add_comms,
    microbatch_count,
    overlapped,
    require_overlap_seam,
    stages_of,
    torch_pipeline_order,
    torch_schedule_class,
)
from titanext.schedules.zero_bubble import one_f_one_b

__all__ = ["OVERLAP_SCHEDULES", "CombinedOneFOneB", "combined_order", "fuse_pairs",
           "overlap_problems", "overlap_schedule_class"]

#: schedules whose steady state pairs a forward chunk with a backward chunk on a rank
OVERLAP_SCHEDULES = ("1F1B", "Interleaved1F1B", "DualPipe", "DualPipeV")


def _pairable(a, b) -> bool:
    kinds = {a.computation_type, b.computation_type}
    return (OVERLAP not in kinds and F in kinds and bool(kinds & {B, I})
            and a.microbatch_index != b.microbatch_index)


def fuse_pairs(order: dict[int, list]) -> dict[int, list]:
    """Each rank's neighbouring (forward, backward) actions of different micro-batches, in
    either order, as one overlapped action (forward first in it); the rest unchanged."""
    out: dict[int, list] = {}
    for r, acts in order.items():
        fused, k = [], 0
        while k < len(acts):
            if k + 1 < len(acts) and _pairable(acts[k], acts[k + 1]):
                a, b = acts[k], acts[k + 1]
                fwd, bwd = (a, b) if a.computation_type == F else (b, a)
                fused.append(overlapped(fwd, bwd))
                k += 2
            else:
                fused.append(acts[k])
                k += 1
        out[r] = fused
    return out


def _alternate(order: dict[int, list], warmup) -> dict[int, list]:
    """Each rank's forwards and backwards, in their own orders, as ``warmup(r, w)`` forwards
    (``w``: the forwards before the rank's first backward in ``order``), then a forward and a
    backward in turn, then the remaining backwards."""
    out = {}
    for r, acts in order.items():
        fs = [a for a in acts if a.computation_type == F]
        bs = [a for a in acts if a.computation_type != F]
        first_b = next((i for i, a in enumerate(acts) if a.computation_type != F), len(acts))
        n = min(warmup(r, first_b), len(fs))
        rest, new = fs[n:], fs[:n]
        for k, b in enumerate(bs):
            new += [rest[k], b] if k < len(rest) else [b]
        out[r] = new
    return out


def combined_order(name: str, pp: int, microbatches: int, stages_per_rank: int) -> dict[int, list]:
    """The fused compute lists of ``name`` ("1F1B" or "Interleaved1F1B").

    A pair waits for both its receives first, so a rank's pair must not need a gradient that
    the next rank computes in the pair that needs this rank's previous forward: that would
    chain the ranks' pairs one after another. 1F1B therefore runs 2(pp-r-1)+1 warm-up forwards
    on rank r (1F1B: pp-r-1), which keeps 1F1B's makespan at zero all-to-all time (checked by
    :func:`titanext.schedules.simulate`) for up to pp-r more micro-batches in flight;
    Interleaved1F1B keeps torch's warm-up, its steady state as strict F/B turns."""
    if name == "1F1B":
        return fuse_pairs(_alternate(one_f_one_b(pp, microbatches), lambda r, w: 2 * w - 1))
    cls = torch_schedule_class("ScheduleInterleaved1F1B")
    base = torch_pipeline_order(cls, pp, microbatches, stages_per_rank)
    return fuse_pairs(_alternate(base, lambda r, w: w))


def _lowered(order: dict[int, list], pp: int, num_stages: int, microbatches: int) -> dict:
    """``order`` with its sends and receives; raises ValueError where a rank would wait for a
    message that only its own pair sends (the pair waits both receives first)."""
    return add_comms(order, lambda s, j: s % pp, num_stages, microbatches)


class CombinedOneFOneB(ChainRuntime):
    """1F1B or Interleaved1F1B (class attribute ``base``) with each steady-state forward and
    backward of different micro-batches overlapped. ``cls(stages, n_microbatches, loss_fn)``
    with this rank's loop-placed stages."""

    placement = "loop"
    splits_backward = False
    comm_overlap = True
    base = "1F1B"
    stages_per_rank: int | None = 1

    def __init__(self, stages, n_microbatches: int, loss_fn=None, **kwargs):
        super().__init__(stages=stages, n_microbatches=n_microbatches, loss_fn=loss_fn, **kwargs)
        pp = stages[0].group_size
        spr = len(stages)
        mapping = {s: s % pp for s in range(pp * spr)}
        for stage in stages:
            stage.stage_index_to_group_rank = mapping
        self.stage_index_to_group_rank = mapping
        self._install_handlers()
        order = combined_order(self.base, pp, n_microbatches, spr)
        self._set_lowered(order, _lowered(order, pp, pp * spr, n_microbatches))

    def _chain(self, s: int, j: int):
        mine = {st.stage_index for st in stages_of(self)}
        return (s - 1 if s - 1 in mine else None), (s + 1 if s + 1 in mine else None)

    def _seen(self, s: int) -> int:
        return microbatch_count(self)


def overlap_schedule_class(cls: type) -> type:
    """The class that runs schedule class ``cls`` (from ``get_schedule_class``) with its paired
    chunks interleaved at their all-to-alls. Raises ValueError for a schedule without paired
    chunks."""
    require_overlap_seam()
    if issubclass(cls, ChainRuntime):  # DualPipe / DualPipeV (titanext's)
        return type(cls.__name__, (cls,), {"comm_overlap": True, "__doc__": cls.__doc__})
    name = cls.__name__
    if name not in ("1F1B", "Interleaved1F1B") or not issubclass(
            cls, torch_schedule_class(f"Schedule{name}")):
        raise ValueError(f"schedule {name!r} has no paired forward/backward chunks to overlap; "
                         "expert_parallel_comm_overlap needs one of "
                         + ", ".join(OVERLAP_SCHEDULES))
    return type(f"Combined{name}", (CombinedOneFOneB,), {
        "base": name, "stages_per_rank": 1 if name == "1F1B" else None,
        "__doc__": CombinedOneFOneB.__doc__})


def overlap_problems(name: str, *, pp: int, microbatches: int, stages_per_rank: int) -> list[str]:
    """Why ``expert_parallel_comm_overlap`` cannot run schedule ``name`` here (one line each;
    empty: it can)."""
    key = "parallelism.expert_parallel_comm_overlap = true"
    if name not in OVERLAP_SCHEDULES:
        return [f"{key}: schedule {name!r} has no paired forward/backward chunks to overlap; "
                f"use one of {', '.join(OVERLAP_SCHEDULES)} or set it false"]
    if name in ("DualPipe", "DualPipeV") or pp < 2:
        return []
    order = combined_order(name, pp, microbatches, stages_per_rank)
    if not any(a.computation_type == OVERLAP for acts in order.values() for a in acts):
        return [f"{key}: {name} at pp = {pp} with {microbatches} micro-batches has no steady "
                "state (no forward next to a backward of another micro-batch); use more "
                "micro-batches or set it false"]
    try:
        _lowered(order, pp, pp * stages_per_rank, microbatches)
    except ValueError as e:
        return [f"{key}: the paired chunks of {name} cannot run at pp = {pp}, {microbatches} "
                f"micro-batches, {stages_per_rank} stage(s) per rank ({e}); set it false"]
    return []

