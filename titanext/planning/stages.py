"""What the configured pipeline schedule means for each pp rank.

The stages a rank holds, and the layers in them, come from the same functions the trainer
uses (:func:`titanext.config.degrees.layers_per_stage`,
:func:`titanext.schedules.pipeline_stage_ids`); micro-batches in flight and the bubble come from
replaying the schedule's own action lists in the simulator (:func:`titanext.schedules.simulate`),
with the micro-batch's forward, input-gradient and weight-gradient times as costs.

>>> pl = pipeline_layout("1F1B", pp=4, microbatches=8, n_layers=8)
>>> [r.layers for r in pl.ranks], pl.ranks[0].embedding, pl.ranks[3].head
([2, 2, 2, 2], True, True)
>>> sim = simulate_schedule("1F1B", pp=4, microbatches=8, stages_per_rank=1)
>>> round(sim.bubble_ratio, 4), sim.peak_activations     # (p-1)/(m+p-1), pp in flight
(0.2727, [4, 3, 2, 1])
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from titanext.config.degrees import layers_per_stage
from titanext.schedules import pipeline_stage_ids, resolved_stages_per_rank


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
    schedule: str
    pp: int
    stages_per_rank: int
    microbatches: int
    ranks: tuple[RankStages, ...]
    #: the schedule's cap on pending weight gradients (0: none; titanext.schedules.memory_cap)
    max_pending_weight_grads: int = 0


def pipeline_layout(schedule: str, *, pp: int, microbatches: int, n_layers: int,
                    stages_per_rank: int | None = None, first_stage_less_layers: int = 0,
                    last_stage_less_layers: int = 0,
                    layers_per_stage_explicit: tuple[int, ...] = (),
                   max_pending_weight_grads: int = 0) -> PipelineLayout:
    """Stages, blocks and sends of every pp rank under ``schedule`` (the trainer's placement)."""
    from titanext.schedules import get_schedule_class, num_stages_for, stage_owners

    spr = resolved_stages_per_rank(schedule, stages_per_rank) if pp > 1 else 1
    placement = get_schedule_class(schedule).placement if pp > 1 else "loop"
    # DualPipe's two copies each have pp stages (rank r holds r of one and pp-1-r of the other)
    n_stages = num_stages_for(placement, pp, spr)
    owner = stage_owners(placement, pp, spr)
    counts = layers_per_stage(n_layers, n_stages, first_stage_less_layers=first_stage_less_layers,
                              last_stage_less_layers=last_stage_less_layers,
                              explicit=list(layers_per_stage_explicit) or None,
                              stage_ranks=owner)
    ids = [pipeline_stage_ids(schedule, pp_rank=r, pp=pp, stages_per_rank=spr) if pp > 1 else [0]
           for r in range(pp)]
    # DualPipe: a copy's neighbouring stages always live on other ranks
    mirrored = placement == "dualpipe"
    starts = [sum(counts[:s]) for s in range(n_stages)]
    ranks = []
    for r, stages in enumerate(ids):
        # a stage sends forward to the next stage and backward to the previous one, unless the
        # neighbour lives on the same rank (the V's turn)
        sends = sum((s + 1 < n_stages and (mirrored or owner[s + 1] != r))
                    + (s > 0 and (mirrored or owner[s - 1] != r)) for s in stages)
        per_stage = tuple(tuple(range(starts[s], starts[s] + counts[s])) for s in stages)
        layer_ids = tuple(i for ids_s in per_stage for i in ids_s)
        ranks.append(RankStages(tuple(stages), len(layer_ids), 0 in stages,
                                n_stages - 1 in stages, sends, layer_ids, per_stage))
    return PipelineLayout(schedule, pp, spr, microbatches, tuple(ranks),
                          max_pending_weight_grads)


@functools.lru_cache(maxsize=1024)
def simulate_schedule(schedule: str, *, pp: int, microbatches: int, stages_per_rank: int,
                      f: float = 1.0, b: float = 1.0, w: float = 1.0, comm: float = 0.0,
                      max_pending_weight_grads: int = 0, a2a: float = 0.0,
                      a2a_b: float | None = None, overlap: bool = False):
    """:func:`titanext.schedules.simulate` of the action lists the trainer runs (a generated
    schedule's for equal costs, as the trainer builds it, unless it measures its own; capped
    at ``max_pending_weight_grads`` pending W's), with these costs; cached (the advice asks
    for the same ones often)."""
    from titanext.schedules import simulate

    return simulate(schedule, pp=pp, microbatches=microbatches, f=f, b=b, w=w, comm=comm,
                    stages_per_rank=stages_per_rank, runtime_order=True,
                    max_pending_weight_grads=max_pending_weight_grads, a2a=a2a, a2a_b=a2a_b,
                    overlap=overlap)


def simulate_times(layout: PipelineLayout, *, f: float, i: float, w: float, comm: float,
                   a2a: float = 0.0, a2a_i: float = 0.0, overlap: bool = False):
    """Replay ``layout``'s schedule with these per-micro-batch seconds (one rank's share;
    ``f`` and ``i`` without the expert-parallel all-to-all, which is ``a2a`` in F and
    ``a2a_i`` in I, hidden behind the paired chunk with ``overlap``).

    Returns (seconds of one pass of all micro-batches, the simulator's result, with
    ``a2a_exposed`` in seconds). Costs are normalised by ``f`` and rounded to 1% before
    simulating, so that similar layouts share a cached simulation.
    """
    def q(x: float) -> float:
        return round(x / f, 2)

    sim = simulate_schedule(layout.schedule, pp=layout.pp, microbatches=layout.microbatches,
                            stages_per_rank=layout.stages_per_rank, f=1.0, b=max(q(i), 0.01),
                            w=max(q(w), 0.01), comm=q(comm), a2a=q(a2a), a2a_b=q(a2a_i),
                            overlap=overlap,
                            max_pending_weight_grads=layout.max_pending_weight_grads)
    exposed = [x * f for x in sim.a2a_exposed]
    return sim.makespan * f, dataclasses.replace(sim, a2a_exposed=exposed)
