"""Old path of :mod:`titanext.launch.preflight` (re-exports only)."""

from titanext.launch.preflight import (
    check_preflight,
    folder_problem,
    output_folders,
    preflight_problems,
)

__all__ = ["check_preflight", "folder_problem", "output_folders", "preflight_problems"]
