"""JSON-tag calls whose string arguments spell the call closer: the closer inside a JSON string
literal is text of that string, the closer after the body ends the call, unstreamed and at every
split point (markers as single tokens, and spelled in bytes so that every character is a chunk)."""

from __future__ import annotations

from typing import Any

import grammar_walks
import pytest
from frontend_builders import calls, check, harness, json_tags

from helios_core.frontend.formats import ToolCallFormat
from helios_core.frontend.structured import GrammarCompiler
from helios_core.plugin_api import OutputDelta, ToolSpec
from helios_core.testing import FrontendHarness, byte_level_tokenizer

CALL = '<tool_call>{"name": "search", "arguments": {"query": "%s"}}</tool_call>'

CASES: list[tuple[str, str, str | None, list[tuple[str, Any]] | None]] = [
    ("closer in a string argument", CALL % "</tool_call>", None, [("search", {"query": "</tool_call>"})]),
    (
        "escaped quotes around the closer",
        CALL % 'say \\"</tool_call>\\" now',
        None,
        [("search", {"query": 'say "</tool_call>" now'})],
    ),
    (
        "escaped backslash ends the string before the real closer",
        CALL % "a\\\\",
        None,
        [("search", {"query": "a\\"})],
    ),
    (
        "closer and opener in a string",
        CALL % "<tool_call>x</tool_call>",
        None,
        [("search", {"query": "<tool_call>x</tool_call>"})],
    ),
    (
        "closer in a key and in arguments given as a string",
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"</tool_call>\\"}", "</tool_call>": 1}'
        "</tool_call>",
        None,
        [("get_weather", {"city": "</tool_call>"})],
    ),
    (
        "two calls, the first with the closer in a string",
        "Checking.\n" + CALL % "a</tool_call>b" + "\n" + CALL % "rain" + "\nDone.",
        "Checking.Done.",
        [("search", {"query": "a</tool_call>b"}), ("search", {"query": "rain"})],
    ),
    ("plain call unchanged", "Hi.\n" + CALL % "x" + "\nBye.", "Hi.Bye.", [("search", {"query": "x"})]),
    ("invalid body still ends at its closer", '<tool_call>{"name": }</tool_call>', None, None),
    (
        "closer only inside an unterminated string is content",
        '<tool_call>{"name": "search", "arguments": {"query": "</tool_call>',
        '<tool_call>{"name": "search", "arguments": {"query": "</tool_call>',
        [],
    ),
]


def _byte_tokenizer() -> Any:
    """The call markers spelled in bytes: one token per character."""
    return byte_level_tokenizer(["<think>", "</think>"])


@pytest.mark.parametrize("markers", ["tokens", "bytes"])
@pytest.mark.parametrize(("text", "content", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_closer_in_a_json_string(
    tokenizer: Any, markers: str, text: str, content: str | None, expected: list[tuple[str, Any]] | None
) -> None:
    h = harness(tokenizer if markers == "tokens" else _byte_tokenizer(), json_tags())
    if expected is None:  # not a call: the text is content as written
        check(h, text, None, text, [])
    else:
        check(h, text, None, content, expected)


def _fed(h: FrontendHarness, chunks: list[str]) -> list[list[OutputDelta]]:
    """The deltas of each text chunk fed to one pipeline (each chunk tokenized on its own), then of
    the finish."""
    pipeline = h.selected.pipeline(h.vocabulary, tools=h.tools, envelope=h.envelope)
    out = [list(pipeline.feed(h.pieces(h.encode(chunk)))) for chunk in chunks]
    out.append(list(pipeline.finish().deltas))
    return out


def test_a_closer_in_an_open_string_does_not_end_the_call_while_streaming(tokenizer: Any) -> None:
    h = harness(_byte_tokenizer(), json_tags())
    head = '<tool_call>{"name": "search", "arguments": {"query": "a</tool_call>'
    before, after, finish = _fed(h, [head, ' b"}}</tool_call>'])
    assert before == []  # neither content nor a call yet
    assert [(d.name, d.arguments) for delta in after for d in delta.tool_calls] == [
        ("search", ""),
        (None, '{"query": "a</tool_call> b"}'),
    ]
    assert not any(delta.content for delta in after + finish)


def test_a_constrained_call_spelling_the_closer_in_a_string_parses_whole() -> None:
    """The JSON-tag grammar lets a string argument spell the closer in ordinary bytes (never as the
    closer's token); the parser keeps such a call whole."""
    tok = byte_level_tokenizer(["<tool_call>", "</tool_call>", "<|eos|>"])
    open_id, close_id, eos = (tok.token_to_id(t) for t in ("<tool_call>", "</tool_call>", "<|eos|>"))
    note = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    compiler = GrammarCompiler(tok, sampled_size=eos + 1, logits_width=288, eos_token_ids=[eos])
    matcher = compiler.compile(ToolCallFormat.from_syntax([("note", note)], "note", json_tags().tool_syntax)).matcher()
    # the closer's spelling in bytes: "<" and "/tool_call>" encoded apart are not its token
    spelled = ['{"name": "note", "arguments": {"text": "<', '/tool_call>"}}']
    body = [token for text in spelled for token in tok.encode(text, add_special_tokens=False).ids]
    assert close_id not in body
    ids = [open_id, *body, close_id]
    for token in ids:
        assert token in grammar_walks.allowed(matcher.mask(), eos + 1)
        matcher.advance(token)
    assert matcher.is_accepting
    result = FrontendHarness(tok, json_tags(), tools=[ToolSpec("note", note)]).run_tokens([ids])
    assert calls(result) == [("note", {"text": "</tool_call>"})]
    assert result.output.content is None and result.finish_reason == "tool_calls"
