"""``ignition build llama-synthetic --reasoning think-tags``: think-tag reasoning for the synthetic cores of
``--tool-syntax none`` and ``json-tags``.

The built core has ``<think>`` and ``</think>`` as single special tokens after the tool syntax's, selects
think-tag reasoning (not terminal) and renders a ChatML template with an assistant message's
``reasoning_content`` as ``<think>REASONING</think>`` before its content and, after the generation prompt,
an empty closed block when the request sets ``enable_thinking`` to false. The tool syntaxes that carry
their own reasoning and the other recipes refuse the option with one line before any key is made;
``--reasoning none`` builds the bytes a build without the option does. One core is served, its reply scripted, to see
the reasoning split from the answer end to end.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from ignition.recipes.synthetic import (
    CHATML_JSON_TOOLS_TEMPLATE,
    CHATML_TEMPLATE,
    check_extra_special,
    synthetic_declaration,
)
from tokenizers import Tokenizer

from helios_core.container.keys import generate_keys
from helios_core.frontend.bootstrap import Bootstrap, compile_chat_template
from helios_core.frontend.detokenizer import hidden_special_ids, output_syntax_texts
from helios_core.loading import TrustSettings, VerifiedCore, open_core
from helios_core.wire import contract_pb2 as ct
from tests.ignition.cli_helpers import build as _build
from tests.ignition.cli_helpers import refused as _refused
from tests.server.conftest import Served, serve_fixture
from tests.server.helpers import scripted_replies

NAMESPACE = "helios-tests/reasoning"
SMALL = ("--max-rows", "2", "--namespace", NAMESPACE)
ASK = {"role": "user", "content": "Hi"}
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
PLAIN_TEMPLATES = {"none": CHATML_TEMPLATE, "json-tags": CHATML_JSON_TOOLS_TEMPLATE}
SYNTAX_TOKENS = {"none": 0, "json-tags": 2}
"""The special tokens each tool syntax adds before ``<think>``."""


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return generate_keys(tmp_path_factory.mktemp("keys") / "keys")


@dataclass(frozen=True)
class Thinking:
    """A think-tag core built by the command line, verified and opened by Helios."""

    tool_syntax: str
    path: Path
    verified: VerifiedCore
    bootstrap: Bootstrap

    @property
    def frontend(self) -> ct.FrontendContract:
        return self.verified.contract.model.frontend

    def render(self, messages: list[dict[str, Any]], **variables: Any) -> str:
        tools = [WEATHER] if self.tool_syntax == "json-tags" and variables.pop("tools", False) else None
        return self.bootstrap.render(messages, tools=tools, client_variables=variables)


@pytest.fixture(scope="module", params=["none", "json-tags"])
def thinking(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, keys: dict[str, Path]
) -> Iterator[Thinking]:
    syntax: str = request.param
    out = tmp_path_factory.mktemp("thinking") / f"{syntax}.core"
    extra = ("--reasoning", "think-tags", "--tool-syntax", syntax, *SMALL)
    assert _build(out, *extra, key=keys["signing"]) == 0
    verified = open_core(out, TrustSettings((keys["public"],), NAMESPACE, None))  # signature, resources, contract
    try:
        yield Thinking(syntax, out, verified, Bootstrap.load(verified.core, verified.contract))
    finally:
        verified.close()


# -- the built core ------------------------------------------------------------------------------------


def test_the_core_selects_think_tag_reasoning(thinking: Thinking) -> None:
    frontend = thinking.frontend
    assert frontend.reasoning_parser == ct.REASONING_PARSER_THINK_TAGS
    syntax = frontend.reasoning_syntax
    assert (syntax.open, syntax.close, syntax.wrapping_newlines, syntax.terminal_marker) == (
        "<think>",
        "</think>",
        True,
        "",
    )
    tool_parser = {"none": ct.TOOL_PARSER_NONE, "json-tags": ct.TOOL_PARSER_JSON_TAGS}[thinking.tool_syntax]
    assert frontend.tool_parser == tool_parser
    assert (frontend.template_tokens.message_end, frontend.template_tokens.assistant_open) == (
        "<|im_end|>",
        "<|im_start|>assistant\n",
    )
    assert list(frontend.template_variables) == []  # no default: a request's chat_template_kwargs decide


def test_the_think_tags_are_single_special_tokens_clients_see(thinking: Thinking) -> None:
    tokenizer = thinking.bootstrap.tokenizer
    first = 259 + SYNTAX_TOKENS[thinking.tool_syntax]
    assert [tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")] == [first, first + 1]
    assert tokenizer.encode("<think>plan</think>", add_special_tokens=False).ids == [
        first,
        *b"plan",
        first + 1,
    ]
    added = tokenizer.get_added_tokens_decoder()
    assert added[first].special and added[first + 1].special
    assert thinking.verified.contract.sampled_size == first + 2
    # the reasoning syntax spells them, so Helios keeps their text for the reasoning parser
    hidden = hidden_special_ids(tokenizer, output_syntax_texts(thinking.frontend))
    assert first not in hidden and first + 1 not in hidden


def test_thinking_is_on_unless_enable_thinking_is_false(thinking: Thinking) -> None:
    prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert thinking.render([ASK]) == prompt  # the model may open <think> itself
    assert thinking.render([ASK], enable_thinking=True) == prompt
    assert thinking.render([ASK], enable_thinking=False) == prompt + "<think>\n\n</think>\n\n"
    assert thinking.render([ASK], tools=True, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_an_assistant_message_renders_its_reasoning_before_its_content(thinking: Thinking) -> None:
    messages = [
        ASK,
        {"role": "assistant", "content": "Hello.", "reasoning_content": "Greet back."},
        {"role": "user", "content": "Bye"},
    ]
    rendered = thinking.render(messages)
    assert rendered == (
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<think>Greet back.</think>Hello.<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = thinking.bootstrap.encode_prompt(messages)
    opener = 259 + SYNTAX_TOKENS[thinking.tool_syntax]
    assert ids.count(opener) == ids.count(opener + 1) == 1  # the template's tags, as single tokens


def test_a_conversation_without_reasoning_renders_as_without_the_option(thinking: Thinking) -> None:
    messages = [ASK, {"role": "assistant", "content": "Yo"}, {"role": "user", "content": "Bye"}]
    plain = compile_chat_template(PLAIN_TEMPLATES[thinking.tool_syntax])
    assert thinking.render(messages) == plain.render(messages=messages, add_generation_prompt=True)


def test_reasoning_comes_before_the_tool_calls() -> None:
    declaration = synthetic_declaration("tiny", tool_syntax="json-tags", reasoning="think-tags")
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    message = {"role": "assistant", "content": None, "reasoning_content": "Look it up.", "tool_calls": [call]}
    assert compile_chat_template(declaration.chat_template).render(messages=[message]) == (
        "<|im_start|>assistant\n<think>Look it up.</think>"
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>\n'
    )


def test_a_third_party_reasoning_parser_keeps_the_think_tags(tmp_path: Path, keys: dict[str, Path]) -> None:
    out = tmp_path / "x.core"
    assert _build(out, "--reasoning", "think-tags", "--reasoning-parser", "100002", *SMALL, key=keys["signing"]) == 0
    verified = open_core(out, TrustSettings((keys["public"],), NAMESPACE, None))
    try:
        frontend = verified.contract.model.frontend
        assert (frontend.reasoning_parser, frontend.reasoning_syntax.open) == (100002, "<think>")
    finally:
        verified.close()


# -- refusals ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("recipe", "extra", "message"),
    [
        (
            "llama-synthetic",
            ["--tool-syntax", "xtml"],
            "--reasoning think-tags cannot be combined with --tool-syntax xtml: that tool syntax carries its own "
            "reasoning",
        ),
        (
            "llama-synthetic",
            ["--tool-syntax", "recipient-header"],
            "--reasoning think-tags cannot be combined with --tool-syntax recipient-header: that tool syntax "
            "carries its own reasoning",
        ),
        (
            "llama-synthetic",
            ["--extra-special", "<a>,<think>"],
            "--extra-special token '<think>' is already added by --reasoning think-tags",
        ),
        (
            "llama-synthetic",
            ["--tool-syntax", "json-tags", "--extra-special", "</think>"],
            "--extra-special token '</think>' is already added by --reasoning think-tags",
        ),
        ("smollm2-135m-instruct", [], "smollm2-135m-instruct does not take --reasoning think-tags"),
        (
            "smollm2-135m-instruct",
            ["--shape", "tiny"],
            "smollm2-135m-instruct does not take --shape, --reasoning think-tags",
        ),
        ("recurrent-synthetic", [], "recurrent-synthetic does not take --reasoning think-tags"),
        ("latent-synthetic", [], "latent-synthetic does not take --reasoning think-tags"),
        ("vision-synthetic", [], "vision-synthetic does not take --reasoning think-tags"),
        (
            "vision-synthetic",
            ["--tool-syntax", "json-tags"],
            "vision-synthetic does not take --reasoning think-tags",
        ),
    ],
)
def test_think_tags_are_refused_where_they_cannot_be_built_before_any_key_is_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], recipe: str, extra: list[str], message: str
) -> None:
    _refused(capsys, _build(tmp_path / "x.core", "--reasoning", "think-tags", *extra, recipe=recipe), message)
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_reasoning_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        _build(tmp_path / "x.core", "--reasoning", "2")
    assert exited.value.code == 2
    assert "argument --reasoning: invalid choice: '2' (choose from 'none', 'think-tags')" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_the_declaration_refuses_what_the_command_line_refuses() -> None:
    with pytest.raises(ValueError, match=r"^--reasoning think-tags cannot be combined with --tool-syntax xtml: "):
        synthetic_declaration("tiny", tool_syntax="xtml", reasoning="think-tags")
    with pytest.raises(ValueError, match=r"^unknown reasoning 'tags'; known: none, think-tags$"):
        synthetic_declaration("tiny", reasoning="tags")
    with pytest.raises(ValueError, match=r"^--extra-special token '<think>' is already added by --reasoning"):
        synthetic_declaration("tiny", extra_special=("<think>",), reasoning="think-tags")
    check_extra_special(("<think>", "</think>"))  # without think tags they are the caller's own tokens


# -- --reasoning none ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("recipe", "extra"),
    [
        ("llama-synthetic", []),
        ("llama-synthetic", ["--tool-syntax", "json-tags", "--extra-special", "<think>,</think>"]),
        ("llama-synthetic", ["--tool-syntax", "xtml"]),
        ("llama-synthetic", ["--tool-syntax", "recipient-header"]),
        ("recurrent-synthetic", []),
    ],
)
def test_reasoning_none_builds_the_same_core(
    tmp_path: Path, keys: dict[str, Path], recipe: str, extra: list[str]
) -> None:
    without, none = tmp_path / "without.core", tmp_path / "none.core"
    assert _build(without, *SMALL, *extra, recipe=recipe, key=keys["signing"]) == 0
    assert _build(none, *SMALL, *extra, "--reasoning", "none", recipe=recipe, key=keys["signing"]) == 0
    assert none.read_bytes() == without.read_bytes()


@pytest.mark.parametrize("tool_syntax", ["none", "json-tags", "recipient-header", "xtml"])
def test_reasoning_none_adds_no_think_tags(tool_syntax: str) -> None:
    declaration = synthetic_declaration("tiny", tool_syntax=tool_syntax, reasoning="none")
    assert Tokenizer.from_str(declaration.tokenizer_json).token_to_id("<think>") is None
    assert declaration.frontend is None or declaration.frontend.reasoning_parser != ct.REASONING_PARSER_THINK_TAGS
    if tool_syntax in PLAIN_TEMPLATES:
        assert declaration.chat_template == PLAIN_TEMPLATES[tool_syntax]


# -- served end to end ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, keys: dict[str, Path]) -> Iterator[Served]:
    out = tmp_path_factory.mktemp("served") / "think.core"
    extra = ("--reasoning", "think-tags", "--tool-syntax", "json-tags", *SMALL)
    assert _build(out, *extra, key=keys["signing"]) == 0
    with serve_fixture(core=out, trust=TrustSettings((keys["public"],), NAMESPACE, None)) as value:
        yield value


def _reply(served: Served, text: str, **body: Any) -> Any:
    with scripted_replies(served.running) as say:
        say(text)
        reply = served.client.chat.completions.create(
            model="llama-synthetic-tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=200, **body
        )
    return reply.choices[0]


def test_a_reply_splits_its_reasoning_from_its_answer(served: Served) -> None:
    choice = _reply(served, "<think>plan</think>Answer.")
    assert choice.finish_reason == "stop"
    assert getattr(choice.message, "reasoning_content", None) == "plan"
    assert choice.message.content == "Answer."


def test_a_call_after_reasoning_is_parsed(served: Served) -> None:
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    choice = _reply(served, "<think>\nLook it up.\n</think>\n\n" + call, tools=[WEATHER])
    assert choice.finish_reason == "tool_calls"
    assert getattr(choice.message, "reasoning_content", None) == "Look it up."
    (tool_call,) = choice.message.tool_calls or []
    assert (tool_call.function.name, json.loads(tool_call.function.arguments)) == ("get_weather", {"city": "Paris"})


def test_thinking_off_answers_at_once(served: Served) -> None:
    import httpx

    switch = {"chat_template_kwargs": {"enable_thinking": False}}
    body = {"messages": [ASK], **switch}
    rendered = httpx.post(served.base_url + "/v1/chat/completions/render", json=body, timeout=60)
    assert rendered.status_code == 200, rendered.text
    prompt = served.running.bootstrap.tokenizer.decode(rendered.json()["prompt_token_ids"], skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    choice = _reply(served, "Answer.", extra_body=switch)
    assert getattr(choice.message, "reasoning_content", None) is None
    assert choice.message.content == "Answer."
