"""Tensor-parallel styles for transformers' ``Conv1D`` (weight ``[in, out]``, ``y = x W + b``).

torch's ``ColwiseParallel`` / ``RowwiseParallel`` take ``nn.Linear`` (weight ``[out, in]``) and
``nn.Embedding`` only. A Conv1D computes the same matmul with its weight transposed, so its
column-wise split shards dim 1 of the weight (and the bias), and its row-wise split dim 0 (the
bias replicated, added once to the reduced output). The activations' layouts are those of the
torch styles: these classes only place the parameters differently, and act as the torch style
on any other module.

>>> plan = {"transformer.h.*.attn.c_attn": Conv1DColwiseParallel(),
...         "transformer.h.*.attn.c_proj": Conv1DRowwiseParallel()}
"""

from __future__ import annotations

from functools import partial

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from titanext.plugins._loud import is_conv1d

__all__ = ["Conv1DColwiseParallel", "Conv1DRowwiseParallel", "check_conv1d_styles"]


def _shard_params(module: nn.Module, mesh: DeviceMesh, placements: dict[str, list],
                  src_data_rank) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        dist_param = nn.Parameter(distribute_tensor(param, mesh, placements[name],
                                                    src_data_rank=src_data_rank),
                                  requires_grad=param.requires_grad)
        module.register_parameter(name, dist_param)


def _prepare_input(input_layouts, desired_layouts, module, inputs, mesh):
    """The torch style's input handling, through public DTensor calls: the input as a DTensor
    in ``input_layouts``, redistributed to ``desired_layouts``."""
    x = inputs[0]
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, input_layouts, run_check=False)
    if tuple(x.placements) != tuple(desired_layouts):
        x = x.redistribute(placements=desired_layouts, async_op=True)
    return (x, *inputs[1:])


def _prepare_output(output_layouts, use_local_output, module, output, mesh):
    if tuple(output.placements) != tuple(output_layouts):
        output = output.redistribute(placements=output_layouts, async_op=True)
    return output.to_local() if use_local_output else output


def _distribute(style, module: nn.Module, mesh: DeviceMesh, placements: dict[str, list]):
    def partition(name, submodule, device_mesh):
        if submodule is module:
            _shard_params(module, device_mesh, placements, getattr(style, "src_data_rank", 0))

    return distribute_module(
        module, mesh, partition,
        partial(_prepare_input, style.input_layouts, style.desired_input_layouts),
        partial(_prepare_output, style.output_layouts, style.use_local_output))


class Conv1DColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` for a Conv1D: weight ``Shard(1)`` (its output features), bias
    ``Shard(0)``; input replicated, output sharded on the last dim (``use_local_output`` as
    torch's). On an ``nn.Linear`` or ``nn.Embedding`` it is torch's ``ColwiseParallel``."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        return _distribute(self, module, device_mesh, {"weight": [Shard(1)], "bias": [Shard(0)]})


class Conv1DRowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` for a Conv1D: weight ``Shard(0)`` (its input features), bias
    replicated; input sharded on the last dim, output reduced to ``output_layouts``. On an
    ``nn.Linear`` or ``nn.Embedding`` it is torch's ``RowwiseParallel``."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)
        return _distribute(self, module, device_mesh, {"weight": [Shard(0)], "bias": [Replicate()]})


def check_conv1d_styles(model: nn.Module, kept: dict[str, ParallelStyle]) -> None:
    """Refuse, before anything is sharded, a torch Colwise/Rowwise style on a module it cannot
    shard: a Conv1D (no linear style can know its weight is transposed) or any module that is
    not an ``nn.Linear`` / ``nn.Embedding`` (one calling ``F.linear`` on its own parameter, say).
    torch would raise deep inside ``parallelize_module``, after other modules were sharded."""
    wrong = []
    for fqn, style in kept.items():
        module = model.get_submodule(fqn)
        if not isinstance(style, (ColwiseParallel, RowwiseParallel)) or isinstance(
                module, (nn.Linear, nn.Embedding)):
            continue
        ours = isinstance(style, (Conv1DColwiseParallel, Conv1DRowwiseParallel))
        if is_conv1d(module) and not ours:
            wrong.append(f"{fqn} ({type(style).__name__}): transformers Conv1D holds its weight "
                         "as [in, out] (y = x @ W + b), and torch's linear styles take nn.Linear "
                         "([out, in]) only. Fix: use titanext.plugins.tensor_parallel."
                         "Conv1DColwiseParallel / Conv1DRowwiseParallel (same arguments) for it "
                         "(docs/fsdp_tp.md#conv1d)")
        elif not is_conv1d(module):
            wrong.append(f"{fqn} ({type(style).__name__} on {type(module).__name__}): the "
                         "column / row styles shard nn.Linear, nn.Embedding and Conv1D weights "
                         "only. Fix: hold the module's weight in an nn.Linear, give it a "
                         "ParallelStyle of your own, or leave it out of the plan (replicated)")
    if wrong:
        raise ValueError("apply_tensor_parallel: " + "; ".join(wrong))
