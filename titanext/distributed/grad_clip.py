"""Global gradient-norm clipping over FSDP / TP / PP shards (:func:`clip_grad_norm_`), and
:func:`clip_mirrored_grads` for DualPipe's two copies of each stage.

>>> import torch
>>> w = torch.nn.Parameter(torch.ones(4))
>>> w.grad = torch.full((4,), 2.0)
>>> float(clip_grad_norm_([w], 1.0)), [round(float(g), 4) for g in w.grad]
(4.0, [0.5, 0.5, 0.5, 0.5])
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from titanext._compat import foreach_mul_

__all__ = ["clip_grad_norm_", "clip_mirrored_grads"]


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    *,
    norm_type: float = 2.0,
    pp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Global gradient-norm clipping for any mix of plain tensors and DTensors.

    Gradients are bucketed by (mesh, sharded mesh dims); each bucket's local ``|g|^p`` is summed
    and reduced once per sharded dim, so parameters sharded by FSDP, TP or both, on different
    meshes, mix freely at a few collectives per step. With ``pp_group`` the total also sums over
    pipeline stages, which hold different parameters. ``max_norm <= 0`` only measures.
    Returns the total norm as a plain fp32 tensor.
    """
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.tensor(0.0)
    is_inf = math.isinf(norm_type)
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            # e.g. SP norm weights: each TP rank holds a partial sum. Reduce it now (the
            # optimizer would do the same), so the norm sees the real gradient.
            g = p.grad = g.redistribute(
                g.device_mesh, [Replicate() if pl.is_partial() else pl for pl in g.placements]
            )
        if isinstance(g, DTensor):
            dims = tuple(i for i, pl in enumerate(g.placements) if not pl.is_replicate())
            key, local = (g.device_mesh, dims), g.to_local()
        else:
            key, local = (None, ()), g
        n = torch.linalg.vector_norm(local.float(), norm_type)
        buckets.setdefault(key, []).append(n if is_inf else n.pow(norm_type))
    device = params[0].grad.device
    total = torch.zeros((), dtype=torch.float32, device=device)
    op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
    for (mesh, dims), parts in buckets.items():
        acc = torch.stack(parts).max() if is_inf else torch.stack(parts).sum()
        for d in dims:
            dist.all_reduce(acc, op=op, group=mesh.get_group(d))
        total = torch.maximum(total, acc) if is_inf else total + acc
    if pp_group is not None:
        dist.all_reduce(total, op=op, group=pp_group)
    if not is_inf:
        total = total.pow(1.0 / norm_type)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        # Scale the local shards in place (under no_grad, to_local() is the DTensor's storage):
        # one foreach kernel, whatever meshes the gradients live on.
        local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
        foreach_mul_(local, coef.to(local[0].device))
    return total


def clip_mirrored_grads(down: list, up: list, max_norm: float, *, pp_group=None) -> torch.Tensor:
    """Global-norm clipping for DualPipe's two copies: the norm counts every stage once (the
    ``down`` copies' parameters, summed over ``pp_group``) and both copies take the same factor,
    so mirrored copies stay bitwise equal. Call after
    :func:`titanext.schedules.dualpipe.sum_mirrored_grads`; returns the norm. The pipeline runner
    does this; the factor is :func:`clip_grad_norm_`'s."""
    total = clip_grad_norm_(down, 0.0, pp_group=pp_group)  # measure only
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                 for p in (*down, *up) if p.grad is not None]
        if grads:
            foreach_mul_(grads, coef.to(grads[0].device))
    return total
