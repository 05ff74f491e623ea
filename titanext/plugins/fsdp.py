"""FSDP2 / HSDP (ZeRO-2 and ZeRO-3) and replicated data parallelism (ZeRO-1).

``apply_fsdp`` shards every block as its own FSDP unit (and every multi-token prediction
module after them), then the root, with a MixedPrecisionPolicy. A 2D mesh
``(dp_replicate, dp_shard)`` gives HSDP.

>>> from torch.distributed.device_mesh import init_device_mesh
>>> mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))  # torchrun  # doctest: +SKIP
>>> apply_fsdp(model, mesh, param_dtype=torch.float32)  # in a process group  # doctest: +SKIP

ZeRO stages (as in the Ultra-Scale Playbook): 3 = parameters, gradients and optimizer state
sharded (reshard after forward); 2 = the same but parameters stay gathered between forward
and backward; 1 = replicated parameters with DDP and a sharded optimizer
(:func:`apply_ddp` + ``ZeroRedundancyOptimizer``, see ``titanext.components.optim``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from titanext.plugins._blocks import find_blocks, mtp_modules

__all__ = ["apply_ddp", "apply_fsdp", "resolve_reshard_after_forward", "set_gradient_divide_factor"]

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
        raise ValueError(
            f"reshard_after_forward = {policy!r}; allowed: {', '.join(_RESHARD_POLICIES)}"
        )
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
    blocks: Iterable[nn.Module] | str | None = None,
    extra_units: Iterable[nn.Module] = (),
    expert_units: Iterable[nn.Module] = (),
    expert_mesh: DeviceMesh | None = None,
    expert_gradient_divide_factor: float | None = None,
) -> nn.Module:
    """Shard ``model`` with FSDP2 over ``mesh`` (1D: FSDP, 2D: HSDP), in place; one WARNING
    line says how many units it made.

    Args:
        model: any module; its blocks come from ``blocks`` or ``model.layers``. Its
            multi-token prediction modules (``model.mtp.layers``) follow them as units of their
            own, so that each is gathered only while it runs.
        mesh: the data-parallel mesh. For HSDP pass a 2D mesh (replicate, shard).
        param_dtype / reduce_dtype: MixedPrecisionPolicy (bf16/fp32 is the usual GPU choice).
        reshard_after_forward: "default", "always", "never", or fully_shard's bool/int.
        zero_stage: 2 or 3 (see module docstring).
        extra_units: further submodules to make their own FSDP units (e.g. embeddings).
        expert_units / expert_mesh / expert_gradient_divide_factor: expert-parallel experts
            modules (see ``titanext.plugins.expert_parallel``), sharded over ``expert_mesh``
            (the data-parallel ranks left after ep) with their summed gradients divided by
            ``expert_gradient_divide_factor`` instead of the mesh size, so that they are scaled
            like the dense gradients (pass the dense mesh size: dp_replicate x dp_shard x cp).
    """
    if zero_stage not in (2, 3):
        raise ValueError(
            f"apply_fsdp: zero_stage = {zero_stage}; allowed: 2, 3 (use apply_ddp for 1)"
        )
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    reshard = resolve_reshard_after_forward(reshard_after_forward, zero_stage=zero_stage,
                                            pp_enabled=pp_enabled)
    expert_units = list(expert_units)
    for unit in expert_units:  # before the blocks that contain them
        fully_shard(unit, mesh=expert_mesh, mp_policy=mp, reshard_after_forward=reshard)
        if expert_gradient_divide_factor is not None:
            set_gradient_divide_factor(unit, expert_gradient_divide_factor, expert_mesh)
    units = [*extra_units, *find_blocks(model, blocks)]
    units += [m for m in mtp_modules(model) if all(m is not u for u in units)]
    for i, unit in enumerate(units):
        # The last unit is needed again right at the start of backward: keep it gathered.
        last = i == len(units) - 1
        fully_shard(unit, mesh=mesh, mp_policy=mp, reshard_after_forward=False if last else reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    if not dist.is_initialized() or dist.get_rank() == 0:
        experts = len(expert_units)
        logging.getLogger("titanext").warning(
            "fsdp: %s: %d block unit(s) + the root sharded over %s (%s ranks), "
            "reshard_after_forward=%s%s", type(model).__name__, len(units), mesh.mesh_dim_names,
            "x".join(str(n) for n in mesh.shape), reshard,
            f", {experts} expert unit(s)" if experts else "")
    return model


def set_gradient_divide_factor(unit: nn.Module, factor: float, mesh: DeviceMesh) -> None:
    """Make an FSDP unit (sharded over ``mesh``) divide its summed gradients by ``factor``,
    not by its mesh size.

    gloo has no PREMUL_SUM, which FSDP uses for a custom factor, so a sharded unit off NCCL
    reduces with SUM and divides afterwards. A unit whose shard group has one rank keeps the
    default path: FSDP divides once by the factor there (since torch 2.10; forcing SUM there
    divides twice in torch 2.13).
    """
    unit.set_gradient_divide_factor(float(factor))
    shard_group = mesh.get_group(mesh.ndim - 1)  # FSDP shards over the last dim (HSDP: 2D)
    if shard_group.size() > 1 and dist.get_backend(shard_group) != "nccl":
        unit.set_force_sum_reduction_for_comms(True)


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """Replicated data parallelism (DDP) over ``dp_mesh``; the ZeRO-1 parameter layout.

    Returns the DDP wrapper; keep a reference to ``model`` for attribute access.
    """
    if dp_mesh.size() == 1:
        return model
    return nn.parallel.DistributedDataParallel(
        model, process_group=dp_mesh.get_group(), broadcast_buffers=False
    )
