"""``[training] dataset = "hf"``: a Hugging Face ``datasets`` split, streamed.

``dataset_path`` is what ``datasets.load_dataset`` takes: a hub name (``"allenai/c4"``), a local
folder (of .parquet, .jsonl, .csv, ... files: datasets picks the builder), or one local file
(its suffix picks the builder: .json/.jsonl -> json, .parquet, .csv, .txt -> text (one row per
line), .arrow). ``dataset_name`` is the builder's config (``"en"``), ``dataset_split`` the split;
the split is opened with ``streaming=True``, so nothing is downloaded or converted ahead.

Each example's ``dataset_text_field`` is one document (null and blank ones are skipped). The
examples feed the streaming text source (:class:`~titanext.data.streaming.StreamingTextWindows`):
the same blocks, shuffle buffer and layout-independent global order. A block's cursor is the
index of its first example; a resume re-opens the split at it with ``IterableDataset.skip``
(the examples before are read again but not tokenized), so it continues exactly under any
data-parallel layout.

The ``datasets`` package is the optional ``datasets`` extra (``pip install
'titanext[datasets]'``); without it the config names the extra at load.

>>> import tempfile, os, json
>>> from titanext.data.tokenizer import ByteTokenizer
>>> d = tempfile.mkdtemp(); p = os.path.join(d, "a.jsonl")
>>> _ = open(p, "w").write("".join(json.dumps({"text": t}) + "\\n" for t in ["abc", "defg"]))
>>> src = HFStreamingWindows(p, tokenizer=ByteTokenizer(), seq_len=3, seed=0, shuffle=False)
>>> src.windows(0, 2).tolist()  # 'abc' EOS 'defg' EOS (257): 9 tokens, two windows of 3 + 1
[[97, 98, 99, 257], [257, 100, 101, 102]]
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from titanext.data import streaming
from titanext.data.readers import Unit, corpus_fingerprint
from titanext.data.rules import FILE_BUILDERS
from titanext.data.sources import Tokenizer
from titanext.data.streaming import StreamingTextWindows
from titanext.errors import ConfigError

__all__ = ["HFStreamingWindows", "open_hf_split"]

_INSTALL = "pip install 'titanext[datasets]'"


def open_hf_split(dataset_path: str, name: str | None = None, split: str = "train", *,
                  key: str = "training.dataset_path"):
    """``datasets.load_dataset(..., split=split, streaming=True)`` for ``dataset_path``; any
    failure (no such hub dataset, config or split) is a one-line :class:`ConfigError`."""
    try:
        import datasets  # optional dependency (Hugging Face datasets)
    except ImportError as e:
        raise ConfigError(f"{key.split('.')[0]}.dataset = 'hf' needs the datasets package, "
                          f"which is not installed; {_INSTALL}") from e
    path = Path(os.path.expanduser(dataset_path))
    args: tuple[Any, ...] = (dataset_path, name or None)
    kwargs: dict[str, Any] = {}
    if path.is_file():
        args, kwargs = (FILE_BUILDERS.get(path.suffix, "text"), name or None), \
            {"data_files": str(path)}
    elif path.is_dir():
        args = (str(path), name or None)
    what = f"{key} = {dataset_path!r}" + (f" (dataset_name = {name!r})" if name else "")
    try:
        return datasets.load_dataset(*args, split=split, streaming=True, **kwargs)
    except Exception as e:  # datasets raises many kinds: FileNotFoundError, ValueError, ...
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"{what}, split {split!r}: datasets.load_dataset failed: "
                          f"{first}") from e


class HFStreamingWindows(StreamingTextWindows):
    """The streaming text source over one ``datasets`` split (see the module docstring).

    The split is one "file" whose units are its examples, ``offset`` being the example index;
    ``state_dict`` / ``load_state_dict`` are the streaming source's.
    """

    def __init__(self, dataset_path: str, *, tokenizer: Tokenizer, seq_len: int, seed: int,
                 shuffle: bool, name: str | None = None, split: str = "train",
                 text_field: str = "text", block_windows: int | None = None,
                 key: str = "training.dataset_path"):
        self.split_name, self.config_name = split, name or None
        self.dataset = open_hf_split(dataset_path, name, split, key=key)
        self.files = [Path(dataset_path)]
        self.tokenizer, self.seq_len, self.seed, self.shuffle = tokenizer, seq_len, seed, shuffle
        self.text_field, self.key = text_field, key
        self.block_windows = block_windows or max(1, streaming.BLOCK_TOKENS // seq_len)
        self.label = f"{key} = {dataset_path!r} (split {split!r})"
        self.fingerprint = _fingerprint(dataset_path, name, split)
        next(self._units(self.files[0], 0, 0), None)  # the text field, before any work
        self._load(epoch=0, epoch_start=0, block=0, block_first=0, cursor=(0, 0, 0, 0))

    def _units(self, path: Path, offset: int, line: int) -> Iterator[Unit]:
        examples = self.dataset.skip(offset) if offset else self.dataset
        for index, example in zip(itertools.count(offset), examples):
            if self.text_field not in example:
                raise ConfigError(f"{self.label} example {index} has no "
                                  f"{self.text_field!r} field (it has "
                                  f"{', '.join(map(repr, example)) or 'none'}); set "
                                  "training.dataset_text_field")
            text = example[self.text_field]
            if text is None:  # a null, as the parquet reader skips it
                continue
            if not isinstance(text, str):
                raise ConfigError(f"{self.label} example {index} field {self.text_field!r} is "
                                  f"a {type(text).__name__}, not text; set "
                                  "training.dataset_text_field to a string column")
            if text.strip():
                yield Unit(offset=index, line=0, text=text, ends_document=True)


def _fingerprint(dataset_path: str, name: str | None, split: str) -> str:
    """The local files' names and sizes (as the text source's), or the hub name, with the
    config and split: a moved local corpus still matches, an edited one does not."""
    path = Path(os.path.expanduser(dataset_path))
    if path.is_dir():
        files = sorted(f for f in path.rglob("*") if f.is_file() and ".cache" not in f.parts)
        where = corpus_fingerprint(files, path)
    elif path.is_file():
        where = corpus_fingerprint([path], path)
    else:
        where = dataset_path
    return hashlib.sha256(f"{where}\0{name or ''}\0{split}".encode()).hexdigest()[:16]
