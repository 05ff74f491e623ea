"""The checkpointable, layout-independent loader over any window source, and document ids."""

from __future__ import annotations

import operator
from typing import Any

import torch

from titanext.data.hf_datasets import HFStreamingWindows
from titanext.data.readers import list_files, read_units
from titanext.data.rules import check_dataset
from titanext.data.sources import (
    SyntheticWindows,
    Tokenizer,
    TokenWindows,
    pack_documents,
    shakespeare_documents,
)
from titanext.data.streaming import StreamingTextWindows
from titanext.data.tokens import TokenShardWindows
from titanext.errors import ConfigError
from titanext.models.layers import document_positions  # re-exported

__all__ = ["DATASETS", "TokenDataLoader", "build_dataloader", "dataloader_from_config",
           "document_ids",
           "check_dataset", "document_positions", "load_documents"]

DATASETS = ("shakespeare", "text", "tokens", "synthetic", "hf")
_ALLOWED_DATASETS = ", ".join(repr(d) for d in DATASETS)
_PATH_DATASETS = ("text", "tokens", "hf")
Source = TokenWindows | SyntheticWindows | StreamingTextWindows | TokenShardWindows


def load_documents(dataset: str, dataset_path: str | None = None,
                   text_field: str = "text") -> list[str]:
    """All non-empty documents of a finite text source, in the stream's (unshuffled) order.

    Reads everything into memory: for inspection and tests; training streams instead.

    >>> load_documents("shakespeare")[0].splitlines()[0]
    'First Citizen:'
    """
    if dataset == "shakespeare":
        return shakespeare_documents()
    if dataset != "text":
        raise ConfigError(f"training.dataset = {dataset!r} has no documents; allowed: "
                          "'shakespeare', 'text'")
    docs, pieces = [], []
    for f in list_files(dataset_path):
        for unit in read_units(f, text_field):
            pieces.append(unit.text)
            if unit.ends_document:
                docs.append("".join(pieces))
                pieces = []
    if not docs:
        raise ConfigError(f"training.dataset_path = {dataset_path!r} holds no text (every "
                          "document is empty)")
    return docs


def document_ids(inputs: torch.Tensor, eos_id: int, bos_id: int | None = None) -> torch.Tensor:
    """Number the documents within each row of ``inputs`` [batch, seq]: int64, 0 at column 0.

    A new document starts at column ``t > 0`` when ``inputs[t - 1]`` is EOS (the EOS ends the
    document before it) or when ``inputs[t]`` is BOS (the BOS opens its document). A BOS right
    after an EOS starts one document, not two; a BOS equal to the EOS id counts as EOS only.

    >>> document_ids(torch.tensor([[5, 9, 1, 6, 9, 9, 7]]), eos_id=9).tolist()
    [[0, 0, 1, 1, 1, 2, 3]]
    >>> document_ids(torch.tensor([[5, 8, 6, 9, 8, 7]]), eos_id=9, bos_id=8).tolist()
    [[0, 1, 1, 1, 2, 2]]
    """
    starts = torch.zeros_like(inputs, dtype=torch.bool)
    starts[:, 1:] = inputs[:, :-1] == eos_id
    if bos_id is not None and bos_id != eos_id:
        starts[:, 1:] |= inputs[:, 1:] == bos_id
    return starts.long().cumsum(dim=1)


class TokenDataLoader:
    """Batches of ``(input_ids, labels)``, each ``torch.long`` [local_batch_size, seq_len];
    with ``document_masking`` also ``document_ids`` (see :func:`document_ids`).

    Build it with :func:`build_dataloader`. ``position`` is the number of global windows consumed
    by all data-parallel ranks together; with the source's own state (a streaming source's
    cursor) it is the whole checkpointed state, and the same on every rank.
    """

    def __init__(self, source: Source, *, dataset: str, seq_len: int, local_batch_size: int,
                 dp_rank: int, dp_degree: int, document_masking: bool = False,
                 eos_id: int | None = None, bos_id: int | None = None):
        self.source, self.dataset, self.seq_len = source, dataset, seq_len
        self.local_batch_size, self.dp_rank, self.dp_degree = local_batch_size, dp_rank, dp_degree
        self.document_masking, self.eos_id, self.bos_id = document_masking, eos_id, bos_id
        if document_masking and eos_id is None:
            raise ValueError("document_masking needs the tokenizer's eos_id")
        self.position = 0

    @property
    def num_windows(self) -> int | None:
        """Windows per epoch, or None when unknown ahead (streaming) or infinite (synthetic)."""
        return self.source.num_windows

    @property
    def tokens_per_window(self) -> int:
        """Tokens in one window (``seq_len + 1``: inputs and labels overlap by all but one)."""
        return self.seq_len + 1

    @property
    def epoch(self) -> int:
        """The epoch the next global window belongs to (0 for the synthetic source)."""
        if isinstance(self.source, StreamingTextWindows):
            return self.source.epoch
        return 0 if self.num_windows is None else self.position // self.num_windows

    def next_batch(self) -> tuple[torch.Tensor, ...]:
        """This rank's next batch; every rank must call it the same number of times."""
        first = self.position + self.dp_rank * self.local_batch_size
        windows = self.source.windows(first, self.local_batch_size)  # [B, seq_len + 1]
        self.position += self.dp_degree * self.local_batch_size
        if isinstance(self.source, StreamingTextWindows):
            self.source.advance(self.position)  # every rank on the same block: one state
        inputs, labels = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
        if not self.document_masking:
            return inputs, labels
        return inputs, labels, document_ids(inputs, self.eos_id, self.bos_id)

    def __iter__(self):
        """Endless batches (the stream restarts a new epoch when a finite source runs out)."""
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """Plain, layout-independent values: the global position and what it refers to."""
        state = {"position": self.position, "dataset": self.dataset, "seq_len": self.seq_len,
                 "num_windows": self.num_windows}
        if hasattr(self.source, "state_dict"):
            state["stream"] = self.source.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved global position (under any dp degree and local batch size)."""
        try:
            position = operator.index(state.get("position"))  # int-like, e.g. a numpy int
        except TypeError:
            position = -1
        if position < 0:
            raise ValueError(f"data loader state has position = {state.get('position')!r}; "
                             "expected a non-negative int from TokenDataLoader.state_dict()")
        for key, fix in (("dataset", "training.dataset"), ("seq_len", "training.seq_len")):
            if state.get(key) != getattr(self, key):
                raise ValueError(f"the checkpoint's data loader was saved with {key} = "
                                 f"{state.get(key)!r} but this run has {getattr(self, key)!r}; set "
                                 f"{fix} = {state.get(key)!r} to resume the same data stream")
        if state.get("num_windows") != self.num_windows:
            # Same dataset name but a different corpus (edited files, another dataset_path): the
            # saved position would point into a different stream.
            raise ValueError(f"the checkpoint's data loader had {state.get('num_windows')!r} "
                             f"windows per epoch but this corpus has {self.num_windows!r}; the "
                             "corpus changed since the checkpoint, so its position is meaningless")
        if hasattr(self.source, "load_state_dict"):
            if not isinstance(state.get("stream"), dict):
                raise ValueError(f"the checkpoint's data loader state for dataset = "
                                 f"{self.dataset!r} has no stream state; it was saved by another "
                                 "titanext version or loader")
            self.source.load_state_dict(state["stream"], position)
        self.position = position


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} = {value!r}; expected a positive int")


def build_dataloader(*, dataset: str, dataset_path: str | None, tokenizer: Tokenizer,
                     seq_len: int, local_batch_size: int, dp_rank: int, dp_degree: int,
                     seed: int = 0, shuffle: bool = True, text_field: str = "text",
                     document_masking: bool = False, block_tokens: int | None = None,
                     section: str = "training", dataset_name: str | None = None,
                     dataset_split: str = "train") -> TokenDataLoader:
    """A loader for ``dataset``: 'shakespeare', 'text' (streamed from ``dataset_path``),
    'tokens' (memory-mapped shards at ``dataset_path``), 'synthetic', or 'hf' (the
    ``datasets.load_dataset(dataset_path, dataset_name, split=dataset_split, streaming=True)``
    split, streamed as 'text' is: :mod:`titanext.data.hf_datasets`).

    ``text_field``: the jsonl key / parquet column holding the text. ``document_masking``: also
    yield document ids. ``block_tokens``: the streaming source's shuffle block (tokens).
    ``section``: the config section named in errors ('validation' for the held-out source).
    See :mod:`titanext.data` for the global order contract and a runnable example.
    """
    key = f"{section}.dataset_path"
    if dataset not in DATASETS:
        raise ConfigError(f"{section}.dataset = {dataset!r} is not a known dataset; allowed: "
                          f"{_ALLOWED_DATASETS}")
    if dataset_path and dataset not in _PATH_DATASETS:
        raise ConfigError(f"{key} = {dataset_path!r} is only read with dataset = 'text', "
                          f"'tokens' or 'hf', but {section}.dataset = {dataset!r}")
    _check_positive("training.seq_len", seq_len)
    _check_positive(f"{section}.local_batch_size", local_batch_size)
    _check_positive("dp_degree", dp_degree)
    if not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_degree:
        raise ConfigError(f"dp_rank = {dp_rank!r}; expected 0 <= dp_rank < dp_degree = "
                          f"{dp_degree}")
    if dataset in _PATH_DATASETS and not dataset_path:
        what = {"text": "a .txt, .jsonl (field training.dataset_text_field), .parquet or .arrow "
                        "file, or a folder of them",
                "tokens": "a folder of .npy token shards from titanext-data tokenize",
                "hf": "a hub name, a local folder or a data file for datasets.load_dataset"}[
                    dataset]
        raise ConfigError(f"{section}.dataset = {dataset!r} needs {key}: {what}")

    source: Source
    if dataset == "synthetic":
        source = SyntheticWindows(vocab_size=tokenizer.vocab_size, seq_len=seq_len, seed=seed)
    elif dataset == "text":
        block = None if block_tokens is None else max(1, block_tokens // seq_len)
        source = StreamingTextWindows.open(dataset_path, tokenizer=tokenizer, seq_len=seq_len,
                                           seed=seed, shuffle=shuffle, text_field=text_field,
                                           block_windows=block, key=key)
    elif dataset == "hf":
        block = None if block_tokens is None else max(1, block_tokens // seq_len)
        source = HFStreamingWindows(dataset_path, tokenizer=tokenizer, seq_len=seq_len, seed=seed,
                                    shuffle=shuffle, name=dataset_name, split=dataset_split,
                                    text_field=text_field, block_windows=block, key=key)
    elif dataset == "tokens":
        source = TokenShardWindows.open(dataset_path, vocab_size=tokenizer.vocab_size,
                                        eos_id=tokenizer.eos_id, seq_len=seq_len, seed=seed,
                                        shuffle=shuffle, key=key)
    else:
        tokens = pack_documents(shakespeare_documents(), tokenizer)
        if len(tokens) < seq_len + 1:
            raise ConfigError(f"training.dataset = {dataset!r} has {len(tokens)} tokens, fewer "
                              f"than training.seq_len + 1 = {seq_len + 1}; lower training.seq_len")
        source = TokenWindows(tokens, seq_len=seq_len, seed=seed, shuffle=shuffle)
    return TokenDataLoader(source, dataset=dataset, seq_len=seq_len,
                           local_batch_size=local_batch_size, dp_rank=dp_rank,
                           dp_degree=dp_degree, document_masking=document_masking,
                           eos_id=tokenizer.eos_id, bos_id=getattr(tokenizer, "bos_id", None))


def dataloader_from_config(training: Any, tokenizer: Tokenizer, dp_rank: int, dp_degree: int, *,
                           validation: Any = None,
                           document_masking: bool = False) -> TokenDataLoader:
    """The loader a config asks for: ``[training]``'s, or with ``validation`` (the
    ``[validation]`` section) the held-out one, read unshuffled with its own batch size.

    >>> from titanext.config import load_config
    >>> from titanext.data.tokenizer import ByteTokenizer
    >>> t = load_config(None, ["--training.seq_len=32"]).training
    >>> dataloader_from_config(t, ByteTokenizer(), 0, 1).next_batch()[0].shape
    torch.Size([8, 32])
    """
    src = validation if validation is not None else training
    return build_dataloader(
        dataset=src.dataset, dataset_path=src.dataset_path or None, tokenizer=tokenizer,
        seq_len=training.seq_len, local_batch_size=src.local_batch_size, dp_rank=dp_rank,
        dp_degree=dp_degree, seed=training.seed,
        shuffle=training.shuffle if validation is None else False,
        text_field=training.dataset_text_field, document_masking=document_masking,
        section="training" if validation is None else "validation",
        dataset_name=training.dataset_name or None, dataset_split=src.dataset_split)
