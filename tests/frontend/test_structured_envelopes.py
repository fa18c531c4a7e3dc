"""Structured output inside the think-tag reasoning envelope: random walks over the grammar mask may
reason first (or start inside reasoning) and always end in a valid answer, which the real output
pipeline parses as reasoning plus a JSON document (response_format) or exactly one tool call."""

from __future__ import annotations

import json
from typing import Any

import frontend_builders as builders
import grammar_walks
import numpy as np
import pytest
from frontend_builders import json_tags

from helios_core.frontend.formats import (
    ResponseFormat,
    ToolCallFormat,
    envelope_reasoning,
    parse_prepared_format,
    prepared_format_json,
    read_prepared_format,
)
from helios_core.frontend.structured import GrammarCompiler, GrammarMatcher
from helios_core.plugin_api import EnvelopeState, ToolSpec
from helios_core.testing import FrontendHarness, byte_level_tokenizer

MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<|eos|>"]
THINK, UNTHINK, CALL, UNCALL, EOS = 256, 257, 258, 259, 260
SAMPLED = 261
WIDTH = 288
MAX_STEPS = 600
WALKS = 30

ANSWER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[a-z</>]{0,10}$"},
        "days": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ADD: dict[str, Any] = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a"],
    "additionalProperties": False,
}
ECHO: dict[str, Any] = {"type": "object", "properties": {"s": {"enum": ["x", "y"]}}, "additionalProperties": False}
TOOLS = [("add", ADD), ("echo", ECHO)]


def valid_answer(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"city", "days"}
        and isinstance(value["city"], str)
        and len(value["city"]) <= 10
        and all(c in "abcdefghijklmnopqrstuvwxyz</>" for c in value["city"])
        and type(value["days"]) is int
        and 0 <= value["days"] <= 9
    )


def valid_call(name: str, arguments: Any) -> bool:
    if name == "add":
        return isinstance(arguments, dict) and set(arguments) == {"a"} and type(arguments["a"]) is int
    return isinstance(arguments, dict) and set(arguments) <= {"s"} and arguments.get("s", "x") in ("x", "y")


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    tok = byte_level_tokenizer(MARKERS)
    assert [tok.token_to_id(t) for t in MARKERS] == [THINK, UNTHINK, CALL, UNCALL, EOS]
    return tok


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, sampled_size=SAMPLED, logits_width=WIDTH, eos_token_ids=[EOS])


FRONTEND = json_tags()  # with_think_tags(json_tags(), terminal=True)
REASONING = envelope_reasoning(FRONTEND)
SCHEMA = ResponseFormat(kind="json_schema", schema=ANSWER, name="answer")


def tool_format(choice: str | None = None) -> ToolCallFormat:
    return ToolCallFormat.from_syntax(TOOLS, choice, FRONTEND.tool_syntax)


def allowed(mask: np.ndarray) -> np.ndarray:
    return grammar_walks.allowed(mask, SAMPLED)


def walk(matcher: GrammarMatcher, seed: int, forced: list[int] | None = None) -> list[int]:
    """Sample among allowed ids until EOS; markers and EOS are favoured so reasoning ends (bounded walks)."""
    return grammar_walks.biased_walk(
        matcher, seed, eos=EOS, sampled=SAMPLED, favoured={THINK, UNTHINK, EOS}, max_steps=MAX_STEPS,
        forced=forced or (),
    )  # fmt: skip


def harness(tokenizer: Any, *, initially: bool, structured: bool) -> FrontendHarness:
    tools = [ToolSpec(name, schema) for name, schema in TOOLS]
    return builders.harness(tokenizer, json_tags(), tools=tools, envelope=EnvelopeState(initially_reasoning=initially),
                            structured_answer=structured)  # fmt: skip


@pytest.mark.parametrize("initially", [False, True])
def test_schema_walks_reason_then_answer_valid_json(compiler: GrammarCompiler, tokenizer: Any, initially: bool) -> None:
    grammar = compiler.compile(SCHEMA, reasoning=REASONING, initially_reasoning=initially)
    reasoned = 0
    for seed in range(WALKS):
        matcher = grammar.matcher()
        first = allowed(matcher.mask())
        assert (THINK in first) is (not initially)
        if initially:
            assert UNTHINK in first
        ids = walk(matcher, seed)
        result = harness(tokenizer, initially=initially, structured=True).run_tokens([ids])
        assert result.finish_reason == "stop" and not result.output.tool_calls
        assert valid_answer(json.loads(result.output.content or "")), result.output.content
        reasoned += result.output.reasoning is not None
    assert reasoned  # walks do reason before answering


@pytest.mark.parametrize("initially", [False, True])
def test_required_walks_reason_then_call_once(compiler: GrammarCompiler, tokenizer: Any, initially: bool) -> None:
    grammar = compiler.compile(tool_format(), reasoning=REASONING, initially_reasoning=initially)
    names = set()
    for seed in range(WALKS):
        ids = walk(grammar.matcher(), seed)
        assert ids.count(CALL) == 1 and ids[-1] == UNCALL
        result = harness(tokenizer, initially=initially, structured=False).run_tokens([ids])
        assert result.finish_reason == "tool_calls"
        assert not (result.output.content or "").strip()
        ((name, arguments),) = [(c.name, json.loads(c.arguments)) for c in result.output.tool_calls]
        assert valid_call(name, arguments), (name, arguments)
        names.add(name)
    assert names == {"add", "echo"}


def test_reasoning_text_never_spells_the_close_or_terminal_marker(compiler: GrammarCompiler, tokenizer: Any) -> None:
    matcher = compiler.compile(SCHEMA, reasoning=REASONING, initially_reasoning=True).matcher()
    for token in tokenizer.encode("a </think", add_special_tokens=False).ids:
        matcher.advance(token)
    assert tokenizer.token_to_id(">") not in allowed(matcher.mask())
    assert CALL not in allowed(matcher.mask())


def test_a_literal_close_tag_in_a_json_string_stays_answer_text(compiler: GrammarCompiler, tokenizer: Any) -> None:
    spelled = (
        tokenizer.encode("<", add_special_tokens=False).ids + tokenizer.encode("/think>", add_special_tokens=False).ids
    )
    forced = [THINK, *tokenizer.encode("hm", add_special_tokens=False).ids, UNTHINK]
    forced += tokenizer.encode('{"city": "', add_special_tokens=False).ids + spelled
    ids = walk(compiler.compile(SCHEMA, reasoning=REASONING).matcher(), 7, forced)
    result = harness(tokenizer, initially=False, structured=True).run_tokens([ids])
    assert result.output.reasoning is not None and "hm" in result.output.reasoning
    answer = json.loads(result.output.content or "")
    assert valid_answer(answer) and answer["city"].startswith("</think>")


def test_the_envelope_travels_in_the_prepared_json(compiler: GrammarCompiler) -> None:
    text = prepared_format_json(json.loads(tool_format("add").to_json()), REASONING, initially_reasoning=True)
    fmt, reasoning, initially, frames = read_prepared_format(text)
    assert fmt == tool_format("add") and parse_prepared_format(text) == fmt and frames is None
    assert reasoning is not None and (reasoning.open, reasoning.close, initially) == ("<think>", "</think>", True)
    plain = prepared_format_json({"type": "json_object"}, None)
    expected = ResponseFormat(kind="json_object", schema={"type": "object"})
    assert read_prepared_format(plain) == (expected, None, False, None)


def test_without_reasoning_the_answer_starts_at_once(compiler: GrammarCompiler) -> None:
    matcher = compiler.compile(tool_format()).matcher()
    assert allowed(matcher.mask()).tolist() == [CALL]
