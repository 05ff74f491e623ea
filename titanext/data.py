"""Token sources and a checkpointable, layout-independent data loader.

Documents are packed into one token stream with EOS after each and cut into windows of
``seq_len + 1`` tokens with stride ``seq_len``: inputs are ``w[:-1]``, labels ``w[1:]``. A finite
source has ``(len(tokens) - 1) // seq_len`` windows per epoch; with ``shuffle`` each epoch visits
them in a permutation seeded by ``(seed, epoch)``. The synthetic source is infinite and window
``g`` is a pure function of ``(seed, g)``.

**Global order.** All data-parallel ranks call :meth:`TokenDataLoader.next_batch` in lockstep.
At global position ``pos``, rank ``r`` of ``D`` takes global windows
``[pos + r*B, pos + (r+1)*B)`` and every rank advances ``pos`` by ``D*B``. One process with
``B' = D*B`` therefore sees exactly what the ``D`` ranks see together, in rank order, and the
saved state (the global position) resumes under any other data-parallel layout.

>>> from titanext.tokenizer import ByteTokenizer
>>> loader = build_dataloader(dataset="shakespeare", dataset_path=None, tokenizer=ByteTokenizer(),
...                           seq_len=64, local_batch_size=2, dp_rank=0, dp_degree=1)
>>> inputs, labels = loader.next_batch()
>>> tuple(inputs.shape), inputs.dtype
((2, 64), torch.int64)
>>> loader.state_dict()["position"]
2
"""

from __future__ import annotations

import array
import json
import operator
from pathlib import Path
from typing import Any, Protocol

import torch

__all__ = [
    "DATASETS",
    "TEXT_SUFFIXES",
    "SyntheticWindows",
    "TokenDataLoader",
    "TokenWindows",
    "build_dataloader",
    "load_documents",
    "pack_documents",
]

DATASETS = ("shakespeare", "text", "synthetic")
TEXT_SUFFIXES = (".txt", ".jsonl")
_CORPUS = Path(__file__).parent / "assets" / "shakespeare.txt"
_ALLOWED_DATASETS = ", ".join(repr(d) for d in DATASETS)
# Domain tags for _mix_seed, so the shuffle, the bigram table and the synthetic windows draw
# from unrelated streams even for equal (seed, index) pairs.
_SHUFFLE, _TABLE, _WINDOW = 1, 2, 3


class Tokenizer(Protocol):
    """What the loader needs from a tokenizer (``titanext.tokenizer.ByteTokenizer`` fits)."""

    eos_id: int
    vocab_size: int

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]: ...


def _mix_seed(*values: int) -> int:
    """A 63-bit generator seed from several ints (splitmix64 folding).

    A linear formula like ``seed * K + epoch`` makes distinct pairs collide (seed 0, epoch K
    equals seed 1, epoch 0); hashing keeps every (seed, index) stream independent.
    """
    mask = (1 << 64) - 1
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & mask)) & mask
        h = (h + 0x9E3779B97F4A7C15) & mask
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & mask
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & mask
        h ^= h >> 31
    return h >> 1  # torch.Generator.manual_seed takes any value, but stay clear of the sign bit


# -- documents ---------------------------------------------------------------------------------
def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"training.dataset_path file {str(path)!r} is not valid UTF-8 "
                         f"(byte {e.start}); re-encode it as UTF-8") from e


def _read_jsonl(path: Path) -> list[str]:
    docs = []
    for lineno, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue  # blank lines (e.g. a trailing newline) are not documents
        where = f"{str(path)!r} line {lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"training.dataset_path file {where} is not valid JSON ({e.msg}); "
                             'each line must be an object like {"text": "..."}') from e
        if not isinstance(record, dict) or "text" not in record:
            raise ValueError(f"training.dataset_path file {where} has no \"text\" field; each "
                             'line must be an object like {"text": "..."}')
        if not isinstance(record["text"], str):
            raise ValueError(f"training.dataset_path file {where}: \"text\" is a "
                             f"{type(record['text']).__name__}, expected a string")
        docs.append(record["text"])
    return docs


def _text_files(dataset_path: str | None) -> list[Path]:
    if not dataset_path:
        raise ValueError("training.dataset = 'text' needs training.dataset_path: a .txt file, a "
                         ".jsonl file (field \"text\") or a folder of them")
    path = Path(dataset_path)
    if not path.exists():
        raise ValueError(f"training.dataset_path = {dataset_path!r} does not exist; give a .txt "
                         "or .jsonl file or a folder of them")
    if path.is_dir():
        # Sorted by relative path so every rank and every resume reads the same order.
        files = sorted((p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES),
                       key=lambda p: p.relative_to(path).as_posix())
        if not files:
            raise ValueError(f"training.dataset_path = {dataset_path!r} is a folder with no "
                             f"{' or '.join(TEXT_SUFFIXES)} files")
        return files
    if path.suffix not in TEXT_SUFFIXES:
        raise ValueError(f"training.dataset_path = {dataset_path!r} has suffix {path.suffix!r}; "
                         f"allowed: {', '.join(repr(s) for s in TEXT_SUFFIXES)} or a folder")
    return [path]


def load_documents(dataset: str, dataset_path: str | None = None) -> list[str]:
    """The non-empty documents of a finite source, in a fixed order.

    ``"shakespeare"``: the built-in corpus, one document per blank-line-separated block (a
    speech). ``"text"``: ``dataset_path`` is a ``.txt`` file (one document), a ``.jsonl`` file
    (one document per line, field ``"text"``) or a folder searched recursively for both.

    >>> docs = load_documents("shakespeare")
    >>> docs[0].splitlines()[0]
    'First Citizen:'
    """
    if dataset == "shakespeare":
        blocks = _CORPUS.read_text(encoding="utf-8").split("\n\n")
    elif dataset == "text":
        blocks = []
        for f in _text_files(dataset_path):
            blocks.extend(_read_jsonl(f) if f.suffix == ".jsonl" else [_read_text(f)])
    else:
        raise ValueError(f"training.dataset = {dataset!r} has no documents; allowed: "
                         "'shakespeare', 'text'")
    docs = [b for b in blocks if b.strip()]
    if not docs:
        where = f"training.dataset_path = {dataset_path!r}" if dataset == "text" else "the corpus"
        raise ValueError(f"{where} holds no text (every document is empty)")
    return docs


def pack_documents(docs: list[str], tokenizer: Tokenizer) -> torch.Tensor:
    """One flat token tensor: each document's ids followed by EOS.

    Stored as int16 when the vocabulary fits (byte tokens do), int32 otherwise, to keep a big
    corpus small in memory; windows are widened to ``torch.long`` only when batched.

    >>> from titanext.tokenizer import ByteTokenizer
    >>> pack_documents(["ab", "c"], ByteTokenizer()).tolist()
    [97, 98, 257, 99, 257]
    """
    typecode, dtype = ("h", torch.int16) if tokenizer.vocab_size <= 2**15 else ("i", torch.int32)
    # array.array is ~4x faster than torch.tensor(list) for a million Python ints.
    buf = array.array(typecode)
    for doc in docs:
        buf.extend(tokenizer.encode(doc, eos=True))
    return torch.frombuffer(buf, dtype=dtype).clone() if buf else torch.empty(0, dtype=dtype)


# -- window sources ----------------------------------------------------------------------------
class TokenWindows:
    """The windows of a finite token stream; ``windows(g0, n)`` are global windows g0..g0+n-1.

    >>> src = TokenWindows(torch.arange(10), seq_len=3, seed=0, shuffle=False)
    >>> src.num_windows, src.windows(0, 2).tolist()
    (3, [[0, 1, 2, 3], [3, 4, 5, 6]])
    """

    def __init__(self, tokens: torch.Tensor, *, seq_len: int, seed: int, shuffle: bool):
        self.tokens, self.seq_len, self.seed, self.shuffle = tokens, seq_len, seed, shuffle
        self.num_windows = (len(tokens) - 1) // seq_len
        assert self.num_windows >= 1, "caller checks the corpus length"
        # Ranks move monotonically through global windows, so one cached epoch is enough.
        self._perm_epoch, self._perm = -1, torch.empty(0, dtype=torch.long)

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            gen = torch.Generator().manual_seed(_mix_seed(_SHUFFLE, self.seed, epoch))
            self._perm = torch.randperm(self.num_windows, generator=gen)
            self._perm_epoch = epoch
        return self._perm

    def windows(self, first: int, count: int) -> torch.Tensor:
        """Global windows ``[first, first + count)`` as a long tensor [count, seq_len + 1]."""
        slots = []
        for g in range(first, first + count):
            epoch, slot = divmod(g, self.num_windows)
            slots.append(int(self._permutation(epoch)[slot]) if self.shuffle else slot)
        starts = torch.tensor(slots, dtype=torch.long) * self.seq_len
        index = starts[:, None] + torch.arange(self.seq_len + 1)  # [count, seq_len + 1]
        return self.tokens[index].long()


class SyntheticWindows:
    """Infinite pseudo-random windows with learnable structure.

    A fixed random bigram table (seeded by ``seed``) gives every token ``branching`` possible
    successors, so the best achievable loss is ``ln(branching)`` (~1.39 nats for 4) against
    ``ln(vocab_size)`` (~5.55) for a fresh model: loss falls visibly within a few steps. Window
    ``g`` is drawn from its own generator seeded by ``(seed, g)``, so it does not depend on how
    windows are split across ranks.

    >>> src = SyntheticWindows(vocab_size=258, seq_len=8, seed=0)
    >>> bool((src.windows(5, 1)[0] == src.windows(3, 3)[2]).all())
    True
    """

    num_windows = None

    def __init__(self, *, vocab_size: int, seq_len: int, seed: int, branching: int = 4):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        gen = torch.Generator().manual_seed(_mix_seed(_TABLE, seed))
        table = torch.randint(0, vocab_size, (vocab_size, branching), generator=gen)
        self._successors = table.tolist()  # lists: the chain walk below is plain Python
        self._branching = branching

    def _window(self, g: int) -> list[int]:
        gen = torch.Generator().manual_seed(_mix_seed(_WINDOW, self.seed, g))
        start = int(torch.randint(0, self.vocab_size, (1,), generator=gen))
        choices = torch.randint(0, self._branching, (self.seq_len,), generator=gen).tolist()
        out = [start]
        for c in choices:  # a Markov chain is sequential; a list walk costs ~0.1 us per token
            out.append(self._successors[out[-1]][c])
        return out

    def windows(self, first: int, count: int) -> torch.Tensor:
        """Global windows ``[first, first + count)`` as a long tensor [count, seq_len + 1]."""
        return torch.tensor([self._window(g) for g in range(first, first + count)],
                            dtype=torch.long)


# -- the loader --------------------------------------------------------------------------------
class TokenDataLoader:
    """Batches of ``(input_ids, labels)``, each ``torch.long`` [local_batch_size, seq_len].

    Build it with :func:`build_dataloader`. ``position`` is the number of global windows consumed
    by all data-parallel ranks together; it is the whole checkpointed state.
    """

    def __init__(self, source: TokenWindows | SyntheticWindows, *, dataset: str, seq_len: int,
                 local_batch_size: int, dp_rank: int, dp_degree: int):
        self.source, self.dataset, self.seq_len = source, dataset, seq_len
        self.local_batch_size, self.dp_rank, self.dp_degree = local_batch_size, dp_rank, dp_degree
        self.position = 0

    @property
    def num_windows(self) -> int | None:
        """Windows per epoch, or None for the infinite synthetic source."""
        return self.source.num_windows

    @property
    def tokens_per_window(self) -> int:
        """Tokens in one window (``seq_len + 1``: inputs and labels overlap by all but one)."""
        return self.seq_len + 1

    @property
    def epoch(self) -> int:
        """The epoch the next global window belongs to (0 for the synthetic source)."""
        return 0 if self.num_windows is None else self.position // self.num_windows

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next batch; every rank must call it the same number of times."""
        first = self.position + self.dp_rank * self.local_batch_size
        windows = self.source.windows(first, self.local_batch_size)  # [B, seq_len + 1]
        self.position += self.dp_degree * self.local_batch_size
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def __iter__(self):
        """Endless batches (the stream restarts a new epoch when a finite source runs out)."""
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """Plain, layout-independent values: the global position and what it refers to."""
        return {"position": self.position, "dataset": self.dataset, "seq_len": self.seq_len,
                "num_windows": self.num_windows}

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
        self.position = position


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} = {value!r}; expected a positive int")


def build_dataloader(*, dataset: str, dataset_path: str | None, tokenizer: Tokenizer,
                     seq_len: int, local_batch_size: int, dp_rank: int, dp_degree: int,
                     seed: int = 0, shuffle: bool = True) -> TokenDataLoader:
    """A loader for ``dataset`` ('shakespeare', 'text' with ``dataset_path``, or 'synthetic').

    See the module docstring for the global order contract and a runnable example.
    """
    if dataset not in DATASETS:
        raise ValueError(f"training.dataset = {dataset!r} is not a known dataset; allowed: "
                         f"{_ALLOWED_DATASETS}")
    if dataset_path and dataset != "text":
        raise ValueError(f"training.dataset_path = {dataset_path!r} is only read with dataset = "
                         f"'text', but training.dataset = {dataset!r}")
    _check_positive("training.seq_len", seq_len)
    _check_positive("training.local_batch_size", local_batch_size)
    _check_positive("dp_degree", dp_degree)
    if not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_degree:
        raise ValueError(f"dp_rank = {dp_rank!r}; expected 0 <= dp_rank < dp_degree = {dp_degree}")

    source: TokenWindows | SyntheticWindows
    if dataset == "synthetic":
        source = SyntheticWindows(vocab_size=tokenizer.vocab_size, seq_len=seq_len, seed=seed)
    else:
        tokens = pack_documents(load_documents(dataset, dataset_path), tokenizer)
        if len(tokens) < seq_len + 1:
            where = (f"training.dataset_path = {dataset_path!r}" if dataset == "text"
                     else f"training.dataset = {dataset!r}")
            raise ValueError(f"{where} has {len(tokens)} tokens, fewer than training.seq_len + 1 "
                             f"= {seq_len + 1}; lower training.seq_len or add text")
        source = TokenWindows(tokens, seq_len=seq_len, seed=seed, shuffle=shuffle)
    return TokenDataLoader(source, dataset=dataset, seq_len=seq_len,
                           local_batch_size=local_batch_size, dp_rank=dp_rank, dp_degree=dp_degree)
