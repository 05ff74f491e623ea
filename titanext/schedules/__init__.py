"""Pipeline schedules: torch's built-ins and titanext's generated ones, plus a simulator.

``get_schedule_class(name)`` returns a schedule class that torch's pipelining runtime
executes. Every class declares its stage placement (``placement``: "loop", "v" or
"dualpipe") and ``stages_per_rank`` (None: configurable), so callers place stages from data,
never from the schedule's name:

>>> cls = get_schedule_class("ZBV")
>>> cls.placement, cls.stages_per_rank, stage_ids_for_rank(cls.placement, 1, 4, 2)
('v', 2, [1, 6])

Ours (ZBH1, ZBH2, ZBV, Auto, DualPipe, DualPipeV) are per-rank action lists from
:mod:`~titanext.schedules.zero_bubble` and :mod:`~titanext.schedules.dualpipe`; the simulator
(:func:`simulate`) replays the very same lists, and for torch's multi-stage schedules the
lists torch builds:

>>> round(simulate("ZBH1", pp=4, microbatches=8).bubble_ratio, 4)   # (p-1)/(3m+p-1)
0.1111
"""

from __future__ import annotations

from titanext._hints import did_you_mean
from titanext.schedules import dualpipe, zero_bubble
from titanext.schedules._torch_ir import (
    check_actions,
    is_single_stage,
    leaves,
    no_self_warmup,
    torch_pipeline_order,
    torch_schedule_class,
)
from titanext.schedules.memory_cap import CAPPABLE, capped_schedule_class
from titanext.schedules.overlap import OVERLAP_SCHEDULES, combined_order
from titanext.schedules.simulator import SimResult, replay
from titanext.schedules.zero_bubble import (
    GeneratedSchedule,
    auto_schedule_class,
    one_f_one_b,
    stage_ids,
)

__all__ = ["SCHEDULE_NAMES", "SimResult", "auto_schedule_class", "build_schedule",
           "capped_schedule_class", "get_schedule_class", "leaves", "num_stages_for",
           "pipeline_stage_ids", "resolved_stages_per_rank",
           "schedule_order", "schedule_problems", "simulate", "stage_ids_for_rank", "stage_owners",
           "validate_order"]


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


def _zb(name: str, fn, placement: str = "loop", stages_per_rank: int = 1) -> type:
    return type(name, (GeneratedSchedule,), {
        "placement": placement, "stages_per_rank": stages_per_rank, "splits_backward": True,
        "generate": staticmethod(fn), "__doc__": fn.__doc__})


_OURS: dict[str, type] = {
    "ZBH1": _zb("ZBH1", zero_bubble.zbh1),
    "ZBH2": _zb("ZBH2", zero_bubble.zbh2),
    "ZBV": _zb("ZBV", zero_bubble.zbv, "v", 2),
    "DualPipe": dualpipe.DualPipe,
    "DualPipeV": dualpipe.DualPipeV,
    "Auto": zero_bubble.Auto,
}


def _gpipe_order(pp: int, m: int) -> dict[int, list]:
    from titanext.schedules._torch_ir import B, F, action
    return {r: [action(r, F, j) for j in range(m)] + [action(r, B, j) for j in range(m)]
            for r in range(pp)}


def _torch(cls_name: str, placement: str, stages_per_rank: int | None,
           splits_backward: bool = False, min_microbatches_per_stage: int = 0,
           min_microbatches_per_rank: int = 0, textbook_order=None) -> type | None:
    base = torch_schedule_class(cls_name)
    if base is None:
        return None
    attrs = {"placement": placement, "stages_per_rank": stages_per_rank,
             "splits_backward": splits_backward, "__doc__": base.__doc__,
             # checks torch makes only once it holds real stages (inside Trainer start-up)
             "min_microbatches_per_stage": min_microbatches_per_stage,
             "min_microbatches_per_rank": min_microbatches_per_rank}
    if textbook_order is not None:  # single-stage runtimes keep no action lists
        attrs["textbook_order"] = staticmethod(textbook_order)
    return type(cls_name.removeprefix("Schedule"), (base,), attrs)


_TORCH = {name: cls for name, cls in {
    "GPipe": _torch("ScheduleGPipe", "loop", 1, textbook_order=_gpipe_order),
    "1F1B": _torch("Schedule1F1B", "loop", 1, min_microbatches_per_stage=1,
                   textbook_order=one_f_one_b),
    "Interleaved1F1B": _torch("ScheduleInterleaved1F1B", "loop", None),
    "LoopedBFS": _torch("ScheduleLoopedBFS", "loop", None),
    "InterleavedZeroBubble": _torch("ScheduleInterleavedZeroBubble", "loop", None, True),
    "ZBVZeroBubble": _torch("ScheduleZBVZeroBubble", "v", 2, True),
    # torch's DualPipeV; "DualPipeV" is titanext's (overlapped F&B chunks)
    "TorchDualPipeV": _torch("ScheduleDualPipeV", "v", 2, True, min_microbatches_per_rank=2),
}.items() if cls is not None}

SCHEDULE_NAMES: tuple[str, ...] = (*_TORCH, *_OURS)
_SIMULATED = SCHEDULE_NAMES  # every schedule can be simulated
_BY_LOWER = {n.lower(): n for n in SCHEDULE_NAMES}
_DEFAULT_INTERLEAVE = 2  # stages per rank of a configurable schedule when none is given


def get_schedule_class(name: str) -> type:
    """The schedule class for ``name`` (torch's names and ours, any case).

    Raises ValueError listing the choices. Every class has ``placement``,
    ``stages_per_rank`` (None = configurable) and ``splits_backward`` (uses I/W actions).
    """
    canonical = _BY_LOWER.get(name.lower()) if isinstance(name, str) else None
    if canonical is None:
        hint = did_you_mean(name, SCHEDULE_NAMES)
        raise ValueError(f"pipeline schedule {name!r} is not known{hint}"
                         f"; choose one of {', '.join(SCHEDULE_NAMES)}")
    return _OURS.get(canonical) or _TORCH[canonical]


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


def build_schedule(schedule: str | type, stages: list, n_microbatches: int, loss_fn=None, *,
                   costs: dict[str, float] | None = None, **kwargs):
    """The schedule ``schedule`` (a name or class) over this rank's ``PipelineStage`` objects.

    torch's single-stage GPipe / 1F1B take the one stage object, every other class the list.
    ``costs`` (f, b, w, comm) regenerate a schedule that uses them (Auto) for measured times;
    ``kwargs`` go to the constructor (e.g. ``scale_grads=False``). The one schedule factory:
    :func:`titanext.distributed.pipeline.build_pipeline` and the trainer's pipeline call it.

    >>> # schedule = build_schedule("ZBH1", [stage], 8, loss_fn=loss_fn, scale_grads=False)
    """
    cls = get_schedule_class(schedule) if isinstance(schedule, str) else schedule
    if costs is not None and hasattr(cls, "with_costs"):  # generated for measured costs (Auto)
        cls = cls.with_costs(**costs)
    no_self_warmup(stages)
    if is_single_stage(cls):
        if len(stages) != 1:
            raise ValueError(f"{cls.__name__} runs one stage per rank, got {len(stages)}")
        return cls(stages[0], n_microbatches, loss_fn=loss_fn, **kwargs)
    return cls(list(stages), n_microbatches, loss_fn=loss_fn, **kwargs)


def validate_order(order: dict[int, list], *, pp: int, num_stages: int, microbatches: int
                   ) -> None:
    """torch's own check of per-rank compute lists (overlapped F&B pairs counted as their two
    actions); raises on an invalid schedule."""
    check_actions({r: [x for a in acts for x in leaves(a)] for r, acts in order.items()}, pp,
             num_stages, microbatches)


def schedule_order(name: str, *, pp: int, microbatches: int, stages_per_rank: int | None = None,
                   max_pending_weight_grads: int = 0, **costs: float) -> dict[int, list]:
    """The compute action lists schedule ``name`` runs on each rank (what executes).

    Ours come from their generators (``costs`` feed Auto), torch's multi-stage ones from the
    ``pipeline_order`` torch builds; GPipe and 1F1B (single-stage runtimes without action
    lists) use their textbook orders. ``max_pending_weight_grads`` > 0 caps the deferred W's
    (:mod:`titanext.schedules.memory_cap`).
    """
    cls = capped_schedule_class(get_schedule_class(name), max_pending_weight_grads)
    spr = resolved_stages_per_rank(cls, stages_per_rank)
    if hasattr(cls, "textbook_order"):
        return cls.textbook_order(pp, microbatches)
    if issubclass(cls, GeneratedSchedule):
        return (cls.with_costs(**costs) if costs else cls).order(pp, microbatches)
    if hasattr(cls, "generate"):
        return cls.generate(pp, microbatches)
    return torch_pipeline_order(cls, pp, microbatches, spr)


def simulate(name: str, *, pp: int, microbatches: int, f: float = 1.0, b: float = 1.0,
             w: float = 1.0, comm: float = 0.0, stages_per_rank: int | None = None,
             runtime_order: bool = False, max_pending_weight_grads: int = 0,
             a2a: float = 0.0, a2a_b: float | None = None, overlap: bool = False) -> SimResult:
    """Replay schedule ``name``'s action lists with these costs.

    ``f``, ``b`` (input grad I) and ``w`` (weight grad W) are the costs of one micro-batch
    through 1/pp of the model; a schedule with k stages per rank (same model) runs stages of
    cost f/k, and ``peak_memory`` counts activations in the same 1/pp units. A full backward
    B costs b + w. ``comm`` is the latency of each cross-rank send. A generated schedule's
    lists are generated for these costs; with ``runtime_order`` they are the lists the trainer
    runs instead (generated for equal costs, except Auto's, which the trainer measures).
    ``max_pending_weight_grads`` > 0: the lists capped as the trainer runs them
    (:func:`titanext.schedules.memory_cap.cap_pending_weight_grads`).

    ``a2a`` (``a2a_b``) is the expert-parallel all-to-all time of one micro-batch's F (I or B;
    default ``a2a``) through 1/pp of the model, exposed unless ``overlap`` runs the schedule as
    ``expert_parallel_comm_overlap`` does: the paired chunks interleaved (1F1B and
    Interleaved1F1B as their combined lists, :mod:`titanext.schedules.overlap`; a ValueError
    for a schedule without paired chunks). ``a2a_exposed`` says what each rank waited.

    >>> [round(sum(simulate("DualPipeV", pp=4, microbatches=16, a2a=0.5, overlap=o).a2a_exposed)
    ...        / 4, 2) for o in (False, True)]
    [16.0, 4.88]
    >>> r = simulate("1F1B", pp=4, microbatches=8)
    >>> round(r.bubble_ratio, 4), r.peak_activations
    (0.2727, [4, 3, 2, 1])
    """
    cls = get_schedule_class(name)
    spr = resolved_stages_per_rank(cls, stages_per_rank)
    share = 1.0 if cls.placement == "dualpipe" else 1.0 / spr
    costs = dict(f=f * share, b=b * share, w=w * share, comm=comm, a2a=a2a * share,
                 a2a_b=None if a2a_b is None else a2a_b * share)
    order_costs = ({} if runtime_order and not getattr(cls, "measures_costs", False)
                   else dict(f=f, b=b, w=w, comm=comm))
    if overlap and cls.__name__ in ("1F1B", "Interleaved1F1B"):
        order = combined_order(cls.__name__, pp, microbatches, spr)
    elif overlap and cls.__name__ not in OVERLAP_SCHEDULES:
        raise ValueError(f"schedule {name!r} has no paired forward/backward chunks to overlap; "
                         f"choose one of {', '.join(OVERLAP_SCHEDULES)}")
    else:
        order = schedule_order(name, pp=pp, microbatches=microbatches, stages_per_rank=spr,
                               max_pending_weight_grads=max_pending_weight_grads, **order_costs)
    chain = num_stages_for(cls.placement, pp, spr)
    if cls.placement != "dualpipe":
        validate_order(order, pp=pp, num_stages=chain, microbatches=microbatches)
    return replay(order, num_stages=chain, stage_size=share, overlap=overlap, **costs)


def schedule_problems(name: str, *, pp: int, microbatches: int,
                      stages_per_rank: int | None = None, compiled: bool = False,
                      max_pending_weight_grads: int = 0) -> list[str]:
    """Config problems of running schedule ``name`` with these settings (one line each).

    >>> schedule_problems("DualPipe", pp=4, microbatches=6)[0]
    'parallelism.pipeline_parallel_microbatches = 6: DualPipe needs an even number >= 2 x pp = 8'
    """
    key = "parallelism.pipeline_parallel"
    try:
        cls = get_schedule_class(name)
    except ValueError as e:
        return [f"{key}_schedule = {name!r}: {e}"]
    problems = []
    cap = max_pending_weight_grads
    if cap > 0 and cls.__name__ not in CAPPABLE:  # a negative cap is the key's own check
        problems.append(f"{key}_max_pending_weight_grads = {cap} needs a schedule whose W's "
                        f"titanext places ({', '.join(CAPPABLE)}), not {name!r}; or set it to 0 "
                        "(no cap)")
    if cls.stages_per_rank is not None and stages_per_rank not in (None, cls.stages_per_rank):
        problems.append(f"{key}_stages_per_rank = {stages_per_rank}: schedule {name!r} places "
                        f"exactly {cls.stages_per_rank} stage(s) per rank; remove the key")
        spr = cls.stages_per_rank
    else:
        try:
            spr = resolved_stages_per_rank(cls, stages_per_rank)
        except ValueError as e:
            return [f"{key}_stages_per_rank = {stages_per_rank}: {e}"]
    if microbatches < 1:
        problems.append(f"{key}_microbatches = {microbatches} must be >= 1")
    elif cls.placement == "dualpipe" and pp % 2:
        problems.append(f"{key}_degree = {pp}: DualPipe needs an even degree (mirrored pairs)")
    elif cls.placement == "dualpipe" and (microbatches < 2 * pp or microbatches % 2):
        problems.append(f"{key}_microbatches = {microbatches}: DualPipe needs an even number "
                        f">= 2 x pp = {2 * pp}")
    elif microbatches < getattr(cls, "min_microbatches_per_rank", 0) * pp:
        need = cls.min_microbatches_per_rank
        problems.append(f"{key}_microbatches = {microbatches}: {cls.__name__} needs >= {need} x pp "
                        f"= {need * pp}")
    elif microbatches < getattr(cls, "min_microbatches_per_stage", 0) * pp * spr:
        problems.append(f"{key}_microbatches = {microbatches}: {name} needs at least one "
                        f"micro-batch per stage ({pp * spr})")
    elif pp > 1:
        try:
            schedule_order(name, pp=pp, microbatches=microbatches, stages_per_rank=spr)
        except Exception as e:  # torch's own constructor checks, e.g. m vs pp for interleaving
            problems.append(f"{key}_microbatches = {microbatches} does not fit schedule "
                            f"{name!r} at pp = {pp}, {spr} stage(s) per rank: {e}")
    if compiled and cls.splits_backward:
        problems.append(f"{key}_schedule = {name!r} splits the backward into input and weight "
                        "gradients, which torch does not support on torch.compile'd stages; "
                        "set compile.enable = false or use 1F1B / Interleaved1F1B / GPipe")
    return problems
