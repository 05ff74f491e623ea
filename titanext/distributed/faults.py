"""Failing fast, once, on every rank: how ``titanext.train`` ends a run that went wrong.

- An unexpected exception on one rank is printed once, naming the rank, and the process group
  is aborted without waiting for peers (no barrier): their collectives fail at once ("connection
  closed by peer") instead of waiting for the timeout, they exit non-zero too, and under
  torchrun the agent stops the rest as soon as one worker has exited non-zero.
- Errors every rank raises alike (a config or checkpoint problem, a diverged loss) are printed
  once, by rank 0, with their exit code: 2 for bad input, 1 for divergence, 130 for Ctrl-C;
  the process group is aborted all the same, so a rank that raised alone never blocks.
- A clean run ends with a barrier and ``destroy_process_group``.

The abort itself, and the guard that gives library calls the same behaviour, live in
:mod:`titanext.distributed.failsafe` (the trainer's build and step run inside those guards too).

>>> run_guarded(lambda: None)   # no process group: nothing to tear down
0
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import NoReturn

from titanext.distributed.failsafe import PEER_GONE, PeerFailed, abort_process_group
from titanext.errors import CheckpointError, ConfigError, TrainingDiverged

__all__ = ["exit_process", "inject_test_fault",
           "print_output", "report_once", "run_guarded"]

# Under torchrun the first worker to exit non-zero gets the others SIGTERMed: ranks that stay
# silent wait this long, so that rank 0 (slower to start, say) prints the shared error first.
_QUIET_RANK_GRACE_S = 3.0


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def exit_process(code: int) -> NoReturn:
    """``sys.exit(code)``; a failed run skips the interpreter's shutdown (no thread or writer
    may keep a dead job alive), after flushing what it printed."""
    if code:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
    sys.exit(code)


def print_output(text: str) -> int:
    """Print what ``--help`` or ``--print-config`` asked for; exit code 0 even when the reader
    closed the pipe early (``--help | head``: no BrokenPipeError traceback)."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        pass
    return 0


def _say(message: str, everyone: bool = False) -> None:
    if everyone or _rank() == 0:
        print(message, file=sys.stderr, flush=True)


def report_once(lines: list[str], prefix: str = "titanext: config error: ") -> int:
    """Print an error every rank found alike from rank 0 only; exit code 2.

    Other ranks linger for a moment first: under torchrun the first worker to exit gets the
    rest stopped, and that must not be before rank 0 has printed.
    """
    for line in lines:
        _say(prefix + line)
    if _rank() != 0:
        time.sleep(_QUIET_RANK_GRACE_S)
    return 2


def _teardown() -> None:
    if not _initialized():
        return
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def run_guarded(body: Callable[[], object]) -> int:
    """Run ``body`` (build the trainer and train) and end the process group; the exit code.

    Ctrl-C and SIGTERM (torchrun stopping the workers) stop the run without saving anything
    partial (checkpoint writes are atomic anyway).
    """
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        body()
    except (ConfigError, CheckpointError) as e:  # raised alike on every rank
        kind = "config" if isinstance(e, ConfigError) else "checkpoint"
        abort_process_group()
        return report_once(getattr(e, "problems", None) or [str(e)], f"titanext: {kind} error: ")
    except TrainingDiverged as e:
        _say(f"titanext: training diverged: {e}")
        abort_process_group()
        return 1
    except KeyboardInterrupt:
        _say("titanext: interrupted; nothing partial was saved")
        abort_process_group()
        return 130
    except Exception as e:  # noqa: BLE001 - any other error must not leave the peers waiting
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if isinstance(e, PeerFailed) or any(marker in str(e) for marker in PEER_GONE):
            _say(f"titanext: rank {_rank()}: stopping, another rank failed ({first[:160]})",
                 everyone=True)
        else:
            _say(f"titanext: rank {_rank()} failed:\n{traceback.format_exc().rstrip()}",
                 everyone=True)
        abort_process_group()
        return 1
    _teardown()
    return 0


def inject_test_fault(rank: int, step: int) -> None:
    """Test-only fault injection, driven by ``TITANEXT_TEST_FAULT`` (unset in real runs).

    ``raise:R:S`` makes rank R raise a RuntimeError after step S; ``kill:R:S:FILE`` makes rank R
    SIGKILL itself after step S (and its checkpoint) unless FILE exists, creating FILE first, so
    that a restarted worker does not kill itself again.
    """
    spec = os.environ.get("TITANEXT_TEST_FAULT")
    if not spec:
        return
    kind, fault_rank, fault_step, *marker = spec.split(":", 3)
    if rank != int(fault_rank) or step != int(fault_step):
        return
    if kind == "raise":
        raise RuntimeError(f"injected test fault on rank {rank} after step {step}")
    if kind == "kill" and marker and not os.path.exists(marker[0]):
        with open(marker[0], "w") as f:
            f.write(f"rank {rank} killed itself after step {step}\n")
        os.kill(os.getpid(), signal.SIGKILL)
