"""Where a schedule's stages live: how many stages each rank holds, which ones, and which rank
holds each stage, from the placement a schedule class declares ("loop", "v" or "dualpipe").

>>> pipeline_stage_ids("ZBV", pp_rank=1, pp=4)
[1, 6]
"""

from __future__ import annotations

from titanext.schedules.registry import get_schedule_class
from titanext.schedules.zero_bubble import stage_ids

__all__ = ["num_stages_for", "pipeline_stage_ids", "resolved_stages_per_rank",
           "stage_ids_for_rank", "stage_owners"]

_DEFAULT_INTERLEAVE = 2  # stages per rank of a configurable schedule when none is given


def stage_ids_for_rank(placement: str, rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """Global stage indices held by ``rank``, in the order to pass them to the schedule.

    loop: rank, rank + pp, ...; v: [rank, 2pp-1-rank]; dualpipe: [rank (down copy),
    pp-1-rank (up copy)] of the model's pp stages.
    """
    if placement == "dualpipe":
        return [rank, pp - 1 - rank]
    return stage_ids(placement, rank, pp, stages_per_rank)


def stage_owners(placement: str, pp: int, stages_per_rank: int) -> list[int]:
    """The pp rank that holds each of the model's stages (DualPipe: the down copy's, stage s on
    rank s; the up copy mirrors it, so both copies weigh the ranks alike).

    >>> stage_owners("v", 2, 2), stage_owners("loop", 2, 2)
    ([0, 1, 1, 0], [0, 1, 0, 1])
    """
    if placement == "dualpipe":
        return list(range(pp))
    owner = {s: r for r in range(pp) for s in stage_ids(placement, r, pp, stages_per_rank)}
    return [owner[s] for s in range(pp * stages_per_rank)]


def pipeline_stage_ids(schedule: str | type, *, pp_rank: int, pp: int,
                       stages_per_rank: int | None = None) -> list[int]:
    """Global stage indices held by ``pp_rank``, from the schedule's declared placement.

    >>> pipeline_stage_ids("1F1B", pp_rank=1, pp=4)
    [1]
    >>> pipeline_stage_ids("Interleaved1F1B", pp_rank=1, pp=4, stages_per_rank=2)
    [1, 5]
    """
    cls = get_schedule_class(schedule) if isinstance(schedule, str) else schedule
    n = resolved_stages_per_rank(cls, stages_per_rank)
    return stage_ids_for_rank(getattr(cls, "placement", "loop"), pp_rank, pp, n)


def num_stages_for(placement: str, pp: int, stages_per_rank: int) -> int:
    """How many stages the model is split into (DualPipe runs two copies of pp stages)."""
    return pp if placement == "dualpipe" else pp * stages_per_rank


def resolved_stages_per_rank(schedule: str | type, requested: int | None = None) -> int:
    """Stages each rank holds under ``schedule`` (a name or class): the class's own count, or
    ``requested`` where it has none (torch's interleaved schedules take any count >= 2; 2 when
    ``requested`` is None or <= 0). Raises ValueError for a count the schedule cannot run.

    >>> resolved_stages_per_rank("ZBV"), resolved_stages_per_rank("Interleaved1F1B", 4)
    (2, 4)
    """
    cls = get_schedule_class(schedule) if isinstance(schedule, str) else schedule
    own = getattr(cls, "stages_per_rank", 1)
    if own is None:
        n = requested if requested and requested > 0 else _DEFAULT_INTERLEAVE
        if n < 2:
            raise ValueError(f"{cls.__name__} needs stages_per_rank >= 2, got {n}")
        return n
    if requested and requested > 0 and requested != own:
        raise ValueError(f"{cls.__name__} places {own} stage(s) per rank; "
                         f"stages_per_rank = {requested} is not allowed (use -1 or {own})")
    return own
