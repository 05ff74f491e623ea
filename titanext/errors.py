"""User-facing error types. A leaf module: it imports nothing of titanext's.

- :class:`ConfigError`: every config problem, one line per problem (exit code 2).
- :class:`TrainingDiverged`: the loss or gradient norm became NaN or inf.
- :class:`CheckpointError` and its subclasses: a checkpoint that cannot be used, named.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointMismatch",
    "CheckpointNotFound",
    "CheckpointUnsafe",
    "ConfigError",
    "TrainingDiverged",
]


class ConfigError(ValueError):
    """Every user-facing config problem; ``problems`` holds one line per problem.

    >>> str(ConfigError(["a.b = 1 is bad", "c.d = 2 is bad"]))
    'a.b = 1 is bad\\nc.d = 2 is bad'
    """

    def __init__(self, problems: Sequence[str] | str) -> None:
        self.problems: list[str] = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))

    def __reduce__(self) -> tuple[type, tuple[list[str]]]:
        # Keep the per-problem split when the error crosses a process boundary (spawned tests).
        return (type(self), (self.problems,))


class TrainingDiverged(RuntimeError):
    """Raised when the loss or gradient norm becomes NaN or inf."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded as asked (named in the message).

    ``titanext.train`` prints the message once and exits 2, on every rank alike: the checks run
    on rank 0 and their verdict is broadcast, so no rank waits for another that has given up.
    """


class CheckpointNotFound(CheckpointError, ValueError):
    """``checkpoint.load_step = N`` names a step without a checkpoint; lists the available ones."""


class CheckpointCorrupt(CheckpointError):
    """The chosen checkpoint is incomplete or damaged (a missing ``.metadata``, a truncated
    shard); names the step folder and the file, and the explicit fallback
    ``--checkpoint.load_step=<an older step>``."""


class CheckpointMismatch(CheckpointError):
    """The checkpoint was saved for another model (flavor or tensor shapes differ)."""


class CheckpointUnsafe(CheckpointError):
    """A checkpoint file that needs code to load (a pickled class or call that
    ``torch.load(weights_only=True)`` refuses), or state that cannot be stored as plain data;
    names the file or the object and the fix. Nothing in the file runs."""
