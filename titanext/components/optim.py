"""Optimizer and learning-rate schedule.

Gradient clipping is :func:`titanext.distributed.grad_clip.clip_grad_norm_`.


>>> import torch
>>> model = torch.nn.Linear(4, 4)
>>> opt = build_optimizer(model.parameters(), name="AdamW", lr=3e-4)
>>> sched = build_lr_scheduler(opt, warmup_steps=100, total_steps=1000)
>>> round(sched.get_last_lr()[0], 12)  # warm-up starts at lr / 100
3e-06
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from titanext.components.lowp_adam import LowPrecisionStateAdam, LowPrecisionStateAdamW

__all__ = ["build_lr_scheduler", "build_optimizer", "lr_lambda"]

_OPTIMIZERS = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}
# [optimizer] state_dtype: the moments' dtype; float32 is torch's own class
_STATE_DTYPES = {"float32": None, "bfloat16": torch.bfloat16}
_LOW_PRECISION_STATE = {"AdamW": LowPrecisionStateAdamW, "Adam": LowPrecisionStateAdam}


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
    state_dtype: str = "float32",
) -> torch.optim.Optimizer:
    """AdamW/Adam; with ``zero1_group`` a ZeroRedundancyOptimizer that shards its state (ZeRO-1).

    ``state_dtype="bfloat16"`` keeps the moments in bf16 (:mod:`titanext.components.lowp_adam`;
    its step runs one parameter at a time, whatever ``implementation`` says).
    """
    if name not in _OPTIMIZERS:
        raise ValueError(f"optimizer.name = {name!r}; allowed: {', '.join(_OPTIMIZERS)}")
    impl = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
    if implementation not in impl:
        raise ValueError(
            f"optimizer.implementation = {implementation!r}; allowed: {', '.join(impl)}"
        )
    if state_dtype not in _STATE_DTYPES:
        raise ValueError(
            f"optimizer.state_dtype = {state_dtype!r}; allowed: {', '.join(_STATE_DTYPES)}")
    optimizer_class = _OPTIMIZERS[name]
    kwargs = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **impl[implementation])
    if _STATE_DTYPES[state_dtype] is not None:
        if name not in _LOW_PRECISION_STATE:
            raise ValueError(f"optimizer.state_dtype = {state_dtype!r} applies to "
                             f"{', '.join(_LOW_PRECISION_STATE)}, not {name!r}")
        optimizer_class = _LOW_PRECISION_STATE[name]
        kwargs = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                      state_dtype=_STATE_DTYPES[state_dtype])
    params = [p for p in params if p.requires_grad]
    if zero1_group is None:
        # foreach/fused kernels cannot mix DTensors and plain tensors (e.g. TP without SP leaves
        # the norms plain), and they run per param group: give each kind its own group.
        kinds = (
            [p for p in params if isinstance(p, DTensor)],
            [p for p in params if not isinstance(p, DTensor)],
        )
        params = [{"params": group} for group in kinds if group]
    if zero1_group is not None:

        return ZeroRedundancyOptimizer(
            params, optimizer_class=optimizer_class, process_group=zero1_group, **kwargs
        )
    return optimizer_class(params, **kwargs)


def lr_lambda(step: int, *, warmup_steps: int, total_steps: int, decay_ratio: float | None,
              decay_type: str, min_lr_factor: float) -> float:
    """LR multiplier at optimizer step ``step`` (0-based): warmup, stable, decay.

    Warmup rises linearly and reaches 1 at its last step (step 0 already trains, at
    1/warmup_steps). The last ``decay_ratio`` of the steps (all steps after warmup when None)
    start at the peak and decay towards ``min_lr_factor`` linearly, as sqrt, or along a
    cosine; the factor would reach ``min_lr_factor`` at step ``total_steps``.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay_ratio is None:
        decay_steps = total_steps - warmup_steps
    else:
        decay_steps = round(total_steps * decay_ratio)
    decay_start = max(total_steps - decay_steps, warmup_steps)
    if step < decay_start or decay_steps <= 0:
        return 1.0
    progress = min(1.0, (step - decay_start) / (total_steps - decay_start))
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
                           decay_ratio=decay_ratio, decay_type=decay_type,
                           min_lr_factor=min_lr_factor)
    return LambdaLR(optimizer, fn)


