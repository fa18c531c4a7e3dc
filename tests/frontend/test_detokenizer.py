"""Incremental detokenization equals whole decoding and never splits a UTF-8 character."""

from __future__ import annotations

import pytest
from ignition.recipes.synthetic import byte_level_tokenizer
from tokenizers import Tokenizer

from helios_core.frontend.detokenizer import IncrementalDetokenizer, TokenBytes


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


def test_the_byte_table_gives_the_tokenizers_text_for_any_ids(tokenizer: Tokenizer) -> None:
    """Random ids (invalid and truncated UTF-8 included): the table path's pieces, the window path's
    pieces and the tokenizer's whole decoding agree."""
    import random

    table = TokenBytes.from_tokenizer(tokenizer)
    assert table is not None and len(table) == tokenizer.get_vocab_size(with_added_tokens=True)
    rng = random.Random(7)
    for _ in range(400):
        ids = [rng.randrange(len(table)) for _ in range(rng.randrange(1, 30))]
        fast, window = IncrementalDetokenizer(tokenizer, table), IncrementalDetokenizer(tokenizer)
        fast_text = "".join(fast.push(i) for i in ids) + fast.flush()
        window_text = "".join(window.push(i) for i in ids) + window.flush()
        assert fast_text == window_text == tokenizer.decode(ids, skip_special_tokens=False), ids


def test_the_byte_table_pieces_are_an_incremental_decode_of_the_bytes(tokenizer: Tokenizer) -> None:
    """Piece by piece, the precomputed texts equal decoding each token's bytes incrementally, also where a
    token of whole characters follows an unfinished character (which then decodes as a replacement)."""
    import codecs
    import random

    table = TokenBytes.from_tokenizer(tokenizer)
    assert table is not None
    partial = tokenizer.encode("日", add_special_tokens=False).ids[0]
    whole = tokenizer.encode("a", add_special_tokens=False).ids[0]
    rng = random.Random(11)
    cases = [[partial, whole, whole], [whole, partial, partial, whole]]
    cases += [[rng.randrange(len(table)) for _ in range(rng.randrange(1, 30))] for _ in range(300)]
    for ids in cases:
        utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        expected = [utf8.decode(table[i]) for i in ids]
        detok = IncrementalDetokenizer(tokenizer, table)
        assert [detok.push(i) for i in ids] == expected, ids
        assert detok.flush() == utf8.decode(b"", final=True)
    detok = IncrementalDetokenizer(tokenizer, table)
    assert [detok.push(partial), detok.push(whole)] == ["", "\ufffda"]


def test_the_byte_table_withholds_a_partial_character(tokenizer: Tokenizer) -> None:
    table = TokenBytes.from_tokenizer(tokenizer)
    ids = tokenizer.encode("日", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tokenizer, table)
    assert [detok.push(i) for i in ids] == ["", "", "日"] and detok.flush() == ""
    detok = IncrementalDetokenizer(tokenizer, table)
    assert detok.push(ids[0]) == "" and detok.flush() == "\ufffd"


def test_other_decoders_have_no_byte_table() -> None:
    from tokenizers import decoders, models

    word_level = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    word_level.decoder = decoders.WordPiece()
    assert TokenBytes.from_tokenizer(word_level) is None
