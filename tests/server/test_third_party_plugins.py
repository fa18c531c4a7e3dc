"""A third-party parser wheel serves a core that selects its identifier; a broken wheel stays isolated.

Both distributions live in ``contrib/`` and are installed by the README's test command
(``contrib/example-plugin``: a bracket-call tool parser and its call grammar under 100001;
``contrib/broken-plugin``: fails at import on purpose, declaring 100002). The example's grammar
serves ``tool_choice`` ``"required"`` and named functions through the grammar hook: the random-weight
model generates under it (nothing scripted), and the example's parser reads the one call back.
A parser returning wrong types, or raising, ends only its request with an ``execution_error`` naming
the parser, and nothing of the bad output reaches the client.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
from ignition.build import build_core
from ignition.preparation import frontend as declarations
from ignition.recipes.llama import Capacities
from ignition.recipes.synthetic import synthetic_declaration

from helios_core.container.keys import generate_keys, load_private_key
from helios_core.errors import StartupError
from helios_core.loading import TrustSettings
from helios_core.plugin_api import OutputDelta
from helios_core.plugins.host import describe_plugins

from .conftest import Served, serve_fixture
from .helpers import chat, scripted_replies, sse_events

NAMESPACE = "helios-tests/third-party"
EXAMPLE_IDENTIFIER = 100_001
BROKEN_IDENTIFIER = 100_002


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


if not (_installed("helios-example-plugin") and _installed("helios-broken-plugin")):
    if os.environ.get("CI"):
        raise RuntimeError("the README's test command installs contrib/example-plugin and contrib/broken-plugin")
    pytest.skip("contrib example and broken plugins are not installed", allow_module_level=True)


def _core(tmp_path_factory: pytest.TempPathFactory, tool_parser: int) -> tuple[object, TrustSettings]:
    tmp = tmp_path_factory.mktemp(f"plugin{tool_parser}")
    keys = generate_keys(tmp / "keys")
    model = synthetic_declaration("tiny", seed=2)
    model.frontend = declarations.plain(tool_parser)
    path = tmp / "core.core"
    caps = Capacities(max_rows=2, prefill_tokens=(64,), decode_rows=(1, 2), page_tokens=16, cache_pages=64, context=256)
    build_core(model, path, caps=caps, signing_key=load_private_key(keys["signing"]), namespace=NAMESPACE)
    return path, TrustSettings((keys["public"],), NAMESPACE, None)


@pytest.fixture(scope="module")
def served_third_party(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    core, trust = _core(tmp_path_factory, EXAMPLE_IDENTIFIER)
    with serve_fixture(core=core, trust=trust) as served:  # type: ignore[arg-type]
        yield served


def test_the_example_wheel_parses_tool_calls_of_a_core_that_selects_it(served_third_party: Served) -> None:
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    with scripted_replies(served_third_party.running) as say:
        say('Checking. [[get_weather {"city": "Paris"}]]')
        reply = served_third_party.client.chat.completions.create(
            model="llama-synthetic-tiny", messages=[{"role": "user", "content": "Weather?"}], tools=[weather]
        )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


ADD = {
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
ECHO = {
    "type": "function",
    "function": {
        "name": "echo",
        "parameters": {
            "type": "object",
            "properties": {"word": {"enum": ["yes", "no"]}},
            "required": ["word"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize(
    ("tool_choice", "seed"), [("required", 1), ("required", 2), ({"type": "function", "function": {"name": "echo"}}, 3)]
)
def test_the_example_grammar_serves_a_forced_tool_choice(
    served_third_party: Served, tool_choice: Any, seed: int
) -> None:
    reply = served_third_party.client.chat.completions.create(
        model="llama-synthetic-tiny",
        messages=[{"role": "user", "content": "Use a tool."}],
        tools=[ADD, ECHO],  # type: ignore[list-item]
        tool_choice=tool_choice,
        temperature=1.0,
        seed=seed,
        max_tokens=64,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not (choice.message.content or "").strip()
    (call,) = choice.message.tool_calls or []
    arguments = json.loads(call.function.arguments)
    if isinstance(tool_choice, dict):
        assert call.function.name == "echo"
    if call.function.name == "echo":
        assert arguments in ({"word": "yes"}, {"word": "no"})
    else:
        assert call.function.name == "add" and set(arguments) == {"a", "b"}
        assert type(arguments["a"]) is int and 0 <= arguments["a"] <= 99 and type(arguments["b"]) is bool


def test_the_broken_wheel_is_reported_and_isolated(served_third_party: Served) -> None:
    # The core above serves although the broken plugin is installed; the listing reports the failure.
    listing = {entry["name"]: entry for entry in describe_plugins()}
    broken = listing["helios-broken-plugin"]
    assert broken["status"] == "failed" and "broken on purpose" in broken["error"]
    assert listing["helios-example-plugin"]["status"] == "ok"
    assert served_third_party.client.models.list().data[0].id == "llama-synthetic-tiny"


def test_a_core_selecting_the_broken_identifier_fails_startup_naming_it(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    core, trust = _core(tmp_path_factory, BROKEN_IDENTIFIER)
    with (
        pytest.raises(StartupError, match=r"tool parser 100002 .*helios-broken-plugin"),
        serve_fixture(
            core=core,
            trust=trust,  # type: ignore[arg-type]
        ),
    ):
        pass


EXAMPLE_PARSER = f"tool parser {EXAMPLE_IDENTIFIER} (bracket-calls from helios-example-plugin)"


def _wrong_content(self: Any, text: str) -> list[OutputDelta]:
    return [OutputDelta(content=123)]  # type: ignore[arg-type]


def _raising(self: Any, text: str) -> list[OutputDelta]:
    raise LookupError("parser state lost")


@pytest.mark.parametrize(
    ("feed", "problem"),
    [
        (_wrong_content, "returned an OutputDelta from feed() whose content is int, not str or None"),
        (_raising, "failed in feed(): LookupError: parser state lost"),
    ],
)
@pytest.mark.parametrize("stream", [True, False])
def test_a_parser_plugin_failure_ends_only_its_request_naming_the_parser(
    served_third_party: Served, monkeypatch: pytest.MonkeyPatch, feed: Any, problem: str, stream: bool
) -> None:
    parser_class = importlib.import_module("helios_example_plugin").BracketCallParser
    with monkeypatch.context() as patch:
        patch.setattr(parser_class, "feed", feed)
        with scripted_replies(served_third_party.running) as say:
            say("Some answer text.")
            response = chat(served_third_party.base_url, max_tokens=16, stream=stream)
    expected = f"output handling failed: ParserPluginError: {EXAMPLE_PARSER} {problem}"
    if stream:
        events = sse_events(response)
        assert '"content":123' not in response.text.replace(" ", "")
        name, data = events[-1]
        assert name == "error" and data["error"] == {**data["error"], "type": "execution_error", "message": expected}
    else:
        assert response.status_code == 500
        assert response.json()["error"]["message"] == expected
    assert chat(served_third_party.base_url, max_tokens=4).status_code == 200  # later requests are served
