"""User stops: validation of stop, stop_token_ids and stop_token_sequences, their compatibility,
and the incremental string and token matchers (every split, overlapping prefixes, multi-byte text,
flush on termination, and property tests against a whole-output oracle)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helios_core.frontend.bootstrap import PromptError
from helios_core.frontend.stops import (
    StopResult,
    StringStopMatcher,
    TokenStopMatcher,
    TokenStopResult,
    check_stop_compatibility,
    parse_string_stops,
    parse_token_stops,
)

# --------------------------------------------------------------------------- oracles


def expected_text(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """Truncate at the first completed stop: earliest end, longest on ties."""
    best: tuple[int, int] | None = None
    for stop in stops:
        index = text.find(stop)
        if index >= 0:
            key = (index + len(stop), index)
            best = key if best is None or key < best else best
    if best is None:
        return text, False
    return text[: best[1]], True


def expected_tokens(ids: Sequence[int], sequences: Sequence[Sequence[int]]) -> tuple[list[int], bool]:
    for end in range(1, len(ids) + 1):
        lengths = [len(s) for s in sequences if len(s) <= end and list(ids[end - len(s) : end]) == list(s)]
        if lengths:
            return list(ids[: end - max(lengths)]), True
    return list(ids), False


def run_text(stops: Sequence[str], pieces: Sequence[str]) -> tuple[str, bool]:
    matcher = StringStopMatcher(stops)
    out: list[str] = []
    for piece in pieces:
        result = matcher.feed(piece)
        out.append(result.visible)
        if result.matched:
            assert matcher.flush() == ""
            return "".join(out), True
    out.append(matcher.flush())
    return "".join(out), False


def run_tokens(sequences: Sequence[Sequence[int]], ids: Sequence[int]) -> tuple[list[int], bool]:
    matcher = TokenStopMatcher(sequences)
    out: list[int] = []
    for token in ids:
        result = matcher.feed(token)
        out.extend(result.released)
        if result.matched:
            assert matcher.flush() == []
            return out, True
    out.extend(matcher.flush())
    return out, False


def all_splits(text: str) -> list[list[str]]:
    """Every way to cut ``text`` into contiguous nonempty pieces."""
    splits = []
    for mask in itertools.product([False, True], repeat=max(len(text) - 1, 0)):
        pieces, start = [], 0
        for position, cut in enumerate(mask, start=1):
            if cut:
                pieces.append(text[start:position])
                start = position
        pieces.append(text[start:])
        splits.append(pieces)
    return splits


# --------------------------------------------------------------------------- string validation


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, ()),
        ([], ()),
        ("x", ("x",)),
        (["a", "bc"], ("a", "bc")),
        (["a", "b", "c", "d"], ("a", "b", "c", "d")),
        (["é" * 2048], ("é" * 2048,)),
    ],
)
def test_string_stops_accepted(value: object, expected: tuple[str, ...]) -> None:
    assert parse_string_stops(value) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("", r"^stop must be a nonempty string$"),
        ([""], r"^stop\[0\] must be a nonempty string$"),
        (["a", ""], r"^stop\[1\] must be a nonempty string$"),
        (["a", "b", "c", "d", "e"], r"^stop accepts at most 4 strings, not 5$"),
        ([1], r"^stop\[0\] must be a string, not int$"),
        (["a", None], r"^stop\[1\] must be a string, not NoneType$"),
        (5, r"^stop must be null, a string or an array of strings, not int$"),
        (("a",), r"^stop must be null, a string or an array of strings, not tuple$"),
        ({"a": 1}, r"^stop must be null, a string or an array of strings, not dict$"),
        (["é" * 2048, "x"], r"^stop totals 4097 UTF-8 bytes; at most 4096 are allowed$"),
        (["a" * 4000, "🙂" * 25], r"^stop totals 4100 UTF-8 bytes; at most 4096 are allowed$"),
        ("x" * 4097, r"^stop totals 4097 UTF-8 bytes; at most 4096 are allowed$"),
    ],
)
def test_string_stops_rejected(value: object, message: str) -> None:
    with pytest.raises(PromptError, match=message):
        parse_string_stops(value)


def test_string_stop_byte_limit_is_exact() -> None:
    assert parse_string_stops(["a" * 4092, "🙂"]) == ("a" * 4092, "🙂")


# --------------------------------------------------------------------------- token validation


def test_token_stops_accepted() -> None:
    assert parse_token_stops(None, None, 10) == ()
    assert parse_token_stops([], [], 10) == ()
    assert parse_token_stops([0, 9], [[1, 2], [3]], 10) == ((0,), (9,), (1, 2), (3,))
    assert parse_token_stops([3, 3], [[3], [1, 2], [1, 2]], 10) == ((3,), (1, 2))


def test_token_stop_limits_are_exact() -> None:
    ids = list(range(16))
    sequences = [[i] * 64 for i in range(16)]
    parsed = parse_token_stops(ids, sequences, 100)
    assert len(parsed) == 32
    assert parsed[16:] == tuple(tuple([i] * 64) for i in range(16))


@pytest.mark.parametrize(
    ("ids", "sequences", "message"),
    [
        (5, None, r"^stop_token_ids must be null or an array of integers, not int$"),
        ((1,), None, r"^stop_token_ids must be null or an array of integers, not tuple$"),
        (list(range(17)), None, r"^stop_token_ids accepts at most 16 IDs, not 17$"),
        ([1, "2"], None, r"^stop_token_ids\[1\] must be an integer token ID, not str$"),
        ([True], None, r"^stop_token_ids\[0\] must be an integer token ID, not bool$"),
        ([1.0], None, r"^stop_token_ids\[0\] must be an integer token ID, not float$"),
        ([-1], None, r"^stop_token_ids\[0\] = -1 lies outside the vocabulary \[0, 10\)$"),
        ([10], None, r"^stop_token_ids\[0\] = 10 lies outside the vocabulary \[0, 10\)$"),
        (None, [1, 2], r"^stop_token_sequences\[0\] must be an array of integers, not int$"),
        (None, "ab", r"^stop_token_sequences must be null or an array of arrays, not str$"),
        (None, [[1]] * 17, r"^stop_token_sequences accepts at most 16 sequences, not 17$"),
        (None, [[1], []], r"^stop_token_sequences\[1\] must not be empty$"),
        (None, [[1] * 65], r"^stop_token_sequences\[0\] has 65 tokens; at most 64 are allowed$"),
        (None, [[1, False]], r"^stop_token_sequences\[0\]\[1\] must be an integer token ID, not bool$"),
        (None, [[1, None]], r"^stop_token_sequences\[0\]\[1\] must be an integer token ID, not NoneType$"),
        (None, [[2], [3, 10]], r"^stop_token_sequences\[1\]\[1\] = 10 lies outside the vocabulary \[0, 10\)$"),
        (None, [[-5]], r"^stop_token_sequences\[0\]\[0\] = -5 lies outside the vocabulary \[0, 10\)$"),
    ],
)
def test_token_stops_rejected(ids: object, sequences: object, message: str) -> None:
    with pytest.raises(PromptError, match=message):
        parse_token_stops(ids, sequences, 10)


@pytest.mark.parametrize("vocab_size", [0, -1, True])
def test_token_stops_need_a_vocabulary(vocab_size: int) -> None:
    with pytest.raises(ValueError, match="vocab_size must be a positive integer"):
        parse_token_stops(None, None, vocab_size)


# --------------------------------------------------------------------------- compatibility


def test_compatibility() -> None:
    check_stop_compatibility((), ((1,),), True)
    check_stop_compatibility(("x",), (), False)
    check_stop_compatibility((), (), True)
    with pytest.raises(PromptError, match=r"^stop cannot be combined with stop_token_ids or stop_token_sequences$"):
        check_stop_compatibility(("x",), ((1,),), False)
    with pytest.raises(PromptError, match=r"^stop cannot be combined with structured output \(response_format\)$"):
        check_stop_compatibility(("x",), (), True)


def test_prompt_error_is_a_request_error() -> None:
    from helios_core.errors import HeliosError

    assert issubclass(PromptError, HeliosError)


# --------------------------------------------------------------------------- string matching


@pytest.mark.parametrize(
    ("stops", "text", "expected"),
    [
        (["ab", "bc"], "xabc", "x"),
        (["bc", "ab"], "xabc", "x"),
        (["ab"], "aab", "a"),
        (["abab"], "ababab", ""),
        (["aab"], "aaab", "a"),
        (["abcd", "bc"], "abcd", "a"),
        (["abc", "bc"], "xabc", "x"),
        (["END"], "helloENDworld", "hello"),
        (["é!"], "caféé!x", "café"),
        (["🙂🙃"], "a🙂🙂🙃b", "a🙂"),
        (["世界"], "你好世界再见", "你好"),
        (["\n\n"], "a\nb\n\nc", "a\nb"),
        (["zz"], "no match here", "no match here"),
    ],
)
def test_string_match_every_split(stops: list[str], text: str, expected: str) -> None:
    oracle = expected_text(text, stops)
    assert oracle[0] == expected
    for pieces in all_splits(text):
        assert run_text(stops, pieces) == oracle, pieces


def test_stop_within_one_piece_removes_suffix() -> None:
    matcher = StringStopMatcher(["STOP"])
    assert matcher.feed("abc") == StopResult("abc", False)
    result = matcher.feed("dSTOPtrailing text")
    assert (result.visible, result.matched) == ("d", True)
    assert matcher.feed("more").visible == ""
    assert matcher.feed("more").matched
    assert matcher.flush() == ""


def test_held_prefix_and_flush() -> None:
    matcher = StringStopMatcher(["abc", "bd"])
    assert matcher.feed("xa").visible == "x"
    assert matcher.held == "a"
    assert matcher.feed("b").visible == ""
    assert matcher.held == "ab"
    result = matcher.feed("x")
    assert (result.visible, result.matched) == ("abx", False)
    assert matcher.held == ""
    assert matcher.feed("ab").visible == ""
    assert matcher.flush() == "ab"
    assert matcher.held == ""


def test_held_tail_is_bounded() -> None:
    matcher = StringStopMatcher(["aaaa", "xy"])
    for _ in range(100):
        result = matcher.feed("a" * 3 + "b")
        assert not result.matched
        assert len(matcher.held) <= 3
    matcher.feed("aaa")
    assert matcher.held == "aaa"
    assert matcher.flush() == "aaa"


def test_empty_pieces_and_no_stops() -> None:
    matcher = StringStopMatcher(["x"])
    assert matcher.feed("").visible == ""
    assert not matcher.feed("").matched
    none = StringStopMatcher([])
    assert none.feed("anything").visible == "anything"
    assert none.flush() == ""


def test_matcher_rejects_empty_stop() -> None:
    with pytest.raises(ValueError, match="nonempty"):
        StringStopMatcher(["a", ""])
    with pytest.raises(ValueError, match="nonempty"):
        TokenStopMatcher([[1], []])


def test_no_match_stream_emits_everything() -> None:
    text = "the quick brown fox jumps over the lazy dog " * 5
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    assert run_text(["dogs", "cat", "the  "], pieces) == (text, False)


def test_matches_envelope_markup() -> None:
    text = "<think>plan</think><tool_call>{}</tool_call>"
    assert run_text(["</think>"], list(text)) == ("<think>plan", True)


# --------------------------------------------------------------------------- token matching


@pytest.mark.parametrize(
    ("sequences", "ids", "expected"),
    [
        ([[1, 2, 3], [2, 4]], [1, 2, 4, 9], ([1], True)),
        ([[1, 2, 3], [2, 4]], [1, 2, 3], ([], True)),
        ([[1, 2, 3], [2, 4]], [1, 2, 5, 2, 4], ([1, 2, 5], True)),
        ([[1, 1, 2]], [1, 1, 1, 2], ([1], True)),
        ([[1, 2, 1, 3]], [1, 2, 1, 2, 1, 3], ([1, 2], True)),
        ([[5]], [1, 2, 5, 6], ([1, 2], True)),
        ([[1, 2], [7]], [1, 7, 2], ([1], True)),
        ([[1, 2, 3]], [1, 2, 1, 2], ([1, 2, 1, 2], False)),
        ([], [1, 2, 3], ([1, 2, 3], False)),
        ([[2, 3], [1, 2, 3]], [0, 1, 2, 3], ([0], True)),
    ],
)
def test_token_matching(sequences: list[list[int]], ids: list[int], expected: tuple[list[int], bool]) -> None:
    assert expected_tokens(ids, sequences) == expected
    assert run_tokens(sequences, ids) == expected


def test_token_buffering_and_release() -> None:
    matcher = TokenStopMatcher([[1, 2, 3], [2, 4]])
    assert matcher.feed(1).released == []
    assert matcher.feed(2).released == []
    assert matcher.held == [1, 2]
    result = matcher.feed(9)
    assert (result.released, result.matched) == ([1, 2, 9], False)
    assert matcher.feed(1).released == []
    assert matcher.flush() == [1]
    result = matcher.feed(2)
    assert (result.released, result.matched) == ([], False)
    result = matcher.feed(4)
    assert (result.released, result.matched) == ([], True)
    assert matcher.matched
    assert matcher.feed(7) == TokenStopResult([], True)


# --------------------------------------------------------------------------- properties

small_text = st.text(alphabet="abcé🙂世", max_size=30)
stop_text = st.text(alphabet="abcé🙂世", min_size=1, max_size=4)


@settings(max_examples=400, deadline=None)
@given(text=small_text, stops=st.lists(stop_text, min_size=1, max_size=4), data=st.data())
def test_string_property(text: str, stops: list[str], data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)))))
    bounds = [0, *cuts, len(text)]
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    assert "".join(pieces) == text
    assert run_text(stops, pieces) == expected_text(text, stops)


@settings(max_examples=400, deadline=None)
@given(
    ids=st.lists(st.integers(0, 3), max_size=40),
    sequences=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=5), min_size=0, max_size=4),
)
def test_token_property(ids: list[int], sequences: list[list[int]]) -> None:
    assert run_tokens(sequences, ids) == expected_tokens(ids, sequences)
