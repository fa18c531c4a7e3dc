"""A structured-output grammar is compiled once, off the model worker, and its work per token is bounded.

Every llguidance grammar construction goes through a recorder that notes the calling thread; constrained
requests then run through the engine directly (compiled by ``Engine.submit`` on the caller's thread) and
through the HTTP server (compiled by preparation), and none of the recorded calls may be on the model
worker's thread. A gate refuses a request whose format was not compiled before submission, and a grammar
whose lexer needs more work on one token than :class:`GrammarLimits` allow fails instead of stalling.
"""

from __future__ import annotations

import json
import threading
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llguidance
import msgspec
import pytest

from helios_core.frontend import structured
from helios_core.frontend.formats import ResponseFormat, parse_response_format
from helios_core.frontend.structured import GrammarCompiler, GrammarError, GrammarLimits, GrammarMatcher
from helios_core.loading import TrustSettings
from helios_core.runtime.gates import HostGate
from helios_core.runtime.messages import AdmissionRejected, Finished, PreparedRequest, SamplingParams, TokenEvent
from helios_core.runtime.startup import RunningModel
from tests.server.conftest import serve_fixture
from tests.server.helpers import build_synthetic_core

WORKER = "helios-model-worker"
GREEDY = SamplingParams(temperature=0.0)
MESSAGES = [{"role": "user", "content": "Hello there"}]
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "kind": {"enum": ["a", "b", "c"]},
        "inner": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
    },
    "required": ["name", "kind"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
NESTED_PATTERN = "^((([a-z]{1,16}){1,16}){1,16})$"
"""Nested counted repetitions: each letter makes llguidance's lexer build many new states."""
NAMESPACE = "helios-tests/grammar-once"
CITY_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,6}$"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


class _Recorder:
    """Thread names of every grammar compilation and llguidance grammar construction."""

    def __init__(self) -> None:
        self.threads: list[str] = []
        self._lock = threading.Lock()

    def note(self) -> None:
        with self._lock:
            self.threads.append(threading.current_thread().name)

    def wrap(self, function: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            self.note()
            return function(*args, **kwargs)

        return recorded


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> _Recorder:
    """Record ``GrammarCompiler.compile`` and every llguidance grammar and matcher construction the
    structured-output module makes (a matcher's copy, the worker's part, is not a construction)."""
    record = _Recorder()
    real = llguidance.LLMatcher
    matcher = types.SimpleNamespace(
        grammar_from_json_schema=record.wrap(real.grammar_from_json_schema),
        grammar_from_lark=record.wrap(real.grammar_from_lark),
    )
    constructed = record.wrap(real)
    members = {"__new__": lambda cls, *args, **kwargs: constructed(*args, **kwargs), **vars(matcher)}
    module = types.SimpleNamespace(
        LLMatcher=type("LLMatcherRecorder", (), members),
        LLParserLimits=llguidance.LLParserLimits,
        LLTokenizer=llguidance.LLTokenizer,
    )
    monkeypatch.setattr(structured, "llguidance", module)
    monkeypatch.setattr(GrammarCompiler, "compile", record.wrap(GrammarCompiler.compile))
    return record


def _format(value: dict[str, Any]) -> ResponseFormat:
    fmt = parse_response_format(value)
    assert fmt is not None
    return fmt


def _events(running: RunningModel, request: PreparedRequest) -> list[Any]:
    return list(running.engine.submit(request))


# -- the engine ---------------------------------------------------------------------------------------


def test_the_worker_never_compiles_a_request_submitted_to_the_engine(
    start_fixture: Callable[..., RunningModel], recorder: _Recorder
) -> None:
    running = start_fixture()
    prompt = running.bootstrap.encode_prompt(MESSAGES)
    formats = [JSON_SCHEMA_FORMAT, {"type": "json_object"}, JSON_SCHEMA_FORMAT]
    streams = [
        running.engine.submit(PreparedRequest(f"c{index}", prompt, 24, GREEDY, response_format=json.dumps(fmt)))
        for index, fmt in enumerate(formats)
    ]
    for stream in streams:
        events = list(stream)
        assert isinstance(events[-1], Finished), events[-1]
        assert any(isinstance(event, TokenEvent) for event in events)
    assert recorder.threads  # the formats were compiled, on the submitting thread
    assert set(recorder.threads) == {threading.current_thread().name}
    assert WORKER not in recorder.threads


def test_a_format_that_does_not_compile_is_refused_at_submission(start_fixture: Callable[..., RunningModel]) -> None:
    running = start_fixture()
    prompt = running.bootstrap.encode_prompt(MESSAGES)
    bad = json.dumps({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
    events = _events(running, PreparedRequest("bad", prompt, 8, GREEDY, response_format=bad))
    assert len(events) == 1
    rejected = events[0]
    assert isinstance(rejected, AdmissionRejected)
    assert rejected.message.startswith("cannot prepare the request's output constraints: PromptError: ")
    assert (rejected.param, rejected.permanent) == ("response_format", True)


def test_a_text_format_constrains_nothing(start_fixture: Callable[..., RunningModel]) -> None:
    running = start_fixture()
    prompt = running.bootstrap.encode_prompt(MESSAGES)
    plain = running.engine.generate(PreparedRequest("plain", prompt, 6, GREEDY, ignore_eos=True))
    text = PreparedRequest("text", prompt, 6, GREEDY, ignore_eos=True, response_format=json.dumps({"type": "text"}))
    assert running.engine.generate(text).token_ids == plain.token_ids


def test_a_gate_refuses_a_format_that_was_not_compiled(start_fixture: Callable[..., RunningModel]) -> None:
    running = start_fixture()
    tokenizer, compiler = running.bootstrap.tokenizer, running.grammar_compiler
    uncompiled = PreparedRequest("u", [1, 2], 4, GREEDY, response_format=json.dumps({"type": "json_object"}))
    with pytest.raises(ValueError, match=r"^the request's response_format was not compiled before submission"):
        HostGate(uncompiled, tokenizer, compiler)
    foreign = GrammarCompiler(
        tokenizer, sampled_size=compiler.sampled_size, logits_width=compiler.mask_words * 32, eos_token_ids=[0]
    )
    other = foreign.compile(_format({"type": "json_object"}))
    with pytest.raises(ValueError, match=r"^the request's grammar was not compiled by this engine's grammar compiler$"):
        HostGate(msgspec.structs.replace(uncompiled, grammar=other), tokenizer, compiler)
    own = compiler.compile(_format({"type": "json_object"}))
    assert HostGate(msgspec.structs.replace(uncompiled, grammar=own), tokenizer, compiler).constrained


# -- the HTTP server ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tools_core(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    built = build_synthetic_core(tmp_path_factory.mktemp("grammar-once"), NAMESPACE, tool_syntax="json-tags")
    return built.path, built.public_key


def test_the_worker_never_compiles_a_request_served_over_http(
    tools_core: tuple[Path, Path], recorder: _Recorder
) -> None:
    core, key = tools_core
    with serve_fixture(core=core, trust=TrustSettings((key,), NAMESPACE, None)) as served:
        client = served.client
        answer = client.chat.completions.create(
            model="llama-synthetic-tiny",
            messages=MESSAGES,
            max_tokens=60,
            response_format=JSON_SCHEMA_FORMAT,  # type: ignore[call-overload]
        )
        called = client.chat.completions.create(
            model="llama-synthetic-tiny",
            messages=MESSAGES,
            max_tokens=60,
            tools=[CITY_TOOL],
            tool_choice="required",  # type: ignore[call-overload]
        )
    assert answer.choices[0].finish_reason in {"stop", "length"}
    assert called.choices[0].finish_reason in {"tool_calls", "length"}
    assert len(recorder.threads) >= 2  # each request's grammar, compiled by preparation
    assert WORKER not in recorder.threads


# -- bounded work per token ---------------------------------------------------------------------------


def _spell_letters(matcher: GrammarMatcher, letter: int, count: int) -> None:
    for _ in range(count):
        matcher.mask()
        matcher.advance(letter)


def test_a_pattern_that_needs_too_much_lexer_work_per_token_fails_its_matcher(
    start_fixture: Callable[..., RunningModel],
) -> None:
    """Under llguidance's own limits the nested pattern's matcher goes on, building more lexer states on
    every letter; under the compiler's limits it fails within a few letters with llguidance's error."""
    running = start_fixture()
    tokenizer, compiler = running.bootstrap.tokenizer, running.grammar_compiler
    ids = {tokenizer.decode([token]): token for token in range(compiler.sampled_size)}
    fmt = _format(
        {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "string", "pattern": NESTED_PATTERN}}}
    )
    assert compiler.limits == GrammarLimits()
    bounded = compiler.compile(fmt).matcher()
    bounded.advance(ids['"'])
    with pytest.raises(GrammarError, match=r"^grammar matcher failed: lexer error: too many expressions constructed$"):
        _spell_letters(bounded, ids["a"], 40)
    unbounded_compiler = GrammarCompiler(
        tokenizer,
        sampled_size=compiler.sampled_size,
        logits_width=compiler.mask_words * 32,
        eos_token_ids=compiler.eos_token_ids,
        limits=GrammarLimits(step_lexer_fuel=200_000, max_lexer_states=250_000),
    )
    unbounded = unbounded_compiler.compile(fmt).matcher()
    unbounded.advance(ids['"'])
    _spell_letters(unbounded, ids["a"], 40)  # llguidance's defaults let it go on
