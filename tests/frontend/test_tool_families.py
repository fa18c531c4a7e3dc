"""Real-format outputs of every tool syntax family, each paired with think-tag reasoning: exact
results, and the same result at every split point of the output."""

from __future__ import annotations

from typing import Any

import pytest
from frontend_builders import DSML_MARK, argument_tags, calls, check, dsml, function_tags, harness, json_tags, xtml

from helios_core.plugin_api import EnvelopeState
from helios_core.testing import GeneratedPiece

W = {"city": "Dallas", "days": 3}

FUNCTION_TAG_CASES: list[tuple[str, str, str | None, str | None, list[tuple[str, Any]]]] = [
    (
        "two calls after reasoning",
        "<think>\nThe user wants weather.\n</think>\n\nLet me check.\n\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nDallas\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=search>\n<parameter=query>\nrain\n</parameter>\n</function>\n</tool_call>",
        "The user wants weather.",
        "Let me check.",
        [("get_weather", W), ("search", {"query": "rain"})],
    ),
    (
        "no newlines, spaces kept, typed values",
        "<tool_call><function=get_weather><parameter=city>  a  </parameter><parameter=metric>True</parameter>"
        "<parameter=tags>['x', 'y']</parameter><parameter=limit>null</parameter><parameter=extra>7</parameter>"
        "</function></tool_call>",
        None,
        None,
        [("get_weather", {"city": "  a  ", "metric": True, "tags": ["x", "y"], "limit": None, "extra": "7"})],
    ),
    (
        "missing parameter closer",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nDallas\n<parameter=days>\n3\n</function>\n</tool_call>",
        None,
        None,
        [("get_weather", W)],
    ),
    (
        "bad integer kept as text, string null kept",
        "<tool_call>\n<function=get_weather>\n<parameter=days>\nsoon\n</parameter>\n<parameter=city>\nnull\n"
        "</parameter>\n</function>\n</tool_call>",
        None,
        None,
        [("get_weather", {"days": "soon", "city": "null"})],
    ),
    (
        "unclosed name is content",
        "Hi <tool_call>\n<function=get_weather\n<parameter=city>x",
        None,
        "Hi <tool_call>\n<function=get_weather\n<parameter=city>x",
        [],
    ),
    ("opener without a function is content", "see <tool_call> here", None, "see <tool_call> here", []),
    (
        "truncated call keeps what it holds",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nDal",
        None,
        None,
        [("get_weather", {"city": "Dal"})],
    ),
    (
        "a value cut off inside its closer keeps the value alone",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nDallas\n</parameter>\n<parameter=days>\n3\n</param",
        None,
        None,
        [("get_weather", W)],
    ),
    (
        "reasoning mentions tool markup as text",
        "<think>I could write <function=search> or a <tool_call text.</think>Answer.",
        "I could write <function=search> or a <tool_call text.",
        "Answer.",
        [],
    ),
    (
        "bare function without opener is content",
        "<function=search><parameter=query>x</parameter></function>",
        None,
        "<function=search><parameter=query>x</parameter></function>",
        [],
    ),
    (
        "repeated parameter: first wins; text after a call is content",
        "<tool_call><function=search><parameter=query>a</parameter><parameter=query>b</parameter></function>"
        "</tool_call>\n\nDone.",
        None,
        "Done.",
        [("search", {"query": "a"})],
    ),
]


@pytest.mark.parametrize(
    ("text", "reasoning", "content", "expected"),
    [c[1:] for c in FUNCTION_TAG_CASES],
    ids=[c[0] for c in FUNCTION_TAG_CASES],
)
def test_function_tags(
    tokenizer: Any, text: str, reasoning: str | None, content: str | None, expected: list[tuple[str, Any]]
) -> None:
    check(harness(tokenizer, function_tags()), text, reasoning, content, expected)


def test_function_tags_terminal_marker_ends_reasoning(tokenizer: Any) -> None:
    h = harness(tokenizer, function_tags(), envelope=EnvelopeState(initially_reasoning=True))
    text = (
        "\nI will call it.\n<tool_call>\n<function=search>\n<parameter=query>\nx\n</parameter>\n</function>\n"
        "</tool_call>"
    )
    check(h, text, "I will call it.", None, [("search", {"query": "x"})])


ARGUMENT_TAG_CASES: list[tuple[str, str, str | None, str | None, list[tuple[str, Any]]]] = [
    (
        "two calls",
        "<think>Need weather.</think>\nSure.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Dallas"
        "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n<tool_call>search\n"
        "<arg_key>query</arg_key>\n<arg_value> rain </arg_value>\n</tool_call>",
        "Need weather.",
        "Sure.",
        [("get_weather", W), ("search", {"query": " rain "})],
    ),
    (
        "no separator after the name, zero-argument call",
        "<tool_call>get_weather<arg_key>tags</arg_key><arg_value>[1, 2]</arg_value></tool_call>"
        "<tool_call>search\n</tool_call>",
        None,
        None,
        [("get_weather", {"tags": [1, 2]}), ("search", {})],
    ),
    (
        "missing value opener",
        "<tool_call>get_weather\n<arg_key>days</arg_key>\n4</arg_value>\n</tool_call>",
        None,
        None,
        [("get_weather", {"days": 4})],
    ),
    (
        "string-typed values stay text",
        "<tool_call>search\n<arg_key>query</arg_key><arg_value>null</arg_value></tool_call>",
        None,
        None,
        [("search", {"query": "null"})],
    ),
    (
        "a value cut off inside its closer keeps the value alone",
        "<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>ab</arg_va",
        None,
        None,
        [("search", {"query": "ab"})],
    ),
    ("unclosed block without a name is content", "Hi <tool_call>", None, "Hi <tool_call>", []),
    (
        "name with spaces is content",
        "<tool_call>not a name\n</tool_call>",
        None,
        "<tool_call>not a name\n</tool_call>",
        [],
    ),
]


@pytest.mark.parametrize(
    ("text", "reasoning", "content", "expected"),
    [c[1:] for c in ARGUMENT_TAG_CASES],
    ids=[c[0] for c in ARGUMENT_TAG_CASES],
)
def test_argument_tags(
    tokenizer: Any, text: str, reasoning: str | None, content: str | None, expected: list[tuple[str, Any]]
) -> None:
    check(harness(tokenizer, argument_tags()), text, reasoning, content, expected)


M = DSML_MARK
DSML_CASES: list[tuple[str, str, str | None, str | None, list[tuple[str, Any]]]] = [
    (
        "parallel invokes",
        f'<think>Two lookups.</think>Checking.\n\n<{M}function_calls>\n<{M}invoke name="get_weather">\n'
        f'<{M}parameter name="city" string="true">Dallas</{M}parameter>\n<{M}parameter name="days" '
        f'string="false">3</{M}parameter>\n</{M}invoke>\n<{M}invoke name="search">\n<{M}parameter name="query" '
        f'string="true"> a b </{M}parameter>\n</{M}invoke>\n</{M}function_calls>',
        "Two lookups.",
        "Checking.",
        [("get_weather", W), ("search", {"query": " a b "})],
    ),
    (
        "empty invoke, JSON object value",
        f'<{M}function_calls>\n<{M}invoke name="search">\n\n</{M}invoke>\n<{M}invoke name="get_weather">\n'
        f'<{M}parameter name="tags" string="false">["a"]</{M}parameter>\n</{M}invoke>\n</{M}function_calls>',
        None,
        None,
        [("search", {}), ("get_weather", {"tags": ["a"]})],
    ),
    ("false prefix is released", "<｜DSM some text", None, "<｜DSM some text", []),
    ("block without invoke is content", f"x <{M}function_calls>\nhello", None, f"x <{M}function_calls>\nhello", []),
]


@pytest.mark.parametrize(
    ("text", "reasoning", "content", "expected"), [c[1:] for c in DSML_CASES], ids=[c[0] for c in DSML_CASES]
)
def test_dsml(
    tokenizer: Any, text: str, reasoning: str | None, content: str | None, expected: list[tuple[str, Any]]
) -> None:
    check(harness(tokenizer, dsml()), text, reasoning, content, expected)


JSON_CASES: list[tuple[str, str, str | None, str | None, list[tuple[str, Any]]]] = [
    (
        "two calls",
        '<think>ok</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Dallas", "days": 3}}'
        '\n</tool_call>\n<tool_call>\n{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}\n</tool_call>',
        "ok",
        None,
        [("get_weather", W), ("search", {"query": "x"})],
    ),
    ("invalid JSON is content", '<tool_call>{"name": }</tool_call>', None, '<tool_call>{"name": }</tool_call>', []),
    ("unclosed block is content", '<tool_call>{"name": "search"', None, '<tool_call>{"name": "search"', []),
]


@pytest.mark.parametrize(
    ("text", "reasoning", "content", "expected"), [c[1:] for c in JSON_CASES], ids=[c[0] for c in JSON_CASES]
)
def test_json_tags(
    tokenizer: Any, text: str, reasoning: str | None, content: str | None, expected: list[tuple[str, Any]]
) -> None:
    check(harness(tokenizer, json_tags()), text, reasoning, content, expected)


OPEN, CLOSE, SEP = "<|open|>", "<|close|>", "<|sep|>"
XTML_CASES: list[tuple[str, str, str | None, str | None, list[tuple[str, Any]]]] = [
    (
        "think, response and tools",
        f"{OPEN}think{SEP}Plan.{CLOSE}think{SEP}{OPEN}response{SEP}Looking.{CLOSE}response{SEP}"
        f'{OPEN}tools{SEP}{OPEN}call tool="get_weather" index="0"{SEP}'
        f'{OPEN}argument key="city" type="string"{SEP}Dallas{CLOSE}argument{SEP}'
        f'{OPEN}argument key="days" type="number"{SEP}3{CLOSE}argument{SEP}{CLOSE}call{SEP}'
        f'{OPEN}call tool="search" index="1"{SEP}{OPEN}argument key="query" type="string"{SEP}a &amp; b'
        f"{CLOSE}argument{SEP}{CLOSE}call{SEP}{CLOSE}tools{SEP}{CLOSE}message{SEP}",
        "Plan.",
        "Looking.",
        [("get_weather", W), ("search", {"query": "a &amp; b"})],
    ),
    (
        "invalid typed value kept as text",
        f'{OPEN}tools{SEP}{OPEN}call tool="get_weather"{SEP}'
        f'{OPEN}argument key="tags" type="array"{SEP}[1,{CLOSE}argument{SEP}'
        f"{CLOSE}call{SEP}{CLOSE}tools{SEP}",
        None,
        None,
        [("get_weather", {"tags": "[1,"})],
    ),
]


@pytest.mark.parametrize(
    ("text", "reasoning", "content", "expected"), [c[1:] for c in XTML_CASES], ids=[c[0] for c in XTML_CASES]
)
def test_xtml(
    tokenizer: Any, text: str, reasoning: str | None, content: str | None, expected: list[tuple[str, Any]]
) -> None:
    check(harness(tokenizer, xtml()), text, reasoning, content, expected)


def test_streamed_fragments_are_incremental_for_strings(tokenizer: Any) -> None:
    h = harness(tokenizer, function_tags())
    text = "<tool_call>\n<function=search>\n<parameter=query>\nlong value\n</parameter>\n</function>\n</tool_call>"
    result = h.run_tokens([[t] for t in h.encode(text)])
    fragments = [d.arguments for delta in result.deltas for d in delta.tool_calls]
    assert fragments[0] == "" and len(fragments) > 5
    assert "".join(fragments) == '{"query": "long value"}'


@pytest.mark.parametrize(
    ("family", "call"),
    [
        (json_tags, '<tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call>'),
        (function_tags, "<tool_call><function=search><parameter=query>x</parameter></function></tool_call>"),
        (argument_tags, "<tool_call>search\n<arg_key>query</arg_key><arg_value>x</arg_value></tool_call>"),
    ],
    ids=["json-tags", "function-tags", "argument-tags"],
)
def test_a_request_offering_no_tools_gets_call_markup_as_content(tokenizer: Any, family: Any, call: str) -> None:
    text = f"Sure.\n{call}\nDone."
    check(harness(tokenizer, family(), tools=()), text, None, text, [])
    check(harness(tokenizer, family()), text, None, "Sure.Done.", [("search", {"query": "x"})])


def test_xtml_framing_is_dropped_when_no_tools_are_offered(tokenizer: Any) -> None:
    framed = f"{OPEN}think{SEP}Plan.{CLOSE}think{SEP}{OPEN}response{SEP}Answer.{CLOSE}response{SEP}{CLOSE}message{SEP}"
    check(harness(tokenizer, xtml(), tools=()), framed, "Plan.", "Answer.", [])
    call = f'{OPEN}tools{SEP}{OPEN}call tool="search"{SEP}{CLOSE}call{SEP}{CLOSE}tools{SEP}'
    check(harness(tokenizer, xtml(), tools=()), f"Hi.{call}{CLOSE}message{SEP}", None, f"Hi.{call}", [])


def test_a_dsml_value_cut_inside_a_closer_character_keeps_the_value_alone(tokenizer: Any) -> None:
    """The output ends inside the first multi-byte character of the parameter closer (``</｜``): the
    detokenizer's final flush writes U+FFFD for its first bytes, which are part of the closer, not the
    value."""
    h = harness(tokenizer, dsml())
    text = f'<{M}function_calls>\n<{M}invoke name="search">\n<{M}parameter name="query" string="true">ab</'
    pieces = [*h.pieces(h.encode(text)), GeneratedPiece(-1, "\ufffd")]
    result = h.run_pieces([pieces])
    assert calls(result) == [("search", {"query": "ab"})]
    plain = text.removesuffix("</")  # a character cut inside the value itself stays in it
    result = h.run_pieces([[*h.pieces(h.encode(plain)), GeneratedPiece(-1, "\ufffd")]])
    assert calls(result) == [("search", {"query": "ab\ufffd"})]
