"""Constrained tool calls (tool_choice 'required' / named): random walks over the grammar mask always
yield exactly one JSON-tag call, of an allowed tool, whose arguments satisfy that tool's schema."""

from __future__ import annotations

import json
from typing import Any

import grammar_walks
import numpy as np
import pytest
from frontend_builders import base, json_tags

from helios_core.frontend.bootstrap import PromptError
from helios_core.frontend.formats import ResponseFormat, ToolCallFormat, parse_prepared_format, parse_response_format
from helios_core.frontend.structured import GrammarCompiler
from helios_core.plugin_api import ToolSpec
from helios_core.testing import FrontendHarness, byte_level_tokenizer

OPEN, CLOSE, EOS = 256, 257, 258  # <tool_call>, </tool_call>, <|eos|> after the 256 byte tokens
SAMPLED = 259
WIDTH = 288
MAX_STEPS = 400
WALKS = 40

WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Za-z ]{1,8}$"},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city"],
    "additionalProperties": False,
}
ADD: dict[str, Any] = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": -5, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 9},
        "exact": {"type": "boolean"},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [("get_weather", WEATHER), ("add", ADD)]


def valid(name: str, arguments: Any) -> bool:
    """A hand-written check of the two schemas above (no jsonschema dependency)."""
    if not isinstance(arguments, dict):
        return False
    if name == "get_weather":
        city, unit = arguments.get("city"), arguments.get("unit", "c")
        return (
            set(arguments) <= {"city", "unit"}
            and isinstance(city, str)
            and 1 <= len(city) <= 8
            and all(c.isascii() and (c.isalpha() or c == " ") for c in city)
            and unit in ("c", "f")
        )
    a, b = arguments.get("a"), arguments.get("b")
    return (
        set(arguments) <= {"a", "b", "exact"}
        and type(a) is int
        and -5 <= a <= 99
        and type(b) is int
        and 0 <= b <= 9
        and isinstance(arguments.get("exact", True), bool)
    )


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    tok = byte_level_tokenizer(["<tool_call>", "</tool_call>", "<|eos|>"])
    assert [tok.token_to_id(t) for t in ("<tool_call>", "</tool_call>", "<|eos|>")] == [OPEN, CLOSE, EOS]
    return tok


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, sampled_size=SAMPLED, logits_width=WIDTH, eos_token_ids=[EOS])


def tool_format(choice: str | None = None) -> ToolCallFormat:
    return ToolCallFormat.from_syntax(TOOLS, choice, json_tags().tool_syntax)


def allowed(mask: np.ndarray) -> np.ndarray:
    return grammar_walks.allowed(mask, SAMPLED)


def walk(compiler: GrammarCompiler, fmt: ToolCallFormat, seed: int) -> list[int]:
    """Sample uniformly among allowed ids until only EOS is allowed; the ids before EOS."""
    matcher = compiler.compile(fmt).matcher()
    return grammar_walks.uniform_walk(matcher, seed, eos=EOS, sampled=SAMPLED, max_steps=MAX_STEPS)


def parsed_calls(tokenizer: Any, ids: list[int]) -> list[tuple[str, Any]]:
    harness = FrontendHarness(tokenizer, json_tags(), tools=[ToolSpec(n, s) for n, s in TOOLS])
    result = harness.run_tokens([ids])
    assert result.finish_reason == "tool_calls"
    assert not (result.output.content or "").strip()
    return [(call.name, json.loads(call.arguments)) for call in result.output.tool_calls]


def test_required_walks_always_yield_one_valid_call(compiler: GrammarCompiler, tokenizer: Any) -> None:
    names = set()
    for seed in range(WALKS):
        ids = walk(compiler, tool_format(), seed)
        assert ids[0] == OPEN and ids[-1] == CLOSE  # the markers as their special tokens
        assert ids.count(OPEN) == 1 and ids.count(CLOSE) == 1
        ((name, arguments),) = parsed_calls(tokenizer, ids)
        assert name in ("get_weather", "add")
        assert valid(name, arguments), (name, arguments)
        names.add(name)
    assert names == {"get_weather", "add"}  # both tools are reachable


def test_named_choice_only_yields_that_function(compiler: GrammarCompiler, tokenizer: Any) -> None:
    for seed in range(WALKS // 2):
        ids = walk(compiler, tool_format("add"), seed)
        ((name, arguments),) = parsed_calls(tokenizer, ids)
        assert name == "add" and valid(name, arguments), arguments


def test_markers_are_matched_as_their_special_tokens(compiler: GrammarCompiler) -> None:
    matcher = compiler.compile(tool_format()).matcher()
    assert allowed(matcher.mask()).tolist() == [OPEN]  # not the byte '<'


def test_a_textual_marker_is_matched_as_text(tokenizer: Any) -> None:
    plain = byte_level_tokenizer(["<|eos|>"])
    compiler = GrammarCompiler(plain, sampled_size=257, logits_width=288, eos_token_ids=[256])
    matcher = compiler.compile(tool_format("add")).matcher()
    assert allowed(matcher.mask()).tolist() == [plain.token_to_id("<")]


def test_the_format_round_trips_through_its_internal_json() -> None:
    fmt = tool_format("get_weather")
    assert parse_prepared_format(fmt.to_json()) == fmt
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    assert isinstance(parse_prepared_format(json.dumps(schema)), ResponseFormat)
    assert parse_prepared_format(json.dumps({"type": "text"})) is None


def test_clients_cannot_send_the_internal_kind() -> None:
    with pytest.raises(PromptError, match=r"response_format\.type"):
        parse_response_format(json.loads(tool_format().to_json()))


def test_unknown_parsers_unknown_names_and_bad_schemas_are_refused(compiler: GrammarCompiler) -> None:
    third_party = base(4242)  # a third-party tool parser identifier: no syntax family Helios can constrain
    with pytest.raises(PromptError, match="not supported for this core's tool syntax"):
        ToolCallFormat.from_syntax(TOOLS, None, third_party.tool_syntax)
    with pytest.raises(PromptError, match="'nope'"):
        ToolCallFormat.from_syntax(TOOLS, "nope", json_tags().tool_syntax)
    with pytest.raises(PromptError, match="at least one tool"):
        ToolCallFormat.from_syntax([], None, json_tags().tool_syntax)
    bad = ToolCallFormat.from_syntax([("f", {"type": "object", "minProperties": "x"})], None, json_tags().tool_syntax)
    with pytest.raises(PromptError):
        compiler.compile(bad)
