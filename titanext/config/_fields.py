"""How a config field declares its constraints, and the check of one value against them.

:func:`_field` stores choices, bounds, a custom check and aliases in a dataclass field's
metadata (the section dataclasses of :mod:`titanext.config.schema` declare every key with it);
:func:`field_rule` says in words what a field allows (``--help`` prints it) and
:func:`constraint_problem` what is wrong with a value.
"""

from __future__ import annotations

import dataclasses
import operator
import typing
from collections.abc import Callable, Sequence
from dataclasses import field
from typing import Any, Union

from titanext._text import did_you_mean as _did_you_mean
from titanext.config._values import _show

__all__ = ["constraint_problem", "field_rule"]

# A custom check returns None when the value is fine, else what is allowed (for the message).
_Check = Callable[[Any], Union[str, None]]


def _field(
    default: Any,
    *,
    choices: Sequence[Any] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    check: _Check | None = None,
    rule: str | None = None,
    aliases: dict[str, str] | None = None,
) -> Any:
    """A dataclass field whose constraints are stored in its metadata for :func:`field_problems`.

    ``rule`` describes a custom ``check`` for ``--help``; choices and bounds describe themselves.
    ``aliases`` maps other accepted spellings to a choice; the loader replaces them while reading
    TOML and command-line values, so code only ever sees the canonical choice.
    """
    meta = {"choices": choices, "ge": ge, "gt": gt, "le": le, "lt": lt, "check": check,
            "rule": rule, "aliases": aliases or {}}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


_BOUND_OPS = {"ge": operator.ge, "gt": operator.gt, "le": operator.le, "lt": operator.lt}
_BOUND_WORDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def _bounds_rule(meta: typing.Mapping[str, Any]) -> str:
    return " and ".join(f"{_BOUND_WORDS[k]} {meta[k]:g}" for k in _BOUND_WORDS
                        if meta.get(k) is not None)


def field_rule(f: dataclasses.Field) -> str:
    """What a field allows, in words ("" when any value of its type is fine)."""
    m = f.metadata
    if m.get("choices") is not None:
        aliases = "".join(f" ({_show(a)} means {_show(c)})" for a, c in m["aliases"].items())
        return "one of " + ", ".join(_show(c) for c in m["choices"]) + aliases
    return m.get("rule") or _bounds_rule(m)


def constraint_problem(f: dataclasses.Field, value: Any) -> str | None:
    """What is wrong with a well-typed ``value`` of field ``f`` and what it allows, or None."""
    m = f.metadata
    if value is None:  # an unset optional key has nothing to check
        return None
    if m.get("choices") is not None:
        if value in m["choices"]:  # types are already checked, so True never passes for 1
            return None
        if value in m["aliases"]:  # the loader translates aliases; code built in Python must not
            return (f"is an alias that only TOML files and the command line accept; set "
                    f"{_show(m['aliases'][value])}")
        hint = (_did_you_mean(value, m["choices"], fallback=False)
                if isinstance(value, str) and all(isinstance(c, str) for c in m["choices"]) else "")
        return f"is not allowed; choose {field_rule(f)}{hint}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if any(m.get(k) is not None and not op(value, m[k]) for k, op in _BOUND_OPS.items()):
            return f"is out of range; it must be {_bounds_rule(m)}"
    if m.get("check") is not None:
        allowed = m["check"](value)
        if allowed:
            return f"is not allowed; allowed: {allowed}"
    return None


def _minus_one_or_positive(value: int) -> str | None:
    return None if value == -1 or value >= 1 else "-1 or an integer >= 1"
