"""In-memory window sources: the built-in corpus packed into one tensor, and synthetic windows.

Both give random access to global window ``g`` (see :mod:`titanext.data` for the global order
contract); the streaming text source lives in :mod:`titanext.data.streaming` and pre-tokenized
shards in :mod:`titanext.data.tokens`.
"""

from __future__ import annotations

import array
from pathlib import Path
from typing import Protocol

import torch

from titanext.data._seed import FILES, SHUFFLE, TABLE, WINDOW, mix_seed

__all__ = ["CORPUS", "FILES", "SHUFFLE", "SyntheticWindows", "TABLE", "TokenWindows",
           "Tokenizer", "WINDOW", "mix_seed", "pack_documents", "shakespeare_documents"]

CORPUS = Path(__file__).resolve().parent.parent / "assets" / "shakespeare.txt"


class Tokenizer(Protocol):
    """What the loader needs from a tokenizer (``components.tokenizer.ByteTokenizer`` fits).

    ``bos_id`` is optional (read with ``getattr``); it only marks document starts for
    document masking.
    """

    eos_id: int
    vocab_size: int

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]: ...


def shakespeare_documents() -> list[str]:
    """The built-in corpus, one document per blank-line-separated block (a speech).

    >>> shakespeare_documents()[0].splitlines()[0]
    'First Citizen:'
    """
    blocks = CORPUS.read_text(encoding="utf-8").split("\n\n")
    return [b for b in blocks if b.strip()]


def pack_documents(docs: list[str], tokenizer: Tokenizer) -> torch.Tensor:
    """One flat token tensor: each document's ids followed by EOS.

    Stored as int16 when the vocabulary fits (byte tokens do), int32 otherwise, to keep a big
    corpus small in memory; windows are widened to ``torch.long`` only when batched.

    >>> from titanext.data.tokenizer import ByteTokenizer
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
            gen = torch.Generator().manual_seed(mix_seed(SHUFFLE, self.seed, epoch))
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
        gen = torch.Generator().manual_seed(mix_seed(TABLE, seed))
        table = torch.randint(0, vocab_size, (vocab_size, branching), generator=gen)
        self._successors = table.tolist()  # lists: the chain walk below is plain Python
        self._branching = branching

    def _window(self, g: int) -> list[int]:
        gen = torch.Generator().manual_seed(mix_seed(WINDOW, self.seed, g))
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
