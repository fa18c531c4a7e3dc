"""Incremental detokenization equals whole decoding and never splits a UTF-8 character."""

from __future__ import annotations

import pytest
from ignition.recipes.synthetic import byte_level_tokenizer
from tokenizers import Tokenizer

from helios_core.frontend.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_str(byte_level_tokenizer().json)


@pytest.mark.parametrize("text", ["plain ascii", "café ☕ 日本語 🎉", "<|im_start|>user\nhé<|im_end|>", "ab\n\n  c"])
def test_pieces_concatenate_to_the_whole_decoding(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(i) for i in ids]
    assert "".join(pieces) + detok.flush() == tokenizer.decode(ids, skip_special_tokens=False) == text
    assert all("\ufffd" not in piece for piece in pieces)


def test_a_multibyte_character_is_withheld_until_complete(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("é", add_special_tokens=False).ids
    assert len(ids) == 2  # byte-level: two bytes, two tokens
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(ids[0]) == ""
    assert detok.push(ids[1]) == "é"
    assert detok.flush() == ""


def test_a_truncated_character_flushes_as_a_replacement(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("日", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(ids[0]) == ""
    assert detok.flush() == "\ufffd"
