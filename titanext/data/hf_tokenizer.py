"""Hugging Face tokenizer files: ``tokenizer.json`` through the ``tokenizers`` library.

:class:`HFTokenizer` is ``[model] tokenizer = "hf"`` (built by
:func:`titanext.data.tokenizer.build_tokenizer`). Importing this module does not import torch
(the config checks a tokenizer's vocabulary).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

from titanext.errors import ConfigError
from titanext.models.hf_configs import read_json

if TYPE_CHECKING:
    import torch

__all__ = ["HFTokenizer", "TOKENIZER_FILES"]

#: Files of an HF directory that belong to the tokenizer (copied into HF exports when present).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")
# Special tokens tried, in order, when tokenizer_config.json names no BOS / EOS.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<|startoftext|>", "<bos>", "[BOS]")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>", "<|im_end|>", "[EOS]")


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

    >>> tok = HFTokenizer("path/to/hf_dir")    # an HF model directory  # doctest: +SKIP
    >>> tok.decode(tok.encode("To be, or not to be"))   # with it  # doctest: +SKIP
    'To be, or not to be'
    """

    def __init__(self, path: str):
        from tokenizers import Tokenizer  # optional dependency (the tokenizers library)

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
        config = read_json(config_file) if os.path.exists(config_file) else {}
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
