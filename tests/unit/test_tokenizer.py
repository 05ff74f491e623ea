"""The byte tokenizer round-trips any text and frames it with BOS/EOS on request."""

from __future__ import annotations

import pytest
import torch

from titanext.data.tokenizer import ByteTokenizer, build_tokenizer

TEXTS = ["", "hello, world", "héllo wörld", "日本語のテキスト", "emoji 🙂 and tabs\t\n", "\x00\x7f"]


def test_special_ids_follow_the_256_bytes():
    tok = ByteTokenizer()
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (256, 257, 258)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_is_exact_including_non_ascii(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS)
def test_bos_and_eos_frame_the_bytes_and_decode_drops_them(text):
    tok = ByteTokenizer()
    ids = tok.encode(text, bos=True, eos=True)
    assert ids == [256, *text.encode("utf-8"), 257]
    assert tok.encode(text, bos=True) == ids[:-1]
    assert tok.encode(text, eos=True) == ids[1:]
    assert tok.decode(ids) == text


def test_decode_replaces_invalid_utf8_instead_of_raising():
    tok = ByteTokenizer()
    cut = tok.encode("é")[:1]  # a window may end inside a multi-byte character
    assert tok.decode(cut) == "\ufffd"
    assert tok.decode([*tok.encode("a"), 0xFF, *tok.encode("b")]) == "a\ufffdb"


def test_decode_accepts_a_tensor_of_any_shape():
    tok = ByteTokenizer()
    ids = torch.tensor([tok.encode("ab", eos=True), tok.encode("cd", bos=True)])
    assert tok.decode(ids) == "abcd"


def test_build_tokenizer_returns_the_byte_tokenizer_by_default():
    assert isinstance(build_tokenizer(), ByteTokenizer)
    assert isinstance(build_tokenizer("byte"), ByteTokenizer)


def test_unknown_tokenizer_name_is_a_value_error_listing_the_choices():
    with pytest.raises(ValueError, match=r"model\.tokenizer = 'bpe'.*allowed: 'byte'"):
        build_tokenizer("bpe")
