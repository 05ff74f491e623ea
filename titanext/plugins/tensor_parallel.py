"""Tensor and sequence parallelism as plain plans: dicts from module FQN to ParallelStyle.

A plan is handed to ``torch.distributed.tensor.parallel.parallelize_module`` unchanged, so any
model can be parallelized with a dict written for it (FQNs may use ``*`` wildcards):

>>> from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
>>> plan = {"blocks.*.mlp.up": ColwiseParallel(), "blocks.*.mlp.down": RowwiseParallel()}
>>> apply_tensor_parallel(my_model, tp_mesh, plan)                    # doctest: +SKIP

``llama_tp_plan`` is the plan of titanext's reference model (Megatron-style TP with sequence
parallelism on the norms, and a vocab-sharded output for loss parallelism).
"""

from __future__ import annotations

import fnmatch
import logging

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

__all__ = ["apply_tensor_parallel", "llama_tp_plan"]

TPPlan = dict[str, ParallelStyle]


def llama_tp_plan(*, sequence_parallel: bool = True, loss_parallel: bool = True,
                  layers_prefix: str = "layers.*", float8: bool = False) -> TPPlan:
    """The TP/SP plan of :class:`titanext.models.llama.Transformer`.

    With ``sequence_parallel`` the activations between blocks stay sharded on the sequence
    dimension (norms run on a slice), and each block all-gathers before attention/FFN and
    reduce-scatters after. With ``loss_parallel`` the logits stay sharded over the vocabulary
    and the cross-entropy must run under ``torch.distributed.tensor.parallel.loss_parallel()``.
    MoE blocks (a ``moe`` instead of ``feed_forward``) get TP on attention only; their MoE is
    replicated over tp (every tp rank routes the same tokens through all experts): under SP its
    input is all-gathered over the sequence and its output sliced back to ``Shard(1)``.
    With ``float8`` the block linears use torchao's float8 TP styles: activations are cast to
    float8 before their all-gathers (needs tensorwise Float8Linear blocks and NCCL).
    """
    colwise, rowwise, prepare_input = ColwiseParallel, RowwiseParallel, PrepareModuleInput
    if float8:
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )

        colwise, rowwise, prepare_input = (Float8ColwiseParallel, Float8RowwiseParallel,
                                           PrepareFloat8ModuleInput)
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: TPPlan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    block: TPPlan = {
        "attention.wq": colwise(),
        "attention.wk": colwise(),
        "attention.wv": colwise(),
        "attention.wo": rowwise(output_layouts=seq),
        "feed_forward.w1": colwise(),
        "feed_forward.w3": colwise(),
        "feed_forward.w2": rowwise(output_layouts=seq),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
        block.update({
            "attention_norm": SequenceParallel(),
            "ffn_norm": SequenceParallel(),
            # attention(x, cos, sin): gather x over the sequence, leave the RoPE tables alone.
            "attention": prepare_input(
                input_layouts=(Shard(1), None, None),
                desired_input_layouts=(Replicate(), None, None),
                **({"fwd_config_submodule_fqn": "wq"} if float8 else {}),
            ),
            "feed_forward": prepare_input(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                **({"fwd_config_submodule_fqn": "w1"} if float8 else {}),
            ),
            # Gradients flow back through the gather/slice, so the replicated MoE parameters
            # get identical, complete gradients on every tp rank (no tp reduction needed).
            "moe": PrepareModuleInputOutput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                use_local_input=True, output_layouts=(Replicate(),),
                desired_output_layouts=(Shard(1),), use_local_output=True,
            ),
        })
    plan.update({f"{layers_prefix}.{k}": v for k, v in block.items()})
    return plan


def apply_tensor_parallel(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    plan: TPPlan | None = None,
    *,
    sequence_parallel: bool = True,
    loss_parallel: bool = True,
    float8: bool = False,
) -> nn.Module:
    """Apply ``plan`` (default: :func:`llama_tp_plan`) to ``model`` over the 1D ``tp_mesh``.

    Modules a plan names but the model lacks (a pipeline stage without embeddings, a MoE
    block without ``feed_forward``, say) are skipped, so one plan serves every stage and
    block kind: ``*`` keys are expanded (one ``*`` per name component) to the modules present. ``float8`` (the model went through
    ``apply_float8``) picks torchao's float8 TP styles for the default plan where they can
    work: tensorwise float8 block linears on a backend with float8 collectives. Otherwise TP
    communicates in high precision and says so; the linears still compute in float8. A custom
    ``plan`` is used as given (put torchao's ``Float8ColwiseParallel`` etc. in it yourself).
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel: tp_mesh must be 1D, got {tp_mesh.ndim}D")
    if plan is None:
        float8 = float8 and _float8_comm_possible(model, tp_mesh, sequence_parallel, loss_parallel)
        plan = llama_tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
                             float8=float8)
    present = [name for name, _ in model.named_modules()]
    kept = {}
    for fqn, style in plan.items():
        for name in _matching(fqn, present):
            kept[name] = style
    parallelize_module(model, tp_mesh, kept)
    return model


def _matching(pattern: str, names: list[str]) -> list[str]:
    """The module names matching ``pattern`` component by component (fnmatch per component)."""
    if "*" not in pattern:
        return [pattern] if pattern in names else []
    parts = pattern.split(".")
    return [n for n in names if len(n.split(".")) == len(parts)
            and all(fnmatch.fnmatchcase(a, b) for a, b in zip(n.split("."), parts))]


def _float8_comm_possible(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool,
                          loss_parallel: bool) -> bool:
    """Whether torchao's float8 TP styles can run here; logs why not."""
    from titanext.plugins.float8 import supports_float8_tp

    backend = str(dist.get_backend(tp_mesh.get_group()))
    if "nccl" not in backend:
        reason = (f"the {backend} backend has no float8 collectives, so TP all-gathers and "
                  "reduce-scatters activations in high precision")
    else:
        hp_plan = llama_tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
        names = [n for n, _ in model.named_modules()]
        linears = [n for key, style in hp_plan.items()
                   if isinstance(style, (ColwiseParallel, RowwiseParallel))
                   and key not in ("tok_embeddings", "output")
                   for n in names if fnmatch.fnmatchcase(n, key)]
        if supports_float8_tp(model, linears):
            return True
        reason = ("float8 TP styles need every block linear to be a tensorwise float8 linear, so "
                  "TP communicates in high precision")
    if dist.get_rank() == 0:
        logging.getLogger("titanext").warning(
            "float8 + tensor parallel: %s (the linears still compute in float8)", reason)
    return False
