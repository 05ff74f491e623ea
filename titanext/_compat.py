"""What differs between the torch versions titanext supports (2.11 to 2.14.1), outside the two
areas that have their own module (pipelining: ``schedules/_torch_ir.py``; the dry run:
``_fake_backend.py``).

Each difference is detected by feature (``hasattr``), never by version string, and titanext
reaches it through the name here only:

- :func:`reduce_scatter_single`: torch 2.13 renamed ``dist.reduce_scatter_tensor`` to
  ``reduce_scatter_single`` (and deprecated the old name); 2.11 has only the old one.
- :func:`trunc_normal_`: torch 2.12 replaced ``nn.init.trunc_normal_``'s inverse-CDF sampler
  by a rejection sampler, so the same generator gave different weights on 2.11 (the debug
  model's step-1 loss at seed 7: 6.6337 on 2.11, 6.8509 on 2.13). titanext samples with its own
  copy of the newer algorithm, so one seed starts the same model on every supported torch.

Leaf module: imports torch only.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = ["reduce_scatter_single", "trunc_normal_"]

#: ``dist.reduce_scatter_single`` where this torch has it (2.13+), else the older name.
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _norm_cdf(x: float) -> float:
    return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0


@torch.no_grad()
def trunc_normal_(t: torch.Tensor, mean: float, std: float, a: float, b: float,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """Fill ``t`` with normal(``mean``, ``std``) values truncated to ``[a, b]``, drawing from
    ``generator`` exactly as ``torch.nn.init.trunc_normal_`` of torch 2.12+ does (the same
    values on torch 2.11, whose own sampler differs).

    >>> g = lambda: torch.Generator().manual_seed(0)
    >>> x = trunc_normal_(torch.empty(1000), 0.0, 0.02, -0.04, 0.04, generator=g())
    >>> bool(x.abs().max() <= 0.04)
    True
    """
    if t.is_meta:
        return t
    if _norm_cdf((b - mean) / std) - _norm_cdf((a - mean) / std) > 0.3:
        # most draws land inside: redraw the ones outside until none is
        lo, hi = t.new_tensor(a, device="cpu").item(), t.new_tensor(b, device="cpu").item()
        t.normal_(mean, std, generator=generator)
        while (mask := (t < lo) | (t > hi)).any():
            t.copy_(torch.where(mask, torch.empty_like(t).normal_(mean, std, generator=generator),
                                t))
        return t
    # a narrow window: uniform proposals on [a, b], accepted with the normal's relative density
    log_peak = -0.5 * ((max(a, min(mean, b)) - mean) / std) ** 2
    candidates, accept = torch.empty_like(t), torch.empty_like(t)

    def rejected(x: torch.Tensor) -> torch.Tensor:  # overwrites candidates with log densities
        candidates.copy_(x).sub_(mean).div_(std).pow_(2).mul_(-0.5).sub_(log_peak)
        return accept.uniform_(generator=generator).log_().gt(candidates)

    t.uniform_(a, b, generator=generator)
    pending = rejected(t)
    result = t
    while pending.any():
        candidates.uniform_(a, b, generator=generator)
        result = torch.where(pending, candidates, result)
        pending = torch.where(pending, rejected(candidates), pending)
    if result is not t:
        t.copy_(result)
    return t
