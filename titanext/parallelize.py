"""Old path of :mod:`titanext.distributed.parallelize` (re-exports only)."""

from titanext.distributed.parallelize import (
    cp_layout,
    loss_parallel_enabled,
    mixed_precision_dtype,
    parallelize,
    zero1_enabled,
)

__all__ = ["cp_layout", "loss_parallel_enabled", "mixed_precision_dtype", "parallelize",
           "zero1_enabled"]
