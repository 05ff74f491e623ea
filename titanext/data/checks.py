"""Checks of a dataset before training starts (torch-free: the config loader calls them).

>>> check_dataset("text", "no/such/file.txt")
["training.dataset_path = 'no/such/file.txt' does not exist; give a .txt or .jsonl or \
.parquet or .arrow file or a folder of them"]
"""

from __future__ import annotations

from titanext.data.readers import check_text_file, list_files
from titanext.data.tokens import check_token_shards
from titanext.errors import ConfigError

__all__ = ["check_dataset"]


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
