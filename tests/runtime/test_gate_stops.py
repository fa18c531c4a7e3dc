"""A host gate's pieces under string stops: every token's piece comes once, when all of its text is
resolved; the text a stop holds when the model ends (EOS) is released by the finish; tokens a matched
stop swallows whole have no piece, and a token the match cuts keeps its text before the match.

The tokenizer is a small byte-level one built here, so tokens span several characters and a stop can
begin or end inside a token."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models

from helios_core.frontend.detokenizer import TokenBytes
from helios_core.runtime.gates import HostGate, StreamText, ending_ids
from helios_core.runtime.messages import Finished, Piece, PreparedRequest, SamplingParams, TokenEvent

VOCAB = {"The": 0, "Ġcapital": 1, "Ġis": 2, "ĠParis": 3, ".": 4, "Ċ": 5, "Ã": 6, "©": 7, "<|end|>": 8}
"""Byte-level spellings: ``Ġ`` is a space, ``Ċ`` a newline, ``Ã`` and ``©`` the two bytes of ``é``."""
THE, CAPITAL, IS, PARIS, DOT, NEWLINE, E_FIRST, E_SECOND, END = range(9)
ANSWER = [THE, CAPITAL, IS, PARIS, DOT]
"""``The capital is Paris.``"""


def _tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(vocab=VOCAB, merges=[]))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken("<|end|>", special=True)])
    return tokenizer


TOKENIZER = _tokenizer()
TABLES = pytest.mark.parametrize("table", [TokenBytes.from_tokenizer(TOKENIZER), None], ids=["bytes", "decode"])


def _request(stops: list[str], *, ignore_eos: bool = False) -> PreparedRequest:
    return PreparedRequest("r", [THE], 32, SamplingParams(temperature=0.0), ignore_eos=ignore_eos, string_stops=stops)


def _gate(request: PreparedRequest, table: TokenBytes | None) -> HostGate:
    return HostGate(request, TOKENIZER, None, table, ending_ids(request, frozenset({END})))


def _run(gate: HostGate, tokens: list[int]) -> tuple[list[list[Piece]], bool]:
    """Each token's pieces, and whether a stop matched (the tokens after a match are not fed)."""
    pieces = []
    for token in tokens:
        outcome = gate.observe(token)
        pieces.append(outcome.pieces)
        if outcome.stopped:
            return pieces, True
    return pieces, False


def test_the_table_is_a_byte_level_one() -> None:
    assert TokenBytes.from_tokenizer(TOKENIZER) is not None
    assert TOKENIZER.decode(ANSWER) == "The capital is Paris."


@TABLES
@pytest.mark.parametrize("stop", [".\n", "Paris.!", "is Paris.\n", "\n\n"])
def test_text_a_stop_holds_when_the_model_ends_is_released_by_the_finish(stop: str, table: TokenBytes | None) -> None:
    gate = _gate(_request([stop]), table)
    pieces, stopped = _run(gate, [*ANSWER, END])
    assert not stopped
    assert pieces[-1] == [(END, "")]  # the ending id has no text and releases nothing
    released = [piece for token_pieces in pieces for piece in token_pieces] + gate.finish()
    visible = [piece for piece in released if piece[0] != END]
    assert "".join(text for _, text in visible) == "The capital is Paris."
    assert [token for token, _ in visible] == ANSWER  # each token once, in order, with its own text
    assert visible == [(token, TOKENIZER.decode([token])) for token in ANSWER]


@TABLES
def test_a_held_token_comes_with_the_token_that_rules_the_stop_out(table: TokenBytes | None) -> None:
    gate = _gate(_request([".!"]), table)
    pieces, stopped = _run(gate, [PARIS, DOT, IS])
    assert not stopped
    assert pieces == [[(PARIS, " Paris")], [], [(DOT, "."), (IS, " is")]]


@TABLES
def test_tokens_a_matched_stop_swallows_whole_have_no_piece(table: TokenBytes | None) -> None:
    gate = _gate(_request(["\n\n"]), table)
    pieces, stopped = _run(gate, [*ANSWER, NEWLINE, NEWLINE, THE])
    assert stopped
    assert [piece for token_pieces in pieces for piece in token_pieces] == [
        (token, TOKENIZER.decode([token])) for token in ANSWER
    ]
    assert pieces[-2:] == [[], []]
    assert gate.finish() == []


@TABLES
@pytest.mark.parametrize(
    ("stop", "expected"),
    [
        ("s Paris", [(THE, "The"), (CAPITAL, " capital"), (IS, " i")]),  # " Paris" swallowed whole
        ("api", [(THE, "The"), (CAPITAL, " c")]),  # within one token
        ("The", []),  # the first token swallowed
    ],
)
def test_a_token_the_match_cuts_keeps_its_text_before_the_match(
    stop: str, expected: list[Piece], table: TokenBytes | None
) -> None:
    gate = _gate(_request([stop]), table)
    pieces, stopped = _run(gate, ANSWER)
    assert stopped
    assert [piece for token_pieces in pieces for piece in token_pieces] == expected


@TABLES
def test_an_incomplete_character_before_the_end_is_released_alike_with_and_without_a_gate(
    table: TokenBytes | None,
) -> None:
    request = _request(["zzz"])
    gate = _gate(request, table)
    stream = StreamText(TOKENIZER, table, ending_ids(request, frozenset({END})))
    gated, plain = [], []
    for token in [THE, E_FIRST, END]:
        gated.extend(gate.observe(token).pieces)
        plain.extend(stream.token(TokenEvent("r", token, -0.5, ((token, ""),))).pieces)
    gated.extend(gate.finish())
    plain.extend(stream.finished(Finished("r", "stop", 1, 3)).pieces)
    text = "The\ufffd"
    assert "".join(t for token, t in gated if token != END) == text
    assert "".join(t for token, t in plain if token != END) == text
    assert (END, "") in gated and (END, "") in plain


@TABLES
def test_with_ignore_eos_the_end_id_is_text_like_any_other(table: TokenBytes | None) -> None:
    request = _request([".!"], ignore_eos=True)
    gate = _gate(request, table)
    pieces, stopped = _run(gate, [PARIS, DOT, END])
    assert not stopped
    assert pieces == [[(PARIS, " Paris")], [], [(DOT, "."), (END, "<|end|>")]]
