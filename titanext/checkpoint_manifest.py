"""Old path of :mod:`titanext.components.checkpoint_manifest` (re-exports only)."""

from titanext.components.checkpoint_manifest import (
    config_changes,
    manifest_info,
    read_manifest,
    resume_problems,
    step_folders,
)

__all__ = ["config_changes", "manifest_info", "read_manifest", "resume_problems", "step_folders"]
