"""One config's layout resolved into the quantities every estimate reads.

:func:`resolve_layout` turns a validated :class:`~titanext.config.JobConfig` and a world size
into a :class:`Layout`: the degrees, dtypes, micro-batches (gradient accumulation by the
trainer's rule), the pipeline split (all read from the job's one resolved
:class:`~titanext.config.layout.JobLayout`, as the trainer reads it), the
tokens one micro-batch puts through a rank, and the float8 and FSDP choices. The estimate
pieces (:mod:`~titanext.planning.memory`, :mod:`~titanext.planning.comm`,
:mod:`~titanext.planning.estimate`) take a Layout and add nothing of their own to it.

>>> from titanext.config import load_config
>>> lo = resolve_layout(load_config(None, ["--training.global_batch_size=64"], world_size=4), 4)
>>> lo.dp, lo.accum, lo.pp_microbatches
(4, 2, 1)
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from titanext.config import JobConfig, JobLayout, Recipe, resolve_job_layout
from titanext.planning.moe import float8_experts, row_bytes, with_ep
from titanext.planning.roofline import Linear
from titanext.planning.shapes import ModelShape, float8_flags, model_shape
from titanext.planning.stages import PipelineLayout, RankStages, pipeline_layout

__all__ = ["Layout", "dtype_bytes", "level", "resolve_layout"]


def dtype_bytes(name: str, on_gpu: bool) -> int:
    return 4 if name == "float32" or (name == "auto" and not on_gpu) else 2


def level(stride: int, size: int, gpus_per_node: int) -> str:
    """A mesh axis group spans stride x size consecutive ranks: inside a node or not."""
    if size == 1:
        return "-"
    return "intra-node" if stride * size <= gpus_per_node else "inter-node"


@dataclass
class Layout:
    """What the estimates of one config on one cluster share (see the module docstring)."""

    cfg: JobConfig
    shape: ModelShape
    rep: int
    shard: int
    tp: int
    cp: int
    pp: int
    ep: int
    a: int  # bytes of the compute dtype
    reduce_bytes: int
    sp: bool
    ac: str
    accum: int  # forward/backward passes per optimizer step (gradient accumulation)
    pp_microbatches: int
    pipe: PipelineLayout
    tokens_mb: float  # one micro-batch, the whole sequence
    tokens: float  # what this rank's matmuls see (SP gathers the sequence back)
    linears: list[Linear]  # layer 0's linears, float8 flags applied
    moe_linears: list[Linear]  # a MoE block's linears on this rank (experts split by ep)
    head_float8: bool
    zero_n: int  # ranks sharding the optimizer state
    reshard: bool
    gathered_layer: float  # bytes of one gathered FSDP unit (the larger of a dense and a MoE one)
    gathered_per_element: float
    gpus_per_node: int
    ulysses: int = 1  # CP's Ulysses degree: cp = ulysses x ring (cp for "alltoall", 1 = ring)
    job: JobLayout | None = None  # the resolved job every figure above is read from
    autocast: bool = False  # the forward runs under torch.autocast to ``a`` (no FSDP, no pp)
    gathered_by_kind: tuple[float, float] = (0.0, 0.0)  # a gathered dense unit's, a MoE one's

    @property
    def recipe(self) -> Recipe:
        """The job's recipe (ZeRO, dtypes, SP, CP, EP dispatch, recompute): the trainer's."""
        return self.job.recipe

    @property
    def zero1(self) -> bool:
        """ZeRO-1's DDP and sharded optimizer (:meth:`Recipe.zero1`)."""
        return self.job.zero1

    @property
    def fsdp(self) -> bool:
        """FSDP2 / HSDP holds the parameters (:meth:`Recipe.fsdp`)."""
        return self.job.fsdp

    @property
    def residual(self) -> int:
        """Bytes of the residual stream (each block's input): float32 under autocast (the
        embedding's output and the residual adds stay in the parameters' dtype), else ``a``."""
        return 4 if self.autocast else self.a

    @property
    def dp(self) -> int:
        return self.rep * self.shard

    @property
    def n_fsdp(self) -> int:
        return self.shard * self.cp

    @property
    def experts_defer(self) -> bool:
        """Whether a split backward keeps the routed experts' rows from I to W: they defer
        their dW unless float8 kernels compute it at I (``Linear.dw_at_i``)."""
        return not any(lin.dw_at_i for lin in self.moe_linears
                       if lin.name.startswith("moe.experts."))

    @property
    def passes(self) -> int:
        """Micro-batches through a rank per optimizer step."""
        return self.accum * self.pp_microbatches

    @property
    def strides(self) -> dict[str, int]:
        tp, cp, shard, rep = self.tp, self.cp, self.shard, self.rep
        return {"tp": 1, "cp": tp, "dp_shard": tp * cp, "dp_replicate": tp * cp * shard,
                "pp": tp * cp * shard * rep}

    def level(self, stride: int, size: int) -> str:
        return level(stride, size, self.gpus_per_node)

    def full_ac_ids(self, layer_ids) -> frozenset[int]:
        """The blocks among one stage's ``layer_ids`` that are fully checkpointed: all of them
        under ``ac = "full"``, the first ``[activation_checkpoint] full_blocks`` (the stage's
        entry; by layer id, the stage's own order) under ``"modules"``, none otherwise."""
        ids = sorted(layer_ids)
        if self.ac == "full" or not ids:
            return frozenset(ids)
        stage = self.job.pipeline.stage_of_block(ids[0])
        return frozenset(ids[:self.recipe.full_blocks_on(stage)] if self.ac == "modules" else ())

    def with_full_ac(self) -> Layout:
        """This layout with every block fully checkpointed (``keep_all_to_all`` as set): the
        per-block terms of ``full_blocks``' blocks under ``ac = "modules"``."""
        return self._full_ac

    @functools.cached_property
    def _full_ac(self) -> Layout:
        # made once per layout (the stage times and memory ask for it per block kind)
        recipe = dataclasses.replace(self.recipe, ac="full", recompute_modules=(),
                                     float8_storage=(), ac_full_blocks=0)
        return dataclasses.replace(self, ac="full", job=dataclasses.replace(self.job,
                                                                            recipe=recipe))

    def full_ac_blocks(self, rank: RankStages) -> int:
        """Blocks of a pp rank that are fully checkpointed (:meth:`full_ac_ids`)."""
        return sum(len(self.full_ac_ids(ids)) for ids in rank.stage_layer_ids)

    def recomputed_moe(self, rank: RankStages) -> int:
        """MoE blocks of a pp rank whose recompute runs the EP all-to-alls (and copies) again:
        the fully checkpointed ones, unless ``[activation_checkpoint] keep_all_to_all``
        replays what the forward received."""
        moe = self.shape.moe
        if moe is None or self.recipe.keep_all_to_all:
            return 0
        return sum(len(moe.layer_ids & self.full_ac_ids(ids)) for ids in rank.stage_layer_ids)

    @property
    def kept_all_to_all_per_token(self) -> float:
        """Bytes per token and MoE block that ``keep_all_to_all`` keeps from the forward for the
        recompute: the dispatched rows (float8 where the dispatch is) and the expert outputs
        before the combine, ``top_k`` of each (balanced routing: a rank receives what it sends)."""
        moe = self.shape.moe
        if moe is None or self.ac != "full" or not self.recipe.keep_all_to_all:
            return 0.0  # (ac = "modules": with_full_ac()'s, for its full blocks)
        f8 = self.recipe.ep_float8_dispatch
        return moe.top_k * (row_bytes(self.shape.dim, self.a, f8) + self.shape.dim * self.a)

    def n_moe(self, rank: RankStages) -> int:
        """MoE blocks among a pp rank's blocks."""
        moe = self.shape.moe
        return len(moe.layer_ids.intersection(rank.layer_ids)) if moe else 0


def resolve_layout(cfg: JobConfig, world_size: int, *, gpus_per_node: int = 8,
                   float8_hardware: bool | None = None) -> Layout:
    """The :class:`Layout` of ``cfg`` (already validated) on ``world_size`` ranks of a device
    with (``float8_hardware``) or without float8 tensor cores (None: this machine's)."""
    # the planner loads without torch and the training runtime until it needs them
    from titanext.plugins.fsdp import resolve_reshard_after_forward

    t, f8 = cfg.training, cfg.float8
    # the job as the trainer resolves it: the model, degrees, accumulation (the trainer's own
    # rule, a ConfigError where it is not whole), micro-batches, the pipeline's placement and
    # split, the recompute
    job = resolve_job_layout(cfg, world_size)
    recipe = job.recipe
    shape = model_shape(cfg, job.model_args)
    rep, tp, cp, pp, ep = job.dp_replicate, job.tp, job.cp, job.pp, job.ep
    moe = shape.moe
    shard = job.dp_shard
    dp, n_fsdp = rep * shard, shard * cp
    # FSDP / HSDP apply the mixed-precision param dtype; without them (one rank, ZeRO-1's DDP)
    # the trainer's forward runs under autocast to it, except in pipeline stages (float32)
    a = dtype_bytes(recipe.param_dtype, True) if job.fsdp or pp == 1 else 4
    accum = job.accumulation_steps
    pp_mb = job.pipeline.microbatches
    pipe = pipeline_layout(job.pipeline)
    tokens_mb = t.local_batch_size // pp_mb * t.seq_len
    f8_layer, f8_head, f8_moe = (
        float8_flags(cfg.model.name, job.model_args, f8.recipe, tuple(f8.filter_fqns),
                     _auto_filter(f8, float8_hardware), tuple(f8.force_fqns))
        if f8.enable else ((False,) * len(shape.linears), False, ()))
    # torchao's float8 linears keep their own backward: dW at I (Linear.dw_at_i)
    linears = [_converted(lin, flag, f8.recipe, flag) for lin, flag in zip(shape.linears, f8_layer)]
    reshard = resolve_reshard_after_forward(recipe.reshard_after_forward,
                                            zero_stage=recipe.fsdp_zero_stage, pp_enabled=pp > 1)
    f8_weights = sum(lin.in_features * lin.out_features for lin in linears if lin.float8)
    gathered_layer = ((1 if f8.enable_fsdp_float8_all_gather else a) * f8_weights
                      + a * (shape.layer_sharded - f8_weights)) / tp + a * shape.layer_replicated
    gathered_per_element = gathered_layer / (shape.layer_sharded / tp + shape.layer_replicated)
    moe_linears: list[Linear] = []
    gathered_by_kind = (gathered_layer, 0.0)
    if moe:  # a MoE unit gathers its attention, router, shared and this rank's experts
        gathered_by_kind = (gathered_layer,
                            a * (moe.sharded / tp + moe.replicated + moe.experts / ep))
        gathered_layer = max(gathered_by_kind)
        moe_linears = with_ep(moe.linears, moe.num_experts, ep)
        converted = dict(f8_moe)  # the block's own linears (attention, shared experts)
        moe_linears = [_converted(lin, converted.get(lin.name, lin.float8), f8.recipe,
                                  converted.get(lin.name, lin.float8)) for lin in moe_linears]
        if f8.moe_experts:
            moe_linears = float8_experts(moe_linears, f8.moe_experts_recipe, kernels=(
                f8.emulate is not True and bool(float8_hardware)))
    return Layout(
        cfg=cfg, shape=shape, rep=rep, shard=shard, tp=tp, cp=cp, pp=pp, ep=ep, a=a,
        reduce_bytes=2 if recipe.reduce_dtype == "bfloat16" else 4,
        sp=recipe.sequence_parallel_on(job), ac=recipe.ac,
        accum=accum, pp_microbatches=pp_mb, pipe=pipe, tokens_mb=tokens_mb,
        tokens=tokens_mb / cp, linears=linears, moe_linears=moe_linears, head_float8=f8_head,
        zero_n=n_fsdp if recipe.zero_stage >= 2 else dp * cp, reshard=reshard,
        gathered_layer=gathered_layer, gathered_per_element=gathered_per_element,
        gpus_per_node=gpus_per_node, ulysses=job.cp_ulysses if cp > 1 else 1, job=job,
        autocast=recipe.autocast(job, "cuda") is not None, gathered_by_kind=gathered_by_kind)


@functools.lru_cache(maxsize=4096)
def _converted(lin: Linear, float8: bool, recipe: str, dw_at_i: bool) -> Linear:
    """``lin`` as a float8 linear or not (frozen, so shared: the advice resolves thousands of
    layouts of one model)."""
    return dataclasses.replace(lin, float8=float8, float8_recipe=recipe, dw_at_i=dw_at_i)


def _auto_filter(f8, float8_hardware: bool | None) -> bool:
    """``[float8] auto_filter`` as the trainer resolves it on the planned device ("auto": on
    where float8 is not emulated; emulate "auto" emulates without float8 tensor cores), so the
    plan for an H100 converts what the trainer converts there, wherever the planner runs."""
    # the planner loads without torch and the training runtime until it needs them
    import torch

    # the planner loads without torch and the training runtime until it needs them
    from titanext.plugins.float8 import resolve_auto_filter, resolve_emulate

    device = "cuda" if torch.cuda.is_available() else "cpu"  # this machine's, if not said
    return resolve_auto_filter(f8.auto_filter, resolve_emulate(
        f8.emulate, device, float8_hardware=float8_hardware))
