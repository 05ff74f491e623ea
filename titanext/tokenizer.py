"""Tokenizers: the built-in byte-level one, and Hugging Face ``tokenizer.json`` files.

``"byte"``: UTF-8 bytes are ids 0..255, plus BOS (256) and EOS (257). It needs no vocabulary
files, round-trips any text exactly, and keeps the debug model's embedding tiny (258 rows),
which is what a CPU-runnable reference stack wants.

``"hf"``: :class:`HFTokenizer` reads ``tokenizer.json`` from ``[model] hf_assets_path`` with the
``tokenizers`` library (no ``transformers`` needed); BOS and EOS come from
``tokenizer_config.json`` or, failing that, from the tokenizer's special tokens.

>>> tok = build_tokenizer("byte")
>>> ids = tok.encode("héllo", bos=True, eos=True)
>>> ids[0], ids[-1], len(ids)  # 'é' is two UTF-8 bytes
(256, 257, 8)
>>> tok.decode(ids)
'héllo'
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the config builds a tokenizer to check its vocabulary; keep that torch-free
    import torch

from titanext.errors import ConfigError

__all__ = ["TOKENIZERS", "ByteTokenizer", "HFTokenizer", "build_tokenizer", "TOKENIZER_FILES"]

#: Files of an HF directory that belong to the tokenizer (copied into HF exports when present).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")
# Special tokens tried, in order, when tokenizer_config.json names no BOS / EOS.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<|startoftext|>", "<bos>", "[BOS]")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>", "<|im_end|>", "[EOS]")


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


def _read_json(path: str) -> dict:
    """``path`` parsed, or a ConfigError naming the file (missing, unreadable or not JSON)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not valid JSON: expected an object, got "
                          f"{type(data).__name__}")
    return data


def _token_text(value: object) -> str | None:
    """A special token as written in tokenizer_config.json: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (read with the ``tokenizers`` library).

    ``path`` is the directory holding it (``[model] hf_assets_path``) or the file itself. A
    missing or malformed file is a :class:`~titanext.errors.ConfigError` naming it.
    ``vocab_size`` counts added tokens too (the highest id + 1). ``bos_id`` is None for
    tokenizers without a BOS token (Qwen's); ``eos_id`` is required, because documents are
    packed with EOS between them.

    >>> tok = HFTokenizer("tests/assets/tiny_hf")              # doctest: +SKIP
    >>> tok.decode(tok.encode("To be, or not to be"))          # doctest: +SKIP
    'To be, or not to be'
    """

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self.directory = path if os.path.isdir(path) else os.path.dirname(path) or "."
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise ConfigError(f"model.hf_assets_path = {path!r}: {file} does not exist; the "
                              "'hf' tokenizer needs a Hugging Face tokenizer.json there")
        try:
            self._tok = Tokenizer.from_file(file)
        except Exception as e:  # the Rust library raises a bare Exception on a bad file
            raise ConfigError(f"{file} is not a valid tokenizer.json: {e}") from None
        self.file = file
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        config_file = os.path.join(self.directory, "tokenizer_config.json")
        config = _read_json(config_file) if os.path.exists(config_file) else {}
        self.bos_id = self._special_id(config.get("bos_token"), _BOS_NAMES, config_file)
        self.eos_id = self._special_id(config.get("eos_token"), _EOS_NAMES, config_file)
        if self.eos_id is None:
            raise ConfigError(
                f"{file}: no EOS token found (tokenizer_config.json has no eos_token and none of "
                f"{', '.join(_EOS_NAMES)} is a token); add eos_token to {config_file}")

    def _special_id(self, configured: object, fallbacks: tuple[str, ...],
                    config_file: str) -> int | None:
        text = _token_text(configured)
        if text is not None:
            token_id = self._tok.token_to_id(text)
            if token_id is None:
                raise ConfigError(f"{config_file}: special token {text!r} is not in {self.file}")
            return token_id
        for name in fallbacks:
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return token_id
        return None

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """The ids of ``text`` (no template specials), optionally framed by BOS and/or EOS."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int] | torch.Tensor) -> str:
        """The text of ``ids``, special tokens dropped."""
        if hasattr(ids, "flatten"):  # a tensor: one conversion, not one per element
            ids = ids.flatten().tolist()
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def asset_files(self) -> list[str]:
        """The tokenizer files of its directory, to copy next to an exported checkpoint."""
        return [os.path.join(self.directory, f) for f in TOKENIZER_FILES
                if os.path.isfile(os.path.join(self.directory, f))]


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
