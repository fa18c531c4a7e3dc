"""The SmolLM2 recipe's tool option: the JSON-tag template, its frontend and the option's refusals.

Rendering runs in Helios' own chat-template sandbox (``compile_chat_template``). No core is built
here; ``tests/server/test_demo_tools.py`` serves one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ignition.cli import main as ignition_main
from ignition.gguf import locate_smollm2_gguf, read_gguf
from ignition.recipes.smollm2 import (
    GGUF_CHAT_TEMPLATE,
    JSON_TAGS_CHAT_TEMPLATE,
    TOOL_SYNTAXES,
    json_tags_frontend,
    smollm2_declaration,
)

from helios_core.frontend.bootstrap import compile_chat_template
from helios_core.frontend.formats import ToolCallFormat
from helios_core.plugins.host import PluginHost
from helios_core.wire import contract_pb2 as ct

SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOLS_SECTION = (
    "\n\nYou may call the tools below. Each line inside <tools></tools> is the JSON schema of one tool:\n<tools>\n"
    '{"name": "get_weather", "description": "Current weather in a city", "parameters": {"type": "object", '
    '"properties": {"city": {"type": "string"}}, "required": ["city"]}}\n</tools>\n\n'
    'To call a tool, reply with <tool_call>{"name": <tool name>, "arguments": <arguments as a JSON object>}'
    "</tool_call>"
)

CONVERSATIONS_WITHOUT_TOOLS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke.\nA short one."},
    ],
    [{"role": "user", "content": ""}],
]


def _render(template: str, messages: list[dict[str, Any]], **variables: Any) -> str:
    text: str = compile_chat_template(template).render(messages=messages, **variables)
    return text


def test_the_extended_template_starts_from_the_packaged_ggufs() -> None:
    assert read_gguf(locate_smollm2_gguf()).get_str("tokenizer.chat_template") == GGUF_CHAT_TEMPLATE


@pytest.mark.parametrize("messages", CONVERSATIONS_WITHOUT_TOOLS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_without_tools_the_json_tags_template_renders_as_the_ggufs(
    messages: list[dict[str, Any]], generation_prompt: bool
) -> None:
    for tools in (None, []):
        assert _render(
            JSON_TAGS_CHAT_TEMPLATE, messages, tools=tools, add_generation_prompt=generation_prompt
        ) == _render(GGUF_CHAT_TEMPLATE, messages, add_generation_prompt=generation_prompt)


def test_tools_close_the_default_system_message() -> None:
    text = _render(
        JSON_TAGS_CHAT_TEMPLATE,
        [{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        add_generation_prompt=True,
    )
    assert text == (
        f"{SYSTEM}{TOOLS_SECTION}<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_tools_close_the_callers_system_message() -> None:
    text = _render(
        JSON_TAGS_CHAT_TEMPLATE,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        add_generation_prompt=False,
    )
    assert text == (
        f"<|im_start|>system\nBe brief.{TOOLS_SECTION}<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n"
    )


def test_assistant_calls_and_tool_results() -> None:
    def call(call_id: str, arguments: Any) -> dict[str, Any]:
        return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}

    messages = [
        {"role": "user", "content": "Weather in Paris and Lyon?"},
        # the server passes arguments as objects; a messages file may hold them as JSON text
        {"role": "assistant", "content": "Checking both.", "tool_calls": [
            call("call_1", {"city": "Paris"}), call("call_2", '{"city":"Lyon"}')
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "21 C"},
        {"role": "assistant", "content": None, "tool_calls": [call("call_3", {"city": "Nice"})]},
    ]  # fmt: skip
    text = _render(JSON_TAGS_CHAT_TEMPLATE, messages, tools=[WEATHER], add_generation_prompt=True)
    assert text == (
        f"{SYSTEM}{TOOLS_SECTION}<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris and Lyon?<|im_end|>\n"
        "<|im_start|>assistant\nChecking both.\n"
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
        '<tool_call>{"name": "get_weather", "arguments": {"city":"Lyon"}}</tool_call><|im_end|>\n'
        "<|im_start|>tool\n18 C<|im_end|>\n"
        "<|im_start|>tool\n21 C<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": {"city": "Nice"}}</tool_call>'
        "<|im_end|>\n<|im_start|>assistant\n"
    )


def test_the_frontend_selects_json_tags_with_chatml_boundaries() -> None:
    frontend = json_tags_frontend()
    assert frontend.tool_parser == ct.TOOL_PARSER_JSON_TAGS
    assert frontend.reasoning_parser == ct.REASONING_PARSER_NONE
    assert (frontend.tool_syntax.opener, frontend.tool_syntax.json_tags.call_open) == ("<tool_call>", "<tool_call>")
    assert frontend.tool_syntax.json_tags.call_close == "</tool_call>"
    assert (frontend.template_tokens.message_end, frontend.template_tokens.assistant_open) == (
        "<|im_end|>",
        "<|im_start|>assistant\n",
    )
    plugins = PluginHost(autoload=False)
    plugins.start()
    assert plugins.resolve(frontend).tool_parser.identifier == ct.TOOL_PARSER_JSON_TAGS
    parameters = WEATHER["function"]["parameters"]
    required = ToolCallFormat.from_syntax([("get_weather", parameters)], None, frontend.tool_syntax)
    assert required.grammar.markers == (("marker_0", "<tool_call>"), ("marker_1", "</tool_call>"))


def test_an_unknown_tool_syntax_is_refused_before_the_gguf_is_read() -> None:
    assert TOOL_SYNTAXES == ("none", "json-tags")
    with pytest.raises(ValueError, match="supports tool syntax none or json-tags, not 'xtml'"):
        smollm2_declaration(tool_syntax="xtml")


def test_the_cli_refuses_other_tool_syntaxes_before_making_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "smol.core"
    code = ignition_main(["build", "smollm2-135m-instruct", "--out", str(out), "--tool-syntax", "recipient-header"])
    assert code == 1
    assert capsys.readouterr().err == (
        "ignition: error: --tool-syntax recipient-header is not available for smollm2-135m-instruct "
        "(choose none or json-tags)\n"
    )
    assert list(tmp_path.iterdir()) == []
