"""Tools and tool_choice through the real server and the official client, on a core with a tool syntax.

The core is a tiny synthetic one whose frontend selects the JSON-tag tool parser. Its weights are
random, so the model's sampled ids are replaced by a scripted reply after each launch (the engine,
host gates, output pipeline and presentation all run for real): the test pins how a generated
tool call reaches the client, not what a trained model would say.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from .conftest import Served, serve_fixture
from .helpers import CITY_TOOL, build_synthetic_core, scripted_replies

NAMESPACE = "helios-tests/tools"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture(scope="module")
def served_tools(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    built = build_synthetic_core(tmp_path_factory.mktemp("tools"), NAMESPACE, tool_syntax="json-tags")
    with serve_fixture(core=built.path, trust=built.trust) as served:
        yield served


@pytest.fixture
def script(served_tools: Served) -> Iterator[Callable[[str], None]]:
    """Make the model 'say' a text (see ``helpers.scripted_replies``)."""
    with scripted_replies(served_tools.running) as say:
        yield say


def test_a_tool_call_reaches_the_client(served_tools: Served, script: Callable[[str], None]) -> None:
    script(CALL)
    reply = served_tools.client.chat.completions.create(
        model="llama-synthetic-tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER]
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_a_streamed_tool_call_assembles_to_the_same_call(served_tools: Served, script: Callable[[str], None]) -> None:
    script("Let me check. " + CALL)
    stream = served_tools.client.chat.completions.create(
        model="llama-synthetic-tiny",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        tool_choice="auto",
        stream=True,
    )
    streamed = _assembled(stream)
    assert streamed.content.strip() == "Let me check."
    assert streamed.names == ["get_weather"] and len(streamed.ids) == 1
    assert json.loads(streamed.arguments) == {"city": "Paris"}
    assert streamed.finish == "tool_calls"


@dataclass
class _Streamed:
    """What a streamed reply's chunks add up to."""

    content: str = ""
    names: list[str] = field(default_factory=list)
    ids: set[str] = field(default_factory=set)
    indexes: set[int] = field(default_factory=set)
    arguments: str = ""
    """Every call's argument fragments, joined in order."""
    finish: str | None = None


def _assembled(stream: Any) -> _Streamed:
    streamed = _Streamed()
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        streamed.content += delta.content or ""
        for call in delta.tool_calls or []:
            streamed.indexes.add(call.index)
            if call.id:
                streamed.ids.add(call.id)
            if call.function and call.function.name:
                streamed.names.append(call.function.name)
            if call.function and call.function.arguments:
                streamed.arguments += call.function.arguments
        streamed.finish = chunk.choices[0].finish_reason or streamed.finish
    return streamed


def test_a_tool_result_turn_renders_and_answers(served_tools: Served, script: Callable[[str], None]) -> None:
    script("It is sunny in Paris.")
    messages: list[Any] = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
    ]
    reply = served_tools.client.chat.completions.create(
        model="llama-synthetic-tiny", messages=messages, tools=[WEATHER]
    )
    assert reply.choices[0].message.content == "It is sunny in Paris."
    assert reply.choices[0].finish_reason == "stop"
    assert not reply.choices[0].message.tool_calls


def test_a_tool_result_may_name_its_function(served_tools: Served, script: Callable[[str], None]) -> None:
    script("It is sunny in Paris.")
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages: list[Any] = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"sky": "clear"}'},
    ]
    reply = served_tools.client.chat.completions.create(
        model="llama-synthetic-tiny", messages=messages, tools=[WEATHER]
    )
    assert reply.choices[0].message.content == "It is sunny in Paris."


def test_tool_choice_none_answers_in_text(served_tools: Served, script: Callable[[str], None]) -> None:
    script("plain answer")
    reply = served_tools.client.chat.completions.create(
        model="llama-synthetic-tiny", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER], tool_choice="none"
    )
    assert reply.choices[0].message.content == "plain answer"
    assert reply.choices[0].finish_reason == "stop"


CITY = CITY_TOOL
ADD: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "boolean"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
REQUIRED_KEYS = {"get_weather": {"city"}, "add": {"a", "b"}}


def constrained(served: Served, tool_choice: Any, seed: int) -> Any:
    """A completion the random-weight model generates under the tool-call grammar (nothing scripted)."""
    return served.client.chat.completions.create(
        model="llama-synthetic-tiny",
        messages=[{"role": "user", "content": "Use a tool."}],
        tools=[CITY, ADD],  # type: ignore[list-item]
        tool_choice=tool_choice,
        temperature=1.0,
        seed=seed,
        max_tokens=200,
    )


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_tool_choice_required_forces_a_valid_call(served_tools: Served, seed: int) -> None:
    choice = constrained(served_tools, "required", seed).choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.function.name in REQUIRED_KEYS
    arguments = json.loads(call.function.arguments)
    assert isinstance(arguments, dict) and REQUIRED_KEYS[call.function.name] <= set(arguments)


@pytest.mark.parametrize("name", ["add", "get_weather"])
def test_a_named_tool_choice_forces_that_function(served_tools: Served, name: str) -> None:
    choice = constrained(served_tools, {"type": "function", "function": {"name": name}}, 5).choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.function.name == name
    assert REQUIRED_KEYS[name] <= set(json.loads(call.function.arguments))


def test_a_streamed_required_call_assembles(served_tools: Served) -> None:
    stream = served_tools.client.chat.completions.create(
        model="llama-synthetic-tiny",
        messages=[{"role": "user", "content": "Use a tool."}],
        tools=[CITY],  # type: ignore[list-item]
        tool_choice="required",
        temperature=1.0,
        seed=9,
        max_tokens=200,
        stream=True,
    )
    names, arguments, finish = [], "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        for call in chunk.choices[0].delta.tool_calls or []:
            if call.function and call.function.name:
                names.append(call.function.name)
            if call.function and call.function.arguments:
                arguments += call.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert names == ["get_weather"] and "city" in json.loads(arguments)
    assert finish == "tool_calls"


def test_invalid_forced_tool_choices_are_refused(served_tools: Served) -> None:
    import openai

    base: dict[str, Any] = {"model": "llama-synthetic-tiny", "messages": [{"role": "user", "content": "hi"}]}
    cases: list[tuple[dict[str, Any], str]] = [
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"response_format": {"type": "tool_call"}}, "response_format"),
    ]
    for extra, expected in cases:
        with pytest.raises(openai.BadRequestError) as error:
            served_tools.client.chat.completions.create(**base, **extra)
        assert expected in str(error.value), (extra, str(error.value))


@pytest.mark.parametrize("seed", [9, 4])
def test_a_streamed_forced_call_sends_one_entry_a_call_in_each_chunk(served_tools: Served, seed: int) -> None:
    import httpx

    from .helpers import sse_events

    body = {
        "model": "llama-synthetic-tiny",
        "messages": [{"role": "user", "content": "Use a tool."}],
        "tools": [CITY],
        "tool_choice": "required",
        "temperature": 1.0,
        "seed": seed,
        "max_tokens": 200,
        "stream": True,
    }
    response = httpx.post(served_tools.base_url + "/v1/chat/completions", json=body, timeout=60)
    entries = [
        call
        for _, chunk in sse_events(response)[:-1]
        for choice in chunk["choices"]
        for call in choice["delta"].get("tool_calls") or []
    ]
    per_chunk = [
        [call["index"] for call in choice["delta"].get("tool_calls") or []]
        for _, chunk in sse_events(response)[:-1]
        for choice in chunk["choices"]
    ]
    assert all(len(indices) == len(set(indices)) for indices in per_chunk), per_chunk
    assert entries[0]["id"].startswith("call_") and entries[0]["function"]["name"] == "get_weather"
    assert "city" in json.loads("".join(call["function"]["arguments"] for call in entries))


@pytest.mark.parametrize("name", ["", "a b", "<|im_end|>", 'quo"te', "x" * 65, "namespace.function"])
def test_a_function_name_openai_would_refuse_is_refused(served_tools: Served, name: str) -> None:
    import httpx

    tool = {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER, tool], "tool_choice": "required"}
    response = httpx.post(served_tools.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": f"tools[1].function.name {name!r} must be 1 to 64 characters of a-z, A-Z, 0-9, _ or -",
        "type": "invalid_request_error",
        "param": "tools",
        "code": 400,
    }


TWO_CALLS = CALL + "\n" + CALL.replace("Paris", "Oslo")


@pytest.mark.parametrize("parallel", [True, False, None])
def test_parallel_tool_calls_false_presents_the_first_call_only(
    served_tools: Served, script: Callable[[str], None], parallel: bool | None
) -> None:
    """Two calls in one reply: both reach the client unless the request set ``parallel_tool_calls: false``,
    which keeps the first (OpenAI's meaning; vLLM drops the calls after the first the same way)."""
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    script(TWO_CALLS)
    reply = served_tools.client.chat.completions.create(
        model="llama-synthetic-tiny",
        messages=[{"role": "user", "content": "Paris and Oslo?"}],
        tools=[WEATHER],
        **extra,
    )
    cities = [json.loads(call.function.arguments)["city"] for call in reply.choices[0].message.tool_calls or []]
    assert cities == (["Paris"] if parallel is False else ["Paris", "Oslo"])
    assert reply.choices[0].finish_reason == "tool_calls"
    assert reply.choices[0].message.content is None


def test_a_streamed_reply_without_parallel_calls_sends_the_first_call_only(
    served_tools: Served, script: Callable[[str], None]
) -> None:
    script(TWO_CALLS)
    stream = served_tools.client.chat.completions.create(
        model="llama-synthetic-tiny",
        messages=[{"role": "user", "content": "Paris and Oslo?"}],
        tools=[WEATHER],
        parallel_tool_calls=False,
        stream=True,
    )
    streamed = _assembled(stream)
    assert streamed.indexes == {0}
    assert json.loads(streamed.arguments) == {"city": "Paris"}
    assert streamed.content.strip() == ""
    assert streamed.finish == "tool_calls"


def test_tool_choice_none_keeps_the_tools_in_the_prompt_and_parses_no_call(
    served_tools: Served, script: Callable[[str], None]
) -> None:
    """The prompt is the one ``auto`` renders (tools in the template, as OpenAI and vLLM keep them), so a
    conversation that turns tools off for one turn keeps its cached prefix; call markup is content."""
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    rendered = {
        choice: httpx.post(
            served_tools.base_url + "/v1/chat/completions/render",
            json={"messages": messages, "tools": [WEATHER], "tool_choice": choice},
            timeout=30,
        ).json()["prompt_token_ids"]
        for choice in ("auto", "none")
    }
    plain = httpx.post(
        served_tools.base_url + "/v1/chat/completions/render", json={"messages": messages}, timeout=30
    ).json()["prompt_token_ids"]
    assert rendered["none"] == rendered["auto"]
    assert len(rendered["none"]) > len(plain)
    script(CALL)
    reply = served_tools.client.chat.completions.create(
        model="llama-synthetic-tiny", messages=messages, tools=[WEATHER], tool_choice="none"
    )
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].message.content == CALL
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None and reply.usage.prompt_tokens == len(rendered["auto"])
