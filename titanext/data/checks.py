"""Checks of a dataset before training starts (torch-free: the config loader calls them).

>>> check_dataset("text", "no/such/file.txt")
["training.dataset_path = 'no/such/file.txt' does not exist; give a .txt or .jsonl or \
.parquet or .arrow file or a folder of them"]
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from titanext.data.readers import check_text_file, list_files
from titanext.data.tokens import check_token_shards
from titanext.errors import ConfigError

__all__ = ["check_dataset", "data_problems"]


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
        if dataset in ("text", "tokens"):
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
                            f"dataset = 'text' or 'tokens', but {name}.dataset = "
                            f"{dataset!r}; set dataset = 'text' or dataset_path = \"\"")
    return problems


def _tokenizer_ids(tokenizer: str, hf_assets_path: str | None) -> tuple[int | None, int | None]:
    """(vocab size, EOS id) of the tokenizer, or Nones when it cannot be built (its own rule
    reports why)."""
    from titanext.data.tokenizer import build_tokenizer

    try:
        tok = build_tokenizer(tokenizer, hf_assets_path)
    except (ConfigError, ValueError):
        return None, None
    return tok.vocab_size, tok.eos_id
