"""Old path of :mod:`titanext.components.checkpoint` (re-exports only)."""

from titanext.components.checkpoint import (
    CheckpointManager,
    config_changes,
    logger,
    manifest_info,
    read_manifest,
    resume_problems,
)

__all__ = ["CheckpointManager", "config_changes", "logger", "manifest_info", "read_manifest",
           "resume_problems"]
