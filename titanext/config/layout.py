"""The job resolved once: one frozen :class:`JobLayout` from a validated config and a world size.

:func:`resolve_job_layout` works out everything about *where* the job runs that more than one
part of titanext needs, from the config alone (no process group, device or model):

- the degrees (``data_parallel_shard_degree = -1`` resolved) and the world mesh's named dims;
- gradient accumulation and the model's arguments (the flavor's, with ``[moe]`` overrides);
- the pipeline (:class:`PipelinePlan`): the schedule *class*, its placement, the stages per
  rank and the rank that owns each stage, the blocks per stage and the micro-batches;
- the EP layout (the ``dp_shard_in_ep`` dim it borrows, in ``mesh_dims``), hot-expert
  replication and the recompute mode.

Every consumer reads this object and recomputes none of it: the config rules (through
:func:`pipeline_plan`, the one function that resolves a pipeline), ``ParallelDims``
(:meth:`~titanext.distributed.parallel_dims.ParallelDims.from_layout`), ``PipelineRunner``,
the Trainer (``trainer.layout``), the dry run, the planner and its advice
(:func:`titanext.planning.layout.resolve_layout` builds each candidate through it, so what the
planner advises is what the trainer runs), and the support matrix (through the rules).
``get_schedule_class`` is called here only. A pp = 1 job imports nothing of torch; a pipeline
imports the schedule classes (torch's pipelining runtime), as the config check always did.

>>> from titanext.config import load_config
>>> cfg = load_config("train_configs/debug_pp.toml",
...                   ["--parallelism.pipeline_parallel_schedule=ZBV"], world_size=4)
>>> lo = resolve_job_layout(cfg, 4)
>>> lo.pp, lo.dp_shard, lo.pipeline.schedule.__name__, lo.pipeline.stage_owners
(2, 2, 'ZBV', (0, 1, 1, 0))
>>> lo.pipeline.layers_per_stage, lo.pipeline.stage_ids(0), lo.pipeline.microbatches
((2, 2, 1, 1), (0, 3), 8)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from titanext.config.degrees import (
    accumulation_steps,
    layers_per_stage,
    mesh_dims,
    resolve_dp_shard,
    resolve_microbatches,
)
from titanext.config.schema import JobConfig
from titanext.config.schema_parallel import MoEConfig
from titanext.errors import ConfigError

if TYPE_CHECKING:
    from titanext.models import ModelArgs

__all__ = ["MOE_RUNTIME_KEYS", "JobLayout", "PipelinePlan", "PipelinePlanError",
           "config_pipeline_plan", "fake_world_size", "gradient_accumulation_steps", "model_args",
           "pipeline_plan", "resolve_job_layout", "resolved_dp_shard", "ulysses_degree"]


class PipelinePlanError(ValueError):
    """A pipeline that cannot exist. ``key`` names what is wrong: ``"stages_per_rank"``,
    ``"max_pending_weight_grads"`` or ``"layers"`` (with the stages it resolved so far)."""

    def __init__(self, message: str, *, key: str, stages_per_rank: int | None = None,
                 num_stages: int | None = None):
        super().__init__(message)
        self.key, self.stages_per_rank, self.num_stages = key, stages_per_rank, num_stages


@dataclass(frozen=True)
class PipelinePlan:
    """A pipeline resolved: which schedule runs, which rank holds which stage, how many blocks
    each stage holds and how many micro-batches go through. One stage and no schedule class
    without pipeline parallelism."""

    name: str
    """The schedule as the config names it (``pipeline_parallel_schedule``)."""
    schedule: type | None
    """The class torch's schedule runtime runs (capped at ``max_pending_weight_grads``)."""
    pp: int
    stages_per_rank: int
    num_stages: int
    """Stages the model is split into (DualPipe: two mirrored copies of ``pp`` stages)."""
    microbatches: int
    stage_owners: tuple[int, ...]
    """The pp rank that holds each stage (DualPipe: the down copy's)."""
    rank_stage_ids: tuple[tuple[int, ...], ...]
    """Per pp rank, its stages in the order the schedule takes them."""
    layers_per_stage: tuple[int, ...] | None
    """Blocks per stage (None when the model's depth was not known)."""
    split_backward: str = "deferred"
    comm_overlap: bool = False

    @property
    def placement(self) -> str:
        return getattr(self.schedule, "placement", "loop")

    @property
    def mirrored(self) -> bool:
        """DualPipe: two copies of the model, rank r holding stage r of one, pp-1-r of the other."""
        return self.placement == "dualpipe"

    @property
    def max_pending_weight_grads(self) -> int:
        return getattr(self.schedule, "max_pending_weight_grads", 0)

    @property
    def loss_copies(self) -> int:
        """Ranks that hold the last stage and so report every micro-batch's loss."""
        return sum(self.num_stages - 1 in ids for ids in self.rank_stage_ids)

    def stage_ids(self, pp_rank: int) -> tuple[int, ...]:
        return self.rank_stage_ids[pp_rank]


def pipeline_plan(schedule: str | type, *, pp: int, microbatches: int,
                  n_layers: int | None = None, stages_per_rank: int | None = None,
                  first_stage_less_layers: int = 0, last_stage_less_layers: int = 0,
                  stage_layers: Any = None, max_pending_weight_grads: int = 0,
                  split_backward: str = "deferred", comm_overlap: bool = False) -> PipelinePlan:
    """The one resolution of a pipeline: schedule name -> class -> stages per rank -> placement
    -> stage count -> stage owners -> blocks per stage. Raises :class:`PipelinePlanError`
    (a ValueError) for a pipeline that cannot exist, and ValueError for an unknown schedule.

    >>> plan = pipeline_plan("DualPipe", pp=2, microbatches=4, n_layers=4)
    >>> plan.num_stages, plan.rank_stage_ids, plan.layers_per_stage, plan.loss_copies
    (2, ((0, 1), (1, 0)), (2, 2), 2)
    """
    from titanext.schedules import (
        capped_schedule_class,
        get_schedule_class,
        num_stages_for,
        resolved_stages_per_rank,
        stage_ids_for_rank,
        stage_owners,
    )

    cls = get_schedule_class(schedule) if isinstance(schedule, str) else schedule
    try:
        spr = resolved_stages_per_rank(cls, stages_per_rank)
    except ValueError as e:
        raise PipelinePlanError(str(e), key="stages_per_rank") from None
    try:
        cls = capped_schedule_class(cls, max_pending_weight_grads)
    except ValueError as e:
        raise PipelinePlanError(str(e), key="max_pending_weight_grads") from None
    placement = getattr(cls, "placement", "loop")
    n_stages = num_stages_for(placement, pp, spr)
    owners = tuple(stage_owners(placement, pp, spr))
    counts = None
    if n_layers is not None:
        try:
            counts = tuple(layers_per_stage(
                n_layers, n_stages, first_stage_less_layers=first_stage_less_layers,
                last_stage_less_layers=last_stage_less_layers,
                explicit=list(stage_layers) if stage_layers else None, stage_ranks=owners))
        except ValueError as e:
            raise PipelinePlanError(str(e), key="layers", stages_per_rank=spr,
                                    num_stages=n_stages) from None
    return PipelinePlan(
        name=schedule if isinstance(schedule, str) else cls.__name__, schedule=cls, pp=pp,
        stages_per_rank=spr, num_stages=n_stages, microbatches=microbatches,
        stage_owners=owners,
        rank_stage_ids=tuple(tuple(stage_ids_for_rank(placement, r, pp, spr)) for r in range(pp)),
        layers_per_stage=counts, split_backward=split_backward, comm_overlap=comm_overlap)


def _single_stage(name: str, n_layers: int) -> PipelinePlan:
    return PipelinePlan(name=name, schedule=None, pp=1, stages_per_rank=1, num_stages=1,
                        microbatches=1, stage_owners=(0,), rank_stage_ids=((0,),),
                        layers_per_stage=(n_layers,))


def config_pipeline_plan(cfg: JobConfig, n_layers: int | None, *,
                         max_pending_weight_grads: int | None = None) -> PipelinePlan:
    """The :class:`PipelinePlan` of ``cfg``'s ``[parallelism]`` pipeline keys (pp > 1), for a
    model of ``n_layers`` blocks (None: not known, no split); ``max_pending_weight_grads``
    replaces the config's cap (the rules retry without a cap the schedule cannot take)."""
    p = cfg.parallelism
    if max_pending_weight_grads is None:
        max_pending_weight_grads = p.pipeline_parallel_max_pending_weight_grads
    pp = p.pipeline_parallel_degree
    return pipeline_plan(
        p.pipeline_parallel_schedule, pp=pp,
        microbatches=resolve_microbatches(pp, p.pipeline_parallel_microbatches,
                                          cfg.training.local_batch_size),
        n_layers=n_layers, stages_per_rank=p.pipeline_parallel_stages_per_rank,
        first_stage_less_layers=p.pipeline_parallel_first_stage_less_layers,
        last_stage_less_layers=p.pipeline_parallel_last_stage_less_layers,
        stage_layers=p.pipeline_parallel_layers_per_stage,
        max_pending_weight_grads=max_pending_weight_grads,
        split_backward=p.pipeline_parallel_split_backward,
        comm_overlap=p.expert_parallel_comm_overlap)


@dataclass(frozen=True)
class JobLayout:
    """Where a job runs, resolved once (see the module docstring)."""

    world_size: int
    dp_replicate: int
    dp_shard: int
    cp: int
    cp_ulysses: int
    tp: int
    pp: int
    ep: int
    mesh_dims: tuple[tuple[str, int], ...]
    """The world mesh's named dims and sizes, in order (size-1 dims included)."""
    accumulation_steps: int
    """Forward/backward passes per optimizer step (global / (local x dp))."""
    model_args: ModelArgs
    pipeline: PipelinePlan
    expert_replicas: int
    """Hot experts each ep rank may host as copies (``[moe] replicate_hot_experts``)."""
    recompute: str
    """Activation checkpointing: "none", "full", or "selective:<option>"."""

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard


def resolve_job_layout(cfg: JobConfig, world_size: int) -> JobLayout:
    """The :class:`JobLayout` of ``cfg`` (already validated, as :func:`~titanext.config.load_config`
    returns it) on ``world_size`` ranks; ConfigError where the degrees do not fit it."""
    p, ac = cfg.parallelism, cfg.activation_checkpoint
    shard = resolved_dp_shard(cfg, world_size)
    args = model_args(cfg)
    pp, cp, ep = p.pipeline_parallel_degree, p.context_parallel_degree, p.expert_parallel_degree
    u = ulysses_degree(p)
    plan = (config_pipeline_plan(cfg, args.n_layers) if pp > 1
            else _single_stage(p.pipeline_parallel_schedule, args.n_layers))
    return JobLayout(
        world_size=world_size, dp_replicate=p.data_parallel_replicate_degree, dp_shard=shard,
        cp=cp, cp_ulysses=u, tp=p.tensor_parallel_degree, pp=pp, ep=ep,
        mesh_dims=mesh_dims(pp=pp, dp_replicate=p.data_parallel_replicate_degree,
                            dp_shard=shard, cp=cp, cp_ulysses=u, tp=p.tensor_parallel_degree,
                            ep=ep),
        accumulation_steps=accumulation_steps(
            global_batch_size=cfg.training.global_batch_size,
            local_batch_size=cfg.training.local_batch_size,
            dp_replicate=p.data_parallel_replicate_degree, dp_shard=shard), model_args=args,
        pipeline=plan, expert_replicas=cfg.moe.replicate_hot_experts if ep > 1 else 0,
        recompute=(f"selective:{ac.selective_ac_option}" if ac.mode == "selective"
                   else ac.mode))


# -- the pieces, each resolved once -------------------------------------------------------------

def _resolve_shard(p: Any, world_size: int | None) -> tuple[int, str | None]:
    """(dp_shard with -1 resolved, the problem if the degrees do not fit ``world_size``)."""
    try:
        shard = resolve_dp_shard(
            dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree,
            cp=p.context_parallel_degree, tp=p.tensor_parallel_degree,
            pp=p.pipeline_parallel_degree, world_size=world_size)
    except ConfigError as e:
        fallback = 1 if p.data_parallel_shard_degree == -1 else p.data_parallel_shard_degree
        return fallback, e.problems[0]
    return shard, None


def ulysses_degree(p: Any) -> int:
    """The Ulysses degree CP runs with: context_parallel_degree for comm = 'alltoall' (pure
    Ulysses), else context_parallel_ulysses_degree (1 = ring only)."""
    if p.context_parallel_comm == "alltoall":
        return p.context_parallel_degree
    return p.context_parallel_ulysses_degree


#: [moe] keys that are not model hyper-parameters (not passed to the flavor's MoEArgs)
MOE_RUNTIME_KEYS = frozenset({"replicate_hot_experts"})


def _moe_overrides(cfg: JobConfig) -> dict[str, Any]:
    return {f.name: getattr(cfg.moe, f.name) for f in dataclasses.fields(MoEConfig)
            if getattr(cfg.moe, f.name) is not None and f.name not in MOE_RUNTIME_KEYS}


def model_args(cfg: JobConfig) -> ModelArgs:
    """The :class:`~titanext.models.ModelArgs` the job trains: the flavor's, with the [moe]
    overrides applied (call on a validated config).

    >>> from titanext.config import load_config
    >>> model_args(load_config("train_configs/debug_moe.toml", ["--moe.top_k=1"])).moe.top_k
    1
    """
    from titanext.models import get_model_args, with_moe_overrides
    from titanext.models.hf_configs import model_args_from_hf

    if cfg.model.flavor == "hf":
        base = model_args_from_hf(cfg.model.hf_assets_path)
    else:
        base = get_model_args(cfg.model.name, cfg.model.flavor)
    if cfg.model.num_mtp_layers >= 0:
        base = dataclasses.replace(base, num_mtp_layers=cfg.model.num_mtp_layers)
    return with_moe_overrides(base, **_moe_overrides(cfg))


def fake_world_size(cfg: JobConfig) -> int:
    """The world size of a ``comm.mode = "fake_backend"`` dry run: ``comm.fake_world_size``, or
    the product of the parallel degrees (data_parallel_shard_degree = -1 counting 1)."""
    if cfg.comm.fake_world_size:
        return cfg.comm.fake_world_size
    p = cfg.parallelism
    return (p.data_parallel_replicate_degree * max(p.data_parallel_shard_degree, 1)
            * p.context_parallel_degree * p.tensor_parallel_degree * p.pipeline_parallel_degree)


def resolved_dp_shard(cfg: JobConfig, world_size: int | None) -> int:
    """``data_parallel_shard_degree`` with -1 resolved to the rest of the world (1 without one).

    Raises :class:`ConfigError` when the degrees cannot fit ``world_size``.

    >>> from titanext.config import load_config
    >>> resolved_dp_shard(load_config(None, ["--parallelism.tensor_parallel_degree=2"]), 8)
    4
    """
    shard, problem = _resolve_shard(cfg.parallelism, world_size)
    if problem:
        raise ConfigError([problem])
    return shard


def gradient_accumulation_steps(cfg: JobConfig, world_size: int | None) -> int:
    """Micro-batches per optimizer step: global_batch_size / (local_batch_size x dp).

    1 when ``global_batch_size = -1``. Raises :class:`ConfigError` when it is not a whole number.

    >>> from titanext.config import load_config
    >>> gradient_accumulation_steps(load_config(None, ["--training.global_batch_size=64"]), 4)
    2
    """
    t, p = cfg.training, cfg.parallelism
    return accumulation_steps(global_batch_size=t.global_batch_size,
                              local_batch_size=t.local_batch_size,
                              dp_replicate=p.data_parallel_replicate_degree,
                              dp_shard=resolved_dp_shard(cfg, world_size))
