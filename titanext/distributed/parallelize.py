"""The parallelize recipe, in one visible order: TP -> EP -> CP -> AC -> compile -> FSDP / DDP.

:func:`parallelize` applies titanext's plugins to a model (or one pipeline stage of it) as the
trainer does, following a :class:`~titanext.config.Recipe` (ZeRO stage, dtypes, SP, CP, EP,
recompute, compile: built from keywords, or a job's ``resolve_job_layout(cfg, n).recipe``),
never a config section or a global, so it runs on your own model too:

- the model's repeated blocks are ``model.layers`` (an ``nn.ModuleList`` / ``nn.ModuleDict``)
  or the ``blocks`` you pass: they become the FSDP units, the AC and the compile regions;
- tensor parallelism follows ``tp_plan`` (a dict from FQN, wildcards allowed, to
  ``ParallelStyle``; default: titanext's Llama plan, see ``titanext.plugins.tensor_parallel``);
- expert parallelism converts modules that follow the experts protocol
  (``titanext.plugins.expert_parallel``), context parallelism attention modules that expose
  ``attn_fn`` (``titanext.plugins.context_parallel``).

Build the model on the meta device and pass ``init_weights``: the parameters are then
allocated (``to_empty``) and initialised after sharding, so no rank ever holds the whole
model. ZeRO-1 (``Recipe(zero_stage=1)``) wraps the materialised model in DDP, so it needs
``init_weights`` (or an already materialised model).

Example (4 CPU processes: ``torchrun --nproc_per_node 4 this_file.py``)::

    import torch
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from titanext.config import Recipe
    from titanext.distributed.parallel_dims import ParallelDims
    from titanext.distributed.parallelize import parallelize
    from titanext.distributed.process_group import init_distributed

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    class MyModel(nn.Module):
        def __init__(self, d=64, n=4):
            super().__init__()
            self.layers = nn.ModuleList(Block(d) for _ in range(n))  # the block protocol
        def forward(self, x):
            for block in self.layers:
                x = block(x)
            return x

    device = init_distributed()
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, ep=1, world_size=4)
    dims.build_mesh(device.type)
    torch.manual_seed(0)
    model = parallelize(MyModel(), dims, Recipe(ac="full"),
                        tp_plan={"layers.*.up": ColwiseParallel(),
                                 "layers.*.down": RowwiseParallel()})
    model(torch.randn(8, 16, 64)).square().mean().backward()   # FSDP x TP gradients

``test_parallelize_user_model_matches_one_process`` (tests/multiprocess/test_plugins_user_model.py)
runs this (and ZeRO-1 from a meta model) against one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from titanext._fake_backend import real_tensors, to_empty
from titanext.config import Recipe
from titanext.distributed.failsafe import guarded
from titanext.distributed.parallel_dims import ParallelDims
from titanext.plugins._blocks import find_blocks
from titanext.plugins.activation_checkpoint import (
    apply_activation_checkpointing,
    check_activation_checkpointing,
    split_full_blocks,
)
from titanext.plugins.compile import apply_compile
from titanext.plugins.context_parallel import (
    apply_context_parallel,
    attention_fn_holders,
    check_options,
)
from titanext.plugins.expert_parallel import (
    ExpertsLayout,
    apply_expert_parallel,
    expert_parallel_targets,
)
from titanext.plugins.float8_experts import has_emulated_float8_experts
from titanext.plugins.float8_storage import apply_float8_storage
from titanext.plugins.fsdp import apply_ddp, apply_fsdp
from titanext.plugins.recompute_modules import recompute_modules
from titanext.plugins.replicated_grads import install_replicated_grad_check
from titanext.plugins.tensor_parallel import TPPlan, apply_tensor_parallel, tp_plan_targets
from titanext.plugins.weight_grad import has_deferred_modules

__all__ = ["parallelize"]


def _install_grad_check(model: nn.Module, dims: ParallelDims, zero1: bool,
                        expert_units: list[nn.Module], steps: int) -> None:
    """The replicated-gradient check over tp, cp and (ZeRO-1's DDP) the loss ranks; experts
    split over ep (which may take cp's ranks) are checked over tp only."""
    meshes = {"tp": dims.tp_mesh if dims.tp_enabled else None,
              "cp": dims.cp_mesh if dims.cp_enabled else None,
              "dp": dims.loss_mesh if zero1 else None}
    meshes = {name: mesh for name, mesh in meshes.items() if mesh is not None}
    experts = {f"{name}." for name, m in model.named_modules() if m in expert_units}

    def skip(param: str, dim: str) -> bool:
        return dim != "tp" and any(param.startswith(e) for e in experts)

    install_replicated_grad_check(model, meshes, steps=steps, skip=skip)


@guarded  # an error on one rank ends every rank (titanext.distributed.failsafe)
def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    recipe: Recipe | None = None,
    *,
    tp_plan: TPPlan | None = None,
    blocks: Iterable[nn.Module] | str | None = None,
    device: torch.device | str | None = None,
    init_weights: Callable[[nn.Module], None] | None = None,
    experts: Callable[[str, nn.Module], bool] | None = None,
    experts_layout: ExpertsLayout | None = None,
    check_replicated_grads: int = 2,
) -> nn.Module:
    """Apply TP -> EP -> CP -> AC -> compile -> FSDP/HSDP (or DDP for ZeRO-1) to ``model``.

    Args:
        model: the whole model or one pipeline stage, usually on the meta device.
        dims: the parallel degrees, with ``dims.build_mesh()`` called.
        recipe: how to parallelize (:class:`~titanext.config.Recipe`; default ``Recipe()``).
            Of ``recipe.float8`` only the float8 TP styles follow; convert the model with
            ``titanext.plugins.float8.apply_float8`` before calling this.
        tp_plan: the tensor-parallel plan for your own model. Without one, titanext's Llama
            plan is used on a model laid out like titanext's Llama, and any other model raises
            (``titanext.plugins.tensor_parallel.default_plan_problems``).
        blocks: the repeated blocks if the model has no ``layers`` container: modules,
            or the dotted path of their container (``"transformer.h"``).
        device: where ``init_weights`` materialises the model (default: the mesh's device type).
        init_weights: ``fn(model)`` that initialises the parameters; when given, the model is
            moved to ``device`` with ``to_empty`` after sharding and ``fn`` runs on it.
        experts, experts_layout: under ep > 1, ``filter_fn`` and ``layout`` of
            ``titanext.plugins.expert_parallel.apply_expert_parallel`` (default: the experts
            modules it detects; none found is a ValueError, except in a pipeline stage).
        check_replicated_grads: before each of the first this many optimizer steps over the
            model's parameters, check that every parameter replicated over tp / cp (and, under
            ZeRO-1, the data-parallel ranks) has the same gradient on every rank of it, and
            raise naming the parameter and the dim if not
            (``titanext.plugins.replicated_grads``; one small all-reduce per dim); 0 = off.

    Loud or correct: each plugin says what it did in one WARNING line (or raises a ValueError
    naming the model class, what it looked for and the fix when a requested degree > 1 would
    change nothing). No rank is left waiting: an error raised on some ranks only ends every rank
    within seconds (:mod:`titanext.distributed.failsafe`). Validate before mutating: every
    argument that can be checked without changing ``model`` is checked first (the blocks every
    per-block plugin needs, the TP plan, the experts, CP's attention modules, the AC options,
    ZeRO-1's materialised parameters), so an error leaves ``model`` exactly as it was passed.

    Returns the module to train: ``model`` itself (changed in place), or its DDP wrapper under
    ZeRO-1 (keep ``model`` for attribute access). See the module docstring for an example.
    """
    r = recipe if recipe is not None else Recipe()
    if isinstance(r.ac_full_blocks, tuple):  # one count per stage: this one's, or none
        if dims.pp_enabled or len(r.ac_full_blocks) != 1:
            raise ValueError(f"Recipe(ac_full_blocks={r.ac_full_blocks!r}) has one count per "
                             "pipeline stage; parallelize each stage with recipe.for_stage(s)")
        r = r.for_stage(0)
    device = torch.device(device if device is not None else dims.world_mesh.device_type)
    blocks = _check_before_changes(model, dims, r, tp_plan, blocks, experts, experts_layout,
                                   init_weights is not None)
    with real_tensors():  # sharding a meta model is host work, also in a dry run's fake mode
        expert_units = _apply_sharding(model, dims, r, tp_plan, experts, experts_layout)
        apply_activation_checkpointing(model, mode=r.ac, option=r.ac_option,
                                       save_ops=r.ac_save_ops, blocks=blocks,
                                       keep_all_to_all=r.keep_all_to_all,
                                       recompute_modules=r.recompute_modules,
                                       required=not dims.pp_enabled, full_blocks=r.ac_full_blocks)
        if r.float8_storage:  # what the fully checkpointed blocks save is their input only
            stored = split_full_blocks(find_blocks(model, blocks), r.ac_full_blocks)[1]
            apply_float8_storage(model, r.float8_storage, blocks=stored,
                                 required=not dims.pp_enabled and bool(stored))
        if r.compile_model:
            _compile(model, dims, r, blocks, expert_units)
        if r.fsdp(dims):
            _fully_shard(model, dims, r, device, blocks, expert_units)
    if init_weights is not None:
        to_empty(model, device)  # (a dry run: fake parameters)
        init_weights(model)
    zero1 = r.zero1(dims)
    _install_grad_check(model, dims, zero1, expert_units, check_replicated_grads)
    if not zero1:
        return model
    # ZeRO-1: DDP over replicated parameters (+ a sharded optimizer, titanext.components.optim).
    return apply_ddp(model, dims.loss_mesh)


def _apply_sharding(model: nn.Module, dims: ParallelDims, r: Recipe, tp_plan, experts,
                    experts_layout) -> list[nn.Module]:
    """TP, then EP, then CP (before AC, so recomputation reruns the ring too); returns the
    expert modules EP converted."""
    if dims.tp_enabled:
        apply_tensor_parallel(model, dims.tp_mesh, tp_plan,
                              sequence_parallel=r.sequence_parallel, float8=r.float8,
                              loss_parallel=r.loss_parallel_on(dims))
    expert_units: list[nn.Module] = []
    if dims.ep_enabled:  # the MoE stays replicated over tp; ep splits its experts
        found = apply_expert_parallel(model, dims.ep_mesh, filter_fn=experts,
                                      layout=experts_layout, required=not dims.pp_enabled,
                                      replicate_hot_experts=r.expert_replicas,
                                      dispatch=r.ep_dispatch,
                                      ranks_per_node=r.ep_ranks_per_node,
                                      float8_dispatch=r.ep_float8_dispatch)
        expert_units = [model.get_submodule(f) for f in found]
    if dims.cp_enabled:
        apply_context_parallel(model, dims.cp_attention_mesh, layout=r.cp_layout,
                               comm=r.cp_comm, ulysses_degree=dims.cp_ulysses)
    return expert_units


def _compile(model: nn.Module, dims: ParallelDims, r: Recipe, blocks,
             expert_units: list[nn.Module]) -> None:
    """torch.compile per block. EP: the experts are their own FSDP unit inside the block, and
    dispatch needs its split sizes on the host; both break the graph, so MoE blocks compile in
    pieces. CP's ring (batch_isend_irecv) cannot be traced either: its attention runs between
    graphs. Deferred weight gradients: each converted linear runs eagerly (a graph break); so
    do emulated float8 experts, and recompute by module's parts and saved-tensor hooks."""
    fullgraph = not (expert_units or dims.cp_enabled or has_deferred_modules(model)
                     or has_emulated_float8_experts(model) or r.ac == "modules"
                     or r.float8_storage)
    apply_compile(model, backend=r.compile_backend, fullgraph=fullgraph, blocks=blocks)


def _fully_shard(model: nn.Module, dims: ParallelDims, r: Recipe, device: torch.device, blocks,
                 expert_units: list[nn.Module]) -> None:
    """FSDP2 / HSDP over the blocks, then the rest, in the recipe's dtypes and reshard policy."""
    apply_fsdp(
        model,
        dims.fsdp_mesh,
        param_dtype=getattr(torch, r.param_dtype_on(device.type)),
        reduce_dtype=getattr(torch, r.reduce_dtype_on(device.type)),
        reshard_after_forward=r.reshard_after_forward,
        zero_stage=r.fsdp_zero_stage,
        pp_enabled=dims.pp_enabled,
        blocks=blocks,
        # Experts are sharded over the dp ranks ep leaves (dp_shard_mod_ep); their gradients
        # are summed over fewer ranks, so divide by the dense reduction size.
        expert_units=expert_units,
        expert_mesh=dims.expert_fsdp_mesh if expert_units else None,
        expert_gradient_divide_factor=dims.gradient_reduction_size,
    )


def _check_before_changes(model: nn.Module, dims: ParallelDims, r: Recipe,
                          tp_plan: TPPlan | None, blocks, experts, experts_layout,
                          materialises: bool) -> list[nn.Module] | None:
    """Every check :func:`parallelize` can make before it changes ``model`` (each raises the
    error the plugin itself would raise later); returns the blocks, resolved once."""
    fsdp = r.fsdp(dims)
    check_activation_checkpointing(r.ac, r.ac_option, r.ac_save_ops, r.keep_all_to_all,
                                   r.recompute_modules, r.ac_full_blocks)
    if r.float8_storage and r.ac not in ("none", "modules"):
        raise ValueError(f"Recipe(float8_storage={r.float8_storage!r}) keeps what the backward "
                         f"reads from a block's forward, but ac = {r.ac!r} recomputes it; use "
                         "ac = 'none' or 'modules'")
    per_block = [name for name, used in (("activation checkpointing", r.ac != "none"),
                                         ("float8 storage", bool(r.float8_storage)),
                                         ("compile", r.compile_model), ("FSDP", fsdp)) if used]
    if per_block or blocks is not None:  # a path, or model.layers
        try:
            blocks = find_blocks(model, blocks)
        except ValueError as e:
            raise ValueError(f"parallelize: {' and '.join(per_block)} need the model's blocks: "
                             f"{e}") from None
    if dims.tp_enabled:
        tp_plan_targets(model, dims.tp, tp_plan, sequence_parallel=r.sequence_parallel,
                        loss_parallel=r.loss_parallel_on(dims))
    if dims.ep_enabled:
        expert_parallel_targets(model, dims.ep, filter_fn=experts, layout=experts_layout,
                                required=not dims.pp_enabled,
                                replicate_hot_experts=r.expert_replicas)
    if dims.cp_enabled:
        check_options(r.cp_layout, r.cp_comm, "auto")
        attention_fn_holders(model)
        if "core_attn" in r.recompute_modules:
            raise ValueError("Recipe(recompute_modules=(..., 'core_attn')): recomputing the "
                             "attention core would run context parallelism's exchanges again; "
                             "drop core_attn or use cp = 1")
    if r.ac == "modules":
        recompute_modules(model, r.recompute_modules, blocks=blocks,
                          required=not dims.pp_enabled)
    if r.zero1(dims) and not materialises and any(q.is_meta for q in model.parameters()):
        raise ValueError("Recipe(zero_stage=1) wraps the model in DDP, which needs real "
                         "parameters: pass init_weights=... or a materialised model")
    return blocks
