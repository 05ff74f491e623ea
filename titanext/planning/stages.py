"""What the configured pipeline schedule means for each pp rank.

The stages a rank holds, and the layers in them, are the job's resolved
:class:`~titanext.config.layout.PipelinePlan`, the one the trainer runs; micro-batches in flight
and the bubble come from replaying the schedule's own action lists in the simulator
(:func:`titanext.schedules.simulate`), with the micro-batch's forward, input-gradient and
weight-gradient times as costs.

>>> from titanext.config.layout import pipeline_plan
>>> pl = pipeline_layout(pipeline_plan("1F1B", pp=4, microbatches=8, n_layers=8))
>>> [r.layers for r in pl.ranks], pl.ranks[0].embedding, pl.ranks[3].head
([2, 2, 2, 2], True, True)
>>> sim = simulate_schedule("1F1B", pp=4, microbatches=8, stages_per_rank=1)
>>> round(sim.bubble_ratio, 4), sim.peak_activations     # (p-1)/(m+p-1), pp in flight
(0.2727, [4, 3, 2, 1])
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

from titanext.config.layout import PipelinePlan, pipeline_plan


@dataclass(frozen=True)
class RankStages:
    """One pp rank: its stage indices, their blocks, whether it runs the embedding (stage 0)
    or the head (the last stage), and its cross-rank sends per micro-batch (forward + backward)."""

    stages: tuple[int, ...]
    layers: int
    embedding: bool
    head: bool
    sends: int
    layer_ids: tuple[int, ...] = ()  # the model's block indices in this rank's stages
    stage_layer_ids: tuple[tuple[int, ...], ...] = ()  # the same, stage by stage


@dataclass(frozen=True)
class PipelineLayout:
    schedule: type
    """The class the trainer runs (the plan's: capped at its ``max_pending_weight_grads``;
    1F1B's over one rank without a pipeline)."""
    name: str
    """The schedule as the config names it."""
    pp: int
    stages_per_rank: int
    microbatches: int
    ranks: tuple[RankStages, ...]

    @property
    def max_pending_weight_grads(self) -> int:
        """The schedule's cap on pending weight gradients (0: none;
        titanext.schedules.memory_cap), held by its class."""
        return getattr(self.schedule, "max_pending_weight_grads", 0)


@functools.lru_cache(maxsize=1024)
def pipeline_layout(plan: PipelinePlan) -> PipelineLayout:
    """Stages, blocks and sends of every pp rank of the job's resolved pipeline ``plan``
    (:func:`titanext.config.layout.pipeline_plan`: the trainer's placement and split); cached
    (a frozen plan, its frozen layout: the advice resolves many layouts of one pipeline)."""
    n_stages, owner, pp = plan.num_stages, plan.stage_owners, plan.pp
    counts = plan.layers_per_stage
    # DualPipe: a copy's neighbouring stages always live on other ranks
    mirrored = plan.mirrored
    starts = [sum(counts[:s]) for s in range(n_stages)]
    ranks = []
    for r in range(pp):
        stages = plan.stage_ids(r)
        # a stage sends forward to the next stage and backward to the previous one, unless the
        # neighbour lives on the same rank (the V's turn)
        sends = sum((s + 1 < n_stages and (mirrored or owner[s + 1] != r))
                    + (s > 0 and (mirrored or owner[s - 1] != r)) for s in stages)
        per_stage = tuple(tuple(range(starts[s], starts[s] + counts[s])) for s in stages)
        layer_ids = tuple(i for ids_s in per_stage for i in ids_s)
        ranks.append(RankStages(tuple(stages), len(layer_ids), 0 in stages,
                                n_stages - 1 in stages, sends, layer_ids, per_stage))
    if pp == 1:  # one stage without a pipeline: simulated as 1F1B over one rank
        plan = pipeline_plan("1F1B", pp=1, microbatches=plan.microbatches)
    return PipelineLayout(plan.schedule, plan.name, pp, plan.stages_per_rank,
                          plan.microbatches, tuple(ranks))


@functools.lru_cache(maxsize=1024)
def simulate_schedule(schedule: str | type, *, pp: int, microbatches: int, stages_per_rank: int,
                      f: float = 1.0, b: float = 1.0, w: float = 1.0, comm: float = 0.0,
                      max_pending_weight_grads: int = 0, a2a: float = 0.0,
                      a2a_b: float | None = None, overlap: bool = False):
    """:func:`titanext.schedules.simulate` of the action lists the trainer runs (a generated
    schedule's for equal costs, as the trainer builds it, unless it measures its own; capped
    at ``max_pending_weight_grads`` pending W's), with these costs; cached (the advice asks
    for the same ones often). The all-to-alls' lane (``comm_events``) is left out: the
    planner reads only the figures and the compute events."""
    # the planner loads without torch and the training runtime until it needs them
    from titanext.schedules import simulate

    return simulate(schedule, pp=pp, microbatches=microbatches, f=f, b=b, w=w, comm=comm,
                    stages_per_rank=stages_per_rank, runtime_order=True,
                    max_pending_weight_grads=max_pending_weight_grads, a2a=a2a, a2a_b=a2a_b,
                    overlap=overlap, comm_events=False)


def simulate_times(layout: PipelineLayout, *, f, i, w, comm: float, a2a=0.0, a2a_i=0.0,
                   overlap: bool = False):
    """Replay ``layout``'s schedule with these per-micro-batch seconds: one figure for every
    rank's share, or a tuple of each stage's own seconds by stage index (the first stage
    with the embedding, the last with the head, loss and MTP); ``f`` and ``i`` without the
    expert-parallel all-to-all, which is ``a2a`` in F and ``a2a_i`` in I, hidden behind the
    paired chunk with ``overlap``.

    Returns (seconds of one pass of all micro-batches, the simulator's result with
    ``a2a_exposed`` in seconds, and the seconds of one unit of its events' times). Costs are
    normalised by the largest F and rounded to 1% before simulating, so that similar layouts
    share a cached simulation; the events stay in those units (their order and proportions
    are all the memory replay reads; rescaling every event of a long schedule cost the 671B's
    advice 11 s).
    """
    unit = max(f) if isinstance(f, tuple) else f

    def q(x, floor: float = 0.0):
        if isinstance(x, tuple):
            return tuple(max(round(v / unit, 2), floor) for v in x)
        return max(round(x / unit, 2), floor)

    sim = simulate_schedule(layout.schedule, pp=layout.pp, microbatches=layout.microbatches,
                            stages_per_rank=layout.stages_per_rank, f=q(f), b=q(i, 0.01),
                            w=q(w, 0.01), comm=q(comm), a2a=q(a2a), a2a_b=q(a2a_i),
                            overlap=overlap)
    return sim.makespan * unit, dataclasses.replace(
        sim, a2a_exposed=[x * unit for x in sim.a2a_exposed]), unit


def recv_intervals(r: int, stages, events_by_rank, by_key) -> tuple[list[float], list[float]]:
    """The sorted posted and freed times of rank ``r``'s receive buffers for ``stages``: a
    micro-batch's input activation from another rank from its sender's F start to the end of
    this stage's I or B (the sender's start: torch posts a receive about one chunk before it
    can land), its output gradient likewise from its sender's I or B. A buffer counts at an
    event of the rank that ends in ``[posted, freed)``, the I or B that frees it included
    (freed: a tiny bit later); a buffer freed before it is posted never counts. ``by_key``:
    every rank's F, I and B events by (stage, "F" or "IB", micro-batch)."""
    posts, frees = [], []
    for e in events_by_rank.get(r, ()):
        if (e.kind != "I" and e.kind != "B") or e.stage not in stages:
            continue
        s, j, freed = e.stage, e.microbatch, e.end + 1e-9 * max(1.0, e.end)
        for sender in (by_key.get((s - 1, "F", j)), by_key.get((s + 1, "IB", j))):
            if sender is not None and sender.rank != r and sender.start < freed:
                posts.append(sender.start)
                frees.append(freed)
    return sorted(posts), sorted(frees)


def events_by_rank(events, program=None) -> tuple[dict, Callable]:
    """(each rank's events in execution order, ``recv(r, stages)``: :func:`recv_intervals` of
    rank ``r``) of a simulated schedule. With the ``program`` it was replayed from
    (``SimResult.program``), which fixes the events' order whatever the costs, who sends
    what to whom is looked up once per program instead of once per simulation."""
    if program is None:
        by_rank: dict[int, list] = {}
        by_key = {}  # (stage, "F" or "IB", micro-batch): its event, the last of those alike
        for e in events:
            rank_events = by_rank.get(e.rank)
            if rank_events is None:
                by_rank[e.rank] = rank_events = []
            rank_events.append(e)
            if e.kind != "W":
                by_key[e.stage, "F" if e.kind == "F" else "IB", e.microbatch] = e
        return by_rank, lambda r, stages: recv_intervals(r, stages, by_rank, by_key)
    index = _program_index(program, events)
    if len(index.events) != len(events):  # not this program's events after all
        return events_by_rank(events)

    def recv(r: int, stages) -> tuple[list[float], list[float]]:
        posts, frees = [], []
        for sent, got in index.pairs(r, stages):
            start, end = events[sent].start, events[got].end
            freed = end + 1e-9 * max(1.0, end)  # recv_intervals's
            if start < freed:
                posts.append(start)
                frees.append(freed)
        return sorted(posts), sorted(frees)

    return {r: [events[i] for i in at] for r, at in index.by_rank.items()}, recv


class _ProgramIndex:
    """Positions in a program's event list: each rank's, and each receive's sender."""

    def __init__(self, events):
        self.by_rank: dict[int, list[int]] = {}
        self.by_key: dict[tuple, int] = {}  # as events_by_rank's, by position
        self.events = [(e.rank, e.stage, e.kind, e.microbatch) for e in events]
        for n, (r, s, kind, j) in enumerate(self.events):
            self.by_rank.setdefault(r, []).append(n)
            if kind != "W":
                self.by_key[s, "F" if kind == "F" else "IB", j] = n
        self._pairs: dict[tuple, list[tuple[int, int]]] = {}

    def pairs(self, r: int, stages) -> list[tuple[int, int]]:
        """(sender, receiver) positions of rank ``r``'s receives for ``stages``, in
        :func:`recv_intervals`'s order."""
        key = (r, tuple(stages))
        if key not in self._pairs:
            out = []
            for n in self.by_rank.get(r, ()):
                _, s, kind, j = self.events[n]
                if (kind != "I" and kind != "B") or s not in stages:
                    continue
                for sender in (self.by_key.get((s - 1, "F", j)),
                               self.by_key.get((s + 1, "IB", j))):
                    if sender is not None and self.events[sender][0] != r:
                        out.append((sender, n))
            self._pairs[key] = out
        return self._pairs[key]


def _program_index(program, events) -> _ProgramIndex:
    """``program``'s index, made from the first events replayed from it (their order is the
    program's, whatever the costs) and kept in its ``derived``."""
    index = program.derived.get("planner index")
    if index is None:
        index = program.derived["planner index"] = _ProgramIndex(events)
    return index
