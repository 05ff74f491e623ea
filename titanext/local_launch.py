"""Old path of :mod:`titanext.launch.local` (re-exports only)."""

from titanext.launch.local import (
    free_port,
    run_distributed,
)

__all__ = ["free_port", "run_distributed"]
