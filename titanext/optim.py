"""Old path of :mod:`titanext.components.optim` (re-exports only)."""

from titanext.components.optim import (
    build_lr_scheduler,
    build_optimizer,
    lr_lambda,
)
from titanext.distributed.utils import (
    clip_grad_norm_,
)

__all__ = ["build_lr_scheduler", "build_optimizer", "clip_grad_norm_", "lr_lambda"]
