"""Old path of :mod:`titanext.components.validation` (re-exports only)."""

from titanext.components.validation import (
    IGNORE_INDEX,
    Validator,
    pipeline_forward,
)

__all__ = ["IGNORE_INDEX", "pipeline_forward", "Validator"]
