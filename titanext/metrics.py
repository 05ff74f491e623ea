"""Old path of :mod:`titanext.components.metrics` (re-exports only)."""

from titanext.components.metrics import (
    MetricsLogger,
    device_peak_flops,
    format_table,
    peak_flops_for_name,
)

__all__ = ["device_peak_flops", "format_table", "MetricsLogger", "peak_flops_for_name"]
