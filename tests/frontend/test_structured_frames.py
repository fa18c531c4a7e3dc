"""Structured output on cores whose reasoning is not think tags.

Recipient-header cores keep their frames: reasoning frames to ``self`` and frames calling the
request's registered tools may come first, then the answer frame to ``user`` holds the constrained
document (or the output ends with a tool frame). XTML think cores admit the XTML think envelope
before the answer and before a required call. Random walks over the grammar mask are parsed by the
real output pipeline."""

from __future__ import annotations

import json
from typing import Any

import grammar_walks
import pytest
from frontend_builders import SPECIAL, harness, recipient_header, xtml

from helios_core.frontend.bootstrap import PromptError
from helios_core.frontend.formats import (
    ResponseFormat,
    ToolCallFormat,
    envelope_reasoning,
    prepared_format_json,
    read_prepared_format,
)
from helios_core.frontend.structured import GrammarCompiler
from helios_core.plugin_api import CLOSED_ENVELOPE, EnvelopeState, ToolSpec
from helios_core.testing import FrontendHarness, byte_level_tokenizer
from helios_core.wire import contract_pb2 as ct
from helios_plugins.recipient_frames import RecipientFrames

WIDTH = 288
MAX_STEPS = 800
WALKS = 24

ANSWER: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
NOTE: dict[str, Any] = {
    "type": "object",
    "properties": {"text": {"type": "string", "maxLength": 6}, "urgent": {"type": "boolean"}},
    "required": ["urgent"],
    "additionalProperties": False,
}
MOVE: dict[str, Any] = {
    "type": "object",
    "properties": {"to": {"enum": ["left", "right"]}},
    "required": ["to"],
    "additionalProperties": False,
}
TOOLS = [("note", NOTE), ("move", MOVE)]
SCHEMA = ResponseFormat(kind="json_schema", schema=ANSWER, name="answer")


def valid_answer(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"city", "days"}
        and isinstance(value["city"], str)
        and 1 <= len(value["city"]) <= 8
        and value["city"].isalpha()
        and value["city"].islower()
        and type(value["days"]) is int
    )


def valid_call(name: str, arguments: Any) -> bool:
    if name == "note":
        return (
            isinstance(arguments, dict)
            and "urgent" in arguments
            and type(arguments["urgent"]) is bool
            and set(arguments) <= {"text", "urgent"}
            and len(arguments.get("text", "")) <= 6
        )
    return name == "move" and arguments in ({"to": "left"}, {"to": "right"})


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return byte_level_tokenizer([*SPECIAL, "<|eos|>"])


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> GrammarCompiler:
    eos = tokenizer.token_to_id("<|eos|>")
    return GrammarCompiler(tokenizer, sampled_size=eos + 1, logits_width=WIDTH, eos_token_ids=[eos])


def ids_of(tokenizer: Any, *texts: str) -> list[int]:
    return [tokenizer.token_to_id(text) for text in texts]


def walk(tokenizer: Any, compiler: GrammarCompiler, grammar: Any, seed: int, favoured: list[str]) -> list[int]:
    eos = tokenizer.token_to_id("<|eos|>")
    return grammar_walks.biased_walk(
        grammar.matcher(),
        seed,
        eos=eos,
        sampled=eos + 1,
        favoured={eos, *ids_of(tokenizer, *favoured)},
        max_steps=MAX_STEPS,
    )


def frames_of(tools: list[tuple[str, Any]], *, open_header: bool) -> RecipientFrames:
    frames = RecipientFrames.from_contract(recipient_header(), tools, open_header=open_header)
    assert frames is not None
    return frames


def recipients(text: str, *, open_header: bool) -> list[str]:
    """The recipient of each frame of ``text`` (frames split at their start and role)."""
    parts = text.split("<|start|>assistant")
    frames = parts if open_header else parts[1:]
    assert open_header or parts[0] == ""
    return [frame.split("<|message|>")[0].removeprefix(" to=") for frame in frames]


FRAME_CONTROLS = ["<|start|>", "<|end|>", "<|eom|>"]


@pytest.mark.parametrize("open_header", [False, True])
def test_response_format_keeps_frames_and_answers_in_the_user_frame(
    tokenizer: Any, compiler: GrammarCompiler, open_header: bool
) -> None:
    frames = frames_of(TOOLS, open_header=open_header)
    grammar = compiler.compile(SCHEMA, frames=frames)
    envelope = EnvelopeState(open_header="assistant") if open_header else CLOSED_ENVELOPE
    answered = reasoned = called = ended_in_call = 0
    for seed in range(WALKS):
        ids = walk(tokenizer, compiler, grammar, seed, FRAME_CONTROLS)
        text = tokenizer.decode(ids, skip_special_tokens=False)
        seen = recipients(text, open_header=open_header)
        assert set(seen) <= {"self", "user", "functions", "functions.note", "functions.move"}, text
        assert "user" not in seen[:-1]  # the answer frame, when there is one, is the last
        harness = FrontendHarness(
            tokenizer,
            recipient_header(),
            tools=[ToolSpec(n, s) for n, s in TOOLS],
            envelope=envelope,
            structured_answer=True,
        )
        result = harness.run_tokens([ids])
        assert all(valid_call(c.name, json.loads(c.arguments)) for c in result.output.tool_calls), text
        if seen[-1] == "user":
            assert valid_answer(json.loads(result.output.content or "")), text
            answered += 1
        else:
            assert result.finish_reason == "tool_calls" and result.output.content is None, text
            ended_in_call += 1
        reasoned += result.output.reasoning is not None
        called += bool(result.output.tool_calls)
    assert answered and reasoned and called and ended_in_call  # every path of the frame grammar is walked


def test_the_answer_frame_admits_only_declared_and_registered_recipients(
    tokenizer: Any, compiler: GrammarCompiler
) -> None:
    def next_letters(frames: RecipientFrames) -> set[str]:
        matcher = compiler.compile(SCHEMA, frames=frames).matcher()
        for token in tokenizer.encode(" to=", add_special_tokens=False).ids:
            matcher.advance(token)
        eos = tokenizer.token_to_id("<|eos|>")
        return {tokenizer.decode([int(t)]) for t in grammar_walks.allowed(matcher.mask(), eos + 1)}

    assert next_letters(frames_of(TOOLS, open_header=True)) == {"s", "u", "f"}  # self, user, functions
    assert next_letters(frames_of([], open_header=True)) == {"s", "u"}  # no tools: no tool recipients
    matcher = compiler.compile(SCHEMA, frames=frames_of([], open_header=False)).matcher()
    eos = tokenizer.token_to_id("<|eos|>")
    assert grammar_walks.allowed(matcher.mask(), eos + 1).tolist() == ids_of(tokenizer, "<|start|>")


def test_an_unregistered_tool_recipient_is_not_allowed(tokenizer: Any, compiler: GrammarCompiler) -> None:
    matcher = compiler.compile(SCHEMA, frames=frames_of(TOOLS, open_header=True)).matcher()
    for token in tokenizer.encode(" to=functions.", add_special_tokens=False).ids:
        matcher.advance(token)
    eos = tokenizer.token_to_id("<|eos|>")
    letters = {tokenizer.decode([int(t)]) for t in grammar_walks.allowed(matcher.mask(), eos + 1)}
    assert letters == {"n", "m"}  # note, move


def test_the_frames_travel_in_the_prepared_json() -> None:
    frames = frames_of(TOOLS, open_header=True)
    text = prepared_format_json({"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}, None,
                                frames=frames)  # fmt: skip
    prepared = read_prepared_format(text)
    assert prepared == (SCHEMA, None, False, frames)
    assert frames.calls is not None and [name for name, _ in frames.calls.tools] == ["note", "move"]
    assert (frames.marker("answer_recipient"), frames.marker("reasoning_recipient")) == ("user", "self")


def test_other_cores_have_no_frames_and_incomplete_headers_are_refused() -> None:
    frontend = xtml()
    assert RecipientFrames.from_contract(frontend, TOOLS) is None
    broken = recipient_header()
    broken.reasoning_syntax.recipient_header.message = ""
    with pytest.raises(PromptError, match="recipient header syntax is incomplete"):
        RecipientFrames.from_contract(broken, [])


# -- XTML think -------------------------------------------------------------------------------


def xtml_harness(tokenizer: Any, *, initially: bool, structured: bool) -> FrontendHarness:
    tools = [ToolSpec(n, s) for n, s in TOOLS]
    return harness(tokenizer, xtml(), tools=tools, envelope=EnvelopeState(initially_reasoning=initially),
                   structured_answer=structured)  # fmt: skip


def test_xtml_think_is_the_envelope_of_its_delimiters() -> None:
    reasoning = envelope_reasoning(xtml())
    assert reasoning is not None
    assert (reasoning.open, reasoning.close) == ("<|open|>think<|sep|>", "<|close|>think<|sep|>")
    undeclared = xtml()
    undeclared.reasoning_syntax.open = undeclared.reasoning_syntax.close = ""
    derived = envelope_reasoning(undeclared)  # the parser's defaults from the XTML framing
    assert derived is not None and (derived.open, derived.close) == (reasoning.open, reasoning.close)
    assert envelope_reasoning(recipient_header()) is None


@pytest.mark.parametrize("initially", [False, True])
def test_xtml_think_reasons_then_answers(tokenizer: Any, compiler: GrammarCompiler, initially: bool) -> None:
    grammar = compiler.compile(SCHEMA, reasoning=envelope_reasoning(xtml()), initially_reasoning=initially)
    reasoned = 0
    for seed in range(WALKS):
        ids = walk(tokenizer, compiler, grammar, seed, ["<|open|>", "<|close|>"])
        result = xtml_harness(tokenizer, initially=initially, structured=True).run_tokens([ids])
        text = tokenizer.decode(ids, skip_special_tokens=False)
        assert result.finish_reason == "stop" and valid_answer(json.loads(result.output.content or "")), text
        reasoned += result.output.reasoning is not None
    assert reasoned


@pytest.mark.parametrize("initially", [False, True])
def test_xtml_think_reasons_then_calls(tokenizer: Any, compiler: GrammarCompiler, initially: bool) -> None:
    fmt = ToolCallFormat.from_syntax(TOOLS, None, xtml().tool_syntax)
    grammar = compiler.compile(fmt, reasoning=envelope_reasoning(xtml()), initially_reasoning=initially)
    names, reasoned = set(), 0
    for seed in range(WALKS):
        ids = walk(tokenizer, compiler, grammar, seed, ["<|open|>", "<|close|>"])
        result = xtml_harness(tokenizer, initially=initially, structured=False).run_tokens([ids])
        ((name, arguments),) = [(c.name, json.loads(c.arguments)) for c in result.output.tool_calls]
        assert result.finish_reason == "tool_calls" and valid_call(name, arguments)
        assert not (result.output.content or "").strip()
        names.add(name)
        reasoned += result.output.reasoning is not None
    assert names == {"note", "move"} and reasoned


def test_reasoning_families_without_an_envelope() -> None:
    plain = ct.FrontendContract(reasoning_parser=ct.REASONING_PARSER_NONE)
    assert envelope_reasoning(plain) is None
