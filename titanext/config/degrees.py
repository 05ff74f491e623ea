"""The layout arithmetic: rules over plain ints that the config, ParallelDims, the pipeline and
the planner all call, so each is written once (:mod:`titanext.config.rules` re-exports them).

>>> resolve_dp_shard(dp_replicate=1, dp_shard=-1, cp=1, tp=2, pp=1, world_size=8)
4
>>> accumulation_steps(global_batch_size=64, local_batch_size=8, dp_shard=4)
2
>>> resolve_microbatches(pp=4, requested=-1, local_batch_size=4)
4
"""

from __future__ import annotations

from collections.abc import Sequence

from titanext.errors import ConfigError

__all__ = ["accumulation_steps", "batch_problem", "degree_problems", "ep_layout_problem",
           "layers_per_stage", "mesh_dims", "resolve_dp_shard", "resolve_microbatches"]


# -- parallel degrees (plain ints: ParallelDims calls these too) ----------------------------------

_DEGREE_KEYS = ("data_parallel_replicate_degree", "data_parallel_shard_degree",
                "context_parallel_degree", "tensor_parallel_degree", "pipeline_parallel_degree")


def resolve_dp_shard(*, dp_replicate: int, dp_shard: int, cp: int, tp: int, pp: int,
                     world_size: int | None) -> int:
    """dp_shard with -1 resolved to the rest of ``world_size``; ConfigError if they do not fit.

    The one place the degree product is checked. Without a world size only -1 -> 1 is done.
    Positive degrees are assumed.
    """
    others = dp_replicate * cp * tp * pp
    if world_size is None:
        return 1 if dp_shard == -1 else dp_shard

    def spelled(shard: int | None) -> str:
        values = (dp_replicate, shard, cp, tp, pp)
        return " x ".join(f"{k}({v})" for k, v in zip(_DEGREE_KEYS, values) if v is not None)

    if dp_shard == -1:
        if world_size % others:
            raise ConfigError([
                f"parallelism.data_parallel_shard_degree = -1 cannot fill the rest of the world "
                f"size {world_size}: it is not divisible by {spelled(None)} = {others}"])
        return world_size // others
    if dp_shard * others != world_size:
        raise ConfigError([
            f"parallelism degrees multiply to {dp_shard * others}, not the world size "
            f"{world_size}: {spelled(dp_shard)} = {dp_shard * others}; set "
            "data_parallel_shard_degree = -1 to fill the rest"])
    return dp_shard


def mesh_dims(*, pp: int, dp_replicate: int, dp_shard: int, cp: int, tp: int, ep: int = 1,
              cp_ulysses: int = 1) -> tuple[tuple[str, int], ...]:
    """The world mesh's named dims and their sizes, outermost first (size-1 dims kept):
    ``pp, dp_replicate, dp_shard, cp, tp``. Expert parallelism splits ``dp_shard`` into
    ``dp_shard_mod_ep x dp_shard_in_ep`` (it borrows ``dp_shard_in_ep x cp`` ranks); hybrid
    Ulysses splits ``cp`` into ``cp_ring x cp_ulysses``. ``dp_shard`` resolved.

    >>> [n for n, _ in mesh_dims(pp=1, dp_replicate=1, dp_shard=4, cp=2, tp=1, ep=4)]
    ['pp', 'dp_replicate', 'dp_shard_mod_ep', 'dp_shard_in_ep', 'cp', 'tp']
    """
    cp_dims = ((("cp_ring", cp // cp_ulysses), ("cp_ulysses", cp_ulysses)) if cp_ulysses > 1
               else (("cp", cp),))
    if ep > 1:
        problem = ep_layout_problem(ep=ep, cp=cp, dp_shard=dp_shard)
        if problem:
            raise ValueError(problem)
        in_ep = ep // cp
        shard_dims = (("dp_shard_mod_ep", dp_shard // in_ep), ("dp_shard_in_ep", in_ep))
    else:
        shard_dims = (("dp_shard", dp_shard),)
    return (("pp", pp), ("dp_replicate", dp_replicate), *shard_dims, *cp_dims, ("tp", tp))


def ep_layout_problem(*, ep: int, cp: int, dp_shard: int) -> str | None:
    """Expert parallelism borrows its ranks from dp_shard x cp: ``ep`` must divide that product
    and be a multiple of ``cp`` (``dp_shard`` resolved). None when it fits.

    >>> ep_layout_problem(ep=4, cp=1, dp_shard=2)[:47]
    'parallelism.expert_parallel_degree = 4 must div'
    """
    if ep == 1 or (ep % cp == 0 and (dp_shard * cp) % ep == 0):
        return None
    return (f"parallelism.expert_parallel_degree = {ep} must divide data_parallel_shard_degree"
            f"({dp_shard}) x context_parallel_degree({cp}) = {dp_shard * cp} and be a multiple "
            f"of context_parallel_degree ({cp}): ep borrows its ranks from dp_shard x cp")


def degree_problems(*, dp_replicate: int, dp_shard: int, cp: int, tp: int, pp: int, ep: int,
                    world_size: int | None) -> tuple[int, list[str]]:
    """(dp_shard resolved, every problem of these degrees): ranges, product, EP layout.

    >>> degree_problems(dp_replicate=1, dp_shard=-1, cp=1, tp=2, pp=1, ep=1, world_size=8)
    (4, [])
    """
    problems = [f"parallelism.{key} = {value} must be >= 1" for key, value in (
        ("data_parallel_replicate_degree", dp_replicate), ("context_parallel_degree", cp),
        ("tensor_parallel_degree", tp), ("pipeline_parallel_degree", pp),
        ("expert_parallel_degree", ep)) if value < 1]
    if dp_shard == 0 or dp_shard < -1:
        problems.append(f"parallelism.data_parallel_shard_degree = {dp_shard} must be -1 or >= 1")
    if problems:
        return dp_shard, problems
    try:
        shard = resolve_dp_shard(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp,
                                 pp=pp, world_size=world_size)
    except ConfigError as e:
        return (1 if dp_shard == -1 else dp_shard), e.problems
    problem = ep_layout_problem(ep=ep, cp=cp, dp_shard=shard)
    return shard, [problem] if problem else []


# -- batch ----------------------------------------------------------------------------------------

def batch_problem(*, global_batch_size: int, local_batch_size: int, dp_replicate: int,
                  dp_shard: int) -> str | None:
    """The global batch must be a whole number (>= 1) of ``local x dp`` batches; -1 is one.

    >>> batch_problem(global_batch_size=48, local_batch_size=8, dp_replicate=1, dp_shard=4)[:44]
    'training.global_batch_size = 48 must be a mu'
    """
    dp = dp_replicate * dp_shard
    per_step = local_batch_size * dp
    if global_batch_size == -1 or (global_batch_size >= per_step
                                   and global_batch_size % per_step == 0):
        return None
    return (f"training.global_batch_size = {global_batch_size} must be a multiple of "
            f"local_batch_size({local_batch_size}) x dp({dp}) = {per_step}, where dp = "
            f"data_parallel_replicate_degree({dp_replicate}) x data_parallel_shard_degree"
            f"({dp_shard}); gradient accumulation runs global / (local x dp) micro-batches per "
            "step")


def accumulation_steps(*, global_batch_size: int, local_batch_size: int, dp_replicate: int = 1,
                       dp_shard: int) -> int:
    """Micro-batches per optimizer step: global / (local x dp_replicate x dp_shard); 1 for
    ``global = -1``. Raises :class:`ConfigError` when that is not a whole number (it never
    rounds). The trainer, the config and the planner all count with this.
    """
    problem = batch_problem(global_batch_size=global_batch_size,
                            local_batch_size=local_batch_size, dp_replicate=dp_replicate,
                            dp_shard=dp_shard)
    if problem:
        raise ConfigError([problem])
    if global_batch_size == -1:
        return 1
    return global_batch_size // (local_batch_size * dp_replicate * dp_shard)


def resolve_microbatches(pp: int, requested: int, local_batch_size: int) -> int:
    """``pipeline_parallel_microbatches`` with -1 resolved: 2 x pp, capped at the batch size."""
    return requested if requested > 0 else max(1, min(2 * pp, local_batch_size))


# -- pipeline split (plain ints: the config rules, the pipeline and the planner call it) -------

def _spread(counts: list[int], extra: int, ranks: Sequence[int], light: Sequence[int],
            first: Sequence[int] = ()) -> list[int]:
    """``counts`` plus ``extra`` units, one per stage, each to a stage of the least loaded rank
    (ties: the ``first`` stages, then stage order, the ``light`` stages last)."""
    n = len(counts)
    counts = list(counts)
    order = list(dict.fromkeys([*first, *(s for s in range(n) if s not in light),
                                *light]))[:n]
    load = dict.fromkeys(ranks, 0)
    for c, r in zip(counts, ranks, strict=True):
        load[r] += c
    rank_first = {s: k for k, s in enumerate(order)}
    for _ in range(extra):
        i = min(order, key=lambda s: (load[ranks[s]], rank_first[s]))
        order.remove(i)
        counts[i] += 1
        load[ranks[i]] += 1
    return counts


def layers_per_stage(n_layers: int, n_stages: int, *, first_stage_less_layers: int = 0,
                     last_stage_less_layers: int = 0,
                     explicit: Sequence[int] | None = None,
                     stage_ranks: Sequence[int] | None = None) -> list[int]:
    """Blocks per stage, as even as possible, with the first / last stage taking
    ``first_stage_less_layers`` / ``last_stage_less_layers`` fewer (they also hold the
    embedding / the norm and output head). ``explicit`` gives the counts directly.

    ``stage_ranks[i]`` is the pp rank holding stage i (:func:`titanext.schedules.stage_owners`):
    a block left over goes to a stage of the least loaded rank, so ranks, not only stages, stay
    even. Under V placement rank 0 holds both ends; stages alone would give it the two light
    ones (6 blocks, pp 2: [1, 2, 2, 1] puts 2 blocks on rank 0 and 4 on rank 1).

    >>> layers_per_stage(8, 4)
    [2, 2, 2, 2]
    >>> layers_per_stage(10, 4, first_stage_less_layers=1, last_stage_less_layers=1)
    [2, 3, 3, 2]
    >>> layers_per_stage(6, 4), layers_per_stage(6, 4, stage_ranks=[0, 1, 1, 0])
    ([1, 2, 2, 1], [2, 2, 1, 1])
    >>> layers_per_stage(5, 4, last_stage_less_layers=1, stage_ranks=[0, 1, 1, 0])
    [1, 2, 1, 1]
    """
    if explicit:
        counts = list(explicit)
        if len(counts) != n_stages or sum(counts) != n_layers or min(counts) < 1:
            raise ValueError(f"pipeline_parallel_layers_per_stage = {counts} must have {n_stages} "
                             f"entries >= 1 summing to n_layers = {n_layers}")
        return counts
    # Count the embedding and head as virtual layers, spread all units evenly, remove them again.
    units = n_layers + first_stage_less_layers + last_stage_less_layers
    if n_layers < n_stages:  # (checked first: a planner's search asks for thousands of stages)
        raise ValueError(f"n_layers = {n_layers} cannot be split into {n_stages} stages with "
                         f"first_stage_less_layers = {first_stage_less_layers} and "
                         f"last_stage_less_layers = {last_stage_less_layers}: every stage "
                         "needs at least one layer")
    base, extra = divmod(units, n_stages)
    counts = [base] * n_stages
    ranks = list(stage_ranks) if stage_ranks is not None else list(range(n_stages))
    if len(ranks) != n_stages:
        raise ValueError(f"stage_ranks = {ranks} must name the rank of each of {n_stages} stages")
    # Extra units go to the middle stages first, so the ends (embedding, head) stay light; with
    # ``stage_ranks``, each to a stage of the rank with the fewest units so far. Where that
    # leaves an end that gives up blocks with none (61 blocks in 32 stages, the last one 1
    # fewer), such an end takes its extra first: its virtual units keep it light already.
    counts = _spread(counts, extra, ranks, light=(0, n_stages - 1))
    counts[0] -= first_stage_less_layers
    counts[-1] -= last_stage_less_layers
    if min(counts) < 1:
        ends = ((0, first_stage_less_layers), (n_stages - 1, last_stage_less_layers))
        retry = _spread([base] * n_stages, extra, ranks,
                        light=[s for s, less in ends if not less],
                        first=[s for s, less in ends if less])
        retry[0] -= first_stage_less_layers
        retry[-1] -= last_stage_less_layers
        # taken only if each such end still holds its blocks fewer than the fullest stage
        if min(retry) >= 1 and all(retry[s] <= max(retry) - less for s, less in ends if less):
            counts = retry
    if min(counts) < 1 or sum(counts) != n_layers:
        raise ValueError(f"n_layers = {n_layers} cannot be split into {n_stages} stages with "
                         f"first_stage_less_layers = {first_stage_less_layers} and "
                         f"last_stage_less_layers = {last_stage_less_layers}: counts {counts}; "
                         "every stage needs at least one layer")
    return counts
