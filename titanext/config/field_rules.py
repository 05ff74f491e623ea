"""Per-field checks of :mod:`titanext.config.schema` that import something heavy lazily (torch's
op registry, the schedule registry) or look at the file system, kept apart so that the schema
reads as a list of sections. Each returns None when the value is fine, else what is allowed.

>>> _ac_option("2") is None, _ac_option("two")
(True, "'op' or a positive integer written as a string, such as '2'")
"""

from __future__ import annotations

import os

from titanext._text import did_you_mean as _did_you_mean
from titanext.plugins.rules import DEFAULT_SAVE_OPS

__all__ = ["writable_folder_problem"]


# Schedules that titanext provides with every supported torch. Only another name asks
# titanext.schedules (which imports torch's pipelining), so a plain load stays torch-free;
# tests/unit/config/test_schema.py checks that these are all in titanext.schedules.SCHEDULE_NAMES.
_KNOWN_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                    "ZBVZeroBubble", "ZBH1", "ZBH2", "ZBV", "DualPipe", "DualPipeV", "Auto")


def _pp_schedule(value: str) -> str | None:
    if value in _KNOWN_SCHEDULES:
        return None
    from titanext.schedules import SCHEDULE_NAMES  # the config loads without torch

    if value in SCHEDULE_NAMES:
        return None
    hint = _did_you_mean(value, list(SCHEDULE_NAMES), fallback=False)
    return f"one of {', '.join(SCHEDULE_NAMES)}{hint}"


def _ac_option(value: str) -> str | None:
    # isdecimal() rejects '²' and similar, which int() would not parse anyway.
    if value == "op" or (value.isdecimal() and int(value) >= 1):
        return None
    return "'op' or a positive integer written as a string, such as '2'"


def _aten_ops(names: list[str]) -> str | None:
    names = [n for n in names if n not in DEFAULT_SAVE_OPS]  # the defaults are known aten ops
    if not names:
        return None
    import torch  # lazy: --help and TOML parsing should not pay for importing torch

    for name in names:
        if not hasattr(torch.ops.aten, name):
            return f"aten op names only; {name!r} is not torch.ops.aten.{name}{_aten_hint(name)}"
    return None


def _aten_hint(name: str) -> str:
    try:  # private, but only feeds a hint; losing it loses nothing else
        from titanext._compat import aten_op_names  # the config loads without torch

        known = {n.split("::", 1)[1].split(".", 1)[0]
                 for n in aten_op_names() if n.startswith("aten::")}
    except (AttributeError, RuntimeError):
        return ""
    return _did_you_mean(name, sorted(known), fallback=False)


def writable_folder_problem(path: str) -> str | None:
    """Why ``path`` (a folder to be created on demand) could not be written, or None.

    Loading writes nothing: this walks up to the nearest existing ancestor and asks whether it
    is a folder this process may create entries in.

    >>> writable_folder_problem("pyproject.toml/traces")
    "'pyproject.toml' exists and is not a folder"
    """
    probe = os.path.normpath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent in (probe, ""):
            probe = parent or "."
            break
        probe = parent
    if not os.path.isdir(probe):
        return f"{probe!r} exists and is not a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe!r} is not writable by this user"
    return None
