"""Old path of :mod:`titanext.launch.dry_run` (re-exports only)."""

from titanext.launch.dry_run import (
    MEASURED_ROUNDS,
    CommBytes,
    DryRunResult,
    dry_run,
    dry_run_config,
    host_float,
    measure,
    measure_real,
    planner_peak_bytes,
    stage_activation,
)

__all__ = ["CommBytes", "dry_run", "dry_run_config", "DryRunResult", "host_float", "measure",
           "measure_real", "MEASURED_ROUNDS", "planner_peak_bytes", "stage_activation"]
