"""Layout-invariant parameter initialisation.

A parameter may be a plain tensor or a DTensor sharded by FSDP/TP. We generate the *full*
tensor from a generator seeded by (seed, parameter name) and keep only the local shard, so a
model initialised with the same seed holds the same values under any parallel layout. That is
what lets a 4-rank run start exactly where a 1-process run starts.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from titanext._compat import trunc_normal_


def _seed_for(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


@torch.no_grad()
def init_tensor_(
    param: torch.Tensor,
    name: str,
    seed: int,
    fill: Callable[[torch.Tensor, torch.Generator], None],
) -> None:
    """Fill ``param`` in place with ``fill(full_tensor, generator)``, shard-aware.

    ``fill`` receives a fresh full-size fp32 tensor and a generator seeded from ``seed`` and
    ``name``; for a DTensor only the local shard of the result is kept.
    """
    if param.device.type == "meta":
        return
    gen = torch.Generator(device=param.device).manual_seed(_seed_for(seed, name))
    full = torch.empty(param.shape, dtype=torch.float32, device=param.device)
    fill(full, gen)
    if isinstance(param, DTensor):
        # src_data_rank=None slices locally: every rank generated the same full tensor.
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(local.to_local())
    else:
        param.copy_(full)


def normal_(
    std: float, truncate: float | None = None
) -> Callable[[torch.Tensor, torch.Generator], None]:
    """A ``fill`` for :func:`init_tensor_`: normal(0, std), truncated at ``truncate`` stds."""

    def fill(t: torch.Tensor, gen: torch.Generator) -> None:
        if truncate is None:
            t.normal_(0.0, std, generator=gen)
        else:
            # titanext's own sampler: torch 2.11's trunc_normal_ draws other values
            trunc_normal_(t, 0.0, std, -truncate * std, truncate * std, generator=gen)

    return fill


def constant_(value: float) -> Callable[[torch.Tensor, torch.Generator], None]:
    def fill(t: torch.Tensor, gen: torch.Generator) -> None:
        t.fill_(value)

    return fill
