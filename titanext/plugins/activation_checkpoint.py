"""Activation checkpointing (recompute) per block: none, full, selective, or by module.

- full: every block's activations are recomputed in backward.
- selective, layer level (``option="2"``): every 2nd block is fully checkpointed.
- selective, op level (``option="op"``): inside every block, the outputs of the ops in
  ``save_ops`` (matmuls and attention by default: the expensive ones) are kept, everything
  else (norms, activations, elementwise) is recomputed.
- ``keep_all_to_all=True`` (with full or layer-level AC): recompute without re-dispatch. Each
  checkpointed call also keeps what its expert-parallel collectives received (the dispatched
  token rows, the expert outputs as they come back before the combine's weighted sum, the
  routing and split sizes, hot-expert copies), and its recompute replays them instead of
  communicating (:class:`~titanext.plugins.expert_parallel._comm.CommTape`): no all-to-all and no
  device-to-host sync runs twice, and the recompute is bitwise the forward. Without expert
  parallelism in the block it is plain full AC.
- modules (``recompute_modules=("layernorm", "moe_act", ...)``): only those parts of each block
  are recomputed, everything else is saved; no collective runs twice
  (:mod:`titanext.plugins.recompute_modules`). With ``full_blocks=n`` the first ``n`` blocks
  (of each pipeline stage: each stage's model is passed on its own) are fully checkpointed
  instead, with ``keep_all_to_all`` as under full AC, and the rest recompute by module: a
  layout trades memory for speed between the two (Megatron-Core's ``recompute_method =
  "block"`` with ``recompute_num_layers``).

The block's ``forward`` is replaced in place instead of wrapping the module, so parameter
names (and therefore checkpoints) are the same with and without AC.

>>> from titanext.models import build_model, get_model_args
>>> model = build_model("llama3", get_model_args("llama3", "debugtiny"), device="meta")
>>> model = apply_activation_checkpointing(model, mode="selective", option="op")
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from titanext.plugins._blocks import find_blocks
from titanext.plugins.expert_parallel._comm import CommTape
from titanext.plugins.recompute_modules import recompute_modules as _module_regions
from titanext.plugins.rules import DEFAULT_SAVE_OPS, RECOMPUTE_MODULES, keep_all_to_all_problem

__all__ = ["DEFAULT_SAVE_OPS", "apply_activation_checkpointing", "check_activation_checkpointing",
           "split_full_blocks"]


def split_full_blocks(blocks: Sequence[nn.Module], full_blocks: int
                      ) -> tuple[list[nn.Module], list[nn.Module]]:
    """``blocks`` (in order) as (fully checkpointed, recomputed by module) for
    ``mode="modules"`` with ``full_blocks``: the first ``full_blocks`` and the rest."""
    return list(blocks[:full_blocks]), list(blocks[full_blocks:])


def _resolve_ops(names: Iterable[str]) -> set:
    ops = set()
    for name in names:
        packet = getattr(torch.ops.aten, name, None)
        if packet is None:
            raise ValueError(
                f"activation_checkpoint.selective_op_save_list: unknown aten op {name!r}"
            )
        ops.add(packet.default if hasattr(packet, "default") else packet)
    return ops


def check_activation_checkpointing(mode: str, option: str = "op",
                                   save_ops: Sequence[str] = DEFAULT_SAVE_OPS,
                                   keep_all_to_all: bool = False,
                                   recompute_modules: Sequence[str] = (),
                                   full_blocks: int = 0) -> None:
    """The ValueError :func:`apply_activation_checkpointing` would raise for these options,
    raised without touching a model (a recipe checks before it mutates)."""
    if mode not in ("none", "full", "selective", "modules"):
        raise ValueError(f"activation_checkpoint.mode = {mode!r}; allowed: none, full, "
                         "selective, modules")
    if isinstance(full_blocks, bool) or not isinstance(full_blocks, int) or full_blocks < 0 or (
            full_blocks and mode != "modules"):
        raise ValueError(f"activation_checkpoint.full_blocks = {full_blocks!r} with mode = "
                         f"{mode!r}; allowed: an integer >= 0, above 0 only with mode = 'modules'")
    problem = keep_all_to_all_problem(mode, option, full_blocks) if keep_all_to_all else None
    if problem:
        raise ValueError(problem)
    if (mode == "modules") != bool(recompute_modules) or any(
            n not in RECOMPUTE_MODULES for n in recompute_modules):
        raise ValueError(f"activation_checkpoint: mode = {mode!r} with recompute_modules = "
                         f"{list(recompute_modules)!r}; mode = 'modules' takes one or more of "
                         f"{', '.join(RECOMPUTE_MODULES)}, the other modes none")
    if mode != "selective":
        return
    if option == "op":
        _resolve_ops(save_ops)
    elif not str(option).isdigit() or int(option) < 1:
        raise ValueError(
            f"activation_checkpoint.selective_ac_option = {option!r}; "
            "allowed: 'op' or a positive integer"
        )


def _checkpoint_forward(block: nn.Module, context_fn=None, keep_all_to_all: bool = False
                        ) -> None:
    inner = block.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        extra = {"context_fn": context_fn} if context_fn is not None else {}
        run = inner
        if keep_all_to_all:  # one tape per call: each micro-batch replays its own
            tape = CommTape()

            def run(*a, **k):
                with tape.session():
                    return inner(*a, **k)
        return checkpoint(
            run, *args, use_reentrant=False, preserve_rng_state=False, **extra, **kwargs
        )

    block.forward = forward


def apply_activation_checkpointing(
    model: nn.Module,
    *,
    mode: str = "full",
    option: str = "op",
    save_ops: Sequence[str] = DEFAULT_SAVE_OPS,
    blocks: Iterable[nn.Module] | str | None = None,
    keep_all_to_all: bool = False,
    recompute_modules: Sequence[str] = (),
    required: bool = True,
    full_blocks: int = 0,
) -> nn.Module:
    """Apply AC to each block of ``model`` (``blocks`` or ``model.layers``), in place.
    ``keep_all_to_all``: recompute without re-dispatch; ``recompute_modules``: what
    ``mode="modules"`` recomputes, each of which must be in some block unless ``required`` is
    False (a pipeline stage); ``full_blocks``: with ``mode="modules"``, how many of the first
    blocks are fully checkpointed instead; see the module docstring."""
    check_activation_checkpointing(mode, option, save_ops, keep_all_to_all, recompute_modules,
                                   full_blocks)
    if mode == "none":
        return model
    block_list = find_blocks(model, blocks)
    if mode == "modules":
        # every name must be in some block of the model, also one only the full blocks hold
        _module_regions(model, recompute_modules, blocks=block_list, required=required)
        full, by_module = split_full_blocks(block_list, full_blocks)
        for block in full:
            _checkpoint_forward(block, keep_all_to_all=keep_all_to_all)
        _module_regions(model, recompute_modules, blocks=by_module, required=False, apply=True)
        return model
    if mode == "full":
        for block in block_list:
            _checkpoint_forward(block, keep_all_to_all=keep_all_to_all)
        return model
    if option == "op":
        ops = _resolve_ops(save_ops)

        def policy(ctx, op, *args, **kwargs):
            return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE

        context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
        for block in block_list:
            _checkpoint_forward(block, context_fn)
        return model
    every = int(option)
    for i, block in enumerate(block_list):
        if i % every == 0:
            _checkpoint_forward(block, keep_all_to_all=keep_all_to_all)
    return model
