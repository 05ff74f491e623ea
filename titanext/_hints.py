"""The "did you mean" hint shared by every user-facing name check."""

from __future__ import annotations

import difflib
from collections.abc import Sequence


def did_you_mean(name: str, choices: Sequence[str], *, fallback: bool = True) -> str:
    """``"; did you mean 'x'?"`` for the closest choice, else ``"; known: ..."`` (or "")."""
    # Case slips ('8b', 'adamw') are the commonest typo, and difflib weighs them like any other.
    close = [c for c in choices if c.lower() == name.lower()]
    close = close or difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f"; known: {', '.join(choices)}" if fallback else ""
