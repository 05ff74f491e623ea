"""The words and tables titanext prints: the "did you mean" hint of every user-facing name
check, and the aligned text / Markdown tables of the planner, the dry run, the profiler, the
simulator and gpucheck. Imports nothing of titanext, so that every layer can use it."""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["did_you_mean", "format_table"]


def did_you_mean(name: str, choices: Sequence[str], *, fallback: bool = True) -> str:
    """``"; did you mean 'x'?"`` for the closest choice, else ``"; known: ..."`` (or "")."""
    # Case slips ('8b', 'adamw') are the commonest typo, and difflib weighs them like any other.
    close = [c for c in choices if c.lower() == name.lower()]
    close = close or difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f"; known: {', '.join(choices)}" if fallback else ""


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fmt_number(v: Any) -> str:
    """Integers as they are; floats with about 4 significant digits, no exponent in 1e-3..1e9."""
    if not isinstance(v, float):
        return str(v)
    if not math.isfinite(v) or v == 0:
        return str(v) if v else "0"
    mag = abs(v)
    if mag >= 1e9 or mag < 1e-3:
        return f"{v:.3e}"
    if mag >= 1000:
        return f"{v:.0f}"
    return f"{v:.{max(0, 3 - math.floor(math.log10(mag)))}f}"


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None, *,
                 markdown: bool = False) -> str:
    """Render ``rows`` as an aligned text table: numeric columns right-aligned, text left-aligned.

    ``columns`` picks and orders the columns (default: every key, in order of first appearance);
    a missing value is an empty cell. ``markdown=True`` gives a GitHub-flavoured Markdown table.

    >>> print(format_table([{"name": "fsdp", "tps": 1234.56}, {"name": "fsdp+tp", "tps": 98.7654}]))
    name       tps
    -------  -----
    fsdp      1235
    fsdp+tp  98.77
    """
    if columns is None:
        columns = list(dict.fromkeys(k for row in rows for k in row))
    columns = list(columns)
    if not columns:
        return ""
    cells = [["" if row.get(c) is None else _fmt_number(row.get(c)) for c in columns]
             for row in rows]
    numeric = [any(_is_number(r.get(c)) for r in rows)
               and all(_is_number(r.get(c)) or r.get(c) is None for r in rows) for c in columns]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        padded = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)]
        return ("| " + " | ".join(padded) + " |") if markdown else "  ".join(padded).rstrip()

    if markdown:
        rule = "|" + "|".join(("-" * (w + 1) + ":") if num else (":" + "-" * (w + 1))
                              for w, num in zip(widths, numeric)) + "|"
    else:
        rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(columns), rule, *(line(row) for row in cells)])
