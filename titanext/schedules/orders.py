"""What a schedule runs and how it would run: its per-rank action lists (:func:`schedule_order`),
torch's check of them (:func:`validate_order`), their replay in the simulator (:func:`simulate`),
the micro-batches each rank holds at once (:func:`forwards_in_flight`) and the problems of
running a schedule with given settings (:func:`schedule_problems`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from titanext.schedules._torch_ir import B, F, I, W, check_actions, leaves, torch_pipeline_order
from titanext.schedules.memory_cap import CAPPABLE, capped_schedule_class
from titanext.schedules.overlap import OVERLAP_SCHEDULES, combined_order
from titanext.schedules.placement import num_stages_for, resolved_stages_per_rank
from titanext.schedules.registry import get_schedule_class
from titanext.schedules.simulator import ReplayProgram, SimResult, compile_order, replay
from titanext.schedules.zero_bubble import GeneratedSchedule

__all__ = ["Repetition", "fewest_repeating_microbatches", "forwards_in_flight",
           "schedule_order", "schedule_problems", "simulate", "validate_order"]


def validate_order(order: dict[int, list], *, pp: int, num_stages: int, microbatches: int
                   ) -> None:
    """torch's own check of per-rank compute lists (overlapped F&B pairs counted as their two
    actions); raises on an invalid schedule."""
    check_actions({r: [x for a in acts for x in leaves(a)] for r, acts in order.items()}, pp,
             num_stages, microbatches)


def schedule_order(name: str | type, *, pp: int, microbatches: int,
                   stages_per_rank: int | None = None, max_pending_weight_grads: int = 0,
                   **costs: float) -> dict[int, list]:
    """The compute action lists schedule ``name`` (a name, or a resolved class such as a
    :class:`~titanext.config.layout.PipelinePlan`'s) runs on each rank (what executes).

    Ours come from their generators (``costs`` feed Auto), torch's multi-stage ones from the
    ``pipeline_order`` torch builds; GPipe and 1F1B (single-stage runtimes without action
    lists) use their textbook orders. ``max_pending_weight_grads`` > 0 caps the deferred W's
    (:mod:`titanext.schedules.memory_cap`).
    """
    cls = get_schedule_class(name) if isinstance(name, str) else name
    if not costs:  # the same lists every time: built once per class (the planner asks often)
        order = _cached_order(cls, pp, microbatches, stages_per_rank, max_pending_weight_grads)
        return {r: list(acts) for r, acts in order.items()}
    return _order(cls, pp, microbatches, stages_per_rank, max_pending_weight_grads, **costs)


@functools.lru_cache(maxsize=256)
def _cached_order(cls, pp, microbatches, stages_per_rank, max_pending_weight_grads):
    return _order(cls, pp, microbatches, stages_per_rank, max_pending_weight_grads)


def _order(cls, pp, microbatches, stages_per_rank, max_pending_weight_grads, **costs):
    cls = capped_schedule_class(cls, max_pending_weight_grads)
    spr = resolved_stages_per_rank(cls, stages_per_rank)
    if hasattr(cls, "textbook_order"):
        return cls.textbook_order(pp, microbatches)
    if issubclass(cls, GeneratedSchedule):
        return (cls.with_costs(**costs) if costs else cls).order(pp, microbatches)
    if hasattr(cls, "generate"):
        return cls.generate(pp, microbatches)
    return torch_pipeline_order(cls, pp, microbatches, spr)


@functools.lru_cache(maxsize=256)
def forwards_in_flight(name: str | type, *, pp: int, microbatches: int,
                       stages_per_rank: int | None = None, max_pending_weight_grads: int = 0
                       ) -> tuple[int, ...] | None:
    """The most micro-batches each rank holds between a forward and its input-gradient
    backward (I or B), read off the rank's own action list: the same whatever the costs,
    since a rank runs its list in order. An overlapped F&B pair counts its backward first
    (the fewer). None for a schedule whose lists depend on measured costs (Auto).

    >>> forwards_in_flight("1F1B", pp=4, microbatches=8)
    (4, 3, 2, 1)
    """
    cls = get_schedule_class(name) if isinstance(name, str) else name
    if getattr(cls, "measures_costs", False):
        return None
    order = schedule_order(cls, pp=pp, microbatches=microbatches,
                           stages_per_rank=resolved_stages_per_rank(cls, stages_per_rank),
                           max_pending_weight_grads=max_pending_weight_grads)
    peaks = []
    for r in range(pp):
        live = peak = 0
        for a in order.get(r, ()):
            kinds = [x.computation_type for x in leaves(a)]
            live -= sum(k in (I, B) for k in kinds)
            live += sum(k == F for k in kinds)
            peak = max(peak, live)
        peaks.append(peak)
    return tuple(peaks)


@dataclass(frozen=True)
class Repetition:
    """Rank ``rank``'s action list at ``microbatches`` is its list at ``fewer`` with the
    ``period`` actions that end at action ``end`` (of the shorter list) repeated ``repeats``
    more times right after them; the repeated actions hold as many micro-batches, per stage
    and kind, when they end as when they begin. ``leaves``: the first and one-past-last leaf
    (single F, I, B or W; an overlapped pair has two) of the repeated actions."""

    rank: int
    microbatches: int
    fewer: int
    period: int
    end: int
    repeats: int
    leaves: tuple[int, int]


def _shape(actions: list) -> list[tuple]:
    """A rank's actions without their micro-batch indices: what they do, and to which stage."""
    return [tuple((x.computation_type, x.stage_index) for x in leaves(a)) for a in actions]


# what one action of each kind changes on its stage: (forwards in flight, pending W's)
_HELD = {F: (1, 0), I: (-1, 1), B: (-1, 0), W: (0, -1)}


def _balanced(shape: list[tuple]) -> bool:
    """Whether these actions leave every stage with the forwards (F - I - B) and pending
    weight gradients (I - W) they found."""
    net: dict[int, tuple[int, int]] = {}
    for action in shape:
        for kind, stage in action:
            fwd, w = net.get(stage, (0, 0))
            d_fwd, d_w = _HELD.get(kind, (0, 0))
            net[stage] = (fwd + d_fwd, w + d_w)
    return all(v == (0, 0) for v in net.values())


def _inside(block: list[tuple], before: list[tuple], after: list[tuple]) -> bool:
    """Whether every (kind, stage) of ``block`` also runs before and after it: a stage's first
    and last F, I, B or W (the first weight gradient creates the gradients, FSDP gathers
    first and reduces last) are not repeated."""
    kinds = {leaf for action in block for leaf in action}
    return all(any(k in a for a in before) and any(k in a for a in after) for k in kinds)


def _repetition(short: list[tuple], long: list[tuple]) -> tuple[int, int, int] | None:
    """(period, end, repeats) such that ``long`` is ``short`` with ``short[end - period:end]``
    repeated ``repeats`` more times at ``end``, the repeated actions balanced and inside
    (:func:`_inside`); the shortest period. None if there is none."""
    extra = len(long) - len(short)
    if extra <= 0:
        return None
    prefix = next((i for i, (a, b) in enumerate(zip(short, long)) if a != b), len(short))
    for period in range(1, extra + 1):
        if extra % period:
            continue
        for end in range(max(period, prefix - extra), min(prefix, len(short)) + 1):
            block = short[end - period:end]
            if (long == short[:end] + block * (extra // period) + short[end:]
                    and _balanced(block) and _inside(block, short[:end - period], short[end:])):
                return period, end, extra // period
    return None


def fewest_repeating_microbatches(name: str, *, pp: int, rank: int, microbatches: int,
                                  stages_per_rank: int | None = None,
                                  max_pending_weight_grads: int = 0, overlap: bool = False
                                  ) -> Repetition | None:
    """The fewest micro-batches whose action list on pp rank ``rank`` is the list at
    ``microbatches`` less whole repetitions of a balanced run of actions (the steady state),
    or None (no fewer count does, or the lists depend on measured costs, as Auto's do).

    With micro-batches of one shape, the rank's memory after the repeated run is what it was
    before it, so the longer list passes through the same memory states as the shorter one
    and peaks at the same bytes. The run holds no stage's first or last action of a kind
    (one-time effects: the first weight gradient creates the gradients; ZBV at 3 micro-batches
    of 12 repeated one and measured 2.9 MB less). What every micro-batch adds for the whole
    step (its inputs, its returned loss) is not in the lists. ``overlap``: the lists
    ``expert_parallel_comm_overlap`` runs (1F1B and Interleaved1F1B's combined pairs). The dry
    run steps this count.

    >>> fewest_repeating_microbatches("1F1B", pp=4, rank=1, microbatches=16).fewer
    5
    """
    cls = capped_schedule_class(get_schedule_class(name), max_pending_weight_grads)
    if getattr(cls, "measures_costs", False):
        return None
    spr = resolved_stages_per_rank(cls, stages_per_rank)

    def shape(m: int) -> list[tuple] | None:
        try:
            return _shape(_action_lists(cls, pp, m, spr, 0, overlap).get(rank, []))
        except Exception:  # a count the schedule cannot run (torch's checks, DualPipe's parity)
            return None

    full = shape(microbatches)
    for fewer in range(1, microbatches):
        if schedule_problems(name, pp=pp, microbatches=fewer, stages_per_rank=stages_per_rank,
                             max_pending_weight_grads=max_pending_weight_grads):
            continue
        short = shape(fewer)
        found = _repetition(short, full) if short and full else None
        if found:
            period, end, repeats = found
            first = sum(len(a) for a in short[:end - period])
            return Repetition(rank, microbatches, fewer, period, end, repeats,
                              (first, first + sum(len(a) for a in short[end - period:end])))
    return None


def simulate(name: str | type, *, pp: int, microbatches: int, f: float = 1.0, b: float = 1.0,
             w: float = 1.0, comm: float = 0.0, stages_per_rank: int | None = None,
             runtime_order: bool = False, max_pending_weight_grads: int = 0,
             a2a: float = 0.0, a2a_b: float | None = None, overlap: bool = False,
             comm_events: bool = True) -> SimResult:
    """Replay schedule ``name``'s action lists (a name, or a resolved class such as a
    :class:`~titanext.config.layout.PipelinePlan`'s) with these costs.

    ``f``, ``b`` (input grad I) and ``w`` (weight grad W) are the costs of one micro-batch
    through 1/pp of the model; a schedule with k stages per rank (same model) runs stages of
    cost f/k, and ``peak_memory`` counts activations in the same 1/pp units. A full backward
    B costs b + w. ``comm`` is the latency of each cross-rank send. A generated schedule's
    lists are generated for these costs; with ``runtime_order`` they are the lists the trainer
    runs instead (generated for equal costs, except Auto's, which the trainer measures).
    ``max_pending_weight_grads`` > 0: the lists capped as the trainer runs them
    (:func:`titanext.schedules.memory_cap.cap_pending_weight_grads`). ``f``, ``b``, ``w``,
    ``a2a`` and ``a2a_b`` may also be tuples of each stage's own cost, by stage index (the
    planner's stages: the first with the embedding, the last with the head, loss and MTP).

    ``a2a`` (``a2a_b``) is the expert-parallel all-to-all time of one micro-batch's F (I or B;
    default ``a2a``) through 1/pp of the model, exposed unless ``overlap`` runs the schedule as
    ``expert_parallel_comm_overlap`` does: the paired chunks interleaved (1F1B and
    Interleaved1F1B as their combined lists, :mod:`titanext.schedules.overlap`; a ValueError
    for a schedule without paired chunks). ``a2a_exposed`` says what each rank waited;
    ``comm_events=False``: no all-to-all lane (:func:`~titanext.schedules.simulator.replay`).

    >>> [round(sum(simulate("DualPipeV", pp=4, microbatches=16, a2a=0.5, overlap=o).a2a_exposed)
    ...        / 4, 2) for o in (False, True)]
    [16.0, 4.88]
    >>> r = simulate("1F1B", pp=4, microbatches=8)
    >>> round(r.bubble_ratio, 4), r.peak_activations
    (0.2727, [4, 3, 2, 1])
    """
    cls = get_schedule_class(name) if isinstance(name, str) else name
    spr = resolved_stages_per_rank(cls, stages_per_rank)
    share = 1.0 if cls.placement == "dualpipe" else 1.0 / spr
    def part(c):  # one figure is 1/pp of the model; a tuple is each stage's own cost
        return c if c is None or isinstance(c, tuple) else c * share

    costs = dict(f=part(f), b=part(b), w=part(w), comm=comm, a2a=part(a2a), a2a_b=part(a2a_b))
    if overlap and cls.__name__ not in OVERLAP_SCHEDULES:
        raise ValueError(f"schedule {cls.__name__!r} has no paired forward/backward chunks to "
                         f"overlap; choose one of {', '.join(OVERLAP_SCHEDULES)}")
    chain = num_stages_for(cls.placement, pp, spr)
    if runtime_order and not getattr(cls, "measures_costs", False):  # the same lists whatever
        program = _compiled_order(cls, pp, microbatches, spr, max_pending_weight_grads,  # the
                                  overlap)  # costs: worked out once (the planner asks often)
    else:
        program = _compile(cls, pp, microbatches, spr, max_pending_weight_grads, overlap,
                           dict(f=f, b=b, w=w, comm=comm))  # Auto: per-stage tuples as measured
    return replay(program, num_stages=chain, stage_size=share, overlap=overlap,
                  comm_events=comm_events, **costs)


def _compile(cls, pp: int, microbatches: int, spr: int, max_pending_weight_grads: int,
             overlap: bool, order_costs: dict) -> ReplayProgram:
    """The checked action lists :func:`simulate` replays (overlapped: 1F1B and Interleaved1F1B
    as their combined lists), compiled for :func:`~titanext.schedules.simulator.replay`."""
    order = _action_lists(cls, pp, microbatches, spr, max_pending_weight_grads, overlap,
                          **order_costs)
    chain = num_stages_for(cls.placement, pp, spr)
    if cls.placement != "dualpipe":
        validate_order(order, pp=pp, num_stages=chain, microbatches=microbatches)
    return compile_order(order, num_stages=chain, overlap=overlap)


def _action_lists(cls, pp: int, microbatches: int, spr: int, max_pending_weight_grads: int,
                  overlap: bool, **costs: float) -> dict[int, list]:
    """The lists a run of ``cls`` executes: :func:`schedule_order`'s, or with ``overlap`` 1F1B
    and Interleaved1F1B's combined lists (``expert_parallel_comm_overlap``)."""
    if overlap and cls.__name__ in ("1F1B", "Interleaved1F1B"):
        return combined_order(cls.__name__, pp, microbatches, spr)
    return schedule_order(cls, pp=pp, microbatches=microbatches, stages_per_rank=spr,
                          max_pending_weight_grads=max_pending_weight_grads, **costs)


@functools.lru_cache(maxsize=256)
def _compiled_order(cls, pp, microbatches, spr, max_pending_weight_grads, overlap):
    return _compile(cls, pp, microbatches, spr, max_pending_weight_grads, overlap, {})


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
