"""FSDP2 / HSDP (ZeRO-2 and ZeRO-3) and replicated data parallelism (ZeRO-1).

``apply_fsdp`` shards every block as its own FSDP unit, then the root, with a
MixedPrecisionPolicy. A 2D mesh ``(dp_replicate, dp_shard)`` gives HSDP.

>>> from torch.distributed.device_mesh import init_device_mesh
>>> mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))   # under torchrun
>>> apply_fsdp(model, mesh, param_dtype=torch.float32)                    # doctest: +SKIP

ZeRO stages (as in the Ultra-Scale Playbook): 3 = parameters, gradients and optimizer state
sharded (reshard after forward); 2 = the same but parameters stay gathered between forward
and backward; 1 = replicated parameters with DDP and a sharded optimizer
(:func:`apply_ddp` + ``ZeroRedundancyOptimizer``, see ``titanext.optim``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from titanext.plugins._blocks import find_blocks

__all__ = ["apply_ddp", "apply_fsdp", "resolve_reshard_after_forward"]

_RESHARD_POLICIES = ("default", "always", "never")


def resolve_reshard_after_forward(policy: str | bool | int, *, zero_stage: int = 3,
                                  pp_enabled: bool = False) -> bool | int:
    """Map a config policy to ``fully_shard``'s argument.

    "default" reshards (ZeRO-3) except under pipeline parallelism, where each micro-batch's
    backward would all-gather again; "always"/"never" force it; ZeRO-2 never reshards.
    """
    if isinstance(policy, (bool, int)):
        return policy
    if policy not in _RESHARD_POLICIES:
        raise ValueError(f"reshard_after_forward = {policy!r}; allowed: {', '.join(_RESHARD_POLICIES)}")
    if zero_stage == 2 or policy == "never":
        return False
    if policy == "always":
        return True
    return not pp_enabled


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: str | bool | int = "default",
    zero_stage: int = 3,
    pp_enabled: bool = False,
    blocks: Iterable[nn.Module] | None = None,
    extra_units: Iterable[nn.Module] = (),
) -> nn.Module:
    """Shard ``model`` with FSDP2 over ``mesh`` (1D: FSDP, 2D: HSDP), in place.

    Args:
        model: any module; its blocks come from ``blocks`` or ``model.layers``.
        mesh: the data-parallel mesh. For HSDP pass a 2D mesh (replicate, shard).
        param_dtype / reduce_dtype: MixedPrecisionPolicy (bf16/fp32 is the usual GPU choice).
        reshard_after_forward: "default", "always", "never", or fully_shard's bool/int.
        zero_stage: 2 or 3 (see module docstring).
        extra_units: further submodules to make their own FSDP units (e.g. embeddings).
    """
    if zero_stage not in (2, 3):
        raise ValueError(f"apply_fsdp: zero_stage = {zero_stage}; allowed: 2, 3 (use apply_ddp for 1)")
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    reshard = resolve_reshard_after_forward(reshard_after_forward, zero_stage=zero_stage,
                                            pp_enabled=pp_enabled)
    units = [*extra_units, *find_blocks(model, blocks)]
    for i, unit in enumerate(units):
        # The last unit is needed again right at the start of backward: keep it gathered.
        last = i == len(units) - 1
        fully_shard(unit, mesh=mesh, mp_policy=mp, reshard_after_forward=False if last else reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    return model


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """Replicated data parallelism (DDP) over ``dp_mesh``; the ZeRO-1 parameter layout.

    Returns the DDP wrapper; keep a reference to ``model`` for attribute access.
    """
    if dp_mesh.size() == 1:
        return model
    return nn.parallel.DistributedDataParallel(
        model, process_group=dp_mesh.get_group(), broadcast_buffers=False
    )
