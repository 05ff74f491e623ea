"""Value types of config keys: type-checking TOML values, parsing CLI text, printing values.

Shared by :mod:`~titanext.config.schema` (per-field checks) and :mod:`~titanext.config.loader`.

>>> _type_name(int | None), _show([True, "a"])
('integer or unset', "[true, 'a']")
"""

from __future__ import annotations

import types
import typing
from typing import Any, Union

_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    # Annotations are strings (``from __future__ import annotations``); resolve them once.
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def _type_name(tp: Any) -> str:
    if _is_union(tp):
        return " or ".join("unset" if a is type(None) else _type_name(a)
                           for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    return {int: "integer", float: "number", bool: "boolean", str: "string"}.get(tp, str(tp))


def _value_type_name(value: Any) -> str:
    for tp, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
                     (list, "list"), (dict, "table")):
        if isinstance(value, tp):
            return name
    return type(value).__name__


def _coerce(value: Any, tp: Any) -> Any:
    """Check a TOML value against ``tp`` and return it (ints widened to float); else TypeError.

    TOML already types its values, so nothing is parsed here: a bool is never an int, and a
    string is never a number.
    """
    if _is_union(tp):
        if value is None and type(None) in typing.get_args(tp):
            return None
        for arg in typing.get_args(tp):
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg)
            except TypeError:
                pass
        raise TypeError(tp)
    if typing.get_origin(tp) is list:
        if not isinstance(value, list):
            raise TypeError(tp)
        return [_coerce(v, typing.get_args(tp)[0]) for v in value]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)  # `lr = 1` means 1.0
    if tp is int and isinstance(value, bool):
        raise TypeError(tp)
    if tp in (bool, int, float, str) and isinstance(value, tp):
        return value
    raise TypeError(tp)


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")



def _parse_cli_value(text: str, tp: Any) -> Any:
    """Turn a CLI string into the value TOML would have given for ``tp``.

    Text that does not parse is returned unchanged, so that :func:`_coerce` reports it with the
    same wrong-type message a TOML file would get.
    """
    if _is_union(tp):
        args = typing.get_args(tp)
        if type(None) in args and text.strip().lower() in ("", "none", "null"):
            return None  # only way to unset an optional key, as TOML has no null
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(_parse_cli_value(text, arg), arg)
            except TypeError:
                pass
        return text
    if typing.get_origin(tp) is list:
        item = typing.get_args(tp)[0]
        return [_parse_cli_value(p.strip(), item) for p in text.split(",") if p.strip()]
    if tp is bool:
        low = text.strip().lower()
        return True if low in _TRUE else False if low in _FALSE else text
    for number in (int, float):
        if tp is number:
            try:
                return number(text)
            except ValueError:
                return text
    return text


def _show(value: Any) -> str:
    """A value as the user wrote it in TOML (true, not True), strings quoted."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "unset"
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return repr(value)

