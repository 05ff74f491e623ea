"""Pre-tokenized shards: ``.npy`` token arrays read through a numpy memmap.

A tokens folder (written by ``titanext-data tokenize``) holds ``00000.npy``,
``00001.npy``, ... (uint16 when the vocabulary has at most 65536 ids, else uint32; each document
followed by EOS) and ``tokens.json``, which records the tokenizer's vocab size, EOS and BOS. Any
folder of 1-D integer ``.npy`` files works too; ``tokens.json`` is then not checked.

The shards, in sorted order, form one stream cut into windows exactly like the in-memory loader
(``(num_tokens - 1) // seq_len`` windows per epoch, the tail dropped). Windows are random access,
so each rank reads only its own. With ``shuffle`` epoch ``e`` visits the windows in a keyed
permutation computed per index (a Feistel network with cycle walking), so billions of tokens
need no permutation table in memory.

>>> import tempfile, os, numpy as np
>>> d = tempfile.mkdtemp(); np.save(os.path.join(d, "00000.npy"), np.arange(10, dtype=np.uint16))
>>> src = TokenShardWindows.open(d, vocab_size=258, seq_len=3, seed=0, shuffle=False)
>>> src.num_windows, src.windows(1, 2).tolist()
(3, [[3, 4, 5, 6], [6, 7, 8, 9]])
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from titanext.data._seed import SHUFFLE, mix_seed
from titanext.data.readers import corpus_fingerprint, list_files
from titanext.errors import ConfigError

__all__ = ["MANIFEST", "TokenShardWindows", "check_token_shards", "permute", "token_dtype"]

MANIFEST = "tokens.json"
_MASK64 = (1 << 64) - 1


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds ids ``0 .. vocab_size - 1``.

    >>> token_dtype(258), token_dtype(65536), token_dtype(65537)
    (dtype('uint16'), dtype('uint16'), dtype('uint32'))
    """
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def _mix(x: np.ndarray, key: int) -> np.ndarray:
    """splitmix64 finalizer of ``x ^ key`` on a uint64 array (wrapping arithmetic)."""
    x = x ^ np.uint64(key)
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def permute(index: np.ndarray, n: int, key: int, rounds: int = 4) -> np.ndarray:
    """A keyed bijection of ``[0, n)`` evaluated at ``index`` without a table.

    A balanced Feistel network permutes ``[0, 4**h)`` for the smallest ``4**h >= n``; values
    that land outside ``[0, n)`` are sent through again (cycle walking) until they land inside.

    >>> sorted(permute(np.arange(10), 10, key=7).tolist()) == list(range(10))
    True
    """
    half = max(1, ((max(n, 2) - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    shift = np.uint64(half)
    keys = [mix_seed(key, r) & _MASK64 for r in range(rounds)]

    def feistel(x: np.ndarray) -> np.ndarray:
        left, right = x >> shift, x & mask
        for k in keys:
            left, right = right, left ^ (_mix(right, k) & mask)
        return (left << shift) | right

    with np.errstate(over="ignore"):
        out = feistel(np.asarray(index, dtype=np.uint64))
        outside = out >= np.uint64(n)
        while outside.any():
            out[outside] = feistel(out[outside])
            outside = out >= np.uint64(n)
    return out.astype(np.int64)


def _open_shard(path: Path, vocab_size: int) -> np.ndarray:
    try:
        shard = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as e:
        raise ConfigError(f"tokens shard {str(path)!r} is not a readable .npy file ({e})") from e
    if shard.ndim != 1 or shard.dtype.kind not in "iu":
        raise ConfigError(f"tokens shard {str(path)!r} holds a {shard.ndim}-D {shard.dtype} "
                          "array; expected 1-D integer token ids")
    if np.iinfo(shard.dtype).max < vocab_size - 1:
        raise ConfigError(f"tokens shard {str(path)!r} has dtype {shard.dtype}, which cannot hold "
                          f"the tokenizer's ids up to {vocab_size - 1} (vocab {vocab_size}); "
                          f"re-tokenize it (titanext-data tokenize writes "
                          f"{token_dtype(vocab_size)})")
    return shard


def _check_manifest(folder: Path, vocab_size: int, eos_id: int | None) -> None:
    path = folder / MANIFEST
    if not path.is_file():
        return
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"tokens manifest {str(path)!r} is not valid JSON ({e})") from e
    theirs = (meta.get("vocab_size"), meta.get("eos_id"))
    ours = (vocab_size, eos_id if eos_id is not None else meta.get("eos_id"))
    if theirs != ours:
        raise ConfigError(f"tokens manifest {str(path)!r} was written by a tokenizer with vocab "
                          f"{theirs[0]} and EOS {theirs[1]}, but this run's tokenizer has vocab "
                          f"{ours[0]} and EOS {ours[1]}; set model.tokenizer to the one that "
                          "tokenized the shards, or re-tokenize them")


def check_token_shards(dataset_path: str | None, vocab_size: int, eos_id: int | None = None, *,
                       key: str = "training.dataset_path") -> list[Path]:
    """The shard files, after checking each dtype (header only) and the manifest."""
    files = list_files(dataset_path, suffixes=(".npy",), key=key)
    root = Path(str(dataset_path))
    _check_manifest(root if root.is_dir() else root.parent, vocab_size, eos_id)
    for f in files:
        _open_shard(f, vocab_size)
    return files


class TokenShardWindows:
    """Random-access global windows over memory-mapped token shards (module docstring)."""

    def __init__(self, files: list[Path], *, root: Path, vocab_size: int, seq_len: int,
                 seed: int, shuffle: bool, label: str = ""):
        self.seq_len, self.seed, self.shuffle = seq_len, seed, shuffle
        self.shards = [_open_shard(f, vocab_size) for f in files]
        self.fingerprint = corpus_fingerprint(files, root)
        sizes = np.array([len(s) for s in self.shards], dtype=np.int64)
        # shard k covers the stream's tokens [starts[k], starts[k + 1])
        self.starts = np.concatenate([[0], np.cumsum(sizes)])
        self.num_tokens = int(self.starts[-1])
        if self.num_tokens < seq_len + 1:
            raise ConfigError(f"{label or root} has {self.num_tokens} tokens, fewer than "
                              f"training.seq_len + 1 = {seq_len + 1}; lower training.seq_len or "
                              "add shards")
        self.num_windows = (self.num_tokens - 1) // seq_len

    @classmethod
    def open(cls, dataset_path: str, *, vocab_size: int, eos_id: int | None = None,
             key: str = "training.dataset_path", **kw: Any) -> TokenShardWindows:
        files = check_token_shards(dataset_path, vocab_size, eos_id, key=key)
        root = Path(dataset_path)
        return cls(files, root=root if root.is_dir() else root.parent, vocab_size=vocab_size,
                   label=f"{key} = {dataset_path!r}", **kw)

    def _span(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of the concatenated shards."""
        k = int(np.searchsorted(self.starts, start, side="right")) - 1
        parts, need = [], length
        while need:
            local = start - int(self.starts[k])
            piece = self.shards[k][local : local + need]
            parts.append(piece)
            need -= len(piece)
            start += len(piece)
            k += 1
        return np.concatenate(parts).astype(np.int64)

    def windows(self, first: int, count: int):
        """Global windows ``[first, first + count)`` as a long tensor [count, seq_len + 1]."""
        import torch  # not at import time: config checks read shard headers without torch

        g = np.arange(first, first + count, dtype=np.int64)
        epoch, slot = np.divmod(g, self.num_windows)
        if self.shuffle:
            for e in np.unique(epoch):
                sel = epoch == e
                key = mix_seed(SHUFFLE, self.seed, int(e))
                slot[sel] = permute(slot[sel], self.num_windows, key)
        rows = [self._span(int(s) * self.seq_len, self.seq_len + 1) for s in slot]
        return torch.from_numpy(np.stack(rows))

    def state_dict(self) -> dict[str, Any]:
        return {"files": self.fingerprint, "num_tokens": self.num_tokens}

    def load_state_dict(self, state: dict[str, Any], position: int) -> None:
        if state.get("files") != self.fingerprint or state.get("num_tokens") != self.num_tokens:
            raise ValueError("the checkpoint's data loader read other token shards (fingerprint "
                             f"{state.get('files')!r}, {state.get('num_tokens')!r} tokens; these: "
                             f"{self.fingerprint!r}, {self.num_tokens}); the shards changed since "
                             "the checkpoint, so its position is meaningless")
