"""Constrained tool calls in the function-tag, argument-tag, DSML, XTML and ATEM (recipient-header frame)
syntaxes: random walks over the grammar mask always yield exactly one call, read by the real parser, of
an allowed tool, with arguments that satisfy its schema."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import grammar_walks
import numpy as np
import pytest
from frontend_builders import DSML_MARK, SPECIAL, argument_tags, dsml, function_tags, recipient_header, xtml

from helios_core.frontend.bootstrap import PromptError
from helios_core.frontend.formats import ToolCallFormat, parse_prepared_format
from helios_core.frontend.structured import GrammarCompiler
from helios_core.plugin_api import CLOSED_ENVELOPE, EnvelopeState, ToolSpec
from helios_core.testing import FrontendHarness, byte_level_tokenizer
from helios_core.wire import contract_pb2 as ct

OPEN, CLOSE, EOS = 256, 257, 258  # <tool_call>, </tool_call>, <|eos|> after the 256 byte tokens
SAMPLED = 259
WIDTH = 288
MAX_STEPS = 600
WALKS = 30

NOTE: dict[str, Any] = {
    "type": "object",
    "properties": {
        "text": {"type": "string", "maxLength": 12},
        "count": {"type": "integer", "minimum": -50, "maximum": 999},
        "urgent": {"type": "boolean"},
    },
    "required": ["text", "urgent"],
    "additionalProperties": False,
}
MOVE: dict[str, Any] = {
    "type": "object",
    "properties": {
        "to": {"enum": ["left", "right"]},
        "code": {"type": "string", "pattern": "^[a-z]{2,4}$"},
        "steps": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
    },
    "required": ["to"],
    "additionalProperties": False,
}
TOOLS = [("note", NOTE), ("move", MOVE)]
FAMILIES: dict[str, Callable[[], ct.FrontendContract]] = {
    "function_tags": function_tags,
    "argument_tags": argument_tags,
    "dsml": dsml,
    "xtml": xtml,
}


def valid(name: str, arguments: Any) -> bool:
    """A hand-written check of the two schemas above (no jsonschema dependency)."""
    if not isinstance(arguments, dict):
        return False
    if name == "note":
        text, count = arguments.get("text"), arguments.get("count", 0)
        return (
            set(NOTE["required"]) <= set(arguments) <= set(NOTE["properties"])
            and isinstance(text, str)
            and len(text) <= 12
            and type(count) is int
            and -50 <= count <= 999
            and isinstance(arguments["urgent"], bool)
        )
    code, steps = arguments.get("code", "ab"), arguments.get("steps", [])
    return (
        set(MOVE["required"]) <= set(arguments) <= set(MOVE["properties"])
        and arguments["to"] in ("left", "right")
        and isinstance(code, str)
        and 2 <= len(code) <= 4
        and code.isascii()
        and code.isalpha()
        and code.islower()
        and isinstance(steps, list)
        and len(steps) <= 3
        and all(type(step) is int and 0 <= step <= 9 for step in steps)
    )


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    tok = byte_level_tokenizer(["<tool_call>", "</tool_call>", "<|eos|>"])
    ids = [tok.token_to_id(t) for t in ("<tool_call>", "</tool_call>", "<|eos|>")]
    if ids != [OPEN, CLOSE, EOS]:
        pytest.fail(f"unexpected special token ids {ids}")
    return tok


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, sampled_size=SAMPLED, logits_width=WIDTH, eos_token_ids=[EOS])


def tool_format(family: str, choice: str | None = None) -> ToolCallFormat:
    return ToolCallFormat.from_syntax(TOOLS, choice, FAMILIES[family]().tool_syntax)


def allowed(mask: np.ndarray) -> np.ndarray:
    return grammar_walks.allowed(mask, SAMPLED)


def walk(compiler: GrammarCompiler, fmt: ToolCallFormat, seed: int) -> list[int]:
    """Sample uniformly among allowed ids until only EOS is allowed; the ids before EOS."""
    matcher = compiler.compile(fmt).matcher()
    return grammar_walks.uniform_walk(matcher, seed, eos=EOS, sampled=SAMPLED, max_steps=MAX_STEPS)


def parsed_calls(tokenizer: Any, family: str, ids: list[int]) -> list[tuple[str, Any]]:
    harness = FrontendHarness(tokenizer, FAMILIES[family](), tools=[ToolSpec(n, s) for n, s in TOOLS])
    result = harness.run_tokens([ids])
    assert result.finish_reason == "tool_calls", tokenizer.decode(ids, skip_special_tokens=False)
    assert not (result.output.content or "").strip()
    return [(call.name, json.loads(call.arguments)) for call in result.output.tool_calls]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_required_walks_always_yield_one_valid_call(compiler: GrammarCompiler, tokenizer: Any, family: str) -> None:
    names = set()
    for seed in range(WALKS):
        ids = walk(compiler, tool_format(family), seed)
        if family == "dsml":  # textual markers: one block holding one invocation
            text = tokenizer.decode(ids, skip_special_tokens=False)
            assert text.count(f"<{DSML_MARK}function_calls>") == 1 and text.count(f"<{DSML_MARK}invoke ") == 1
        elif family == "xtml":  # textual controls here: one block holding one call
            text = tokenizer.decode(ids, skip_special_tokens=False)
            assert text.startswith("<|open|>tools<|sep|><|open|>call tool=") and text.endswith("<|close|>tools<|sep|>")
            assert text.count("<|open|>call ") == 1
        else:
            assert ids[0] == OPEN and ids[-1] == CLOSE  # the call markers as their special tokens
            assert ids.count(OPEN) == 1 and ids.count(CLOSE) == 1
        ((name, arguments),) = parsed_calls(tokenizer, family, ids)
        assert name in ("note", "move")
        assert valid(name, arguments), (name, arguments, tokenizer.decode(ids, skip_special_tokens=False))
        names.add(name)
    assert names == {"note", "move"}  # both tools are reachable


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_named_choice_only_yields_that_function(compiler: GrammarCompiler, tokenizer: Any, family: str) -> None:
    for seed in range(WALKS // 2):
        ids = walk(compiler, tool_format(family, "note"), seed)
        ((name, arguments),) = parsed_calls(tokenizer, family, ids)
        assert name == "note" and valid(name, arguments), arguments


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_format_round_trips_through_its_internal_json(family: str) -> None:
    fmt = tool_format(family, "move")
    assert parse_prepared_format(fmt.to_json()) == fmt


def test_function_tag_values_follow_the_declared_layout(compiler: GrammarCompiler, tokenizer: Any) -> None:
    ids = walk(compiler, tool_format("function_tags", "note"), 3)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("<tool_call>\n<function=note>\n<parameter=text>\n")
    assert text.endswith("</parameter>\n</function>\n</tool_call>")


def test_unenforceable_schemas_are_refused(compiler: GrammarCompiler) -> None:
    syntax = function_tags().tool_syntax
    for schema in (
        {"type": "object", "properties": {"a": {"type": "string", "format": "date"}}},
        {"type": "object", "properties": {}, "required": ["a"]},
        {"type": "object", "properties": {"a b>": {"type": "integer"}}},
        {"type": "object", "minProperties": 1},
    ):
        with pytest.raises(PromptError):
            compiler.compile(ToolCallFormat.from_syntax([("f", schema)], None, syntax))


def test_dsml_blocks_follow_the_declared_layout(compiler: GrammarCompiler, tokenizer: Any) -> None:
    mark = DSML_MARK
    for seed in range(WALKS // 2):
        text = tokenizer.decode(walk(compiler, tool_format("dsml", "note"), seed), skip_special_tokens=False)
        assert text.startswith(f'\n\n<{mark}function_calls>\n<{mark}invoke name="note">\n<{mark}parameter name="text" ')
        assert f'<{mark}parameter name="text" string="true">' in text
        assert f'<{mark}parameter name="urgent" string="false">' in text
        assert text.endswith(f"</{mark}parameter>\n</{mark}invoke>\n</{mark}function_calls>")


def test_dsml_without_parameters_writes_an_empty_line(compiler: GrammarCompiler, tokenizer: Any) -> None:
    fmt = ToolCallFormat.from_syntax([("ping", {"type": "object", "properties": {}})], None, dsml().tool_syntax)
    matcher = compiler.compile(fmt).matcher()
    ids: list[int] = []
    while not matcher.finished:
        (token,) = allowed(matcher.mask()).tolist()
        matcher.advance(token)
        ids.append(token)
    mark = DSML_MARK
    expected = f'\n\n<{mark}function_calls>\n<{mark}invoke name="ping">\n\n</{mark}invoke>\n</{mark}function_calls>'
    assert tokenizer.decode(ids, skip_special_tokens=False) == expected


def test_xtml_controls_are_matched_as_their_tokens() -> None:
    controls = ["<|open|>", "<|close|>", "<|sep|>", "<|eos|>"]
    tok = byte_level_tokenizer(controls)
    open_, close, sep, eos = (tok.token_to_id(text) for text in controls)
    compiler = GrammarCompiler(tok, sampled_size=eos + 1, logits_width=WIDTH, eos_token_ids=[eos])
    fmt = ToolCallFormat.from_syntax(TOOLS, "move", xtml().tool_syntax)
    matcher = compiler.compile(fmt).matcher()
    rng = np.random.default_rng(0)
    ids: list[int] = []
    while not matcher.finished:
        bits = np.unpackbits(matcher.mask().astype("<u4").view(np.uint8), bitorder="little")
        choices = [int(i) for i in np.flatnonzero(bits[:eos]) if i != eos]
        token = int(rng.choice(choices))
        matcher.advance(token)
        ids.append(token)
    assert ids[0] == open_ and ids[-1] == sep and ids.count(open_) == ids.count(close)  # the controls as tokens
    assert tok.decode(ids, skip_special_tokens=False).startswith('<|open|>tools<|sep|><|open|>call tool="move"<|sep|>')
    harness = FrontendHarness(tok, xtml(), tools=[ToolSpec(n, s) for n, s in TOOLS])
    result = harness.run_tokens([ids])
    ((name, arguments),) = [(call.name, json.loads(call.arguments)) for call in result.output.tool_calls]
    assert name == "move" and valid(name, arguments), arguments


def atem_walk(choice: str | None, seed: int, *, open_header: bool = False) -> tuple[str, list[tuple[str, Any]], str]:
    """One walk of the ATEM frame grammar (controls as tokens): the call frame's text, the parsed
    calls and the reasoning of the frames before it."""
    tok = byte_level_tokenizer([*SPECIAL, "<|eos|>"])
    eos = tok.token_to_id("<|eos|>")
    frontend = recipient_header()
    header = frontend.reasoning_syntax.recipient_header
    fmt = ToolCallFormat.from_syntax(TOOLS, choice, frontend.tool_syntax, header, open_header=open_header)
    assert parse_prepared_format(fmt.to_json()) == fmt
    compiler = GrammarCompiler(tok, sampled_size=eos + 1, logits_width=WIDTH, eos_token_ids=[eos])
    start, message, end, eom = (tok.token_to_id(t) for t in ("<|start|>", "<|message|>", "<|end|>", "<|eom|>"))
    matcher = compiler.compile(fmt).matcher()
    ids = grammar_walks.biased_walk(
        matcher, seed, eos=eos, sampled=eos + 1, favoured={start, end, eom, eos}, max_steps=MAX_STEPS
    )
    assert matcher.finished and ids[-1] == eom  # the call frame ends at end-of-message
    frames = ids.count(message)
    assert ids.count(start) == frames - open_header and ids.count(eom) + ids.count(end) == frames  # tokens only
    envelope = EnvelopeState(open_header=header.assistant_role) if open_header else CLOSED_ENVELOPE
    harness = FrontendHarness(tok, frontend, tools=[ToolSpec(n, s) for n, s in TOOLS], envelope=envelope)
    result = harness.run_tokens([ids])
    assert result.finish_reason == "tool_calls" and not (result.output.content or "").strip()
    text = tok.decode(ids, skip_special_tokens=False)
    *before, call_frame = text.split("<|start|>assistant")
    reasoning_frames = [*before[1:], *([before[0]] if open_header and before else [])]
    assert all(frame.startswith(" to=self<|message|>") for frame in reasoning_frames), text
    calls = [(call.name, json.loads(call.arguments)) for call in result.output.tool_calls]
    return call_frame, calls, result.output.reasoning or ""


def test_atem_required_is_one_frame_to_the_generic_recipient() -> None:
    names, reasoned = set(), 0
    for seed in range(WALKS // 2):
        text, ((name, arguments),), reasoning = atem_walk(None, seed)
        assert text.startswith(" to=functions<|message|><atem:function_calls>\n<atem:invoke name=")
        assert text.endswith("</atem:invoke>\n</atem:function_calls><|eom|>")
        assert valid(name, arguments), (name, arguments, text)
        names.add(name)
        reasoned += bool(reasoning)
    assert names == {"note", "move"}
    assert 0 < reasoned < WALKS // 2  # reasoning frames may come first, and need not


def test_atem_named_choice_addresses_the_named_recipient() -> None:
    for seed in range(WALKS // 3):
        text, ((name, arguments),), _ = atem_walk("note", seed)
        assert text.startswith(' to=functions.note<|message|><atem:function_calls>\n<atem:invoke name="note">')
        assert name == "note" and valid(name, arguments), arguments


def test_atem_open_header_starts_at_the_recipient_suffix() -> None:
    for seed in range(WALKS // 3):
        text, ((name, arguments),), _ = atem_walk("move", seed, open_header=True)
        assert text.startswith(" to=functions.move<|message|><atem:function_calls>")
        assert name == "move" and valid(name, arguments), arguments


def test_atem_needs_its_recipient_header_frames() -> None:
    with pytest.raises(PromptError, match="not supported for this core's tool syntax"):
        ToolCallFormat.from_syntax(TOOLS, None, recipient_header().tool_syntax)


SAY = {"type": "object", "properties": {"text": {"type": "string"}, "loud": {"type": "boolean"}}, "required": ["text"]}
"""A string argument bounded by nothing but its closing tag."""


def _accepts(compiler: GrammarCompiler, fmt: ToolCallFormat, tokens: list[int], sampled: int = SAMPLED) -> bool:
    matcher = compiler.compile(fmt).matcher()
    for token in tokens:
        choices = grammar_walks.allowed(matcher.mask(), sampled)
        assert token in choices, f"token {token} refused after {tokens[: tokens.index(token)]}"
        matcher.advance(token)
    return matcher.finished


@pytest.mark.parametrize("value", ["Paris", "a < b", "</x>", "x</dsml", "Ende"])
def test_a_dsml_string_value_closes_at_its_closing_tag(compiler: GrammarCompiler, tokenizer: Any, value: str) -> None:
    mark = DSML_MARK
    fmt = ToolCallFormat.from_syntax([("say", SAY)], "say", dsml().tool_syntax)
    text = (
        f'\n\n<{mark}function_calls>\n<{mark}invoke name="say">\n<{mark}parameter name="text" string="true">'
        f"{value}</{mark}parameter>\n</{mark}invoke>\n</{mark}function_calls>"
    )
    assert _accepts(compiler, fmt, tokenizer.encode(text, add_special_tokens=False).ids)
    harness = FrontendHarness(tokenizer, dsml(), tools=[ToolSpec("say", SAY)])
    result = harness.run_text(text)
    assert [(call.name, json.loads(call.arguments)) for call in result.output.tool_calls] == [("say", {"text": value})]


def test_an_atem_string_value_closes_at_its_closing_tag() -> None:
    tok = byte_level_tokenizer([*SPECIAL, "<|eos|>"])
    eos = tok.token_to_id("<|eos|>")
    frontend = recipient_header()
    header = frontend.reasoning_syntax.recipient_header
    fmt = ToolCallFormat.from_syntax([("say", SAY)], "say", frontend.tool_syntax, header)
    compiler = GrammarCompiler(tok, sampled_size=eos + 1, logits_width=WIDTH, eos_token_ids=[eos])
    text = (
        '<|start|>assistant to=functions.say<|message|><atem:function_calls>\n<atem:invoke name="say">\n'
        '<atem:parameter name="text">Paris</atem:parameter>\n<atem:parameter name="loud">true</atem:parameter>\n'
        "</atem:invoke>\n</atem:function_calls><|eom|>"
    )
    assert _accepts(compiler, fmt, tok.encode(text, add_special_tokens=False).ids, eos + 1)
