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
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from titanext.components.lowp_adam import LowPrecisionStateAdam, LowPrecisionStateAdamW
from titanext.components.muon import MuonWithAdamW
from titanext.components.param_groups import ParamGroup

__all__ = ["build_lr_scheduler", "build_optimizer", "lr_lambda"]

_OPTIMIZERS = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}
# [optimizer] state_dtype: the moments' dtype; float32 is torch's own class
_STATE_DTYPES = {"float32": None, "bfloat16": torch.bfloat16}
_LOW_PRECISION_STATE = {"AdamW": LowPrecisionStateAdamW, "Adam": LowPrecisionStateAdam}
_IMPLEMENTATIONS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True},
                    "fused": {"fused": True}}


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
    groups: Sequence[ParamGroup] | None = None,
    muon: Mapping[str, Any] | None = None,
    state_dtype: str = "float32",
) -> torch.optim.Optimizer:
    """AdamW/Adam; with ``zero1_group`` a ZeroRedundancyOptimizer that shards its state (ZeRO-1).

    ``state_dtype="bfloat16"`` keeps the AdamW / Adam moments in bf16
    (:mod:`titanext.components.lowp_adam`; its step runs one parameter at a time, whatever
    ``implementation`` says); Muon groups take no low-precision state.

    With ``groups`` (:func:`titanext.components.param_groups.param_groups`), ``params`` are
    ``(fqn, param)`` pairs and each group gets its optimizer, learning rate and weight decay;
    a Muon group makes it a :class:`~titanext.components.muon.MuonWithAdamW`, whose Muon
    settings (``lr``, ``weight_decay``, ``momentum``, ``nesterov``, ``ns_steps``,
    ``adjust_lr_fn``, ``ns_dtype``, ``splits``) come from ``muon``.
    """
    if groups is not None:
        return _build_grouped(params, groups, name=name, lr=lr, betas=betas, eps=eps,
                              weight_decay=weight_decay, implementation=implementation,
                              zero1_group=zero1_group, muon=muon or {},
                              state_dtype=state_dtype)
    optimizer_class, impl = _adam_class(name, implementation, state_dtype)
    kwargs = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **impl)
    params = [p for p in params if p.requires_grad]
    if zero1_group is not None:
        return ZeroRedundancyOptimizer(
            params, optimizer_class=optimizer_class, process_group=zero1_group, **kwargs
        )
    return optimizer_class([{"params": kind} for kind in _by_kind(params)], **kwargs)


def _adam_class(name: str, implementation: str, state_dtype: str) -> tuple[type, dict]:
    """The AdamW / Adam class for ``state_dtype`` and its implementation keywords."""
    if name not in _OPTIMIZERS:
        raise ValueError(f"optimizer.name = {name!r}; allowed: {', '.join(_OPTIMIZERS)}")
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(f"optimizer.implementation = {implementation!r}; allowed: "
                         f"{', '.join(_IMPLEMENTATIONS)}")
    if state_dtype not in _STATE_DTYPES:
        raise ValueError(
            f"optimizer.state_dtype = {state_dtype!r}; allowed: {', '.join(_STATE_DTYPES)}")
    if _STATE_DTYPES[state_dtype] is None:
        return _OPTIMIZERS[name], _IMPLEMENTATIONS[implementation]
    return _LOW_PRECISION_STATE[name], {"state_dtype": _STATE_DTYPES[state_dtype]}


def _by_kind(params: list[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
    # foreach/fused kernels cannot mix DTensors and plain tensors (e.g. TP without SP leaves
    # the norms plain), and they run per param group: give each kind its own group.
    kinds = ([p for p in params if isinstance(p, DTensor)],
             [p for p in params if not isinstance(p, DTensor)])
    return [k for k in kinds if k]


def _build_grouped(named: Iterable[tuple[str, torch.nn.Parameter]],
                   groups: Sequence[ParamGroup], *, name: str, lr: float,
                   betas: tuple[float, float], eps: float, weight_decay: float,
                   implementation: str, zero1_group: dist.ProcessGroup | None,
                   muon: Mapping[str, Any], state_dtype: str) -> torch.optim.Optimizer:
    """The optimizer over ``groups`` of the named parameters."""
    by_name = {n: p for n, p in named if p.requires_grad}
    decay = {"muon": muon.get("weight_decay", weight_decay), "default": weight_decay,
             "none": 0.0}
    dicts = []
    for g in groups:
        settings = {"optimizer": g.optimizer, "weight_decay": decay[g.weight_decay_from]}
        if g.optimizer == "Muon":
            settings.update(lr=muon.get("lr", lr), momentum=muon.get("momentum", 0.95),
                            nesterov=muon.get("nesterov", True),
                            ns_steps=muon.get("ns_steps", 5),
                            adjust_lr_fn=muon.get("adjust_lr_fn"))
        else:
            settings.update(lr=lr, betas=betas, eps=eps)
        members = [by_name[n] for n in g.names if n in by_name]
        dicts += [{"params": kind, **settings} for kind in _by_kind(members)]
    if not any(g.optimizer == "Muon" for g in groups):
        for d in dicts:
            del d["optimizer"]
        optimizer_class, impl = _adam_class(name, implementation, state_dtype)
        if zero1_group is not None:
            return ZeroRedundancyOptimizer(dicts, optimizer_class=optimizer_class,
                                           process_group=zero1_group, lr=lr, **impl)
        return optimizer_class(dicts, lr=lr, **impl)
    if _STATE_DTYPES.get(state_dtype) is not None:
        raise ValueError(f"optimizer.state_dtype = {state_dtype!r} keeps AdamW / Adam moments; "
                         "with name = 'Muon' use 'float32'")
    names = {id(p): n for n, p in by_name.items()}
    foreach = implementation != "for-loop"  # Muon's matrices run one by one whatever it is
    cls = functools.partial(MuonWithAdamW, param_names=names, foreach=foreach,
                            ns_dtype=muon.get("ns_dtype", torch.bfloat16),
                            splits=muon.get("splits"))
    if zero1_group is not None:  # ZeRO-1 hands each matrix to one rank: that rank is its owner
        return ZeroRedundancyOptimizer(dicts, optimizer_class=cls, process_group=zero1_group,
                                       lr=lr)
    return cls(dicts, lr=lr)


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


