"""Optimizer, learning-rate schedule and global gradient-norm clipping.

>>> opt = build_optimizer(model.parameters(), name="AdamW", lr=3e-4)          # doctest: +SKIP
>>> sched = build_lr_scheduler(opt, warmup_steps=100, total_steps=1000)       # doctest: +SKIP
>>> norm = clip_grad_norm_(model.parameters(), max_norm=1.0)                  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

__all__ = ["build_lr_scheduler", "build_optimizer", "clip_grad_norm_", "lr_lambda"]

_OPTIMIZERS = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}


def build_optimizer(
    params: Iterable[torch.nn.Parameter],
    *,
    name: str = "AdamW",
    lr: float = 8e-4,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    weight_decay: float = 0.1,
    implementation: str = "foreach",
    zero1_group: dist.ProcessGroup | None = None,
) -> torch.optim.Optimizer:
    """AdamW/Adam; with ``zero1_group`` a ZeroRedundancyOptimizer that shards its state (ZeRO-1)."""
    if name not in _OPTIMIZERS:
        raise ValueError(f"optimizer.name = {name!r}; allowed: {', '.join(_OPTIMIZERS)}")
    impl = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
    if implementation not in impl:
        raise ValueError(f"optimizer.implementation = {implementation!r}; allowed: {', '.join(impl)}")
    kwargs = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **impl[implementation])
    params = [p for p in params if p.requires_grad]
    if zero1_group is not None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(
            params, optimizer_class=_OPTIMIZERS[name], process_group=zero1_group, **kwargs
        )
    return _OPTIMIZERS[name](params, **kwargs)


def lr_lambda(step: int, *, warmup_steps: int, total_steps: int, decay_ratio: float | None,
              decay_type: str, min_lr_factor: float) -> float:
    """LR multiplier at optimizer step ``step`` (0-based): warmup, stable, decay.

    Warmup rises linearly to 1 over ``warmup_steps`` (starting above 0, so step 0 trains).
    The last ``decay_ratio`` of the steps (all steps after warmup when None) decay to
    ``min_lr_factor`` linearly, as sqrt, or along a cosine.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    decay_steps = total_steps - warmup_steps if decay_ratio is None else round(total_steps * decay_ratio)
    decay_start = total_steps - decay_steps
    if step < decay_start or decay_steps <= 0:
        return 1.0
    progress = min(1.0, (step - decay_start + 1) / (decay_steps + 1))
    if decay_type == "linear":
        frac = 1.0 - progress
    elif decay_type == "sqrt":
        frac = 1.0 - math.sqrt(progress)
    elif decay_type == "cosine":
        frac = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"lr_scheduler.decay_type = {decay_type!r}; allowed: linear, sqrt, cosine")
    return min_lr_factor + (1.0 - min_lr_factor) * frac


def build_lr_scheduler(optimizer: torch.optim.Optimizer, *, warmup_steps: int = 0,
                       total_steps: int, decay_ratio: float | None = None,
                       decay_type: str = "linear", min_lr_factor: float = 0.0) -> LambdaLR:
    fn = functools.partial(lr_lambda, warmup_steps=warmup_steps, total_steps=total_steps,
                           decay_ratio=decay_ratio, decay_type=decay_type, min_lr_factor=min_lr_factor)
    return LambdaLR(optimizer, fn)


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    *,
    norm_type: float = 2.0,
    pp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Global gradient-norm clipping for any mix of plain tensors and DTensors.

    Each DTensor's norm is reduced over its own mesh (so parameters sharded by FSDP, TP or
    both, on different meshes, can be mixed), then the per-parameter norms are combined.
    With ``pp_group`` the total also sums over pipeline stages, which hold different
    parameters. ``max_norm <= 0`` only measures. Returns the total norm (a plain tensor).
    """
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.tensor(0.0)
    norms = []
    for p in params:
        n = torch.linalg.vector_norm(p.grad, norm_type)
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    device = norms[0].device
    stacked = torch.stack([n.to(device=device, dtype=torch.float32) for n in norms])
    if math.isinf(norm_type):
        total = stacked.max()
        if pp_group is not None:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_group)
    else:
        total = stacked.pow(norm_type).sum()
        if pp_group is not None:
            dist.all_reduce(total, group=pp_group)
        total = total.pow(1.0 / norm_type)
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_([p for p in params], max_norm, total)
    return total
