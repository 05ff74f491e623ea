"""Token sources and a checkpointable, layout-independent data loader.

Sources (``[training] dataset``):

- ``"shakespeare"``: the built-in corpus, packed in memory.
- ``"text"``: ``.txt``, ``.jsonl`` (field ``dataset_text_field``) and ``.parquet`` files or a
  folder of them, streamed: read and tokenized as the windows are needed, with memory bounded by
  one block (:mod:`titanext.data.streaming`).
- ``"tokens"``: pre-tokenized ``.npy`` shards read through a memmap (:mod:`titanext.data.tokens`),
  written by ``python -m titanext.data tokenize`` (:mod:`titanext.data.tokenize`).
- ``"synthetic"``: infinite learnable random windows.

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

>>> from titanext.tokenizer import ByteTokenizer
>>> loader = build_dataloader(dataset="shakespeare", dataset_path=None, tokenizer=ByteTokenizer(),
...                           seq_len=64, local_batch_size=2, dp_rank=0, dp_degree=1)
>>> inputs, labels = loader.next_batch()
>>> tuple(inputs.shape), inputs.dtype
((2, 64), torch.int64)
>>> loader.state_dict()["position"]
2
"""

from titanext.data.loader import (
    DATASETS,
    TokenDataLoader,
    build_dataloader,
    check_dataset,
    document_ids,
    document_positions,
    load_documents,
)
from titanext.data.readers import TEXT_SUFFIXES
from titanext.data.sources import SyntheticWindows, TokenWindows, pack_documents
from titanext.data.streaming import StreamingTextWindows
from titanext.data.tokens import TokenShardWindows

__all__ = [
    "DATASETS",
    "TEXT_SUFFIXES",
    "StreamingTextWindows",
    "SyntheticWindows",
    "TokenDataLoader",
    "TokenShardWindows",
    "TokenWindows",
    "build_dataloader",
    "check_dataset",
    "document_ids",
    "document_positions",
    "load_documents",
    "pack_documents",
]
