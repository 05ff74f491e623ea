"""The one place that touches torch.distributed.pipelining's private schedule IR.

torch executes custom schedules given as per-rank lists of ``_Action`` (stage, kind,
micro-batch); it inserts the send/recv actions itself (``_add_send_recv``) and validates lists
(``_validate_schedule``). These names are private but stable across torch 2.11-2.13; every use
goes through this module so a rename is fixed here only.
"""

from __future__ import annotations

from torch.distributed.pipelining import schedules as _s

Action = _s._Action
Kind = _s._ComputationType
F, I, W, B = Kind.FORWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT, Kind.FULL_BACKWARD  # noqa: E741
COMPUTE_KINDS = (F, I, W, B)


def action(stage: int, kind: Kind, microbatch: int) -> Action:
    return Action(stage, kind, microbatch)


def with_comms(compute: dict[int, list], stage_to_rank, num_stages: int) -> dict[int, list]:
    """Add torch's send/recv actions to compute-only per-rank lists."""
    return _s._add_send_recv(compute, stage_to_rank=stage_to_rank, num_stages=num_stages)


def validate(compute: dict[int, list], pp: int, num_stages: int, microbatches: int) -> None:
    """torch's own check of a compute-only schedule (raises on an invalid one)."""
    _s._validate_schedule(compute, pp, num_stages, microbatches)
