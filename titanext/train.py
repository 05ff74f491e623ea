"""The training entrypoint: ``torchrun --nproc_per_node N -m titanext.train --config FILE``.

The flow reads like a recipe (see :meth:`Trainer.__init__`): validate the config, build the
mesh, build the model on the meta device, apply TP -> AC -> compile -> FSDP/DDP, then
``to_empty`` and ``init_weights``; then optimizer, scheduler, data, checkpoints and metrics.

Loss normalisation: each step's loss is the sum of token losses divided by the number of
(non-ignored) tokens in the *global* batch, counted once across all data-parallel ranks and
micro-batches. FSDP/DDP average gradients over the ``gradient_reduction_size`` ranks, so each
rank scales its backward by that size; every layout then computes the gradient one process
would compute on the whole batch.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import signal
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from titanext.checkpoint import CheckpointManager
from titanext.config import (
    ConfigError,
    JobConfig,
    config_help,
    gradient_accumulation_steps,
    load_config,
    model_args,
    parse_cli,
    to_toml,
)
from titanext.data import build_dataloader
from titanext.errors import TrainingDiverged
from titanext.hf_checkpoint import load_initial_weights, save_hf_checkpoint
from titanext.metrics import MetricsLogger
from titanext.models import build_model
from titanext.models.moe import MoE, expert_load, set_aux_loss_weight, update_expert_bias
from titanext.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_
from titanext.parallel_dims import ParallelDims, init_distributed
from titanext.pipeline import (
    StageTimer,
    build_pipeline,
    ignore_shape_inference_forward,
    layers_per_stage,
    pass_position_ids,
    pipeline_stage_ids,
    resolve_microbatches,
    split_model,
    stages_per_rank_of,
)
from titanext.plugins.activation_checkpoint import apply_activation_checkpointing
from titanext.plugins.compile import apply_compile
from titanext.plugins.context_parallel import apply_context_parallel, shard_batch, shard_sequence
from titanext.plugins.expert_parallel import apply_expert_parallel
from titanext.plugins.float8 import apply_float8, precompute_float8_scales
from titanext.plugins.fsdp import apply_ddp, apply_fsdp
from titanext.plugins.tensor_parallel import apply_tensor_parallel
from titanext.schedules import get_schedule_class, num_stages_for, stage_ids_for_rank
from titanext.schedules.dualpipe import clip_mirrored_grads, sum_mirrored_grads
from titanext.tokenizer import build_tokenizer

IGNORE_INDEX = -100


def _reset_moe_counts(module: nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, MoE):
            m.tokens_per_expert.zero_()


def _dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def _set_process_group_timeout(seconds: float) -> None:
    """Shorten the collective timeout once start-up (which may compile or load) is done."""
    try:  # private in every torch we support; losing it only keeps the init timeout.
        from torch.distributed.distributed_c10d import _set_pg_timeout

        _set_pg_timeout(datetime.timedelta(seconds=seconds), None)
    except (ImportError, AttributeError, RuntimeError):
        pass


class Trainer:
    """Builds everything from a :class:`JobConfig` and runs the loop.

    Needs ``torch.distributed`` initialised (``init_distributed`` does it from torchrun's
    environment, also for a single process).
    """

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        t, p = cfg.training, cfg.parallelism
        self.device = init_distributed(cfg.comm.init_timeout_seconds)
        self.rank, world_size = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(t.seed)
        if t.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.benchmark = False

        self.dims = dims = ParallelDims(
            dp_replicate=p.data_parallel_replicate_degree,
            dp_shard=p.data_parallel_shard_degree,
            cp=p.context_parallel_degree,
            tp=p.tensor_parallel_degree,
            pp=p.pipeline_parallel_degree,
            ep=p.expert_parallel_degree,
            world_size=world_size,
        )
        dims.build_mesh(self.device.type)
        self.grad_accum_steps = gradient_accumulation_steps(cfg, world_size)

        # Model: meta -> parallelize -> materialise -> init.
        self.model_args = model_args(cfg)  # the flavor's, with the [moe] overrides
        model = build_model(cfg.model.name, self.model_args, device="meta")
        f8 = cfg.float8
        if f8.enable:  # converters run first, on the meta model
            apply_float8(model, recipe=f8.recipe, filter_fqns=f8.filter_fqns, auto_filter=f8.auto_filter,
                         enable_fsdp_float8_all_gather=f8.enable_fsdp_float8_all_gather,
                         emulate=f8.emulate, device=self.device)
        self._precompute_float8 = f8.enable and f8.precompute_scale
        # Every MoE block of the whole model (a pipeline rank holds some of them).
        self._moe_names = [n for n, m in model.named_modules() if isinstance(m, MoE)]
        self.loss_parallel = dims.tp_enabled and p.enable_loss_parallel
        self.cp_layout = "zigzag" if p.context_parallel_load_balance == "zigzag" else "contiguous"
        # ZeRO-1 replicates parameters over every rank that reduces gradients: dp and cp.
        zero1 = p.zero_stage == 1 and (dims.dp_enabled or dims.cp_enabled)
        self.pp_mirrored = False  # DualPipe's two copies (set by _build_pipeline)
        if dims.pp_enabled:  # one part per stage this rank holds, each parallelized alone
            self.model_parts = self._build_pipeline(model)
            model = self.model_parts[0]
        else:
            self._parallelize(model)
            model.to_empty(device=self.device)
            model.init_weights(seed=t.seed)
            self.model_parts = [model]
        self.model = model
        # ZeRO-1: DDP over replicated parameters + a sharded optimizer state.
        self.train_module: nn.Module = apply_ddp(model, dims.loss_mesh) if zero1 else model
        self._is_ddp = isinstance(self.train_module, nn.parallel.DistributedDataParallel)
        # MoE sequence aux loss: weight 1/(sequences per rank per step) per sequence, so that
        # after FSDP's average over dp x cp it is the mean over the global step's sequences
        # (CP slices count as sequences), next to the token-mean cross-entropy.
        for part in self.model_parts:
            set_aux_loss_weight(part, 1.0 / (self.grad_accum_steps * t.local_batch_size))
        self.moe_load: dict[str, torch.Tensor] = {}
        self.compute_loss = self._token_loss_sum
        if cfg.compile.enable and "loss" in cfg.compile.components:
            self.compute_loss = torch.compile(self._token_loss_sum, backend=cfg.compile.backend)

        o = cfg.optimizer
        self.optimizer = build_optimizer(
            [q for part in self.model_parts for q in part.parameters()], name=o.name, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
            weight_decay=o.weight_decay, implementation=o.implementation,
            zero1_group=dims.loss_mesh.get_group() if zero1 else None,
        )
        s = cfg.lr_scheduler
        self.lr_scheduler = build_lr_scheduler(
            self.optimizer, warmup_steps=s.warmup_steps, total_steps=t.steps,
            decay_ratio=s.decay_ratio, decay_type=s.decay_type, min_lr_factor=s.min_lr_factor,
        )
        self.tokenizer = build_tokenizer(cfg.model.tokenizer, cfg.model.hf_assets_path)
        self.dataloader = build_dataloader(
            dataset=t.dataset, dataset_path=t.dataset_path, tokenizer=self.tokenizer,
            seq_len=t.seq_len, local_batch_size=t.local_batch_size,
            dp_rank=dims.dp_mesh.get_local_rank(), dp_degree=dims.dp, seed=t.seed, shuffle=t.shuffle,
        )
        c = cfg.checkpoint
        self.checkpointer = CheckpointManager(
            folder=os.path.join(cfg.job.dump_folder, c.folder), interval=c.interval,
            keep_latest_k=c.keep_latest_k, load_step=c.load_step, last_save=c.last_save,
            enable=c.enable, model_parts=self.model_parts, optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler, dataloader=self.dataloader,
        )
        self.step = 0
        self._resumed = False

    def _parallelize(self, model: nn.Module) -> None:
        """TP -> EP -> CP -> AC -> compile -> FSDP on one model (or one pipeline stage), in place."""
        cfg, dims, p, t = self.cfg, self.dims, self.cfg.parallelism, self.cfg.training
        f8 = cfg.float8
        if dims.tp_enabled:
            apply_tensor_parallel(model, dims.tp_mesh, sequence_parallel=p.enable_sequence_parallel,
                                  float8=f8.enable,
                                  loss_parallel=self.loss_parallel)
        experts: list[nn.Module] = []
        if dims.ep_enabled:  # the MoE stays replicated over tp; ep splits its experts
            experts = [model.get_submodule(f) for f in apply_expert_parallel(model, dims.ep_mesh)]
        if dims.cp_enabled:  # before AC, so recomputation reruns the ring too
            apply_context_parallel(model, dims.cp_mesh, layout=self.cp_layout,
                                   comm=p.context_parallel_comm)
        ac = cfg.activation_checkpoint
        apply_activation_checkpointing(model, mode=ac.mode, option=ac.selective_ac_option,
                                       save_ops=ac.selective_op_save_list)
        if cfg.compile.enable and "model" in cfg.compile.components:
            # EP: the experts are their own FSDP unit inside the block, and dispatch needs its split
            # sizes on the host; both break the graph, so MoE blocks compile in pieces.
            apply_compile(model, backend=cfg.compile.backend, fullgraph=not experts)
        # ZeRO-1 replicates parameters over every rank that reduces gradients: dp and cp.
        zero1 = p.zero_stage == 1 and (dims.dp_enabled or dims.cp_enabled)
        if not zero1 and (dims.fsdp_enabled or dims.dp_replicate > 1):
            apply_fsdp(
                model,
                dims.fsdp_mesh,
                param_dtype=_dtype(t.mixed_precision_param, self.device),
                reduce_dtype=_dtype(t.mixed_precision_reduce, self.device),
                reshard_after_forward=p.fsdp_reshard_after_forward,
                zero_stage=max(p.zero_stage, 2),
                pp_enabled=dims.pp_enabled,
                # Experts are sharded over the dp ranks ep leaves (dp_shard_mod_ep); their
                # gradients are summed over fewer ranks, so divide by the dense reduction size.
                expert_units=experts,
                expert_mesh=dims.expert_fsdp_mesh if experts else None,
                expert_gradient_divide_factor=dims.gradient_reduction_size,
            )

    # -- pieces ------------------------------------------------------------------------------
    @staticmethod
    def _token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Sum of token cross-entropies (fp32); normalised by the caller."""
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                               reduction="sum", ignore_index=IGNORE_INDEX)

    def _loss_context(self):
        return loss_parallel() if self.loss_parallel else contextlib.nullcontext()

    def next_microbatches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [self.dataloader.next_batch() for _ in range(self.grad_accum_steps)]

    def _shard_for_cp(self, inputs: torch.Tensor, labels: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """This CP rank's slice of each sequence, with the global positions for RoPE."""
        if not self.dims.cp_enabled:
            return inputs, labels, None
        return shard_batch(inputs, labels, self.dims.cp_mesh, layout=self.cp_layout)

    def train_step(self, microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
        """One optimizer step over this rank's micro-batches; returns (global loss, grad norm)."""
        if self.dims.pp_enabled:
            return self._pp_train_step(microbatches)
        dims = self.dims
        loss_group = dims.loss_mesh.get_group()
        # Under CP each rank counts (and sums the loss of) only its own slice of the tokens.
        microbatches = [self._shard_for_cp(*mb) for mb in microbatches]
        local_tokens = sum(int((labels != IGNORE_INDEX).sum()) for _, labels, _ in microbatches)
        counts = torch.tensor([float(local_tokens)], dtype=torch.float64, device=self.device)
        dist.all_reduce(counts, group=loss_group)
        global_tokens = counts.item()
        scale = dims.gradient_reduction_size / max(global_tokens, 1.0)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, (inputs, labels, positions) in enumerate(microbatches):
            inputs, labels = inputs.to(self.device), labels.to(self.device)
            if positions is not None:
                positions = positions.to(self.device)
            # DDP (ZeRO-1) all-reduces on every backward unless told otherwise; FSDP's
            # per-micro-batch reduce-scatter is what keeps its gradients sharded.
            skip_sync = self._is_ddp and i < len(microbatches) - 1
            sync = self.train_module.no_sync() if skip_sync else contextlib.nullcontext()
            with sync, self._loss_context():
                logits = self.train_module(inputs, positions)
                loss = self.compute_loss(logits, labels)
                (loss * scale).backward()
            if isinstance(loss, DTensor):
                loss = loss.full_tensor()
            loss_sum += loss.detach().to(torch.float64)
            del logits, loss
        dist.all_reduce(loss_sum, group=loss_group)
        mean_loss = (loss_sum / max(global_tokens, 1.0)).item()
        grad_norm = clip_grad_norm_(self.model.parameters(), self.cfg.training.max_norm).item()
        if not (math.isfinite(mean_loss) and math.isfinite(grad_norm)):
            raise TrainingDiverged(
                f"step {self.step + 1}: loss = {mean_loss}, grad norm = {grad_norm}; stopping without "
                "an optimizer step (the last good checkpoint is kept)"
            )
        self.optimizer.step()
        self._update_moe()
        if self._precompute_float8:  # one all-reduce for every float8 all-gathered weight's scale
            precompute_float8_scales(self.model)
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return mean_loss, grad_norm

    def _update_moe(self) -> None:
        """After the optimizer step: aux-loss-free bias update of every MoE block, with the
        loads summed over dp x cp (the ranks that see different tokens) and, under PP, over pp
        (every rank learns every block's load; DualPipe's two copies of a block add up to the
        one model's counts); keeps them for the metrics as {block FQN: max/mean load}."""
        if not self._moe_names:
            return
        held = self._held_moe_blocks()
        loads = torch.zeros(len(self._moe_names), self.model_args.moe.num_experts, device=self.device)
        for i, m in held:
            loads[i] += m.tokens_per_expert.float()
        if self.dims.pp_enabled:
            dist.all_reduce(loads, group=self.pp_group)
        if self.dims.loss_mesh.size() > 1:
            dist.all_reduce(loads, group=self.dims.loss_mesh.get_group())
        for i, m in held:  # the summed counts, then the update of this process's blocks only
            m.tokens_per_expert.copy_(loads[i])
        for part in self.model_parts:
            update_expert_bias(part, group=None)
        self.moe_load = dict(zip(self._moe_names, expert_load(loads), strict=True))

    def _held_moe_blocks(self) -> list[tuple[int, MoE]]:
        """(index in ``self._moe_names``, block) of every MoE block this process holds (pipeline
        stages keep the whole model's FQNs)."""
        index = {n: i for i, n in enumerate(self._moe_names)}
        return [(index[n], m) for part in self.model_parts for n, m in part.named_modules()
                if isinstance(m, MoE)]

    def _moe_metrics(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(console + TensorBoard, TensorBoard only) MoE metrics of the last step."""
        if not self.moe_load:
            return {}, {}
        shown = {"moe_load": torch.stack(list(self.moe_load.values())).max()}
        if self.model_args.moe.aux_loss_alpha:  # the last micro-batch, summed over blocks
            aux = torch.zeros(len(self._moe_names), device=self.device)
            for i, m in self._held_moe_blocks():
                if m.aux_loss is not None:
                    aux[i] = m.aux_loss
            if self.dims.pp_enabled:  # each block from a rank that holds it (aux >= 0)
                dist.all_reduce(aux, op=dist.ReduceOp.MAX, group=self.pp_group)
            shown["moe_aux_loss"] = aux.sum()
        return shown, {f"moe_load/{name}": v for name, v in self.moe_load.items()}

    # -- pipeline parallelism --------------------------------------------------------------
    def _build_pipeline(self, model: nn.Module) -> list[nn.Module]:
        """Split the meta model into this rank's stages, parallelize and init each, build the
        schedule. Placement comes from the schedule class (titanext.pipeline)."""
        p, t, dims = self.cfg.parallelism, self.cfg.training, self.dims
        pp_mesh = dims.pp_mesh
        self.pp_group, pp_rank = pp_mesh.get_group(), pp_mesh.get_local_rank()
        name = p.pipeline_parallel_schedule
        per_rank = stages_per_rank_of(name, p.pipeline_parallel_stages_per_rank)
        placement = get_schedule_class(name).placement
        # DualPipe runs two mirrored copies of a pp-stage model: rank r holds stage r of the
        # down copy and stage pp-1-r of the up copy, both initialised alike (FQN-keyed init)
        self.pp_mirrored = placement == "dualpipe"
        self.pp_num_stages = n_stages = num_stages_for(placement, dims.pp, per_rank)
        # ranks that hold the last stage report every micro-batch's loss (2 under DualPipe)
        self._pp_loss_copies = sum(n_stages - 1 in stage_ids_for_rank(placement, r, dims.pp, per_rank)
                                   for r in range(dims.pp))
        counts = layers_per_stage(len(model.layers), n_stages,
                                  first_stage_less_layers=p.pipeline_parallel_first_stage_less_layers,
                                  last_stage_less_layers=p.pipeline_parallel_last_stage_less_layers,
                                  explicit=p.pipeline_parallel_layers_per_stage)
        self.pp_stage_ids = pipeline_stage_ids(name, pp_rank=pp_rank, pp=dims.pp,
                                               stages_per_rank=per_rank)
        parts = []
        for i in self.pp_stage_ids:
            part = split_model(model, counts, i)
            self._parallelize(part)
            part.to_empty(device=self.device)
            part.init_weights(seed=t.seed)  # FQN-keyed init: same values as the whole model
            parts.append(part)
        # Every stage runs RoPE, but only the first sees the tokens (later ones get hidden
        # states, sharded over tp under SP): each stage is handed the positions its rank's slice
        # of the sequence holds. They depend on the cp rank, layout and seq_len only, so they
        # are the same for every micro-batch and step.
        positions = torch.arange(t.seq_len, device=self.device)
        if dims.cp_enabled:
            positions = shard_sequence(positions, 0, dims.cp_mesh, self.cp_layout)
        for part in parts:
            pass_position_ids(part, positions)
        self.pp_microbatches = resolve_microbatches(dims.pp, p.pipeline_parallel_microbatches,
                                                    t.local_batch_size)
        self._pp_loss_scale = 1.0
        self._pp_loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.pp_stages, self.pp_schedule = build_pipeline(
            parts, self.pp_stage_ids, num_stages=n_stages, pp_group=self.pp_group,
            device=self.device, schedule=name, microbatches=self.pp_microbatches,
            loss_fn=self._pp_loss,
            # mirrored gradients are summed once per optimizer step (after accumulation)
            schedule_kwargs={"sum_mirrored_grads": False} if self.pp_mirrored else None)
        ignore_shape_inference_forward(parts, _reset_moe_counts)
        # Auto: time F, I and W on the first step, then switch to the schedule made for them.
        measures = getattr(get_schedule_class(name), "measures_costs", False)
        self._pp_timer = StageTimer(self.pp_stages) if measures else None
        return parts

    def _pp_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per micro-batch on the last stage: token-loss sum, scaled once by the global count.

        Runs inside ``schedule.step``, which ``_pp_train_step`` already wraps in the loss
        parallel context (a nested context would switch it off on exit, before the backward)."""
        return self.compute_loss(logits, labels) * self._pp_loss_scale

    def _pp_train_step(self, microbatches) -> tuple[float, float]:
        """One optimizer step through the pipeline schedule (see titanext.pipeline)."""
        dims = self.dims
        loss_group = dims.loss_mesh.get_group()
        # Under CP each rank feeds (and takes the loss of) its own slice of every sequence; the
        # stages already hold the matching positions (see _build_pipeline).
        microbatches = [self._shard_for_cp(*mb)[:2] for mb in microbatches]
        local_tokens = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in microbatches)
        counts = torch.tensor([float(local_tokens)], dtype=torch.float64, device=self.device)
        dist.all_reduce(counts, group=loss_group)
        global_tokens = counts.item()
        self._pp_loss_scale = dims.gradient_reduction_size / max(global_tokens, 1.0)
        self._pp_loss_sum.zero_()
        first, last = 0 in self.pp_stage_ids, self.pp_num_stages - 1 in self.pp_stage_ids
        for inputs, labels in microbatches:  # gradient accumulation: one schedule step each
            args = (inputs.to(self.device),) if first else ()
            losses: list[torch.Tensor] = []
            kwargs = {"target": labels.to(self.device), "losses": losses} if last else {}
            with self._loss_context():  # loss parallel: its backward runs inside step too
                self.pp_schedule.step(*args, **kwargs)
            for loss in losses:  # the schedule's record of what each micro-batch returned
                loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
                self._pp_loss_sum += loss.detach().to(torch.float64) / self._pp_loss_scale
        if self._pp_timer is not None:  # Auto's measuring step is done: switch schedules
            costs = self._pp_timer.costs(self.pp_group)
            self._pp_timer.detach()
            self._pp_timer = None
            self.pp_costs = costs
            self.pp_stages, self.pp_schedule = build_pipeline(
                self.model_parts, self.pp_stage_ids, num_stages=self.pp_num_stages,
                pp_group=self.pp_group, device=self.device,
                schedule=self.cfg.parallelism.pipeline_parallel_schedule,
                microbatches=self.pp_microbatches, loss_fn=self._pp_loss, costs=costs)
            ignore_shape_inference_forward(self.model_parts, _reset_moe_counts)
        # Only the last stage saw the loss: sum over pp (others add 0), then over dp.
        loss_sum = self._pp_loss_sum.clone()
        dist.all_reduce(loss_sum, group=self.pp_group)
        dist.all_reduce(loss_sum, group=loss_group)
        mean_loss = (loss_sum / self._pp_loss_copies / max(global_tokens, 1.0)).item()
        max_norm = self.cfg.training.max_norm
        if self.pp_mirrored:  # both copies of a stage get the summed gradient (bitwise equal)
            sum_mirrored_grads(self.pp_stages)
            grad_norm = clip_mirrored_grads(list(self.model_parts[0].parameters()),
                                            list(self.model_parts[1].parameters()), max_norm,
                                            pp_group=self.pp_group).item()
        else:
            params = [q for part in self.model_parts for q in part.parameters()]
            grad_norm = clip_grad_norm_(params, max_norm, pp_group=self.pp_group).item()
        if not (math.isfinite(mean_loss) and math.isfinite(grad_norm)):
            raise TrainingDiverged(f"step {self.step + 1}: loss = {mean_loss}, grad norm = "
                                   f"{grad_norm}; stopping without an optimizer step")
        self.optimizer.step()
        self._update_moe()
        if self._precompute_float8:
            for part in self.model_parts:
                precompute_float8_scales(part)
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return mean_loss, grad_norm

    # -- loop --------------------------------------------------------------------------------
    def train(self, until_step: int | None = None) -> list[float]:
        """Resume if a checkpoint exists, then train to ``training.steps`` (or ``until_step``).

        ``until_step`` stops early without changing the schedule, as a preempted job would.
        Returns this call's per-step losses.
        """
        cfg, t = self.cfg, self.cfg.training
        last_step = t.steps if until_step is None else min(until_step, t.steps)
        if not self._resumed:  # a second train() call continues in memory
            self.step = self.checkpointer.load()
            self._resumed = True
            if self.step == 0 and cfg.checkpoint.initial_load_path:  # nothing to resume yet
                load_initial_weights(self.model_parts, cfg.checkpoint.initial_load_path,
                                     self.model_args, in_hf=cfg.checkpoint.initial_load_in_hf)
        tokens_per_step = self.grad_accum_steps * t.local_batch_size * self.dims.dp * t.seq_len
        metrics = MetricsLogger(
            job_dir=cfg.job.dump_folder, rank=self.rank, is_logging_rank=self.rank == 0,
            log_freq=cfg.metrics.log_freq, total_steps=t.steps,
            enable_tensorboard=cfg.metrics.enable_tensorboard, tb_folder=cfg.metrics.save_tb_folder,
            device=self.device, flops_per_token=self.model.num_flops_per_token(t.seq_len),
            num_devices=dist.get_world_size(), color=not cfg.metrics.disable_color_printing,
            progress_bar=cfg.metrics.progress_bar,
        )
        if self.rank == 0:
            self._print_banner(tokens_per_step)
        losses = []
        try:
            while self.step < last_step:
                lr = self.lr_scheduler.get_last_lr()[0]  # the LR this step uses
                loss, grad_norm = self.train_step(self.next_microbatches())
                self.step += 1
                if self.step == 1:
                    _set_process_group_timeout(cfg.comm.train_timeout_seconds)
                losses.append(loss)
                metrics.record_tokens(tokens_per_step)
                shown, tb_only = self._moe_metrics()
                metrics.log(self.step, loss=loss, grad_norm=grad_norm, lr=lr, extra=shown,
                            tb_extra=tb_only)
                self.checkpointer.maybe_save(self.step, last=self.step == t.steps)
                if self.step == t.steps and cfg.checkpoint.last_save_in_hf and cfg.checkpoint.enable:
                    save_hf_checkpoint(
                        self.model_parts, os.path.join(cfg.job.dump_folder, cfg.checkpoint.folder,
                                                       f"step-{self.step}-hf"),
                        self.model_args, tokenizer=self.tokenizer,
                        hf_assets_path=cfg.model.hf_assets_path)
        finally:
            metrics.close()
        return losses

    def _print_banner(self, tokens_per_step: int) -> None:
        d = self.dims
        n = self.model.num_params()
        print(
            f"titanext: {self.cfg.model.name}/{self.cfg.model.flavor} ({n / 1e6:.2f}M params) on "
            f"{dist.get_world_size()} x {self.device.type} | pp={d.pp} dp_replicate={d.dp_replicate} "
            f"dp_shard={d.dp_shard} cp={d.cp} tp={d.tp} ep={d.ep} | zero_stage={self.cfg.parallelism.zero_stage} "
            f"| grad accumulation {self.grad_accum_steps} | {tokens_per_step} tokens/step",
            flush=True,
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, validate (exit code 2 on a bad config, before anything starts), then train."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        config_path, overrides, flags = parse_cli(argv)
        if flags.get("help"):
            try:
                print(config_help())
            except BrokenPipeError:  # `--help | head`
                pass
            return 0
        cfg = load_config(config_path, overrides, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as e:
        if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, say it once
            for problem in e.problems:
                print(f"titanext: config error: {problem}", file=sys.stderr)
        return 2
    if flags.get("print_config"):
        print(to_toml(cfg))
        return 0
    # Ctrl-C: stop without saving anything partial (checkpoint writes are atomic anyway).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    trainer = None
    code = 0
    try:
        trainer = Trainer(cfg)
        start = time.time()
        trainer.train()
        if trainer.rank == 0:
            print(f"titanext: done, {trainer.step} steps in {time.time() - start:.1f}s", flush=True)
    except TrainingDiverged as e:
        print(f"titanext: training diverged: {e}", file=sys.stderr, flush=True)
        code = 1
    except KeyboardInterrupt:
        print("titanext: interrupted; nothing partial was saved", file=sys.stderr, flush=True)
        code = 130
    finally:
        if dist.is_initialized():
            if code == 0:
                dist.barrier()
            dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
