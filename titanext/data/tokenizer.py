"""Tokenizers: the built-in byte-level one, and Hugging Face ``tokenizer.json`` files.

``"byte"``: UTF-8 bytes are ids 0..255, plus BOS (256) and EOS (257). It needs no vocabulary
files, round-trips any text exactly, and keeps the debug model's embedding tiny (258 rows),
which is what a CPU-runnable reference stack wants.

``"hf"``: :class:`~titanext.data.hf_tokenizer.HFTokenizer` reads ``tokenizer.json`` from
``[model] hf_assets_path`` with the ``tokenizers`` library (no ``transformers`` needed); BOS
and EOS come from ``tokenizer_config.json`` or, failing that, from the tokenizer's special
tokens.

>>> tok = build_tokenizer("byte")
>>> ids = tok.encode("héllo", bos=True, eos=True)
>>> ids[0], ids[-1], len(ids)  # 'é' is two UTF-8 bytes
(256, 257, 8)
>>> tok.decode(ids)
'héllo'
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the config builds a tokenizer to check its vocabulary; keep that torch-free
    import torch

from titanext.data.hf_tokenizer import HFTokenizer
from titanext.errors import ConfigError

__all__ = ["TOKENIZERS", "ByteTokenizer", "build_tokenizer"]


class ByteTokenizer:
    """Maps text to its UTF-8 bytes (ids 0..255); 256 and 257 are the BOS and EOS markers.

    >>> tok = ByteTokenizer()
    >>> tok.encode("hi", eos=True)
    [104, 105, 257]
    >>> tok.decode([104, 105, 257])
    'hi'
    """

    bos_id: int = 256
    eos_id: int = 257
    vocab_size: int = 258

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """The ids of ``text``: its UTF-8 bytes, optionally framed by BOS and/or EOS.

        >>> ByteTokenizer().encode("a", bos=True)
        [256, 97]
        """
        ids = list(text.encode("utf-8"))
        if bos:
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int] | torch.Tensor) -> str:
        """The text of ``ids``. Special ids are dropped, and byte sequences that are not valid
        UTF-8 (e.g. a window cut inside a multi-byte character) become U+FFFD instead of raising,
        because decoding is used for logging samples, where a crash helps nobody.

        >>> ByteTokenizer().decode([256, 0xC3, 0xA9, 257])
        'é'
        >>> ByteTokenizer().decode([0xC3])  # half of a 2-byte character
        '\ufffd'
        """
        if hasattr(ids, "flatten"):  # a tensor: one conversion, not one per element
            ids = ids.flatten().tolist()
        data = bytes(i for i in map(int, ids) if 0 <= i < 256)
        return data.decode("utf-8", errors="replace")


# Registry of tokenizer names -> classes. `build_tokenizer` is the only lookup, so an unknown
# name fails loudly in one place instead of silently falling back.
TOKENIZERS: dict[str, type] = {"byte": ByteTokenizer, "hf": HFTokenizer}


def build_tokenizer(name: str = "byte", hf_assets_path: str | None = None
                    ) -> ByteTokenizer | HFTokenizer:
    """The tokenizer called ``name`` (the value of ``model.tokenizer``); ``"hf"`` reads
    ``hf_assets_path`` (``[model] hf_assets_path``).

    >>> build_tokenizer().vocab_size
    258
    """
    if name not in TOKENIZERS:
        allowed = ", ".join(repr(n) for n in TOKENIZERS)
        raise ValueError(f"model.tokenizer = {name!r} is not a known tokenizer; allowed: {allowed}")
    if name == "hf":
        if not hf_assets_path:
            raise ConfigError("model.tokenizer = 'hf' needs model.hf_assets_path (a directory "
                              "with tokenizer.json)")
        return HFTokenizer(hf_assets_path)
    return TOKENIZERS[name]()
