"""A byte-level tokenizer: UTF-8 bytes are ids 0..255, plus BOS (256) and EOS (257).

It needs no files, handles any text, and keeps the debug model's vocabulary tiny.

>>> tok = ByteTokenizer()
>>> tok.decode(tok.encode("héllo", bos=True, eos=True))
'héllo'
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["ByteTokenizer", "build_tokenizer"]


class ByteTokenizer:
    bos_id = 256
    eos_id = 257
    vocab_size = 258

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


_TOKENIZERS = {"byte": ByteTokenizer}


def build_tokenizer(name: str = "byte") -> ByteTokenizer:
    if name not in _TOKENIZERS:
        raise ValueError(f"model.tokenizer = {name!r}; allowed: {', '.join(_TOKENIZERS)}")
    return _TOKENIZERS[name]()
