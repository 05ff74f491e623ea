"""Old path of :mod:`titanext.distributed.parallel_dims` (re-exports only)."""

from titanext.distributed.parallel_dims import (
    ParallelDims,
    resolve_dp_shard,
)
from titanext.distributed.utils import (
    device_type,
    init_distributed,
    set_determinism,
    set_process_group_timeout,
)

__all__ = ["device_type", "init_distributed", "ParallelDims", "resolve_dp_shard",
           "set_determinism", "set_process_group_timeout"]
