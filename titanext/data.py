"""Token sources and a checkpointable, layout-independent data loader.

Documents are packed into one token stream with EOS between them and cut into windows of
``seq_len + 1`` tokens (stride ``seq_len``): inputs are ``w[:-1]``, labels ``w[1:]``.

**Global order.** All data-parallel ranks call :meth:`TokenDataLoader.next_batch` in lockstep.
At global position ``pos``, rank ``r`` of ``D`` takes global windows
``[pos + r*B, pos + (r+1)*B)`` and every rank advances ``pos`` by ``D*B``. One process with
``B' = D*B`` therefore sees exactly what the ``D`` ranks see together, and the saved state (the
global position) resumes under any other data-parallel layout.

>>> from titanext.tokenizer import ByteTokenizer
>>> loader = build_dataloader(dataset="shakespeare", dataset_path=None, tokenizer=ByteTokenizer(),
...                           seq_len=64, local_batch_size=2, dp_rank=0, dp_degree=1)
>>> inputs, labels = loader.next_batch()
>>> tuple(inputs.shape)
(2, 64)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["DATASETS", "TokenDataLoader", "build_dataloader", "load_documents"]

DATASETS = ("shakespeare", "text", "synthetic")
_CORPUS = Path(__file__).parent / "assets" / "shakespeare.txt"


def _read_file(path: Path) -> list[str]:
    if path.suffix == ".jsonl":
        docs = []
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    docs.append(json.loads(line)["text"])
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(f"{path}:{lineno}: expected a JSON object with a 'text' field ({e})") from e
        return docs
    return [path.read_text(encoding="utf-8", errors="replace")]


def load_documents(dataset: str, dataset_path: str | None) -> list[str]:
    """The documents of a finite source: the built-in corpus or the user's .txt/.jsonl files."""
    if dataset == "shakespeare":
        # Scenes are separated by blank lines; treat each block as a document.
        return [b for b in _CORPUS.read_text(encoding="utf-8").split("\n\n") if b.strip()]
    if dataset != "text":
        raise ValueError(f"training.dataset = {dataset!r}; allowed: {', '.join(DATASETS)}")
    if not dataset_path:
        raise ValueError("training.dataset = 'text' needs training.dataset_path (a .txt/.jsonl file or folder)")
    path = Path(dataset_path)
    if not path.exists():
        raise ValueError(f"training.dataset_path = {dataset_path!r} does not exist")
    files = sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".jsonl")) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"training.dataset_path = {dataset_path!r} holds no .txt or .jsonl files")
    docs = [d for f in files for d in _read_file(f) if d]
    if not docs:
        raise ValueError(f"training.dataset_path = {dataset_path!r} holds no text")
    return docs


def _pack(docs: list[str], tokenizer) -> torch.Tensor:
    ids: list[int] = []
    for doc in docs:
        ids.extend(tokenizer.encode(doc, eos=True))
    dtype = torch.int16 if tokenizer.vocab_size <= 32767 else torch.int32  # compact storage
    return torch.tensor(ids, dtype=dtype)


class TokenDataLoader:
    """Batches of (input_ids, labels), each ``torch.long`` of shape [local_batch_size, seq_len]."""

    def __init__(self, *, dataset: str, tokens: torch.Tensor | None, seq_len: int, local_batch_size: int,
                 dp_rank: int, dp_degree: int, seed: int = 0, shuffle: bool = True, vocab_size: int = 258):
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank = {dp_rank} must be in [0, dp_degree = {dp_degree})")
        self.dataset, self.seq_len, self.batch_size = dataset, seq_len, local_batch_size
        self.dp_rank, self.dp_degree, self.seed, self.shuffle = dp_rank, dp_degree, seed, shuffle
        self.tokens, self.vocab_size = tokens, vocab_size
        self.position = 0  # global windows consumed
        if tokens is not None:
            n = (len(tokens) - 1) // seq_len
            if n < 1:
                raise ValueError(f"the {dataset!r} corpus has {len(tokens)} tokens, fewer than "
                                 f"training.seq_len + 1 = {seq_len + 1}")
            self._num_windows = n
        else:
            self._num_windows = None
            # Synthetic: a fixed random bigram table gives learnable structure.
            g = torch.Generator().manual_seed(seed)
            self._next = torch.randint(0, vocab_size, (vocab_size, 4), generator=g)
        self._perm_epoch, self._perm = -1, None

    @property
    def num_windows(self) -> int | None:
        """Windows per epoch (None for the infinite synthetic source)."""
        return self._num_windows

    @property
    def tokens_per_window(self) -> int:
        return self.seq_len + 1

    def _window(self, g: int) -> torch.Tensor:
        if self.tokens is None:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + g)
            choice = torch.randint(0, 4, (self.seq_len,), generator=gen)
            out = torch.empty(self.seq_len + 1, dtype=torch.long)
            out[0] = torch.randint(0, self.vocab_size, (1,), generator=gen)
            for i in range(self.seq_len):
                out[i + 1] = self._next[out[i], choice[i]]
            return out
        epoch, slot = divmod(g, self._num_windows)
        if self.shuffle:
            if epoch != self._perm_epoch:
                gen = torch.Generator().manual_seed(self.seed * 7919 + epoch)
                self._perm, self._perm_epoch = torch.randperm(self._num_windows, generator=gen), epoch
            slot = int(self._perm[slot])
        start = slot * self.seq_len
        return self.tokens[start : start + self.seq_len + 1].long()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        first = self.position + self.dp_rank * self.batch_size
        windows = torch.stack([self._window(first + i) for i in range(self.batch_size)])
        self.position += self.dp_degree * self.batch_size
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "dataset": self.dataset, "seq_len": self.seq_len,
                "num_windows": self._num_windows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("dataset", "seq_len", "num_windows"):
            if state.get(key) != getattr(self, "_num_windows" if key == "num_windows" else key):
                raise ValueError(f"data loader state was saved with {key} = {state.get(key)!r}; this run has "
                                 f"{getattr(self, '_num_windows' if key == 'num_windows' else key)!r}")
        self.position = int(state["position"])


def build_dataloader(*, dataset: str, dataset_path: str | None, tokenizer, seq_len: int,
                     local_batch_size: int, dp_rank: int, dp_degree: int, seed: int = 0,
                     shuffle: bool = True) -> TokenDataLoader:
    """A loader for ``dataset`` ('shakespeare', 'text' with ``dataset_path``, or 'synthetic')."""
    if dataset not in DATASETS:
        raise ValueError(f"training.dataset = {dataset!r}; allowed: {', '.join(DATASETS)}")
    tokens = None if dataset == "synthetic" else _pack(load_documents(dataset, dataset_path), tokenizer)
    return TokenDataLoader(dataset=dataset, tokens=tokens, seq_len=seq_len, local_batch_size=local_batch_size,
                           dp_rank=dp_rank, dp_degree=dp_degree, seed=seed, shuffle=shuffle,
                           vocab_size=tokenizer.vocab_size)
