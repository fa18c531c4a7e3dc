"""The versioned plugin API surface, the grammar hooks' composition rules, and a core that names no
syntax family: a plugin written for another major version is refused and isolated, a fragment that
breaks the composition rules is a clear 400, and the core modules leave every family to its plugin."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import grammar_walks
import pytest
from frontend_builders import base

from helios_core import plugin_api
from helios_core.errors import StartupError
from helios_core.frontend.bootstrap import PromptError
from helios_core.frontend.formats import ToolCallFormat, ToolChoiceError, envelope_reasoning
from helios_core.frontend.structured import GrammarCompiler
from helios_core.plugin_api import (
    PLUGIN_API_VERSION,
    DelimitedEnvelope,
    DelimitedReasoning,
    GrammarFragment,
    GrammarWriter,
    OutputDelta,
    Register,
    ToolGrammarRequest,
)
from helios_core.plugins import PluginHost
from helios_core.testing import byte_level_tokenizer
from helios_core.wire import contract_pb2 as ct

ROOT = Path(__file__).resolve().parents[2]
FAMILY_NAMES = re.compile(r"json_tags|function_tags|argument_tags|dsml|xtml|atem|think_tags|recipient_header", re.I)
CORE_FILES = [
    "helios_core/frontend/structured.py",
    "helios_core/frontend/formats.py",
    "helios_core/plugins/host.py",
    "helios_core/plugins/hookspecs.py",
    "helios_core/plugins/grammar.py",
    "helios_core/plugins/tag_grammar.py",
    "helios_core/plugin_api.py",
]
TOOLS = [("add", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})]


def test_the_core_names_no_syntax_family() -> None:
    offenders = [
        f"{name}:{number}: {line.strip()}"
        for name in CORE_FILES
        for number, line in enumerate((ROOT / name).read_text(encoding="utf-8").splitlines(), 1)
        if FAMILY_NAMES.search(line)
    ]
    assert offenders == []
    contract = (ROOT / "helios_core/contract/prepared.py").read_text(encoding="utf-8")
    table = contract[contract.index("def _tool_families") : contract.index("REQUIRED_TOOL_PARSER")]
    assert not FAMILY_NAMES.search(table)  # the tool parsers' syntax fields come from the contract schema


def test_the_family_check_catches_a_family_name() -> None:
    assert FAMILY_NAMES.search('if family == "dsml":') and FAMILY_NAMES.search("ct.TOOL_PARSER_ATEM")
    assert not FAMILY_NAMES.search("a grammar fragment of the selected tool plugin")


def test_the_surface_is_versioned_and_exports_what_it_lists() -> None:
    major, minor = plugin_api.PLUGIN_API_VERSION
    assert isinstance(major, int) and isinstance(minor, int) and major >= 1
    missing = [name for name in plugin_api.__all__ if not hasattr(plugin_api, name)]
    assert missing == []
    assert plugin_api.contract.FrontendContract is ct.FrontendContract  # the frontend part of the contract
    assert not hasattr(plugin_api.contract, "ModelContract")  # and nothing else of it


class Upper:
    def feed(self, text: str) -> list[OutputDelta]:
        return [OutputDelta(content=text.upper())]

    def finish(self) -> list[OutputDelta]:
        return []


def versioned(declared: Any) -> Any:
    class Plugin:
        HELIOS_PLUGIN_API = declared

        def helios_register_tool_parsers(self, register: Register) -> None:
            register(100001, lambda context: Upper(), name="upper")

    return Plugin()


def third_party() -> ct.FrontendContract:
    frontend = base(100001)
    frontend.tool_parser = 100001
    return frontend


@pytest.mark.parametrize(
    ("declared", "error"),
    [
        ((PLUGIN_API_VERSION[0] + 1, 0), rf"written for plugin API {PLUGIN_API_VERSION[0] + 1}\.0, but this Helios"),
        ((PLUGIN_API_VERSION[0], PLUGIN_API_VERSION[1] + 1), r"at most this minor version"),
        ("1.0", r"HELIOS_PLUGIN_API must be a \(major, minor\) tuple"),
    ],
)
def test_an_incompatible_plugin_is_refused_and_isolated(declared: Any, error: str) -> None:
    host = PluginHost(autoload=False)
    host.plugin_manager.register(versioned(declared), name="old-dist")
    with pytest.raises(StartupError, match=r"tool parser 100001 is selected by the core but no installed plugin"):
        host.resolve(third_party())
    entry = next(e for e in host.describe() if e["name"] == "old-dist")
    assert entry["status"] == "failed" and re.search(error, entry["error"]), entry["error"]
    assert host.resolve(base(ct.TOOL_PARSER_NONE)).tool_parser.plugin == "helios"  # the rest still serves


def test_a_compatible_declaration_is_served() -> None:
    host = PluginHost(autoload=False)
    host.plugin_manager.register(versioned((PLUGIN_API_VERSION[0], 0)), name="ok-dist")
    assert host.resolve(third_party()).tool_parser.name == "upper"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return byte_level_tokenizer(["<call>", "<|eos|>"])


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> GrammarCompiler:
    eos = tokenizer.token_to_id("<|eos|>")
    return GrammarCompiler(tokenizer, sampled_size=eos + 1, logits_width=288, eos_token_ids=[eos])


def fixed(lark: str) -> Any:
    return lambda request: GrammarFragment(lark)


@pytest.mark.parametrize(
    ("lark", "error"),
    [
        ('call: "x"', "must define the rule 'start' exactly once"),
        ('start: "x"\nstart: "y"', "must define the rule 'start' exactly once"),
        ('start: answer\nanswer: "x"', "defines 'answer', a rule the core reserves"),
        ('start: helios_thought\nhelios_thought: "x"', "defines 'helios_thought', a rule the core reserves"),
        ("start: (", "tools"),
    ],
)
def test_a_fragment_breaking_the_composition_rules_is_a_clear_error(
    compiler: GrammarCompiler, lark: str, error: str
) -> None:
    fmt = ToolCallFormat.for_frontend(TOOLS, None, third_party(), grammar=fixed(lark))
    with pytest.raises(PromptError, match=re.escape(error)):
        compiler.compile(fmt)


def test_a_grammar_returning_none_refuses_the_forced_choice() -> None:
    with pytest.raises(ToolChoiceError, match="not supported for this core's tool syntax"):
        ToolCallFormat.for_frontend(TOOLS, None, third_party(), grammar=lambda request: None)


def test_markers_are_tokens_and_the_envelope_comes_first(tokenizer: Any, compiler: GrammarCompiler) -> None:
    def grammar(request: ToolGrammarRequest) -> GrammarFragment:
        writer = GrammarWriter()
        (_, name, _), *_ = request.callable_tools()
        return writer.fragment([f'start: {writer.marker("<call>")} "{name}"'])

    fmt = ToolCallFormat.for_frontend(TOOLS, "add", third_party(), grammar=grammar)
    frontend = third_party()
    reasoning = envelope_reasoning(frontend, lambda _: DelimitedEnvelope(DelimitedReasoning("<t>", "</t>")))
    assert reasoning is not None and (reasoning.open, reasoning.close) == ("<t>", "</t>")
    plain = compiler.compile(fmt).matcher()
    call, (angle,) = tokenizer.token_to_id("<call>"), tokenizer.encode("<", add_special_tokens=False).ids
    assert grammar_walks.allowed(plain.mask(), 258).tolist() == [call]  # the marker as its token
    thinking = compiler.compile(fmt, reasoning=reasoning).matcher()
    assert grammar_walks.allowed(thinking.mask(), 258).tolist() == sorted([angle, call])  # reasoning may come first
