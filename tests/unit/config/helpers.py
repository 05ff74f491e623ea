"""What the config tests share: the repo's train_configs/, the problem lines a config has, and
small TOML files written for a test."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tests import REPO_ROOT
from titanext.config import SECTIONS, ConfigError, load_config

ROOT = REPO_ROOT
CONFIGS = ROOT / "train_configs"


def problems_of(args=(), world_size=None, path=None) -> list[str]:
    """The problem lines load_config reports (an empty list when the config is valid)."""
    try:
        load_config(None if path is None else str(path), list(args), world_size=world_size)
    except ConfigError as e:
        return e.problems
    return []


def the_problem(args=(), world_size=None, path=None) -> str:
    """The single problem a config has (fails if it has none or several)."""
    found = problems_of(args, world_size, path)
    assert len(found) == 1, found
    return found[0]


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def all_keys():
    return [(s, f.name) for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
