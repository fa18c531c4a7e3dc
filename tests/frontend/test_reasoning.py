"""Think-tag and recipient-header reasoning: token-versus-text delimiters, initial state from the
open envelope, dropped later closers, terminal markers and opaque structured answers."""

from __future__ import annotations

from typing import Any

import pytest
from frontend_builders import base, calls, check, function_tags, harness, recipient_header, think

from helios_core.plugin_api import EnvelopeState
from helios_core.testing import FrontendHarness, byte_level_tokenizer
from helios_core.wire import contract_pb2 as ct


def plain_think() -> ct.FrontendContract:
    return think(base(ct.TOOL_PARSER_NONE))


@pytest.mark.parametrize(
    ("text", "reasoning", "content"),
    [
        ("<think>\nabc\n</think>\n\nanswer", "abc", "answer"),
        ("<think></think>answer", None, "answer"),
        ("no reasoning here", None, "no reasoning here"),
        ("\n<think>\nx\n</think>y", "x", "y"),
        ("<think>truncated", "truncated", None),
        ("<think>a</think>b</think>c", "a", "bc"),  # a later close token is dropped markup
        ("", None, None),
    ],
)
def test_think_tags(tokenizer: Any, text: str, reasoning: str | None, content: str | None) -> None:
    check(harness(tokenizer, plain_think()), text, reasoning, content, [])


def test_initially_reasoning_from_the_open_envelope(tokenizer: Any) -> None:
    h = harness(tokenizer, plain_think(), envelope=EnvelopeState(initially_reasoning=True))
    check(h, "\nthinking\n</think>\n\nanswer", "thinking", "answer", [])


def test_plain_text_spelling_of_a_single_token_delimiter_is_text(tokenizer: Any) -> None:
    h = harness(tokenizer, plain_think(), envelope=EnvelopeState(initially_reasoning=True))
    spelled = [t for ch in "</think>" for t in h.encode(ch)]  # eight byte tokens, not the token
    pieces = h.encode("a") + spelled + h.encode("b") + h.encode("</think>") + h.encode("c")
    result = h.run_tokens([pieces])
    assert (result.output.reasoning, result.output.content) == ("a</think>b", "c")


def test_later_close_token_dropped_but_later_close_text_kept(tokenizer: Any) -> None:
    h = harness(tokenizer, plain_think())
    spelled = [t for ch in "</think>" for t in h.encode(ch)]
    ids = h.encode("<think>r</think>x") + h.encode("</think>") + spelled + h.encode("y")
    result = h.run_tokens([ids])
    assert (result.output.reasoning, result.output.content) == ("r", "x</think>y")


def test_multi_token_delimiters_match_text_across_chunks() -> None:
    tokenizer = byte_level_tokenizer([])  # <think> is several tokens: delimits as text
    h = FrontendHarness(tokenizer, plain_think())
    check(h, "<think>\nr\n</think>\n\nanswer </think>", "r", "answer </think>", [])


def test_structured_answer_is_opaque(tokenizer: Any) -> None:
    h = harness(tokenizer, function_tags(), structured_answer=True)
    text = '<think>r</think>{"a": "<tool_call><function=search></function></tool_call></think>"}'
    result = h.check_split_invariance(text)
    assert result.output.reasoning == "r"
    assert result.output.content == '{"a": "<tool_call><function=search></function></tool_call></think>"}'
    assert result.output.tool_calls == []


def test_tool_opener_inside_reasoning_ends_it_only_as_terminal(tokenizer: Any) -> None:
    h = harness(tokenizer, function_tags())
    text = "<think>call <tool_call>\n<function=search>\n<parameter=query>\nq\n</parameter>\n</function>\n</tool_call>"
    check(h, text, "call ", None, [("search", {"query": "q"})])


S, M, E, EOM = "<|start|>", "<|message|>", "<|end|>", "<|eom|>"
OPEN = EnvelopeState(open_header="assistant")


def _call(name: str, body: str, recipient: str = "functions") -> str:
    return (
        f'{S}assistant to={recipient}{M}<atem:function_calls><atem:invoke name="{name}">{body}'
        f"</atem:invoke></atem:function_calls>{EOM}"
    )


@pytest.mark.parametrize(
    ("text", "reasoning", "content", "expected"),
    [
        (
            f" to=self{M}Think about <atem:function_calls>.{E}{S}assistant to=user{M}Hello.{E}",
            "Think about <atem:function_calls>.",
            "Hello.",
            [],
        ),
        (
            f" to=self{M}Need two.{EOM}"
            + _call(
                "get_weather",
                '<atem:parameter name="city">Dallas</atem:parameter><atem:parameter name="days">3</atem:parameter>',
            )
            + _call("search", '<atem:parameter name="query">x</atem:parameter>', "functions.search"),
            "Need two.",
            None,
            [("get_weather", {"city": "Dallas", "days": 3}), ("search", {"query": "x"})],
        ),
        (
            f" to=commentary{M}Checking.{EOM}"
            + _call("get_weather.*", '<atem:parameter name="tags">[1]</atem:parameter>'),
            None,
            "Checking.",
            [("get_weather", {"tags": [1]})],
        ),
        (
            f' to=functions.search{M}<atem:function_calls><atem:invoke name="get_weather"></atem:invoke>'
            f"</atem:function_calls>{EOM}",
            None,
            '<atem:function_calls><atem:invoke name="get_weather"></atem:invoke></atem:function_calls>',
            [],
        ),
        (f" to=user{M}literal <|message|> text{E}", None, "literal <|message|> text", []),
        (
            f' to=functions{M}<atem:function_calls><atem:invoke name="search"><atem:parameter name="query">tru',
            None,
            None,
            [("search", {"query": "tru"})],
        ),
    ],
)
def test_recipient_header_frames(
    tokenizer: Any, text: str, reasoning: str | None, content: str | None, expected: list[Any]
) -> None:
    h = harness(tokenizer, recipient_header(), envelope=OPEN)
    if "literal <|message|>" in text:  # spell the control as plain text inside the body
        ids = h.encode(f" to=user{M}literal ") + [t for ch in M for t in h.encode(ch)] + h.encode(f" text{E}")
        result = h.run_tokens([ids])
        assert (result.output.reasoning, result.output.content) == (reasoning, content)
        return
    check(h, text, reasoning, content, expected)


def test_recipient_header_starting_inside_reasoning_body(tokenizer: Any) -> None:
    h = harness(tokenizer, recipient_header(), envelope=EnvelopeState(open_recipient="self"))
    result = h.check_split_invariance(f"more thought{E}{S}assistant to=user{M}done{E}")
    assert (result.output.reasoning, result.output.content, calls(result)) == ("more thought", "done", [])


def test_recipient_header_controls_must_be_tokens() -> None:
    from helios_core.errors import StartupError

    with pytest.raises(StartupError, match="must be one token"):
        FrontendHarness(byte_level_tokenizer([]), recipient_header())
