"""The streaming text source: files read and tokenized as the windows are needed.

**Stream.** Epoch ``e`` reads the files in sorted order (with ``shuffle``: a permutation seeded
by ``(seed, e)``), each document's ids followed by EOS, and cuts the stream into windows of
``seq_len + 1`` tokens with stride ``seq_len``; the tokens after the epoch's last whole window
are dropped, as the in-memory loader drops them.

**Blocks.** The windows are produced ``block_windows`` at a time (about a million tokens by
default). With ``shuffle`` each block is emitted in a permutation seeded by
``(seed, epoch, block)``: a shuffle buffer whose order does not depend on the reader. Memory is
one block plus one document, however large the corpus.

**State.** A block is addressed by a cursor ``[file position in the epoch order, unit offset,
jsonl line, tokens to skip]`` (see :mod:`titanext.data.readers`): a resume opens that file,
seeks to the unit, re-tokenizes it and drops ``skip`` tokens, so it continues exactly without
reading anything before. Every data-parallel rank reads the whole stream and keeps its own
windows, which is what makes the stream independent of the dp layout (ranks tokenize the same
text; pre-tokenize with ``titanext-data tokenize`` when that costs too much).

>>> import tempfile, os
>>> from titanext.data.tokenizer import ByteTokenizer
>>> d = tempfile.mkdtemp(); _ = open(os.path.join(d, "a.txt"), "w").write("abcdefg")
>>> src = StreamingTextWindows.open(d, tokenizer=ByteTokenizer(), seq_len=3, seed=0,
...                                 shuffle=False)
>>> src.windows(0, 2).tolist()  # 'abcdefg' + EOS (257): 8 tokens, two windows of 3 + 1
[[97, 98, 99, 100], [100, 101, 102, 103]]
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from titanext.data.readers import (
    Unit,
    check_text_file,
    corpus_fingerprint,
    list_files,
    read_units,
)
from titanext.data.sources import FILES, SHUFFLE, Tokenizer, mix_seed
from titanext.errors import ConfigError

__all__ = ["BLOCK_TOKENS", "StreamingTextWindows"]

BLOCK_TOKENS = 1 << 20  # default tokens per block: the shuffle buffer and the resume granularity

# (file, unit offset, jsonl line) -> the units from there on
UnitReader = Callable[[Path, int, int], Iterator[Unit]]


@dataclass
class _Segment:
    """The ids of one unit and how many of them were consumed already."""

    file_pos: int
    offset: int
    line: int
    ids: np.ndarray
    skip: int


class _TokenReader:
    """The token stream of one epoch from a cursor on, read into a bounded buffer."""

    def __init__(self, files: list[Path], order: list[int], units: UnitReader,
                 tokenizer: Tokenizer, cursor: tuple[int, int, int, int]):
        self.files, self.order, self.units, self.tokenizer = files, order, units, tokenizer
        self.start = cursor
        self.segments: deque[_Segment] = deque()
        self.exhausted = False
        self.tokens_read = 0
        self._units = self._read(cursor)

    def _read(self, cursor: tuple[int, int, int, int]) -> Iterator[_Segment]:
        file_pos, offset, line, skip = cursor
        for pos in range(file_pos, len(self.order)):
            path = self.files[self.order[pos]]
            first = pos == file_pos
            for unit in self.units(path, offset if first else 0, line if first else 0):
                ids = self.tokenizer.encode(unit.text, eos=unit.ends_document)
                seg = _Segment(pos, unit.offset, unit.line, np.asarray(ids, dtype=np.int64), skip)
                skip = 0
                yield seg
            skip = 0

    def cursor(self) -> tuple[int, int, int, int]:
        if not self.segments:
            return self.start
        s = self.segments[0]
        return (s.file_pos, s.offset, s.line, s.skip)

    def _buffered(self) -> int:
        return sum(len(s.ids) - s.skip for s in self.segments)

    def take_block(self, max_windows: int, seq_len: int) -> tuple[np.ndarray, bool]:
        """Up to ``max_windows`` windows [n, seq_len + 1]; and True when the epoch ends with
        them (what is left is less than a window and is dropped)."""
        need = max_windows * seq_len + 1
        have = self._buffered()
        while have < need and not self.exhausted:
            seg = next(self._units, None)
            if seg is None:
                self.exhausted = True
                break
            self.segments.append(seg)
            have += len(seg.ids) - seg.skip
            self.tokens_read += len(seg.ids) - seg.skip
        parts = [s.ids[s.skip:] for s in self.segments]
        stream = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        n = min(max_windows, max(len(stream) - 1, 0) // seq_len)
        index = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)  # [n, seq_len + 1]
        windows = stream[index]
        self._consume(n * seq_len)
        done = self.exhausted and self._buffered() < seq_len + 1
        return windows, done

    def _consume(self, count: int) -> None:
        while count:
            s = self.segments[0]
            take = min(count, len(s.ids) - s.skip)
            s.skip += take
            count -= take
            if s.skip == len(s.ids) and len(self.segments) > 1:
                self.segments.popleft()  # keep the last one: the cursor lives on it
        while len(self.segments) > 1 and self.segments[0].skip == len(self.segments[0].ids):
            self.segments.popleft()


class StreamingTextWindows:
    """Global windows of a streamed text corpus, read forward only (see the module docstring).

    ``windows(first, count)`` needs ``first`` at or after the current block; the loader calls
    :meth:`advance` after each step so that every rank holds the same block, and hence the same
    :meth:`state_dict`.
    """

    num_windows = None

    def __init__(self, files: list[Path], *, root: Path, tokenizer: Tokenizer, seq_len: int,
                 seed: int, shuffle: bool, text_field: str = "text",
                 block_windows: int | None = None, label: str = "",
                 key: str = "training.dataset_path"):
        self.files, self.tokenizer, self.seq_len = files, tokenizer, seq_len
        self.seed, self.shuffle, self.text_field = seed, shuffle, text_field
        self.block_windows = block_windows or max(1, BLOCK_TOKENS // seq_len)
        self.fingerprint = corpus_fingerprint(files, root)
        self.label, self.key = label or str(root), key
        for f in files:
            check_text_file(f, text_field, key=key)
        self._load(epoch=0, epoch_start=0, block=0, block_first=0, cursor=(0, 0, 0, 0))

    @classmethod
    def open(cls, dataset_path: str, *, key: str = "training.dataset_path",
             **kw: Any) -> StreamingTextWindows:
        """The source for ``dataset_path`` (a file or a folder searched recursively); errors
        name it as ``key``."""
        files = list_files(dataset_path, key=key)
        root = Path(dataset_path)
        return cls(files, root=root if root.is_dir() else root.parent,
                   label=f"{key} = {dataset_path!r}", key=key, **kw)

    # -- reading -----------------------------------------------------------------------------
    def _units(self, path: Path, offset: int, line: int) -> Iterator[Unit]:
        """The units of one file from a cursor on (a subclass reads another kind of source)."""
        return read_units(path, self.text_field, offset, line, key=self.key)

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.files)))
        gen = torch.Generator().manual_seed(mix_seed(FILES, self.seed, epoch))
        return torch.randperm(len(self.files), generator=gen).tolist()

    def _load(self, *, epoch: int, epoch_start: int, block: int, block_first: int,
              cursor: tuple[int, int, int, int]) -> None:
        self.epoch, self.epoch_start, self.block_index = epoch, epoch_start, block
        self.block_first = block_first
        self._reader = _TokenReader(self.files, self._order(epoch), self._units, self.tokenizer,
                                    cursor)
        self._fill()

    def _new_epoch(self) -> None:
        self.epoch += 1
        self.epoch_start, self.block_index = self.block_first, 0
        self._reader = _TokenReader(self.files, self._order(self.epoch), self._units,
                                    self.tokenizer, (0, 0, 0, 0))

    def _fill(self) -> None:
        while True:
            self.block_cursor = self._reader.cursor()
            windows, done = self._reader.take_block(self.block_windows, self.seq_len)
            if len(windows):
                block = torch.from_numpy(windows)
                if self.shuffle:
                    gen = torch.Generator().manual_seed(
                        mix_seed(SHUFFLE, self.seed, self.epoch, self.block_index))
                    block = block[torch.randperm(len(block), generator=gen)]
                self.block, self._last_in_epoch = block, done
                return
            if self.block_first == self.epoch_start and not self._reader.tokens_read:
                raise ConfigError(f"{self.label} holds no text (every document is empty)")
            if self.block_first == self.epoch_start:
                raise ConfigError(f"{self.label} has {self._reader.tokens_read} tokens, fewer "
                                  f"than training.seq_len + 1 = {self.seq_len + 1}; lower "
                                  "training.seq_len or add text")
            self._new_epoch()  # the epoch ended exactly at the previous block's end

    def _next_block(self) -> None:
        self.block_first += len(self.block)
        if self._last_in_epoch:
            self._new_epoch()
        else:
            self.block_index += 1
        self._fill()

    def advance(self, position: int) -> None:
        """Read on until the block holding global window ``position``."""
        while position >= self.block_first + len(self.block):
            self._next_block()

    def windows(self, first: int, count: int) -> torch.Tensor:
        """Global windows ``[first, first + count)`` as a long tensor [count, seq_len + 1]."""
        assert first >= self.block_first, "the streaming source reads forward only"
        rows = []
        for g in range(first, first + count):
            self.advance(g)
            rows.append(self.block[g - self.block_first])
        return torch.stack(rows)

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where the current block starts: plain ints, the same on every rank."""
        return {"epoch": self.epoch, "epoch_start": self.epoch_start, "block": self.block_index,
                "block_first": self.block_first, "cursor": list(self.block_cursor),
                "block_windows": self.block_windows, "shuffle": self.shuffle, "seed": self.seed,
                "files": self.fingerprint, "text_field": self.text_field}

    def load_state_dict(self, state: dict[str, Any], position: int) -> None:
        """Re-open the saved block (re-reading only it) and check it holds ``position``."""
        for key, fix in (("files", "training.dataset_path"), ("block_windows", None),
                         ("shuffle", "training.shuffle"), ("seed", "training.seed"),
                         ("text_field", "training.dataset_text_field")):
            if state.get(key) != getattr(self, "fingerprint" if key == "files" else key):
                ours = getattr(self, "fingerprint" if key == "files" else key)
                if key == "files":
                    raise ValueError("the checkpoint's data loader read another corpus (files "
                                     f"fingerprint {state.get(key)!r}, this one {ours!r}); the "
                                     "corpus changed since the checkpoint, so its position is "
                                     "meaningless")
                fix_text = f"; set {fix} = {state.get(key)!r}" if fix else ""
                raise ValueError(f"the checkpoint's data stream was saved with {key} = "
                                 f"{state.get(key)!r} but this run has {ours!r}{fix_text} to "
                                 "resume the same data stream")
        cursor = tuple(int(c) for c in state["cursor"])
        self._load(epoch=int(state["epoch"]), epoch_start=int(state["epoch_start"]),
                   block=int(state["block"]), block_first=int(state["block_first"]),
                   cursor=cursor)  # type: ignore[arg-type]
        if not self.block_first <= position <= self.block_first + len(self.block):
            raise ValueError(f"data loader state has position = {position} outside its saved "
                             f"block [{self.block_first}, {self.block_first + len(self.block)}); "
                             "the state is damaged")
        self.advance(position)
