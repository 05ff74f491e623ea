"""Old path of :mod:`titanext.components.tokenizer` (re-exports only)."""

from titanext.components.tokenizer import (
    TOKENIZER_FILES,
    TOKENIZERS,
    ByteTokenizer,
    HFTokenizer,
    build_tokenizer,
)

__all__ = ["build_tokenizer", "ByteTokenizer", "HFTokenizer", "TOKENIZER_FILES", "TOKENIZERS"]
