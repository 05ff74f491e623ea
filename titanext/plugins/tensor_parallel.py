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

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

__all__ = ["apply_tensor_parallel", "llama_tp_plan"]

TPPlan = dict[str, ParallelStyle]


def llama_tp_plan(*, sequence_parallel: bool = True, loss_parallel: bool = True,
                  layers_prefix: str = "layers.*") -> TPPlan:
    """The TP/SP plan of :class:`titanext.models.llama.Transformer`.

    With ``sequence_parallel`` the activations between blocks stay sharded on the sequence
    dimension (norms run on a slice), and each block all-gathers before attention/FFN and
    reduce-scatters after. With ``loss_parallel`` the logits stay sharded over the vocabulary
    and the cross-entropy must run under ``torch.distributed.tensor.parallel.loss_parallel()``.
    """
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
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=seq),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=seq),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
        block.update({
            "attention_norm": SequenceParallel(),
            "ffn_norm": SequenceParallel(),
            # attention(x, cos, sin): gather x over the sequence, leave the RoPE tables alone.
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None),
                desired_input_layouts=(Replicate(), None, None),
            ),
            "feed_forward": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
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
) -> nn.Module:
    """Apply ``plan`` (default: :func:`llama_tp_plan`) to ``model`` over the 1D ``tp_mesh``.

    Modules a plan names but the model lacks (a pipeline stage without embeddings, say) are
    skipped, so one plan serves every stage.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel: tp_mesh must be 1D, got {tp_mesh.ndim}D")
    if plan is None:
        plan = llama_tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    present = {name for name, _ in model.named_modules()}
    kept = {}
    for fqn, style in plan.items():
        if "*" in fqn or fqn in present:
            kept[fqn] = style
    parallelize_module(model, tp_mesh, kept)
    return model
