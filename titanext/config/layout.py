"""The job resolved once: one frozen :class:`JobLayout` from a validated config and a world size.

:func:`resolve_job_layout` works out everything about *where* the job runs that more than one
part of titanext needs, from the config alone (no process group, device or model):

- the degrees (``data_parallel_shard_degree = -1`` resolved) and the world mesh's named dims;
- gradient accumulation and the model's arguments (the flavor's, with ``[moe]`` overrides);
- the pipeline (:class:`PipelinePlan`): the schedule *class*, its placement, the stages per
  rank and the rank that owns each stage, the blocks per stage and the micro-batches;
- the EP layout (the ``dp_shard_in_ep`` dim it borrows, in ``mesh_dims``);
- the :class:`Recipe` (:func:`recipe_from_config`): ZeRO stage and FSDP, reshard policy, param
  and reduce dtypes and autocast, SP and loss parallel, CP layout and comm, EP dispatch, ranks
  per node, float8 dispatch and hot-expert replicas, recompute, compile scope. The decisions
  that also need the degrees (ZeRO-1 on, FSDP on, autocast, loss parallel) are its methods.

Every consumer reads this object and recomputes none of it: the config rules (through
:func:`pipeline_plan`, the one function that resolves a pipeline), ``ParallelDims``
(:meth:`~titanext.distributed.parallel_dims.ParallelDims.from_layout`), ``PipelineRunner``,
the Trainer (``trainer.layout``), :func:`~titanext.distributed.parallelize.parallelize`
(``layout.recipe``), the dry run, the planner and its advice
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
from titanext.plugins.expert_parallel.rules import EP_DISPATCH_MODES
from titanext.plugins.rules import (
    DEFAULT_SAVE_OPS,
    FLOAT8_STORAGE,
    RECOMPUTE_MODULES,
    any_full_blocks,
    resolved_recompute_modules,
)

if TYPE_CHECKING:
    from titanext.models import ModelArgs

__all__ = ["MOE_RUNTIME_KEYS", "SPLIT_BACKWARD", "JobLayout", "PipelinePlan", "PipelinePlanError",
           "Recipe",
           "config_pipeline_plan", "fake_world_size", "gradient_accumulation_steps", "model_args",
           "pipeline_plan", "recipe_from_config", "resolve_job_layout", "resolved_dp_shard",
           "ulysses_degree"]


#: ``split_backward`` values: queue the linears' weight GEMMs (default), or torch's split.
SPLIT_BACKWARD = ("deferred", "autograd")


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

    def stage_of_block(self, block: int) -> int:
        """The stage that holds the model's block ``block`` (its index; 0 without a split)."""
        end = 0
        for stage, n in enumerate(self.layers_per_stage or ()):
            end += n
            if block < end:
                return stage
        return 0

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
    # the config layer loads without torch: the schedules and models import it
    from titanext.schedules import (
        capped_schedule_class,
        get_schedule_class,
        num_stages_for,
        resolved_stages_per_rank,
        stage_ids_for_rank,
        stage_owners,
    )

    if split_backward not in SPLIT_BACKWARD:
        raise ValueError(f"split_backward = {split_backward!r}; allowed: "
                         f"{', '.join(SPLIT_BACKWARD)}")
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


_PRECISIONS = ("auto", "bfloat16", "float32")
_RESHARD_POLICIES = ("default", "always", "never")
_CP_LAYOUTS = ("zigzag", "contiguous")
_CP_COMMS = ("p2p", "allgather", "alltoall")
_AC_MODES = ("none", "selective", "full", "modules")
_COMPILE_SCOPES = ("model", "loss")
_COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


@dataclass(frozen=True)
class Recipe:
    """How the model is parallelized and trained, decided once: what the runtime
    (:func:`~titanext.distributed.parallelize.parallelize`, the trainer, the pipeline), the
    planner and the dry run share. Torch-free; build one from keywords (each checked, a
    ValueError naming the field, the value and what is allowed) or take a job's
    (``resolve_job_layout(cfg, world_size).recipe``, from :func:`recipe_from_config`).

    The decisions that also depend on the degrees are methods of a ``degrees`` object with
    ``dp_replicate``, ``dp_shard``, ``cp``, ``tp`` and ``pp`` (a :class:`JobLayout` or a
    ``ParallelDims``), answered here only.

    >>> r = Recipe(zero_stage=1, ac="selective", ac_option="2")
    >>> r.recompute, r.fsdp_zero_stage
    ('selective:2', 2)
    >>> from types import SimpleNamespace as D
    >>> four = D(dp_replicate=1, dp_shard=4, cp=1, tp=1, pp=1)
    >>> r.zero1(four), r.fsdp(four), Recipe().fsdp(four), r.autocast(four, "cuda")
    (True, False, True, 'bfloat16')
    >>> Recipe(zero_stage=4)
    Traceback (most recent call last):
    ...
    ValueError: Recipe: zero_stage = 4; allowed: 1, 2, 3
    """

    zero_stage: int = 3
    """1: DDP over the data-parallel ranks and a sharded optimizer; 2: FSDP that keeps the
    gathered parameters between forward and backward; 3: FSDP (``parallelism.zero_stage``)."""
    reshard_after_forward: str = "default"
    """FSDP's policy: "default", "always" or "never" (``fsdp_reshard_after_forward``)."""
    param_dtype: str = "auto"
    """Compute dtype of FSDP's parameters, or autocast's without FSDP: "auto" (bfloat16 on
    CUDA, else float32), "bfloat16" or "float32"."""
    reduce_dtype: str = "float32"
    """Dtype of the gradient reduction: "auto", "bfloat16" or "float32"."""
    sequence_parallel: bool = True
    """With TP, shard norms and residual activations along the sequence."""
    loss_parallel: bool = True
    """With TP, keep the output layer sharded and compute the loss in ``loss_parallel()``."""
    cp_layout: str = "zigzag"
    """Context parallelism's sequence layout: "zigzag" (load-balanced) or "contiguous"."""
    cp_comm: str = "p2p"
    """How CP's attention exchanges keys and values: "p2p", "allgather" or "alltoall"."""
    ep_dispatch: str = "flat"
    """Expert-parallel dispatch: "flat" or "two_level"."""
    ep_ranks_per_node: int = 0
    """Two-level dispatch: ep ranks per node (0: the launcher's local world size)."""
    ep_float8_dispatch: bool = False
    """Send the dispatched token rows in float8."""
    ep_comm_overlap: bool = False
    """Interleave paired pipeline chunks at their expert-parallel all-to-alls."""
    expert_replicas: int = 0
    """Hot experts each ep rank may host as copies (under ep > 1)."""
    ac: str = "none"
    """Activation checkpointing: "none", "selective", "full" or "modules" (only the parts of
    each block in ``recompute_modules``)."""
    ac_option: str = "op"
    """Selective AC: "op" (save ``ac_save_ops``' outputs) or "n" (every n-th block); checked
    with the save list by the AC plugin (``check_activation_checkpointing``), as parallelize
    starts."""
    ac_save_ops: tuple[str, ...] = DEFAULT_SAVE_OPS
    """Op-level selective AC: the aten ops whose outputs are kept."""
    keep_all_to_all: bool = False
    """AC under EP: keep what the dispatch received and replay it in the recompute."""
    recompute_modules: tuple[str, ...] = ()
    """``ac = "modules"``: the parts of each block recomputed, any of ``RECOMPUTE_MODULES``
    (``titanext.plugins.recompute_modules``); a config's empty list is resolved to DeepSeek-V3's
    choice that the model has."""
    ac_full_blocks: int | tuple[int, ...] = 0
    """``ac = "modules"``: how many of the first blocks of each pipeline stage (or of the model)
    are fully checkpointed instead (with ``keep_all_to_all``'s choice), the rest by module;
    a tuple: one count per stage (:meth:`for_stage`)."""
    float8_storage: tuple[str, ...] = ()
    """Tensors saved for the backward in float8 with 1 x 128 scales, any of
    ``FLOAT8_STORAGE`` (``titanext.plugins.float8_storage``)."""
    compile: tuple[str, ...] = ()
    """What torch.compile compiles: any of "model" (each block), "loss"."""
    compile_backend: str = "inductor"
    float8: bool = False
    """The model's linears were converted to float8 (TP then uses the float8 styles)."""

    def __post_init__(self) -> None:
        problems = [_recipe_problem(name, getattr(self, name), allowed)
                    for name, allowed in _RECIPE_CHOICES.items()]
        for name in ("ep_ranks_per_node", "expert_replicas"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                problems.append(f"{name} = {value!r}; allowed: an integer >= 0")
        problems += [f"compile = {self.compile!r}; allowed: any of 'model', 'loss'"
                     for c in self.compile if c not in _COMPILE_SCOPES][:1]
        full = self.ac_full_blocks
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 0
               for v in (full if isinstance(full, tuple) else (full,))):
            problems.append(f"ac_full_blocks = {full!r}; allowed: an integer >= 0 or a tuple "
                            "of them (one per pipeline stage)")
        problems += _recompute_problems(self)
        problems = [p for p in problems if p]
        if problems:
            raise ValueError("; ".join(f"Recipe: {p}" for p in problems))

    # -- the decisions ----------------------------------------------------------------------
    @property
    def recompute(self) -> str:
        """"none", "full", "selective:<option>" or "modules:<name>+<name>..."."""
        if self.ac == "modules":
            n = self.ac_full_blocks
            full = (f" (full:{','.join(map(str, n)) if isinstance(n, tuple) else n})"
                    if n else "")
            return "modules:" + "+".join(self.recompute_modules) + full
        return f"selective:{self.ac_option}" if self.ac == "selective" else self.ac

    def for_stage(self, stage: int) -> Recipe:
        """The recipe of pipeline stage ``stage``: a per-stage ``ac_full_blocks`` resolved to
        its entry (the recipe itself otherwise)."""
        if not isinstance(self.ac_full_blocks, tuple):
            return self
        return dataclasses.replace(self, ac_full_blocks=self.full_blocks_on(stage))

    def full_blocks_on(self, stage: int) -> int:
        """``ac_full_blocks`` of pipeline stage ``stage``."""
        full = self.ac_full_blocks
        return full[stage] if isinstance(full, tuple) else full

    @property
    def fsdp_zero_stage(self) -> int:
        """The stage FSDP runs (ZeRO-1's DDP aside: 2 or 3)."""
        return max(self.zero_stage, 2)

    @property
    def compile_model(self) -> bool:
        return "model" in self.compile

    @property
    def compile_loss(self) -> bool:
        return "loss" in self.compile

    def zero1(self, degrees: Any) -> bool:
        """ZeRO-1: DDP over every rank that reduces gradients (dp and cp), a sharded optimizer."""
        d = degrees
        return self.zero_stage == 1 and d.dp_replicate * d.dp_shard * d.cp > 1

    def fsdp(self, degrees: Any) -> bool:
        """FSDP2 / HSDP shards (or replicates) the parameters."""
        d = degrees
        return not self.zero1(d) and (d.dp_shard * d.cp > 1 or d.dp_replicate > 1)

    def sequence_parallel_on(self, degrees: Any) -> bool:
        return degrees.tp > 1 and self.sequence_parallel

    def loss_parallel_on(self, degrees: Any) -> bool:
        """Whether the output layer stays sharded over tp (the loss in ``loss_parallel()``)."""
        return degrees.tp > 1 and self.loss_parallel

    def param_dtype_on(self, device_type: str) -> str:
        """``param_dtype`` with "auto" resolved: "bfloat16" on CUDA, else "float32"."""
        return _precision(self.param_dtype, device_type)

    def reduce_dtype_on(self, device_type: str) -> str:
        return _precision(self.reduce_dtype, device_type)

    def autocast(self, degrees: Any, device_type: str) -> str | None:
        """The dtype the forward runs under ``torch.autocast`` to, or None: mixed precision
        where FSDP does not apply it (one rank, ZeRO-1's DDP), outside pipeline stages."""
        dtype = self.param_dtype_on(device_type)
        if dtype == "float32" or self.fsdp(degrees) or degrees.pp > 1:
            return None
        return dtype


_RECIPE_CHOICES = {"zero_stage": (1, 2, 3), "reshard_after_forward": _RESHARD_POLICIES,
                   "param_dtype": _PRECISIONS, "reduce_dtype": _PRECISIONS,
                   "sequence_parallel": (True, False), "loss_parallel": (True, False),
                   "cp_layout": _CP_LAYOUTS, "cp_comm": _CP_COMMS, "ep_dispatch": EP_DISPATCH_MODES,
                   "ep_float8_dispatch": (True, False), "ep_comm_overlap": (True, False),
                   "ac": _AC_MODES, "keep_all_to_all": (True, False),
                   "compile_backend": _COMPILE_BACKENDS, "float8": (True, False)}


def _recompute_problems(r: Recipe) -> list[str]:
    """``recompute_modules`` / ``float8_storage``: tuples of known names; modules only with
    ``ac = "modules"``, which needs at least one."""
    problems = [f"{name} = {getattr(r, name)!r}; allowed: a tuple of any of {', '.join(allowed)}"
                for name, allowed in (("recompute_modules", RECOMPUTE_MODULES),
                                      ("float8_storage", FLOAT8_STORAGE))
                if not isinstance(getattr(r, name), tuple)
                or any(n not in allowed for n in getattr(r, name))]
    if r.ac == "modules" and not r.recompute_modules:
        problems.append("ac = 'modules' needs recompute_modules, e.g. ('layernorm', 'moe_act')")
    if r.ac != "modules" and any_full_blocks(r.ac_full_blocks):
        problems.append(f"ac_full_blocks = {r.ac_full_blocks!r} needs ac = 'modules', not {r.ac!r}")
    if r.recompute_modules and r.ac != "modules":
        problems.append(f"recompute_modules = {r.recompute_modules!r} needs ac = 'modules', "
                        f"not {r.ac!r}")
    return problems


def _recipe_problem(name: str, value: Any, allowed: tuple) -> str | None:
    if value in allowed and type(value) is type(allowed[0]):
        return None
    return f"{name} = {value!r}; allowed: {', '.join(str(a) for a in allowed)}"


def _precision(name: str, device_type: str) -> str:
    if name == "auto":
        return "bfloat16" if device_type == "cuda" else "float32"
    return name


def recipe_from_config(cfg: JobConfig) -> Recipe:
    """The :class:`Recipe` of a validated config's ``[parallelism]``, ``[training]``,
    ``[activation_checkpoint]``, ``[compile]``, ``[float8]`` and ``[moe]`` keys.

    >>> from titanext.config import load_config
    >>> cfg = load_config("train_configs/debug_model.toml", ["--parallelism.zero_stage=2"])
    >>> recipe_from_config(cfg).zero_stage, recipe_from_config(cfg).cp_layout
    (2, 'zigzag')
    """
    p, t, ac, c = cfg.parallelism, cfg.training, cfg.activation_checkpoint, cfg.compile
    return Recipe(
        zero_stage=p.zero_stage, reshard_after_forward=p.fsdp_reshard_after_forward,
        param_dtype=t.mixed_precision_param, reduce_dtype=t.mixed_precision_reduce,
        sequence_parallel=p.enable_sequence_parallel, loss_parallel=p.enable_loss_parallel,
        cp_layout="zigzag" if p.context_parallel_load_balance == "zigzag" else "contiguous",
        cp_comm=p.context_parallel_comm, ep_dispatch=p.expert_parallel_dispatch,
        ep_ranks_per_node=p.expert_parallel_ranks_per_node,
        ep_float8_dispatch=p.expert_parallel_float8_dispatch,
        ep_comm_overlap=p.expert_parallel_comm_overlap,
        expert_replicas=cfg.moe.replicate_hot_experts if p.expert_parallel_degree > 1 else 0,
        ac=ac.mode, ac_option=str(ac.selective_ac_option),
        ac_save_ops=tuple(ac.selective_op_save_list), keep_all_to_all=ac.keep_all_to_all,
        recompute_modules=(resolved_recompute_modules(ac.recompute_modules, model_args(cfg))
                           if ac.mode == "modules" else ()),
        ac_full_blocks=(tuple(ac.full_blocks) if isinstance(ac.full_blocks, list)
                        else ac.full_blocks) if ac.mode == "modules" else 0,
        float8_storage=tuple(ac.float8_storage),
        compile=tuple(c.components) if c.enable else (), compile_backend=c.backend,
        float8=cfg.float8.enable)


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
    recipe: Recipe
    """How the model is parallelized and trained (:class:`Recipe`)."""

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def expert_replicas(self) -> int:
        """Hot experts each ep rank may host as copies (``[moe] replicate_hot_experts``)."""
        return self.recipe.expert_replicas

    @property
    def recompute(self) -> str:
        """Activation checkpointing: "none", "full", or "selective:<option>"."""
        return self.recipe.recompute

    @property
    def zero1(self) -> bool:
        return self.recipe.zero1(self)

    @property
    def fsdp(self) -> bool:
        return self.recipe.fsdp(self)


def resolve_job_layout(cfg: JobConfig, world_size: int) -> JobLayout:
    """The :class:`JobLayout` of ``cfg`` (already validated, as :func:`~titanext.config.load_config`
    returns it) on ``world_size`` ranks; ConfigError where the degrees do not fit it."""
    p = cfg.parallelism
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
        pipeline=plan, recipe=recipe_from_config(cfg))


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
    # the config layer loads without torch: the schedules and models import it
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
