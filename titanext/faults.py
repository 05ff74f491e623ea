"""Old path of :mod:`titanext.launch.faults` (re-exports only)."""

from titanext.distributed.utils import (
    elastic_store,
)
from titanext.launch.faults import (
    abort_process_group,
    exit_process,
    inject_test_fault,
    print_output,
    report_once,
    run_guarded,
)

__all__ = ["abort_process_group", "elastic_store", "exit_process", "inject_test_fault",
           "print_output", "report_once", "run_guarded"]
