"""Checks of a dataset before training starts (torch-free: the config loader calls them).

>>> check_dataset("text", "no/such/file.txt")
["training.dataset_path = 'no/such/file.txt' does not exist; give a .txt or .jsonl or \
.parquet or .arrow file or a folder of them"]
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path

from titanext.data.readers import check_text_file, list_files
from titanext.data.tokenizer import build_tokenizer
from titanext.data.tokens import check_token_shards
from titanext.errors import ConfigError

__all__ = ["FILE_BUILDERS", "check_dataset", "data_problems", "hf_dataset_problems"]

# a single local file: its suffix -> the datasets builder that reads it
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv",
                 ".txt": "text", ".arrow": "arrow"}


def _looks_local(path: str) -> bool:
    """A path the user means as a file or folder here, not a hub name."""
    return (path.startswith((".", "/", "~")) or path.count("/") > 1
            or Path(path).suffix in FILE_BUILDERS or os.path.exists(path))


def hf_dataset_problems(section: str, dataset_path: str | None) -> list[str]:
    """Cheap checks at config load, one line each: ``datasets`` installed, the path set, and a
    local path (one that starts with ``.``, ``/`` or ``~``, or has a data-file suffix) existing.
    Hub names are not looked up here (that needs the network);
    :func:`titanext.data.hf_datasets.open_hf_split` names a failure when the loader is built,
    before training starts."""
    key = f"{section}.dataset_path"
    if importlib.util.find_spec("datasets") is None:
        return [f"{section}.dataset = 'hf' needs the datasets package, which is not installed; "
                "pip install 'titanext[datasets]'"]
    if not dataset_path:
        return [f"{section}.dataset = 'hf' needs {key} (a hub name, a local folder or a data "
                "file for datasets.load_dataset), which is unset"]
    if _looks_local(dataset_path) and not os.path.exists(os.path.expanduser(dataset_path)):
        return [f"{key} = {dataset_path!r} does not exist (relative paths start at "
                f"{os.getcwd()!r}); give a hub name, a local folder or a "
                f"{'/'.join(FILE_BUILDERS)} file"]
    path = Path(os.path.expanduser(dataset_path))
    if path.is_file() and path.suffix not in FILE_BUILDERS:
        return [f"{key} = {dataset_path!r} is a {path.suffix or 'suffix-less'} file; "
                f"datasets reads {', '.join(FILE_BUILDERS)} files (or a folder of them)"]
    return []


def check_dataset(dataset: str, dataset_path: str | None, *, text_field: str = "text",
                  vocab_size: int | None = None, eos_id: int | None = None,
                  section: str = "training") -> list[str]:
    """Problems a run would hit reading ``dataset_path``, found cheaply: a missing path, a
    parquet file without the text column, a jsonl file whose first record lacks the field, a
    tokens shard whose dtype cannot hold the vocab (when ``vocab_size`` is given). One line
    each, naming ``section``'s keys."""
    key = f"{section}.dataset_path"
    try:
        if dataset == "text":
            for f in list_files(dataset_path, key=key):
                check_text_file(f, text_field, key=key)
        elif dataset == "tokens" and vocab_size is not None:
            check_token_shards(dataset_path, vocab_size, eos_id, key=key)
        elif dataset == "tokens":
            list_files(dataset_path, suffixes=(".npy",), key=key)
    except ConfigError as e:
        return list(e.problems)
    return []


def data_problems(sections: Sequence[tuple[str, str, str | None]], *, text_field: str,
                  tokenizer: str, hf_assets_path: str | None) -> list[str]:
    """``(section, dataset, dataset_path)`` of the training (and validation) data against the
    disk, one line per problem: the path is set and exists, parquet and jsonl files have the
    text field, token shards' dtype holds the tokenizer's ids (file headers only). The config
    calls it while loading."""
    problems: list[str] = []
    vocab: tuple[int | None, int | None] | None = None
    for name, dataset, dataset_path in sections:
        if dataset == "hf":
            problems += hf_dataset_problems(name, dataset_path)
        elif dataset in ("text", "tokens"):
            if not dataset_path:
                what = (".txt, .jsonl, .parquet or .arrow file, or a folder of them"
                        if dataset == "text"
                        else "folder of .npy shards from titanext-data tokenize")
                problems.append(f"{name}.dataset = {dataset!r} needs {name}.dataset_path (a "
                                f"{what}), which is unset")
                continue
            if not os.path.exists(dataset_path):
                problems.append(f"{name}.dataset_path = {dataset_path!r} does not exist "
                                f"(relative paths start at {os.getcwd()!r})")
                continue
            if dataset == "tokens" and vocab is None:
                vocab = _tokenizer_ids(tokenizer, hf_assets_path)
            problems += check_dataset(dataset, dataset_path, text_field=text_field,
                                      vocab_size=vocab[0] if vocab else None,
                                      eos_id=vocab[1] if vocab else None, section=name)
        elif dataset_path:
            problems.append(f"{name}.dataset_path = {dataset_path!r} is only read with "
                            f"dataset = 'text', 'tokens' or 'hf', but {name}.dataset = "
                            f"{dataset!r}; set dataset = 'text' or dataset_path = \"\"")
    return problems


def _tokenizer_ids(tokenizer: str, hf_assets_path: str | None) -> tuple[int | None, int | None]:
    """(vocab size, EOS id) of the tokenizer, or Nones when it cannot be built (its own rule
    reports why)."""

    try:
        tok = build_tokenizer(tokenizer, hf_assets_path)
    except (ConfigError, ValueError):
        return None, None
    return tok.vocab_size, tok.eos_id
