"""Seeding and deterministic kernels for a run (``[training] seed``, ``deterministic``): the
trainer calls :func:`set_determinism` once, before it builds the model.
"""

from __future__ import annotations

import os

import torch

__all__ = ["set_determinism"]


def set_determinism(seed: int, deterministic: bool = False) -> None:
    """Seed torch's RNG; ``deterministic`` also asks for deterministic kernels (slower)."""
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
