"""Token sources and a checkpointable, layout-independent data loader.

Sources (``[training] dataset``):

- ``"shakespeare"``: the built-in corpus, packed in memory.
- ``"text"``: ``.txt``, ``.jsonl`` (field ``dataset_text_field``), ``.parquet`` and ``.arrow``
  (a ``datasets`` ``save_to_disk`` split) files or a folder of them, streamed: read and
  tokenized as the windows are needed, with memory bounded by one block
  (:mod:`titanext.data.streaming`).
- ``"tokens"``: pre-tokenized ``.npy`` shards read through a memmap (:mod:`titanext.data.tokens`),
  written by ``titanext-data tokenize`` (:mod:`titanext.data.pretokenize`).
- ``"synthetic"``: infinite learnable random windows.
- ``"hf"``: a Hugging Face ``datasets`` split (hub name, local folder or file) streamed through
  ``load_dataset(..., streaming=True)`` into the streaming text source
  (:mod:`titanext.data.hf_datasets`).

Documents are packed into one token stream with EOS after each and cut into windows of
``seq_len + 1`` tokens with stride ``seq_len``: inputs are ``w[:-1]``, labels ``w[1:]``. A finite
source has ``(num_tokens - 1) // seq_len`` windows per epoch; with ``shuffle`` each epoch visits
them in an order seeded by ``(seed, epoch)``.

**Global order.** All data-parallel ranks call :meth:`TokenDataLoader.next_batch` in lockstep.
At global position ``pos``, rank ``r`` of ``D`` takes global windows
``[pos + r*B, pos + (r+1)*B)`` and every rank advances ``pos`` by ``D*B``. One process with
``B' = D*B`` therefore sees exactly what the ``D`` ranks see together, in rank order, and the
saved state (the global position, plus a streaming source's cursor) resumes under any other
data-parallel layout.

**Document masking.** With ``document_masking=True`` a batch is ``(inputs, labels,
document_ids)``: :func:`document_ids` numbers the documents of each row (a new one starts after
every EOS and at every BOS) and :func:`document_positions` turns them into positions that
restart at 0 at each document. Labels are unchanged.

>>> from titanext.data import build_dataloader
>>> from titanext.data.tokenizer import ByteTokenizer
>>> loader = build_dataloader(dataset="shakespeare", dataset_path=None, tokenizer=ByteTokenizer(),
...                           seq_len=64, local_batch_size=2, dp_rank=0, dp_degree=1)
>>> inputs, labels = loader.next_batch()
>>> tuple(inputs.shape), inputs.dtype
((2, 64), torch.int64)
>>> loader.state_dict()["position"]
2
"""

from __future__ import annotations

import importlib
from typing import Any

# Names load on first use, so that torch-free parts (readers, checks, tokens) can be imported
# (by the config loader) without importing torch.
_EXPORTS = {
    "DATASETS": "loader", "TokenDataLoader": "loader", "build_dataloader": "loader",
    "dataloader_from_config": "loader",
    "document_ids": "loader", "document_positions": "loader", "load_documents": "loader",
    "check_dataset": "rules", "TEXT_SUFFIXES": "readers", "SyntheticWindows": "sources",
    "TokenWindows": "sources", "pack_documents": "sources",
    "StreamingTextWindows": "streaming", "TokenShardWindows": "tokens",
    "HFStreamingWindows": "hf_datasets",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'titanext.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"titanext.data.{_EXPORTS[name]}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
