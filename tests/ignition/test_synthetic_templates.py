"""The chat templates of the synthetic recipes' tool syntaxes, rendered in Helios' own chat-template sandbox
(``compile_chat_template``, as a served core renders them).

JSON tags: ChatML messages ``<|im_start|>ROLE\\nCONTENT<|im_end|>\\n`` and the tool calls of assistant
messages. Recipient-header (ATEM) frames and XTML: an earlier assistant message's calls are written exactly
as the model writes them, so the core's own parser reads them back as the same calls and the core's own
call grammar admits them token by token."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from ignition.build import TextModelDeclaration
from ignition.recipes.synthetic import (
    CHATML_JSON_TOOLS_TEMPLATE,
    CHATML_TEMPLATE,
    RECIPIENT_HEADER_TEMPLATE,
    XTML_TEMPLATE,
    synthetic_declaration,
)
from ignition.recipes.vision import VISION_CHATML_TEMPLATE, VISION_JSON_TOOLS_TEMPLATE
from tokenizers import Tokenizer

from helios_core.frontend.bootstrap import compile_chat_template
from helios_core.frontend.formats import ToolCallFormat
from helios_core.frontend.structured import GrammarCompiler
from helios_core.frontend.template_sandbox import RenderLimits, TemplateRenderError
from helios_core.frontend.template_sandbox import render as render_template
from helios_core.plugin_api import CLOSED_ENVELOPE, EnvelopeState, ToolSpec
from helios_core.testing import FrontendHarness
from helios_core.wire import contract_pb2 as ct

JSON_TAGS_TEMPLATES = [
    pytest.param(CHATML_JSON_TOOLS_TEMPLATE, CHATML_TEMPLATE, id="llama-synthetic"),
    pytest.param(VISION_JSON_TOOLS_TEMPLATE, VISION_CHATML_TEMPLATE, id="vision-synthetic"),
]
WEATHER: dict[str, Any] = {"type": "function", "function": {"name": "get_weather"}}
CALLS: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "Let me check. ",
        "tool_calls": [
            # the server passes arguments as objects; a library caller may pass the JSON text
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Nice"}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": '{"sky": "clear"}'},
]


def _render(template: str, messages: list[dict[str, Any]], **variables: Any) -> str:
    text: str = compile_chat_template(template).render(messages=messages, **variables)
    return text


@pytest.mark.parametrize(("template", "plain"), JSON_TAGS_TEMPLATES)
def test_json_tags_messages_are_chatml(template: str, plain: str) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    rendered = _render(template, messages, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nYo<|im_end|>\n<|im_start|>assistant\n"
    assert rendered == _render(plain, messages, add_generation_prompt=True)
    assert _render(template, messages, tools=[], add_generation_prompt=False) == _render(plain, messages)


@pytest.mark.parametrize(("template", "plain"), JSON_TAGS_TEMPLATES)
def test_json_tags_tool_calls_follow_the_assistant_text(template: str, plain: str) -> None:
    assert _render(template, CALLS, tools=[WEATHER], add_generation_prompt=True) == (
        "<|im_start|>system\nCall a tool by replying "
        '<tool_call>{"name": NAME, "arguments": {...}}</tool_call>. Tools:\n'
        '{"type": "function", "function": {"name": "get_weather"}}\n<|im_end|>\n'
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\nLet me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
        '</tool_call><tool_call>{"name": "get_weather", "arguments": {"city": "Nice"}}</tool_call><|im_end|>\n'
        '<|im_start|>tool\n{"sky": "clear"}<|im_end|>\n'
        "<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(("template", "plain"), JSON_TAGS_TEMPLATES)
def test_a_json_tags_call_without_text(template: str, plain: str) -> None:
    call = {"function": {"name": "f", "arguments": {}}}
    messages = [{"role": "assistant", "content": None, "tool_calls": [call]}]
    assert _render(template, messages) == (
        '<|im_start|>assistant\n<tool_call>{"name": "f", "arguments": {}}</tool_call><|im_end|>\n'
    )


def test_vision_json_tags_content_parts() -> None:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Where?"}]}]
    assert _render(VISION_JSON_TOOLS_TEMPLATE, messages, add_generation_prompt=True) == (
        "<|im_start|>user\n<|image|>Where?<|im_end|>\n<|im_start|>assistant\n"
    )


# -- recipient-header (ATEM) and XTML calls -----------------------------------------------------------

# ``city`` admits letters only: the ATEM grammar writes its markers as text, and its value lexeme is
# greedy, so a value that may go on to spell a prefix of ``</atem:parameter>`` would swallow the closer
FORECAST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Za-z]+$"},
        "days": {"type": "integer"},
        "options": {"type": "object"},
    },
    "required": ["city"],
}
SEARCH_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"query": {"type": "string"}, "filters": {"type": "object"}},
}
FORECAST_ARGUMENTS: dict[str, Any] = {"city": "Paris", "days": 3, "options": {"units": "metric", "hours": [6, 12]}}
SEARCH_ARGUMENTS: dict[str, Any] = {"query": "museums", "filters": {"open": True, "near": {"km": 2.5}}}
TOOL_SPECS = [ToolSpec("get_forecast", FORECAST_SCHEMA), ToolSpec("search", SEARCH_SCHEMA)]


def _call(name: str, arguments: Any) -> dict[str, Any]:
    return {"id": f"call_{name}", "type": "function", "function": {"name": name, "arguments": arguments}}


ONE_CALL: dict[str, Any] = {
    "role": "assistant",
    "content": None,
    "tool_calls": [_call("get_forecast", FORECAST_ARGUMENTS)],
}
TWO_CALLS: dict[str, Any] = {
    "role": "assistant",
    "content": "Let me look. ",
    "tool_calls": [_call("get_forecast", FORECAST_ARGUMENTS), _call("search", SEARCH_ARGUMENTS)],
}
ASK = {"role": "user", "content": "Plans for Paris?"}
RESULT = {"role": "tool", "tool_call_id": "call_get_forecast", "content": "sunny"}

ATEM_FORECAST = (
    "<|start|>assistant to=functions.get_forecast<|message|><atem:function_calls>\n"
    '<atem:invoke name="get_forecast">\n'
    '<atem:parameter name="city">Paris</atem:parameter>\n'
    '<atem:parameter name="days">3</atem:parameter>\n'
    '<atem:parameter name="options">{"units": "metric", "hours": [6, 12]}</atem:parameter>\n'
    "</atem:invoke>\n</atem:function_calls><|eom|>"
)
ATEM_SEARCH = (
    "<|start|>assistant to=functions.search<|message|><atem:function_calls>\n"
    '<atem:invoke name="search">\n'
    '<atem:parameter name="query">museums</atem:parameter>\n'
    '<atem:parameter name="filters">{"open": true, "near": {"km": 2.5}}</atem:parameter>\n'
    "</atem:invoke>\n</atem:function_calls><|eom|>"
)
XTML_FORECAST = (
    '<|open|>call tool="get_forecast"<|sep|>'
    '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
    '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>'
    '<|open|>argument key="options" type="object"<|sep|>{"units": "metric", "hours": [6, 12]}<|close|>argument<|sep|>'
    "<|close|>call<|sep|>"
)
XTML_SEARCH = (
    '<|open|>call tool="search"<|sep|>'
    '<|open|>argument key="query" type="string"<|sep|>museums<|close|>argument<|sep|>'
    '<|open|>argument key="filters" type="object"<|sep|>{"open": true, "near": {"km": 2.5}}<|close|>argument<|sep|>'
    "<|close|>call<|sep|>"
)


def test_recipient_header_replays_a_call_as_its_frame() -> None:
    rendered = _render(RECIPIENT_HEADER_TEMPLATE, [ASK, ONE_CALL, RESULT], add_generation_prompt=True)
    assert rendered == (
        "<|start|>user<|message|>Plans for Paris?<|end|>"
        + ATEM_FORECAST
        + "<|start|>functions to=assistant<|message|>sunny<|end|><|start|>assistant"
    )


def test_recipient_header_replays_text_then_one_frame_per_call() -> None:
    assert _render(RECIPIENT_HEADER_TEMPLATE, [TWO_CALLS]) == (
        "<|start|>assistant<|message|>Let me look. <|end|>" + ATEM_FORECAST + ATEM_SEARCH
    )


def test_xtml_replays_a_call_in_a_tools_block() -> None:
    rendered = _render(XTML_TEMPLATE, [ASK, ONE_CALL, RESULT], add_generation_prompt=True)
    assert rendered == (
        '<|open|>message role="user"<|sep|>Plans for Paris?<|close|>message<|sep|>'
        '<|open|>message role="assistant"<|sep|><|open|>tools<|sep|>'
        + XTML_FORECAST
        + "<|close|>tools<|sep|><|close|>message<|sep|>"
        '<|open|>message role="tool"<|sep|>sunny<|close|>message<|sep|>'
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
    )


def test_xtml_replays_text_then_one_block_of_every_call() -> None:
    assert _render(XTML_TEMPLATE, [TWO_CALLS]) == (
        '<|open|>message role="assistant"<|sep|>Let me look. <|open|>tools<|sep|>'
        + XTML_FORECAST
        + XTML_SEARCH
        + "<|close|>tools<|sep|><|close|>message<|sep|>"
    )


def test_calls_without_arguments() -> None:
    messages = [{"role": "assistant", "content": "", "tool_calls": [_call("ping", {})]}]
    assert _render(RECIPIENT_HEADER_TEMPLATE, messages) == (
        "<|start|>assistant to=functions.ping<|message|><atem:function_calls>\n"
        '<atem:invoke name="ping">\n\n</atem:invoke>\n</atem:function_calls><|eom|>'
    )
    assert _render(XTML_TEMPLATE, messages) == (
        '<|open|>message role="assistant"<|sep|><|open|>tools<|sep|><|open|>call tool="ping"<|sep|>'
        "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>"
    )


def test_xtml_types_each_value() -> None:
    arguments = {"s": "1", "i": 1, "f": 0.5, "b": False, "n": None, "a": [1], "o": {}}
    rendered = _render(XTML_TEMPLATE, [{"role": "assistant", "content": None, "tool_calls": [_call("f", arguments)]}])
    assert re.findall(r'key="(\w)" type="(\w+)"<\|sep\|>(.*?)<\|close\|>', rendered) == [
        ("s", "string", "1"),
        ("i", "number", "1"),
        ("f", "number", "0.5"),
        ("b", "boolean", "false"),
        ("n", "null", "null"),
        ("a", "array", "[1]"),
        ("o", "object", "{}"),
    ]


@pytest.mark.parametrize("template", [RECIPIENT_HEADER_TEMPLATE, XTML_TEMPLATE], ids=["recipient-header", "xtml"])
@pytest.mark.parametrize("arguments", ['{"city": "Paris"}', ["Paris"], None], ids=["json-text", "array", "null"])
def test_arguments_that_are_not_an_object_are_refused(template: str, arguments: Any) -> None:
    messages = [{"role": "assistant", "content": None, "tool_calls": [_call("get_forecast", arguments)]}]
    with pytest.raises(TemplateRenderError, match="must be a JSON object"):
        render_template(compile_chat_template(template), RenderLimits(), 0, {"messages": messages})


# -- the replayed calls read back by the core's own parsers and accepted by its call grammars ----------


@dataclass(frozen=True)
class Replay:
    """A synthetic core's declaration in one tool syntax and its tokenizer."""

    declaration: TextModelDeclaration
    tokenizer: Tokenizer

    @property
    def frontend(self) -> ct.FrontendContract:
        frontend = self.declaration.frontend
        assert frontend is not None
        return frontend

    def generated(self, message: dict[str, Any]) -> str:
        """The rendered assistant ``message`` after the assistant opener the generation prompt writes."""
        rendered = _render(self.declaration.chat_template, [message])
        opener = self.frontend.template_tokens.assistant_open
        assert rendered.startswith(opener)
        return rendered[len(opener) :]

    def envelope(self) -> EnvelopeState:
        """Where generation starts after the generation prompt: inside the open frame header for
        recipient-header frames; a fresh answer for XTML (replayed messages hold no think element)."""
        if self.frontend.reasoning_parser == ct.REASONING_PARSER_RECIPIENT_HEADER:
            return EnvelopeState(open_header=self.frontend.reasoning_syntax.recipient_header.assistant_role)
        return CLOSED_ENVELOPE


@pytest.fixture(scope="module", params=["recipient-header", "xtml"])
def replay(request: pytest.FixtureRequest) -> Replay:
    declaration = synthetic_declaration("tiny", tool_syntax=request.param)
    return Replay(declaration, Tokenizer.from_str(declaration.tokenizer_json))


def _parsed(replay: Replay, text: str, tools: list[ToolSpec]) -> tuple[str | None, list[tuple[str, Any]]]:
    harness = FrontendHarness(replay.tokenizer, replay.frontend, tools=tools, envelope=replay.envelope())
    result = harness.run_text(text)
    assert result.finish_reason == "tool_calls"
    return result.output.content, [(call.name, json.loads(call.arguments)) for call in result.output.tool_calls]


def test_one_replayed_call_parses_to_the_same_call(replay: Replay) -> None:
    assert _parsed(replay, replay.generated(ONE_CALL), TOOL_SPECS) == (None, [("get_forecast", FORECAST_ARGUMENTS)])


def test_two_replayed_calls_parse_to_the_same_calls(replay: Replay) -> None:
    content, calls = _parsed(replay, replay.generated(TWO_CALLS), TOOL_SPECS)
    assert calls == [("get_forecast", FORECAST_ARGUMENTS), ("search", SEARCH_ARGUMENTS)]
    # the text is content; XTML drops the whitespace between content and the tools block
    xtml = replay.frontend.tool_parser == ct.TOOL_PARSER_XTML
    assert content == ("Let me look." if xtml else "Let me look. ")


def test_escaped_names_parse_to_the_same_call(replay: Replay) -> None:
    arguments = {'a "b" <c> & d': "x", "plain": 1}
    message = {"role": "assistant", "content": None, "tool_calls": [_call("get_forecast", arguments)]}
    # the tool is offered without a parameter schema: the escaped keys are undeclared
    offered = [ToolSpec("get_forecast")]
    assert _parsed(replay, replay.generated(message), offered) == (None, [("get_forecast", arguments)])


def test_a_replayed_call_is_what_the_call_grammar_generates(replay: Replay) -> None:
    """The replayed call, token by token, is admitted by the grammar a request naming that tool gets,
    and completes it."""
    frontend, declaration = replay.frontend, replay.declaration
    text = replay.generated(ONE_CALL)
    if frontend.reasoning_parser == ct.REASONING_PARSER_RECIPIENT_HEADER:
        header = frontend.reasoning_syntax.recipient_header
        fmt = ToolCallFormat.from_syntax(
            [("get_forecast", FORECAST_SCHEMA)], "get_forecast", frontend.tool_syntax, header, open_header=True
        )
    else:
        fmt = ToolCallFormat.from_syntax([("get_forecast", FORECAST_SCHEMA)], "get_forecast", frontend.tool_syntax)
        text = text.removesuffix(frontend.template_tokens.message_end)
    compiler = GrammarCompiler(
        replay.tokenizer,
        sampled_size=declaration.sampled_size,
        logits_width=declaration.shape.vocab,
        eos_token_ids=declaration.eos_token_ids,
    )
    matcher = compiler.compile(fmt).matcher()
    ids = replay.tokenizer.encode(text, add_special_tokens=False).ids
    for position, token in enumerate(ids):
        bits = np.unpackbits(matcher.mask().astype("<u4").view(np.uint8), bitorder="little")
        assert bits[token], (
            f"the grammar refuses {replay.tokenizer.decode(ids[: position + 1], skip_special_tokens=False)!r}"
        )
        matcher.advance(token)
    assert matcher.is_accepting
