"""Structured output and forced tool calls through the real server on cores whose reasoning is not
think tags: recipient-header frames with ATEM calls, and XTML with XTML think.

The cores are tiny synthetic ones (random weights). Where a test needs a particular path through the
grammar (a reasoning frame, a tool frame), the first ids are scripted and the model samples the rest
under the grammar mask; a scripted id the grammar did not allow would fail the request, so every
scripted prefix is also a check that the grammar admits it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ignition.build import build_core
from ignition.recipes.llama import Capacities
from ignition.recipes.synthetic import synthetic_declaration

from helios_core.container.keys import generate_keys, load_private_key
from helios_core.loading import TrustSettings

from .conftest import Served, serve_fixture
from .helpers import CITY_TOOL, scripted_replies

NAMESPACE = "helios-tests/frames"
MODEL = "llama-synthetic-tiny"
CITY = CITY_TOOL
ANSWER: dict[str, Any] = {
    "type": "object",
    "properties": {"temperature": {"type": "integer", "minimum": -40, "maximum": 50}},
    "required": ["temperature"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": ANSWER}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def serve(tmp: Path, syntax: str) -> Iterator[Served]:
    keys = generate_keys(tmp / "keys")
    core = tmp / f"{syntax}.core"
    caps = Capacities(
        max_rows=2, prefill_tokens=(64, 256), decode_rows=(1, 2), page_tokens=16, cache_pages=256, context=2048,
        snapshots=0,
    )  # fmt: skip
    build_core(
        synthetic_declaration("tiny", seed=5, tool_syntax=syntax), core, caps=caps,
        signing_key=load_private_key(keys["signing"]), namespace=NAMESPACE,
    )  # fmt: skip
    with serve_fixture(core=core, trust=TrustSettings((keys["public"],), NAMESPACE, None)) as served:
        yield served


@pytest.fixture(scope="module")
def recipient(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from serve(tmp_path_factory.mktemp("recipient"), "recipient-header")


@pytest.fixture(scope="module")
def xtml(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from serve(tmp_path_factory.mktemp("xtml"), "xtml")


def valid_answer(content: str | None) -> bool:
    value = json.loads(content or "")
    return set(value) == {"temperature"} and type(value["temperature"]) is int and -40 <= value["temperature"] <= 50


def create(served: Served, **body: Any) -> Any:
    body.setdefault("messages", ASK)
    return served.client.chat.completions.create(model=MODEL, temperature=1.0, max_tokens=1500, **body)


# -- recipient-header frames ------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2])
def test_a_required_call_continues_the_open_header(recipient: Served, seed: int) -> None:
    choice = create(recipient, tools=[CITY], tool_choice="required", seed=seed).choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}


def test_a_structured_answer_keeps_the_reasoning_frame(recipient: Served) -> None:
    with scripted_replies(recipient.running) as say:
        say(" to=self<|message|>Look it up.<|end|><|start|>assistant to=user<|message|>", end=False)
        reply = create(recipient, response_format=RESPONSE_FORMAT, seed=3)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert getattr(choice.message, "reasoning_content", None) == "Look it up."
    assert valid_answer(choice.message.content), choice.message.content


def test_a_structured_request_may_call_a_registered_tool(recipient: Served) -> None:
    frame = (
        " to=functions.get_weather<|message|><atem:function_calls>\n"
        '<atem:invoke name="get_weather">\n<atem:parameter name="city">paris</atem:parameter>\n'
        "</atem:invoke>\n</atem:function_calls><|eom|>"
    )
    with scripted_replies(recipient.running) as say:
        say(frame)
        reply = create(recipient, response_format=RESPONSE_FORMAT, tools=[CITY], seed=4)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "paris"})


@pytest.mark.parametrize("seed", [5, 6])
def test_structured_answers_sampled_in_frames_parse(recipient: Served, seed: int) -> None:
    choice = create(recipient, response_format=RESPONSE_FORMAT, seed=seed).choices[0]
    assert choice.finish_reason == "stop" and valid_answer(choice.message.content), choice.message.content


def test_an_unregistered_tool_frame_fails_only_that_request(recipient: Served) -> None:
    import openai

    with scripted_replies(recipient.running) as say:
        say(" to=functions.other<|message|>", end=False)
        with pytest.raises(openai.InternalServerError):
            create(recipient, response_format=RESPONSE_FORMAT, tools=[CITY], seed=7)
    choice = create(recipient, response_format=RESPONSE_FORMAT, seed=8).choices[0]
    assert valid_answer(choice.message.content)


# -- XTML with XTML think ---------------------------------------------------------------------


def test_a_required_call_after_xtml_think(xtml: Served) -> None:
    with scripted_replies(xtml.running) as say:
        say("Use the tool.<|close|>think<|sep|>", end=False)
        choice = create(xtml, tools=[CITY], tool_choice="required", seed=9).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert getattr(choice.message, "reasoning_content", None) == "Use the tool."
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}


def test_a_structured_answer_after_xtml_think(xtml: Served) -> None:
    with scripted_replies(xtml.running) as say:
        say("Answer in JSON.<|close|>think<|sep|>", end=False)
        choice = create(xtml, response_format=RESPONSE_FORMAT, seed=10).choices[0]
    assert choice.finish_reason == "stop"
    assert getattr(choice.message, "reasoning_content", None) == "Answer in JSON."
    assert valid_answer(choice.message.content), choice.message.content


def test_text_the_grammar_refuses_fails_only_that_request(xtml: Served) -> None:
    import openai

    with scripted_replies(xtml.running) as say, pytest.raises(openai.InternalServerError):
        say("<|close|>think<|sep|>hello", end=False)  # text where only the tool block may follow
        create(xtml, tools=[CITY], tool_choice="required", seed=12)
    with scripted_replies(xtml.running) as say:
        say("ok<|close|>think<|sep|>", end=False)
        choice = create(xtml, tools=[CITY], tool_choice="required", seed=13).choices[0]
    assert choice.finish_reason == "tool_calls"
