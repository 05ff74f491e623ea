"""``python -m tests.e2e.fault_entry [titanext.train arguments]``: ``titanext.train`` with one
fault injected after a step, for the fault tests (tests/e2e/test_train_faults.py). The trainer
knows nothing of it: this entry point wraps the trainer's after-step work.

``TITANEXT_TEST_FAULT`` says which fault:

- ``raise:R:S``: rank R raises a RuntimeError after step S;
- ``kill:R:S:FILE``: rank R SIGKILLs itself after step S (and its checkpoint) unless FILE exists,
  creating FILE first, so that a restarted worker does not kill itself again.
"""

from __future__ import annotations

import os
import signal

from titanext.distributed.failsafe import exit_process
from titanext.train import main
from titanext.trainer import Trainer


def inject_fault(spec: str, rank: int, step: int) -> None:
    """The fault ``spec`` names, if it is ``rank``'s after ``step``; else nothing."""
    kind, fault_rank, fault_step, *marker = spec.split(":", 3)
    if rank != int(fault_rank) or step != int(fault_step):
        return
    if kind == "raise":
        raise RuntimeError(f"injected test fault on rank {rank} after step {step}")
    if kind == "kill" and marker and not os.path.exists(marker[0]):
        with open(marker[0], "w") as f:
            f.write(f"rank {rank} killed itself after step {step}\n")
        os.kill(os.getpid(), signal.SIGKILL)


def _install(spec: str) -> None:
    after_step = Trainer._after_step

    def after_step_then_fault(self, *args, **kwargs):
        after_step(self, *args, **kwargs)
        inject_fault(spec, self.rank, self.step)

    Trainer._after_step = after_step_then_fault


if __name__ == "__main__":
    _install(os.environ["TITANEXT_TEST_FAULT"])
    exit_process(main())
