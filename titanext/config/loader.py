"""Reading a config: TOML files with ``extends``, command-line overrides, and the two outputs,
``--help`` (:func:`config_help`) and ``--print-config`` (:func:`to_toml`).

Loading is strict: unknown sections and keys (with a did-you-mean hint), wrong types, values
outside their range or choices and the cross-field rules of :mod:`titanext.config.rules` are
all collected and raised together as one :class:`ConfigError`, one line per problem, before any
process group exists. A torchtitan TOML is read through :mod:`titanext.config.torchtitan_keys`
first (its keys renamed, ignored or refused, one line each). Loading reads the TOML files and,
for ``dataset = "text"``, checks that ``dataset_path`` exists; it writes nothing.

>>> cfg = load_config("train_configs/debug_model.toml", ["--training.steps=10"], world_size=4)
>>> cfg.training.steps
10

A file can inherit from another with ``[job] extends = "base.toml"`` (relative to the file);
sections are merged key by key, so a child file only lists what it changes.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import json
import os
import re
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

from titanext._text import did_you_mean as _did_you_mean
from titanext.config import schema, schema_parallel
from titanext.config._fields import field_rule
from titanext.config._values import (
    _coerce,
    _hints,
    _parse_cli_value,
    _show,
    _type_name,
    _value_type_name,
)
from titanext.config.rules import collect_problems
from titanext.config.schema import SECTIONS, JobConfig
from titanext.config.torchtitan_keys import translate_torchtitan
from titanext.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["config_help", "field_docs", "load_config", "parse_cli", "to_toml"]


# -- attribute docstrings -------------------------------------------------------------------------

def _read_attribute_docs() -> dict[str, dict[str, str]]:
    """class name -> field name -> the string literal written under the field.

    Python keeps no attribute docstrings at runtime, so they are read from the source of
    :mod:`titanext.config.schema` and :mod:`titanext.config.schema_parallel` with ``ast``; that
    is done once, at import.
    """
    try:
        body = [node for module in (schema, schema_parallel)
                for node in ast.parse(inspect.getsource(module)).body]
    except (OSError, TypeError):  # shipped without source: help text loses its descriptions
        return {}
    docs: dict[str, dict[str, str]] = {}
    for node in body:
        if not isinstance(node, ast.ClassDef):
            continue
        docs[node.name] = {}
        for a, b in zip(node.body, node.body[1:]):
            if (isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)
                    and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)
                    and isinstance(b.value.value, str)):
                docs[node.name][a.target.id] = " ".join(b.value.value.split())
    return docs


_ATTRIBUTE_DOCS = _read_attribute_docs()


def field_docs() -> dict[tuple[str, str], str]:
    """``(section, key) -> docstring`` for every key ("" where a docstring is missing).

    >>> field_docs()[("training", "steps")]
    'Optimizer steps to train for.'
    """
    return {(section, f.name): _ATTRIBUTE_DOCS.get(cls.__name__, {}).get(f.name, "")
            for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}



# -- command line ---------------------------------------------------------------------------------

_OVERRIDE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*")


def _is_bool_key(section: str, key: str) -> bool:
    return section in SECTIONS and _hints(SECTIONS[section]).get(key) is bool


def _split_argv(argv: Sequence[str]) -> tuple[str | None, list[tuple[str, str, str]],
                                              dict[str, bool], list[str]]:
    """(config path, overrides as (section, key, text), flags, problems)."""
    config_path: str | None = None
    overrides: list[tuple[str, str, str]] = []
    flags = {"help": False, "print_config": False}
    problems: list[str] = []
    argv = list(argv)
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg in ("--help", "-h"):
            flags["help"] = True
        elif arg == "--print-config":
            flags["print_config"] = True
        elif arg == "--config" or arg.startswith("--config="):
            if "=" in arg:
                config_path = arg.split("=", 1)[1]
            elif i < len(argv) and not argv[i].startswith("--"):
                config_path, i = argv[i], i + 1
            if not config_path:
                problems.append("--config needs a file path: --config FILE or --config=FILE")
        elif arg.startswith("--") and "." in arg.split("=", 1)[0]:
            name, eq, text = arg[2:].partition("=")
            if not _OVERRIDE_NAME.fullmatch(name):
                problems.append(f"override {arg!r} is malformed; write --section.key=value "
                                "(one dot, letters, digits and underscores)")
                continue
            section, key = name.split(".")
            if not eq:
                # `--section.key value`; a bare boolean key means true (`--checkpoint.enable`).
                # Values may start with a single dash (`-1`), never with two.
                if i < len(argv) and not argv[i].startswith("--") and argv[i] != "-h":
                    text, i = argv[i], i + 1
                elif _is_bool_key(section, key):
                    text = "true"
                else:
                    problems.append(f"override --{name} has no value; write --{name}=VALUE "
                                    f"or --{name} VALUE")
                    continue
            overrides.append((section, key, text))
        else:
            problems.append(f"unrecognised argument {arg!r}; expected --config FILE, "
                            "--section.key=value, --print-config or --help")
    return config_path, overrides, flags, problems


def parse_cli(argv: Sequence[str]) -> tuple[str | None, list[str], dict[str, bool]]:
    """Split argv into (config path, overrides normalised to ``--section.key=value``, flags).

    Flags are ``help`` (``--help``/``-h``) and ``print_config`` (``--print-config``). A boolean
    key may be given bare (``--checkpoint.enable`` means ``=true``). Raises :class:`ConfigError`
    for a malformed override, an override without a value or an unknown argument.

    >>> parse_cli(["--config", "a.toml", "--training.steps", "5", "--print-config"])
    ('a.toml', ['--training.steps=5'], {'help': False, 'print_config': True})
    """
    config_path, overrides, flags, problems = _split_argv(argv)
    if problems:
        raise ConfigError(problems)
    return config_path, [f"--{s}.{k}={v}" for s, k, v in overrides], flags



# -- loading --------------------------------------------------------------------------------------

def _deep_merge(base: dict[str, Any], child: dict[str, Any]) -> dict[str, Any]:
    """``child`` over ``base``, table by table; lists and scalars are replaced, not merged."""
    out = dict(base)
    for key, value in child.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _read_toml(path: str, problems: list[str], chain: tuple[tuple[str, str], ...] = (),
               via: str = "") -> dict[str, Any]:
    """The TOML at ``path`` with its ``[job] extends`` chain merged in.

    ``chain`` holds (real path, path as written) of the files that extend this one, to detect
    cycles; ``via`` names the extends entry that led here, for messages.
    """
    real = os.path.realpath(path)
    if any(real == seen for seen, _ in chain):
        names = " -> ".join([shown for _, shown in chain] + [path])
        problems.append(f"job.extends: inheritance cycle {names}; remove one of the extends")
        return {}
    where = f"{via}: " if via else ""
    try:
        with open(path, "rb") as f:
            raw = f.read()
        data = tomllib.loads(raw.decode("utf-8"))
    except FileNotFoundError:
        problems.append(f"{where}config file {path!r} does not exist")
        return {}
    except OSError as e:
        problems.append(f"{where}config file {path!r} cannot be read: {e.strerror or e}")
        return {}
    except UnicodeDecodeError as e:
        problems.append(f"{where}config file {path!r} is not UTF-8 text: {e.reason} at byte "
                        f"{e.start}")
        return {}
    except tomllib.TOMLDecodeError as e:
        # tomllib names only a position for a repeated key or table; name the key instead.
        twice = _given_twice(raw.decode("utf-8"), path)
        problems.append(f"{where}{twice}" if twice
                        else f"{where}config file {path!r} is not valid TOML: {e}")
        return {}
    if not data:
        problems.append(f"{where}config file {path!r} is empty: it sets no [section], so the run "
                        "would silently train on the defaults; write the sections to change "
                        "(e.g. [training] steps = 10), or [job] extends = \"base.toml\"")
        return {}
    job = data.get("job")
    base_ref = job.get("extends") if isinstance(job, dict) else None
    if base_ref is None:
        return data
    if not isinstance(base_ref, str) or not base_ref:
        problems.append(f"job.extends = {_show(base_ref)} in {path!r} must be a non-empty path "
                        "string")
        return data
    base_path = os.path.join(os.path.dirname(path), base_ref)
    base = _read_toml(base_path, problems, (*chain, (real, path)),
                      via=f"job.extends = {base_ref!r} in {path!r}")
    return _deep_merge(base, data)


_TOML_KEY = r"""(?:[A-Za-z0-9_-]+|"(?:[^"\\]|\\.)*"|'[^']*')"""
_KEY_LINE = re.compile(rf"^\s*({_TOML_KEY}(?:\s*\.\s*{_TOML_KEY})*)\s*=")
_TABLE_LINE = re.compile(rf"^\s*\[\s*({_TOML_KEY}(?:\s*\.\s*{_TOML_KEY})*)\s*\]\s*(?:#.*)?$")


def _dotted(text: str) -> str:
    """A TOML key as written (``a."b c"``) -> its parts joined by dots (``a.b c``)."""
    parts = re.findall(_TOML_KEY, text)
    return ".".join(p[1:-1] if p[:1] in "\"'" else p for p in parts)


def _given_twice(text: str, path: str) -> str | None:
    """The first key or table that ``text`` gives twice, as one problem line, or None.

    A line-based scan that knows tables, keys and multi-line strings, enough to name what
    tomllib reports only as "Cannot overwrite a value (at line N, column M)".
    """
    table, seen_keys, seen_tables = "", {}, {}
    in_string = None  # the delimiter of an open multi-line string
    for n, line in enumerate(text.splitlines(), 1):
        if in_string:
            in_string = None if line.count(in_string) % 2 else in_string
            continue
        header = _TABLE_LINE.match(line)
        if header:
            table = _dotted(header.group(1))
            if table in seen_tables:
                return (f"{path}: line {n}: table [{table}] is given twice (first on line "
                        f"{seen_tables[table]}); merge the two into one [{table}]")
            seen_tables[table] = n
            continue
        key = _KEY_LINE.match(line)
        if key:
            name = _dotted(key.group(1))
            where = f"[{table}]" if table else "the top level (outside any [section])"
            if (table, name) in seen_keys:
                return (f"{path}: line {n}: key {name!r} in {where} is given twice (first on "
                        f"line {seen_keys[table, name]}); keep one")
            seen_keys[table, name] = n
        for quote in ('"""', "'''"):
            if line.count(quote) % 2:
                in_string = quote
    return None


def _unknown_key_message(section: str, key: str) -> str:
    fields = [f.name for f in dataclasses.fields(SECTIONS[section])]
    close = difflib.get_close_matches(key, fields, n=1, cutoff=0.6)
    if close:
        return f"unknown key '{section}.{key}'; did you mean {close[0]!r}?"
    owners = [s for s, cls in SECTIONS.items() if key in {f.name for f in dataclasses.fields(cls)}]
    if owners:
        return f"unknown key '{section}.{key}'; did you mean '{owners[0]}.{key}'?"
    return f"unknown key '{section}.{key}'; known keys in [{section}]: {', '.join(fields)}"


def _apply(raw: dict[str, Any], cfg: JobConfig, problems: list[str], bad: set[str]) -> None:
    """Type-check ``raw`` (sections of TOML values) and set it on ``cfg``.

    A value of the wrong type is not set (the field keeps its default) and its key goes into
    ``bad``, so cross-field rules do not reason about it. A documented alias of a choice (such
    as ``context_parallel_load_balance = "none"``) is stored as that choice.
    """
    for section, values in raw.items():
        if section not in SECTIONS:
            if isinstance(values, dict):
                problems.append(f"unknown section [{section}]{_did_you_mean(section, SECTIONS)}")
                continue
            owners = [s for s, cls in SECTIONS.items()
                      if section in {f.name for f in dataclasses.fields(cls)}]
            hint = (f"; did you mean '{owners[0]}.{section}' (under [{owners[0]}])?" if owners
                    else "; put it under its [section]")
            problems.append(f"key {section!r} = {_show(values)} is outside any [section]{hint}")
            continue
        if not isinstance(values, dict):
            problems.append(f"{section} = {_show(values)} must be a [{section}] table of keys")
            continue
        obj, cls = getattr(cfg, section), SECTIONS[section]
        hints = _hints(cls)
        aliases = {f.name: f.metadata.get("aliases", {}) for f in dataclasses.fields(cls)}
        for key, value in values.items():
            if key not in hints:
                problems.append(_unknown_key_message(section, key))
                continue
            try:
                value = _coerce(value, hints[key])
                setattr(obj, key, aliases[key].get(value, value) if isinstance(value, str)
                        else value)
            except TypeError:
                bad.add(f"{section}.{key}")
                problems.append(f"{section}.{key} = {_show(value)} has the wrong type: expected "
                                f"{_type_name(hints[key])}, got {_value_type_name(value)}")


def _literal(text: str) -> Any:
    """An override of a key titanext does not have (a torchtitan key, say) read as a TOML value
    (``4``, ``true``, ``["float8"]``), else as the text itself."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _say_notes(notes: list[str]) -> None:
    """The INFO lines of a torchtitan file's keys, on stderr, once (rank 0 under torchrun)."""
    if os.environ.get("RANK", "0") == "0":
        for note in notes:
            print(f"titanext: config: INFO: {note}", file=sys.stderr, flush=True)


def load_config(path: str | None, args: Sequence[str] = (), *,
                world_size: int | None = None) -> JobConfig:
    """Read ``path`` (and what it extends), apply ``args`` overrides, validate, return the config.

    ``args`` are overrides, ``--section.key=value`` or ``--section.key value``; their text is
    parsed by the key's type (booleans as true/false/1/0/yes/no, lists comma-separated).
    ``path=None`` starts from the defaults. With ``world_size`` the parallel degrees are checked
    against it (see :func:`~titanext.config.rules.check_config`). Raises :class:`ConfigError`
    listing every problem found.

    >>> cfg = load_config(None, ["--parallelism.tensor_parallel_degree", "2"], world_size=8)
    >>> cfg.parallelism.tensor_parallel_degree
    2
    """
    problems: list[str] = []
    raw: dict[str, Any] = _read_toml(path, problems) if path is not None else {}
    config_path, overrides, flags, arg_problems = _split_argv(args)
    problems += arg_problems
    if config_path is not None or any(flags.values()):
        problems.append("load_config() args take only --section.key overrides; pass the config "
                        "file as `path` and handle --help/--print-config with parse_cli()")
    for section, key, text in overrides:
        if (section, key) == ("job", "extends"):
            problems.append(f"--job.extends={text} is not allowed on the command line; "
                            "inheritance is resolved from files (use --config on the child file)")
            continue
        tp = _hints(SECTIONS[section]).get(key) if section in SECTIONS else None
        table = raw.setdefault(section, {})
        if isinstance(table, dict):  # a non-table here is reported by _apply
            table[key] = _parse_cli_value(text, tp) if tp is not None else _literal(text)
    raw, notes, tt_problems = translate_torchtitan(raw)
    problems += tt_problems
    _say_notes(notes)
    cfg = JobConfig()
    bad: set[str] = set()
    _apply(raw, cfg, problems, bad)
    problems += collect_problems(cfg, world_size, bad)
    if problems:
        # A broken base file reached twice (diamond inheritance) would repeat its messages.
        raise ConfigError(list(dict.fromkeys(problems)))
    return cfg



# -- output ---------------------------------------------------------------------------------------

def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        # JSON string escapes (\n, \", \\, \uXXXX) are all valid TOML basic-string escapes.
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)  # ints, and floats as repr (1e-08, inf) which TOML reads back exactly


def to_toml(cfg: JobConfig) -> str:
    """The resolved config as TOML, every key listed; :func:`load_config` reads it back equal.

    Unset optional keys are left out (TOML has no null), and so is ``job.extends``, since the
    inherited values are already in the output.

    >>> print(to_toml(JobConfig()).splitlines()[1])
    [job]
    """
    out = ["# resolved titanext config (inheritance and overrides applied)"]
    for section in SECTIONS:
        out.append(f"[{section}]")
        obj = getattr(cfg, section)
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if value is None or (section, f.name) == ("job", "extends"):
                continue
            out.append(f"{f.name} = {_toml_value(value)}")
        out.append("")
    return "\n".join(out)


def config_help(width: int = 96) -> str:
    """Every section and key with its type, default, allowed values and docstring (``--help``).

    >>> "--training.seq_len" in config_help()
    True
    """
    docs = field_docs()
    section_docs = _ATTRIBUTE_DOCS.get(JobConfig.__name__, {})
    lines = [
        "usage: torchrun --nproc_per_node N -m titanext.train --config FILE "
        "[--section.key=value ...]",
        "       python -m titanext.train --config FILE --print-config | --help",
        "",
        *textwrap.wrap("Every key below can be set in the TOML file ([section] then key = value) "
                       "or overridden on the command line as --section.key=value or "
                       "--section.key value. Lists are comma-separated on the command line; "
                       "a bare boolean key means true.", width=width),
    ]
    for section, cls in SECTIONS.items():
        lines += ["", f"[{section}]" + (f"  {section_docs[section]}" if section in section_docs
                                        else "")]
        hints = _hints(cls)
        for f in dataclasses.fields(cls):
            default = (f.default_factory() if f.default_factory is not dataclasses.MISSING
                       else f.default)
            shown = "unset" if default is None else _toml_value(default)
            rule = field_rule(f)
            lines.append(f"  --{section}.{f.name}  ({_type_name(hints[f.name])}, default {shown}"
                         + (f"; {rule}" if rule else "") + ")")
            lines += textwrap.wrap(docs[(section, f.name)], width=width,
                                   initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)

