"""The Trainer: build everything from a :class:`~titanext.config.JobConfig`, then the loop.

The build (:meth:`Trainer.__init__`): mesh, meta model, converters (float8), then
:func:`titanext.distributed.parallelize.parallelize` (or a
:class:`titanext.distributed.pipeline.PipelineRunner` that parallelizes each stage), optimizer,
data, checkpoints, metrics. :meth:`Trainer.train_step` is one optimizer step for every layout.
The loss is the token-loss sum over the tokens of the *global* batch (counted once); FSDP/DDP
average gradients over ``gradient_reduction_size`` ranks, so each rank scales its backward by
that size, as one process on the whole batch. The command line is :mod:`titanext.train`.

>>> from titanext.config import load_config
>>> cfg = load_config("train_configs/debug_model.toml", ["--training.steps=2"])
>>> losses = Trainer(cfg).train()   # trains the debug model: a minute  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from titanext._compat import inductor_cache_options
from titanext._fake_backend import host_float, real_tensors
from titanext._profiler_ranges import BACKWARD, DATA, FORWARD, LOG, LOSS, OPTIMIZER, PIPELINE, phase
from titanext.components.checkpoint import CheckpointManager, manifest_info
from titanext.components.garbage_collection import scheduled_collection
from titanext.components.metrics import MetricsLogger
from titanext.components.optim import build_lr_scheduler, build_optimizer
from titanext.components.param_groups import (
    ParamGroup,
    group_problems,
    muon_splits,
    param_groups,
)
from titanext.components.profiling import PipelineShape, StepProfiler
from titanext.components.validation import Validator
from titanext.config import JobConfig, Recipe, resolve_job_layout
from titanext.config.muon_split import ns_dtype_on
from titanext.data import dataloader_from_config
from titanext.data.tokenizer import build_tokenizer
from titanext.distributed.determinism import set_determinism
from titanext.distributed.grad_clip import clip_grad_norm_
from titanext.distributed.parallel_dims import ParallelDims
from titanext.distributed.parallelize import parallelize
from titanext.distributed.pipeline import PipelineRunner
from titanext.distributed.process_group import init_distributed, set_process_group_timeout
from titanext.errors import ConfigError, TrainingDiverged
from titanext.hf.checkpoint import load_initial_weights, save_hf_checkpoint
from titanext.models import build_model
from titanext.models.mtp import mtp_labels, mtp_loss_sums, reset_mtp_loss, set_mtp_grad_weight
from titanext.plugins.context_parallel import prepare_batch, shard_sequence
from titanext.plugins.expert_parallel.replication import copies_per_step
from titanext.plugins.float8 import apply_float8, precompute_float8_scales
from titanext.plugins.float8_experts import apply_float8_experts
from titanext.plugins.moe_balancing import MoEBalancing, reset_routing_counts

__all__ = ["IGNORE_INDEX", "Trainer"]

IGNORE_INDEX = -100


class Trainer:
    """Builds everything from a :class:`JobConfig` and runs the loop (initialises
    ``torch.distributed`` from torchrun's environment, or as one process)."""

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        t = cfg.training
        self.device = init_distributed(cfg.comm.init_timeout_seconds)
        self.rank, world_size = dist.get_rank(), dist.get_world_size()
        set_determinism(t.seed, t.deterministic)
        # the job resolved once: degrees, accumulation, model args, the pipeline's plan, and
        # the recipe (ZeRO, dtypes, SP, CP, EP, recompute, compile)
        self.layout = layout = resolve_job_layout(cfg, world_size)
        self.dims = dims = ParallelDims.from_layout(layout)
        dims.build_mesh(self.device.type)
        self.grad_accum_steps = layout.accumulation_steps
        self.recipe = recipe = layout.recipe
        self.loss_parallel, self.cp_layout = recipe.loss_parallel_on(dims), recipe.cp_layout
        self._loss_context = loss_parallel if self.loss_parallel else contextlib.nullcontext
        self._autocast = self._autocast_context(recipe, dims, self.device)
        self.compute_loss = self.token_loss_sum
        if recipe.compile_loss:
            self.compute_loss = torch.compile(
                self.token_loss_sum, backend=recipe.compile_backend,
                options=inductor_cache_options(recipe.compile_backend))
        # Model: meta -> converters -> parallelize (each pipeline stage alone) -> init.
        self.model_args = layout.model_args  # the flavor's, with the [moe] overrides
        self._parallelize(self._meta_model())
        self._pp_group = self.pipeline.pp_group if self.pipeline else None
        self.moe_balancing.weigh_aux_loss(self.model_parts,
                                          self.grad_accum_steps * t.local_batch_size)
        self._build_training_state()
        self.step, self._resumed = 0, False
        self.mtp_loss = 0.0  # the last step's MTP loss (models with MTP modules)

    def _meta_model(self) -> torch.nn.Module:
        """The whole model on the meta device, converters (float8) applied, its MoE blocks'
        balancing attached."""
        cfg, f8 = self.cfg, self.cfg.float8
        model = build_model(cfg.model.name, self.model_args, device="meta")
        self.num_params = model.num_params()  # the whole model's (a PP rank holds a part)
        if f8.enable:  # converters run first, on the meta model
            apply_float8(model, recipe=f8.recipe, filter_fqns=f8.filter_fqns,
                         auto_filter=f8.auto_filter, force_fqns=f8.force_fqns,
                         emulate=f8.emulate, device=self.device,
                         enable_fsdp_float8_all_gather=f8.enable_fsdp_float8_all_gather)
        if f8.moe_experts:  # the routed experts' grouped GEMMs (the rules checked it has them)
            # a dry run plans the float8 GPU's run: the kernels' own backward, not deferred
            apply_float8_experts(model, recipe=f8.moe_experts_recipe, emulate=f8.emulate,
                                 device=self.device,
                                 target_kernels=cfg.comm.mode == "fake_backend")
        self.moe_balancing = MoEBalancing(model, device=self.device)  # the whole model's blocks
        self.moe_load = self.moe_balancing.load  # {block FQN: max/mean load} of the last step
        self.param_groups = self._param_groups(model)
        return model

    def _param_groups(self, model: torch.nn.Module) -> list[ParamGroup] | None:
        """[optimizer]'s groups over the whole model (ConfigError, one line per problem), or
        None where none are configured (AdamW / Adam on every parameter, as before)."""
        o = self.cfg.optimizer
        self.muon_splits: dict[str, tuple[int, tuple[int, ...]]] = {}  # muon_split_params
        if o.name != "Muon" and o.no_decay_params is None:
            return None
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        rules = dict(name=o.name, muon_params=o.muon_params, no_decay_params=o.no_decay_params)
        problems = group_problems(shapes, **rules, muon_split_params=o.muon_split_params)
        if problems:
            raise ConfigError(problems)
        self.muon_splits = muon_splits(shapes, o.muon_split_params)
        return param_groups(shapes, **rules)

    def _parallelize(self, model: torch.nn.Module) -> None:
        """The recipe applied to the model, or to each of this rank's pipeline stages:
        ``model_parts``, ``model``, ``train_module`` (ZeRO-1: the DDP wrapper), ``pipeline``."""
        cfg, t, dims = self.cfg, self.cfg.training, self.dims
        parallelize_part = functools.partial(
            parallelize, dims=dims, recipe=self.recipe, device=self.device,
            check_replicated_grads=(cfg.parallelism.check_replicated_grads_steps
                                    if cfg.comm.mode == "real" else 0),
            init_weights=(lambda m: None) if cfg.comm.mode == "fake_backend"  # fake values
            else (lambda m: m.init_weights(seed=t.seed)))
        self.pipeline: PipelineRunner | None = None
        if not dims.pp_enabled:
            self.model, self.train_module = model, parallelize_part(model)
            self.model_parts = [model]
            return
        positions = torch.arange(t.seq_len, device=self.device)  # each stage runs RoPE on
        if dims.cp_enabled:  # the positions of this rank's slice
            positions = shard_sequence(positions, 0, dims.cp_mesh, self.cp_layout)
        plan = self.layout.pipeline

        def parallelize_stage(part: torch.nn.Module) -> torch.nn.Module:
            # the stage's own recipe (a per-stage full_blocks), found by its first block
            first = int(next(iter(part.layers), 0))
            return parallelize_part(part, recipe=self.recipe.for_stage(plan.stage_of_block(first)))

        self.pipeline = PipelineRunner(
            model, dims, plan, device=self.device,
            loss_fn=lambda logits, labels: self.compute_loss(logits, labels),
            position_ids=positions, parallelize_stage=parallelize_stage,
            reset_stage_state=self._reset_stage_state, loss_context=self._loss_context)
        self.model_parts = self.pipeline.parts
        self.model = self.train_module = self.model_parts[0]

    def _build_training_state(self) -> None:
        """Optimizer (ZeRO-1: sharded over the loss ranks), LR schedule, tokenizer, data,
        validation and checkpoints."""
        cfg, t, dims = self.cfg, self.cfg.training, self.dims
        o, s, c = cfg.optimizer, cfg.lr_scheduler, cfg.checkpoint
        named = [(n, q) for part in self.model_parts for n, q in part.named_parameters()]
        muon = dict(lr=o.muon_lr, momentum=o.muon_momentum, nesterov=o.muon_nesterov,
                    ns_steps=o.muon_ns_steps, adjust_lr_fn=o.muon_adjust_lr_fn,
                    ns_dtype=getattr(torch, ns_dtype_on(  # a dry run stands for CUDA
                        o.muon_ns_dtype, "cuda" if cfg.comm.mode == "fake_backend"
                        else self.device.type)),
                    splits=self.muon_splits,
                    weight_decay=o.weight_decay if o.muon_weight_decay is None
                    else o.muon_weight_decay)
        self.optimizer = build_optimizer(
            named if self.param_groups else [q for _, q in named], name=o.name, lr=o.lr,
            betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
            implementation=o.implementation,
            zero1_group=dims.loss_mesh.get_group() if self.recipe.zero1(dims) else None,
            groups=self.param_groups, muon=muon, state_dtype=o.state_dtype)
        self.lr_scheduler = build_lr_scheduler(
            self.optimizer, warmup_steps=s.warmup_steps, total_steps=t.steps,
            decay_ratio=s.decay_ratio, decay_type=s.decay_type, min_lr_factor=s.min_lr_factor)
        self.tokenizer = build_tokenizer(cfg.model.tokenizer, cfg.model.hf_assets_path)
        with real_tensors():  # a dry run's data are real tokens (they turn fake in the step)
            self.dataloader = dataloader_from_config(
                t, self.tokenizer, dims.dp_mesh.get_local_rank(), dims.dp,
                document_masking=t.document_masking)
        self.validator = Validator(self)  # [validation]: held-out loss every freq steps
        self.checkpointer = CheckpointManager(
            folder=os.path.join(cfg.job.dump_folder, c.folder), interval=c.interval,
            keep_latest_k=c.keep_latest_k, load_step=c.load_step, last_save=c.last_save,
            enable=c.enable, model_parts=self.model_parts, optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler, dataloader=self.dataloader,
            manifest=manifest_info(cfg, dims), async_mode=c.async_mode,
            model_weights_only=c.model_weights_only, export_dtype=c.export_dtype)

    @staticmethod
    def _reset_stage_state(module: torch.nn.Module) -> None:
        """Forget what a pipeline stage's shape-inference forward accumulated."""
        reset_routing_counts(module)
        reset_mtp_loss(module)

    @staticmethod
    def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Sum of token cross-entropies (fp32); normalised by the caller."""
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                               reduction="sum", ignore_index=IGNORE_INDEX)

    @staticmethod
    def _autocast_context(recipe: Recipe, dims: ParallelDims, device: torch.device):
        """Mixed precision where FSDP does not apply it (one rank, or ZeRO-1's DDP), as torchtitan
        does: ``torch.autocast`` to the recipe's param dtype around the forward
        (:meth:`Recipe.autocast <titanext.config.Recipe.autocast>`)."""
        dtype = recipe.autocast(dims, device.type)
        if dtype is None:
            return contextlib.nullcontext
        return functools.partial(torch.autocast, device.type, dtype=getattr(torch, dtype))

    def next_microbatches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [self.dataloader.next_batch() for _ in range(self.grad_accum_steps)]

    def _forward_backward(self, microbatches, scale: float) -> torch.Tensor:
        """Backward of every micro-batch's loss x ``scale``; returns the unscaled loss sum."""
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, (inputs, labels, positions, docs, *mtp) in enumerate(microbatches):
            # DDP (ZeRO-1) all-reduces on every backward unless told otherwise; FSDP's
            # per-micro-batch reduce-scatter is what keeps its gradients sharded.
            skip_sync = self.train_module is not self.model and i < len(microbatches) - 1
            sync = self.train_module.no_sync() if skip_sync else contextlib.nullcontext()
            with sync, self._loss_context():
                with phase(FORWARD), self._autocast():
                    extra = {"mtp_labels": mtp[0]} if mtp else {}
                    logits = self.train_module(inputs, positions, document_ids=docs, **extra)
                    loss = self.compute_loss(logits, labels)
                with phase(BACKWARD):
                    (loss * scale).backward()
            if isinstance(loss, DTensor):
                loss = loss.full_tensor()
            loss_sum += loss.detach().to(torch.float64)
            del logits, loss
        return loss_sum

    def train_step(self, microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]]
                   ) -> tuple[float, float]:
        """One optimizer step over this rank's micro-batches; returns (global loss, grad norm)."""
        dims, max_norm = self.dims, self.cfg.training.max_norm
        loss_group = dims.loss_mesh.get_group()
        # Under CP each rank counts (and sums the loss of) only its own slice of the tokens,
        # with the slice's global positions for RoPE (document masking: in-document positions).
        cp = dims.cp_mesh if dims.cp_enabled else None
        with phase(DATA):
            microbatches = [self._prepare(mb, cp) for mb in microbatches]
        with phase(LOSS):
            local_tokens = sum(host_float((y != IGNORE_INDEX).sum(), y.numel()) for _, y, *_ in
                               microbatches)  # (a dry run's labels are fake: all count)
            counts = torch.tensor([float(local_tokens)], dtype=torch.float64, device=self.device)
            dist.all_reduce(counts, group=loss_group)
            global_tokens = max(host_float(counts, local_tokens * dims.loss_mesh.size()), 1.0)
        scale = dims.gradient_reduction_size / global_tokens
        depth = self.model_args.num_mtp_layers
        if depth:  # the MTP loss: mtp_loss_weight / depth x its token-CE sum / global tokens
            set_mtp_grad_weight(self.model_parts, scale * self.cfg.training.mtp_loss_weight / depth)
        # hot-expert copies: planned, sent and returned once per step (expert_replication)
        calls = (len(microbatches) if self.pipeline is None
                 else self.pipeline.stage_microbatches(len(microbatches)))
        if self.pipeline is not None:  # document ids and their positions reach every stage
            with phase(PIPELINE), copies_per_step(self.model_parts, calls):
                loss_sum = self.pipeline.step(microbatches, loss_scale=scale)
            with phase(OPTIMIZER):
                grad_norm = self.pipeline.clip_grad_norm(max_norm)
        else:
            with copies_per_step(self.model_parts, calls):
                loss_sum = self._forward_backward(microbatches, scale)
            with phase(OPTIMIZER):
                grad_norm = clip_grad_norm_(self.model.parameters(), max_norm)
        with phase(LOSS):
            dist.all_reduce(loss_sum, group=loss_group)
            mean_loss, grad_norm = host_float(loss_sum / global_tokens), host_float(grad_norm)
            if depth:
                self.mtp_loss = self._mtp_loss(global_tokens, loss_group)
        if self.cfg.comm.mode == "real" and not (math.isfinite(mean_loss + grad_norm)):
            raise TrainingDiverged(
                f"step {self.step + 1}: loss = {mean_loss}, grad norm = {grad_norm}; stopping "
                "without an optimizer step (the last good checkpoint is kept)")
        with phase(OPTIMIZER):
            self._optimizer_step()
        return mean_loss, grad_norm

    def _prepare(self, microbatch, cp) -> tuple:
        """This rank's (inputs, labels, positions, docs[, mtp labels]) of a loader batch: the
        MTP labels come from the whole sequence, then are sharded like the labels under CP."""
        prepared = prepare_batch(*microbatch, group=cp, layout=self.cp_layout, device=self.device)
        depth = self.model_args.num_mtp_layers
        if not depth:
            return prepared
        future = mtp_labels(microbatch[1], depth)
        if cp is not None:
            future = shard_sequence(future, 1, cp, self.cp_layout)
        return (*prepared, future.to(self.device))

    def _mtp_loss(self, global_tokens: float, loss_group) -> float:
        """The step's MTP loss: the mean over the MTP modules of their token-CE sum / the main
        loss's token count (DeepSeek-V3's L_MTP^k, averaged over k), for the metrics."""
        depth = self.model_args.num_mtp_layers
        sums = mtp_loss_sums(self.model_parts, depth, self.device)
        if self._pp_group is not None:
            dist.all_reduce(sums, group=self._pp_group)  # held by the last stage(s) only
        dist.all_reduce(sums, group=loss_group)
        return host_float(sums.sum() / (global_tokens * depth))

    def _optimizer_step(self) -> None:
        """Optimizer and LR steps, MoE bias update, float8 scales, zero_grad."""
        dims = self.dims
        loss_group = dims.loss_mesh.get_group()
        self.optimizer.step()
        dp_group = loss_group if dims.loss_mesh.size() > 1 else None
        self.moe_balancing.step(self.model_parts, pp_group=self._pp_group, dp_group=dp_group)
        if self.cfg.float8.enable and self.cfg.float8.precompute_scale:
            for part in self.model_parts:  # one all-reduce for every all-gathered weight's scale
                precompute_float8_scales(part)
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def train(self, until_step: int | None = None) -> list[float]:
        """Resume if a checkpoint exists, then train to ``training.steps`` (or ``until_step``).

        ``until_step`` stops early without changing the schedule, as a preempted job would.
        Returns this call's per-step losses.
        """
        cfg, t, m, c = self.cfg, self.cfg.training, self.cfg.metrics, self.cfg.checkpoint
        last_step = t.steps if until_step is None else min(until_step, t.steps)
        if not self._resumed:  # a second train() call continues in memory
            self.step, self._resumed = self.checkpointer.load(), True
            if self.step == 0 and c.initial_load_path:  # nothing to resume yet
                load_initial_weights(self.model_parts, c.initial_load_path, self.model_args,
                                     in_hf=c.initial_load_in_hf)
        tokens_per_step = self.grad_accum_steps * t.local_batch_size * self.dims.dp * t.seq_len
        metrics = MetricsLogger(
            job_dir=cfg.job.dump_folder, rank=self.rank, is_logging_rank=self.rank == 0,
            log_freq=m.log_freq, total_steps=t.steps, enable_tensorboard=m.enable_tensorboard,
            tb_folder=m.save_tb_folder, device=self.device,
            flops_per_token=self.model.num_flops_per_token(t.seq_len),
            num_devices=dist.get_world_size(), color=not m.disable_color_printing,
            progress_bar=m.progress_bar, enable_wandb=m.enable_wandb,
            wandb_config=dataclasses.asdict(cfg) if m.enable_wandb else None)
        d, n, mc = self.dims, self.num_params, cfg.model
        mine = sum(part.num_params() for part in self.model_parts)  # this rank's stages
        share = f", this rank's stages {mine / 1e6:.2f}M" if self.pipeline else ""
        if self.rank == 0:
            print(f"titanext: {mc.name}/{mc.flavor} ({n / 1e6:.2f}M params{share}) on "
                  f"{dist.get_world_size()} x {self.device.type} | pp={d.pp} dp_replicate="
                  f"{d.dp_replicate} dp_shard={d.dp_shard} cp={d.cp} tp={d.tp} ep={d.ep} | "
                  f"zero_stage={self.recipe.zero_stage} | grad accumulation "
                  f"{self.grad_accum_steps} | {tokens_per_step} tokens/step", flush=True)
        losses = []
        profiler = self.profiler()
        try:
            with profiler, scheduled_collection(t.gc_freq) as collect_garbage:
                while self.step < last_step:
                    lr = self.lr_scheduler.get_last_lr()[0]  # the LR this step uses
                    with profiler.around_step(self.step + 1):
                        with phase(DATA):
                            microbatches = self.next_microbatches()
                        loss, grad_norm = self.train_step(microbatches)
                    self.step += 1
                    if self.step == 1:
                        set_process_group_timeout(cfg.comm.train_timeout_seconds)
                    losses.append(loss)
                    with phase(LOG):
                        self._after_step(metrics, tokens_per_step, loss, grad_norm, lr)
                    collect_garbage(self.step)
                    profiler.step(self.step)
        finally:
            metrics.close()
        self.checkpointer.wait()  # an async save in flight is committed before train returns
        return losses

    def _after_step(self, metrics: MetricsLogger, tokens_per_step: int, loss: float,
                    grad_norm: float, lr: float) -> None:
        """Metrics, validation, checkpoints after a step."""
        cfg, c = self.cfg, self.cfg.checkpoint
        metrics.record_tokens(tokens_per_step)
        shown, tb = self.moe_balancing.metrics(self.model_parts, pp_group=self._pp_group)
        if self.model_args.num_mtp_layers:  # logged apart from the main loss
            shown = {**(shown or {}), "mtp_loss": self.mtp_loss}
        metrics.log(self.step, loss=loss, grad_norm=grad_norm, lr=lr, extra=shown, tb_extra=tb)
        self.validator.maybe_run(self.step, metrics)
        self.checkpointer.maybe_save(self.step, last=self.step == cfg.training.steps)
        if self.step == cfg.training.steps and c.last_save_in_hf and c.enable:
            save_hf_checkpoint(self.model_parts, os.path.join(
                cfg.job.dump_folder, c.folder, f"step-{self.step}-hf"), self.model_args,
                tokenizer=self.tokenizer, hf_assets_path=cfg.model.hf_assets_path)

    def profiler(self) -> StepProfiler:
        """The ``[profiling]`` driver of a training loop starting at the current step."""
        pipe, shape = self.pipeline, None
        if pipe is not None:
            shape = PipelineShape(plan=self.layout.pipeline,
                                  pp_rank=self.dims.pp_mesh.get_local_rank(), group=pipe.pp_group)
        return StepProfiler(self.cfg.profiling, dump_folder=self.cfg.job.dump_folder,
                            rank=self.rank, device=self.device, start_step=self.step,
                            parts=self.model_parts, optimizer=self.optimizer, pipeline=shape,
                            pipeline_schedule=pipe.schedule if pipe else None)
