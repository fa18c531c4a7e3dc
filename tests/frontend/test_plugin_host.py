"""The plugin host: in-process third-party identifiers, duplicates and ``prefer`` (fatal only to a
core that selects the clashing identifier), the reserved identifier ranges (a third-party plugin
registering a built-in identifier is isolated), missing identifiers, isolation of a plugin that fails
to import (``SystemExit`` and other ``BaseException``s included), the allowlist and autoload
switches, pairing failures, hook documentation and the ``helios plugins`` listing (text and
``--json``)."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import inspect
import io
import json
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from frontend_builders import base, function_tags, recipient_header, xtml

from helios_core.errors import StartupError
from helios_core.plugin_api import OutputDelta, ParserContext, Register, ToolSpec
from helios_core.plugins import PluginHost, hookspecs
from helios_core.plugins.cli_command import add_plugins_command, run_plugins_command
from helios_core.testing import FrontendHarness
from helios_core.wire import contract_pb2 as ct


class Upper:
    """A toy third-party tool parser: upper-cases content."""

    def feed(self, text: str) -> list[OutputDelta]:
        return [OutputDelta(content=text.upper())]

    def finish(self) -> list[OutputDelta]:
        return []


class UpperPlugin:
    def helios_register_tool_parsers(self, register: Register) -> None:
        register(100001, lambda context: Upper(), name="upper")


class ShadowPlugin:
    def helios_register_tool_parsers(self, register: Register) -> None:
        register(100001, lambda context: Upper(), name="shadow")


@dataclass
class FakeEntryPoint:
    name: str
    value: str
    group: str
    dist: Any
    error: Exception | None = None
    plugin: Any = None

    def load(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.plugin


def dist(name: str) -> Any:
    return SimpleNamespace(name=name, version="1.0", metadata=None)


def third_party(identifier: int = 100001) -> ct.FrontendContract:
    frontend = base(identifier)
    frontend.tool_parser = identifier
    return frontend


def test_third_party_identifier_served_in_process(tokenizer: Any) -> None:
    harness = FrontendHarness(tokenizer, third_party(), plugins=[UpperPlugin()])
    assert harness.run_text("hello").output.content == "HELLO"


def test_missing_identifier_names_it() -> None:
    with pytest.raises(StartupError, match="tool parser 100001 is selected by the core but no installed plugin"):
        PluginHost(autoload=False).resolve(third_party())


def test_zero_never_selects() -> None:
    frontend = base(ct.TOOL_PARSER_NONE)
    frontend.image_layout = 0
    with pytest.raises(StartupError, match="selects no image layout"):
        PluginHost(autoload=False).resolve(frontend)


def test_duplicates_fail_naming_both_unless_preferred() -> None:
    host = PluginHost(autoload=False)
    host.plugin_manager.register(UpperPlugin(), name="upper-dist")
    host.plugin_manager.register(ShadowPlugin(), name="shadow-dist")
    with pytest.raises(StartupError, match=r"100001 is provided by both 'shadow-dist' .* and 'upper-dist'"):
        host.resolve(third_party())
    host = PluginHost(autoload=False, prefer={100001: "shadow"})
    host.plugin_manager.register(UpperPlugin(), name="upper-dist")
    host.plugin_manager.register(ShadowPlugin(), name="shadow-dist")
    assert host.resolve(third_party()).tool_parser.name == "shadow"


class BuiltinClash:
    """A third-party plugin registering the built-in ``TOOL_PARSER_NONE`` and a third-party parser."""

    def helios_register_tool_parsers(self, register: Register) -> None:
        register(100005, lambda context: Upper(), name="fine")
        register(ct.TOOL_PARSER_NONE, lambda context: Upper(), name="clash")


RESERVED_ERROR = (
    "ValueError: tool parser 1 (clash) is a built-in identifier, reserved for Helios's built-in plugins; "
    "a third-party plugin registers identifiers in the third-party range 100000-199999"
)


def test_a_plugin_registering_a_builtin_identifier_in_process_is_isolated(tokenizer: Any) -> None:
    host = PluginHost(autoload=False)
    host.plugin_manager.register(BuiltinClash(), name="clash-dist")
    selected = host.resolve(base(ct.TOOL_PARSER_NONE))
    assert (selected.tool_parser.plugin, selected.tool_parser.name) == ("helios", "none")
    assert host.conflicts == []
    entry = next(e for e in host.describe() if e["name"] == "clash-dist")
    assert (entry["status"], entry["error"]) == ("failed", RESERVED_ERROR)
    assert 100005 not in host.registries["tool_parser"]  # a failed plugin's registrations are dropped
    harness = FrontendHarness(tokenizer, base(ct.TOOL_PARSER_NONE), plugins=[BuiltinClash()])
    assert harness.run_text("hello").output.content == "hello"  # the built-in, not the upper-casing clash


def test_a_distribution_registering_a_builtin_identifier_is_listed_failed_and_the_builtin_serves() -> None:
    entry_points = [FakeEntryPoint("clash", "helios_clash", "helios", dist("helios-clash"), plugin=BuiltinClash())]
    host = PluginHost(entry_points=entry_points, environ={})
    assert host.resolve(base(ct.TOOL_PARSER_NONE)).tool_parser.plugin == "helios"
    out = io.StringIO()
    assert run_plugins_command(argparse.Namespace(json=False), host=host, out=out) == 0  # no clash
    lines = out.getvalue().splitlines()
    assert f"helios-clash 1.0: clash = helios_clash [failed] (no identifiers declared) error: {RESERVED_ERROR}" in lines
    assert not any("conflict" in line for line in lines)


def test_a_builtin_plugin_registers_only_builtin_values() -> None:
    class ThirdPartyNumber:
        def helios_register_tool_parsers(self, register: Register) -> None:
            register(100001, lambda context: Upper(), name="numbered")

    entry_points = [FakeEntryPoint("numbered", "helios_numbered", "helios", dist("helios"), plugin=ThirdPartyNumber())]
    entry = PluginHost(entry_points=entry_points, environ={}).describe()[0]
    assert (entry["builtin"], entry["status"]) == (True, "failed")
    assert entry["error"] == (
        "ValueError: tool parser 100001 (numbered) is not a built-in tool parser value; "
        "a built-in plugin registers only those"
    )


def _clashing_entry_points() -> list[Any]:
    return [
        FakeEntryPoint("upper", "upper", "helios", dist("helios-upper"), plugin=UpperPlugin()),
        FakeEntryPoint("shadow", "shadow", "helios", dist("helios-shadow"), plugin=ShadowPlugin()),
    ]


def test_a_clash_fails_only_a_core_that_selects_the_identifier() -> None:
    host = PluginHost(entry_points=_clashing_entry_points(), environ={})
    assert host.resolve(base(ct.TOOL_PARSER_NONE)).tool_parser.name == "none"
    assert host.resolve(function_tags()).tool_parser.name == "function-tags"
    with pytest.raises(StartupError, match=r"tool parser 100001 is provided by both 'helios-shadow' .* 'helios-upper'"):
        host.resolve(third_party(100001))
    assert run_plugins_command(argparse.Namespace(json=False), host=host, out=io.StringIO()) == 1  # still listed


def test_a_grammar_clash_fails_only_a_core_selecting_its_parser() -> None:
    class Grammar:
        def __init__(self, name: str) -> None:
            self.name = name

        def helios_register_tool_grammars(self, register: Register) -> None:
            register(100001, lambda request: None, name=self.name)

    host = PluginHost(autoload=False)
    host.plugin_manager.register(UpperPlugin(), name="upper-dist")
    host.plugin_manager.register(Grammar("grammar-a"), name="grammar-a-dist")
    host.plugin_manager.register(Grammar("grammar-b"), name="grammar-b-dist")
    assert host.resolve(base(ct.TOOL_PARSER_NONE)).tool_grammar is None
    with pytest.raises(StartupError, match=r"^tool grammar 100001 is provided by both 'grammar-a-dist'"):
        host.resolve(third_party(100001))


def test_a_clash_between_builtins_is_listed_on_the_lines_of_the_two_plugins_only() -> None:
    class NoneAgain:
        def helios_register_tool_parsers(self, register: Register) -> None:
            register(ct.TOOL_PARSER_NONE, lambda context: Upper(), name="none-again")

    builtin = dist("helios")
    entry_points = [
        FakeEntryPoint(
            "none", "helios_plugins.none", "helios", builtin, plugin=importlib.import_module("helios_plugins.none")
        ),
        FakeEntryPoint("none_again", "none_again", "helios", builtin, plugin=NoneAgain()),
        FakeEntryPoint("upper", "upper", "helios", dist("helios-upper"), plugin=UpperPlugin()),
    ]
    host = PluginHost(entry_points=entry_points, environ={})
    out = io.StringIO()
    assert run_plugins_command(argparse.Namespace(json=False), host=host, out=out) == 1
    conflict = "conflict: tool parser 1 is provided by both 'helios' (none) and 'helios' (none-again)"
    lines = {line.split(" [")[0]: line for line in out.getvalue().splitlines()}
    assert conflict in lines["helios 1.0: none = helios_plugins.none"]
    assert conflict in lines["helios 1.0: none_again = none_again"]
    assert "conflict" not in lines["helios-upper 1.0: upper = upper"]
    assert host.resolve(third_party(100001)).tool_parser.name == "upper"  # the clash is not selected


def _broken_entry_points() -> list[Any]:
    return [
        FakeEntryPoint("broken", "helios_broken", "helios", dist("helios-broken"), error=ImportError("no module x")),
        FakeEntryPoint("tool_parser.100002", "helios_broken", "helios.identifiers", dist("helios-broken")),
        FakeEntryPoint("upper", "upper", "helios", dist("helios-upper"), plugin=UpperPlugin()),
    ]


def test_a_plugin_failing_at_import_is_isolated() -> None:
    host = PluginHost(entry_points=_broken_entry_points(), environ={})
    selected = host.resolve(third_party(100001))
    assert selected.tool_parser.plugin == "helios-upper"
    broken = next(entry for entry in host.describe() if entry["name"] == "helios-broken")
    assert broken["status"] == "failed" and "ImportError: no module x" in broken["error"]
    assert broken["identifiers"] == {"tool_parser": [100002]}


def test_a_failed_plugin_is_fatal_when_its_identifier_is_selected() -> None:
    host = PluginHost(entry_points=_broken_entry_points(), environ={})
    with pytest.raises(StartupError, match=r"100002 is selected .*'helios-broken' declares it but failed: ImportError"):
        host.resolve(third_party(100002))


def test_a_hook_that_raises_is_isolated() -> None:
    class Raises:
        def helios_register_tool_parsers(self, register: Register) -> None:
            register(100003, lambda context: Upper(), name="half")
            raise RuntimeError("boom")

    host = PluginHost(autoload=False)
    host.plugin_manager.register(Raises(), name="raises")
    entry = next(e for e in host.describe() if e["name"] == "raises")
    assert entry["status"] == "failed" and entry["error"] == "RuntimeError: boom"
    assert 100003 not in host.registries["tool_parser"]


def test_out_of_range_identifier_fails_the_plugin() -> None:
    class Bad:
        def helios_register_tool_parsers(self, register: Register) -> None:
            register(99, lambda context: Upper(), name="bad")

    host = PluginHost(autoload=False)
    host.plugin_manager.register(Bad(), name="bad")
    entry = next(e for e in host.describe() if e["name"] == "bad")
    assert entry["status"] == "failed" and "third-party range 100000-199999" in entry["error"]


def test_allowlist_and_autoload_switches() -> None:
    names = lambda host: {e["name"] for e in host.describe()}  # noqa: E731
    only_broken = PluginHost(entry_points=_broken_entry_points(), environ={"HELIOS_PLUGINS": "helios_broken"})
    assert "helios-upper" not in names(only_broken) and "helios-broken" in names(only_broken)
    assert names(PluginHost(entry_points=_broken_entry_points(), environ={"HELIOS_PLUGINS": ""})) == {"helios"}
    disabled = PluginHost(entry_points=_broken_entry_points(), environ={"HELIOS_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert names(disabled) == {"helios"}
    assert disabled.registries["tool_parser"][ct.TOOL_PARSER_FUNCTION_TAGS].plugin == "helios"


@pytest.mark.parametrize(
    ("frontend", "message"),
    [
        (lambda: _swap_tool(xtml(), ct.TOOL_PARSER_FUNCTION_TAGS), "XTML_THINK requires tool parser TOOL_PARSER_XTML"),
        (lambda: _swap_tool(recipient_header(), ct.TOOL_PARSER_NONE), "RECIPIENT_HEADER requires tool parser"),
        (lambda: _swap_reasoning(recipient_header(), ct.REASONING_PARSER_NONE), "ATEM requires reasoning parser"),
    ],
)
def test_mismatched_pairings_fail(frontend: Any, message: str) -> None:
    with pytest.raises(StartupError, match=message):
        PluginHost(autoload=False).resolve(frontend())


def _swap_tool(frontend: ct.FrontendContract, tool: int) -> ct.FrontendContract:
    frontend.tool_parser = tool
    return frontend


def _swap_reasoning(frontend: ct.FrontendContract, reasoning: int) -> ct.FrontendContract:
    frontend.reasoning_parser = reasoning
    return frontend


def test_unusable_syntax_data_fails_at_startup(tokenizer: Any) -> None:
    frontend = function_tags()
    frontend.tool_syntax.function_tags.function_prefix = ""
    with pytest.raises(StartupError, match=r"function-tags .* rejects the core's syntax data"):
        FrontendHarness(tokenizer, frontend)


def test_every_hookspec_is_typed_and_documented() -> None:
    specs = [f for name, f in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("helios_")]
    assert len(specs) == 6  # four selections and the two grammar hooks
    for spec in specs:
        assert inspect.getdoc(spec), spec.__name__
        assert "register" in inspect.signature(spec).parameters
        assert all(p.annotation is not inspect.Parameter.empty for p in inspect.signature(spec).parameters.values())


def test_plugins_command_json() -> None:
    parser = argparse.ArgumentParser(prog="helios")
    add_plugins_command(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plugins", "--json"])
    out = io.StringIO()
    host = PluginHost(entry_points=_broken_entry_points(), environ={})
    assert args.handler(args) == 0
    from helios_core.plugins.cli_command import run_plugins_command

    assert run_plugins_command(args, host=host, out=out) == 0
    listing = json.loads(out.getvalue())
    by_name = {entry["name"]: entry for entry in listing}
    assert by_name["helios-upper"]["identifiers"] == {"tool_parser": [100001]}
    assert by_name["helios-broken"]["status"] == "failed"
    builtin = [entry for entry in listing if entry["builtin"]]
    provided = {(i["kind"], i["identifier"]) for entry in builtin for i in entry["implementations"]}
    assert {("tool_parser", n) for n in range(1, 8)} <= provided
    assert {("reasoning_parser", n) for n in range(1, 5)} <= provided


BUILTIN_LINES = [
    "images = helios_plugins.images [ok] image_preparation=2,3 image_layout=2,3",
    "none = helios_plugins.none [ok] tool_parser=1 reasoning_parser=1 image_preparation=1 image_layout=1",
    "reasoning_think_tags = helios_plugins.reasoning_think_tags [ok] reasoning_parser=2",
    "recipient_header = helios_plugins.recipient_header [ok] tool_parser=6 reasoning_parser=4",
    "tool_argument_tags = helios_plugins.tool_argument_tags [ok] tool_parser=3",
    "tool_dsml = helios_plugins.tool_dsml [ok] tool_parser=4",
    "tool_function_tags = helios_plugins.tool_function_tags [ok] tool_parser=2",
    "tool_json_tags = helios_plugins.tool_json_tags [ok] tool_parser=7",
    "xtml = helios_plugins.xtml [ok] tool_parser=5 reasoning_parser=3",
]


def test_plugins_command_names_each_distribution_and_entry_point() -> None:
    host = PluginHost(entry_points=_broken_entry_points(), environ={})
    host.plugin_manager.register(ShadowPlugin(), name="shadow-dist")
    out = io.StringIO()
    assert run_plugins_command(argparse.Namespace(json=False), host=host, out=out) == 1  # 1: a conflict
    version = importlib.metadata.version("helios")
    conflict = (
        "conflict: tool parser 100001 is provided by both 'helios-upper' (upper) and 'shadow-dist' (shadow); "
        "uninstall one, or load only one: HELIOS_PLUGINS=helios-upper (a comma-separated list of the plugins to load)"
    )
    assert out.getvalue().splitlines() == [
        "helios-broken 1.0: broken = helios_broken [failed] tool_parser=100002 error: ImportError: no module x",
        f"helios-upper 1.0: upper = upper [ok] tool_parser=100001 {conflict}",
        *(f"helios {version}: {line}" for line in BUILTIN_LINES),
        f"shadow-dist ?: (registered in process) [ok] tool_parser=100001 {conflict}",
    ]
    upper = next(entry for entry in host.describe() if entry["name"] == "helios-upper")
    assert upper["conflicts"] == [host.conflicts[0]]


# --------------------------------------------------------------- BaseException at import


class PluginAbort(BaseException):
    """A custom BaseException, as a plugin might raise to stop everything."""


class ModuleEntryPoint(FakeEntryPoint):
    """An entry point that imports its module, as an installed one does."""

    def load(self) -> Any:
        return importlib.import_module(self.value)


IMPORT_FAILURES = {
    "helios_exit_plugin": ('raise SystemExit("exits on import")', "SystemExit: exits on import"),
    "helios_exit_code_plugin": ("raise SystemExit(3)", "SystemExit: 3"),
    "helios_abort_plugin": (
        "class PluginAbort(BaseException):\n    pass\nraise PluginAbort('stops everything')",
        "PluginAbort: stops everything",
    ),
    "helios_generator_exit_plugin": ("raise GeneratorExit", "GeneratorExit"),
    "helios_interrupt_plugin": (
        'raise KeyboardInterrupt("not from the operator")',
        "KeyboardInterrupt: not from the operator",
    ),
}


@pytest.fixture
def failing_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Entry points of modules that raise a BaseException at import, then a working plugin."""
    for module, (source, _) in IMPORT_FAILURES.items():
        (tmp_path / f"{module}.py").write_text(source + "\n", encoding="utf-8")
        monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    entry_points: list[Any] = [
        ModuleEntryPoint(module.removesuffix("_plugin"), module, "helios", dist(module.replace("_", "-")))
        for module in IMPORT_FAILURES
    ]
    entry_points.append(FakeEntryPoint("upper", "upper", "helios", dist("helios-upper"), plugin=UpperPlugin()))
    return entry_points


def test_a_plugin_raising_a_base_exception_at_import_is_isolated(failing_modules: list[Any]) -> None:
    host = PluginHost(entry_points=failing_modules, environ={})
    assert host.resolve(third_party(100001)).tool_parser.plugin == "helios-upper"
    by_name = {entry["name"]: entry for entry in host.describe()}
    for module, (_, error) in IMPORT_FAILURES.items():
        entry = by_name[module.replace("_", "-")]
        assert (entry["status"], entry["error"], entry["identifiers"]) == ("failed", error, "unknown")
    out = io.StringIO()
    assert run_plugins_command(argparse.Namespace(json=False), host=host, out=out) == 0
    lines = out.getvalue().splitlines()
    assert (
        "helios-exit-plugin 1.0: helios_exit = helios_exit_plugin [failed] (no identifiers declared) "
        "error: SystemExit: exits on import"
    ) in lines
    assert (
        "helios-exit-code-plugin 1.0: helios_exit_code = helios_exit_code_plugin [failed] (no identifiers declared) "
        "error: SystemExit: 3"
    ) in lines
    assert (
        "helios-abort-plugin 1.0: helios_abort = helios_abort_plugin [failed] (no identifiers declared) "
        "error: PluginAbort: stops everything"
    ) in lines


def test_a_hook_raising_a_base_exception_is_isolated() -> None:
    class Exits:
        def helios_register_tool_parsers(self, register: Register) -> None:
            register(100003, lambda context: Upper(), name="half")
            raise PluginAbort("no more")

    host = PluginHost(autoload=False)
    host.plugin_manager.register(Exits(), name="exits")
    entry = next(e for e in host.describe() if e["name"] == "exits")
    assert (entry["status"], entry["error"]) == ("failed", "PluginAbort: no more")
    assert 100003 not in host.registries["tool_parser"]


def test_a_factory_raising_system_exit_fails_startup_with_a_startup_error(tokenizer: Any) -> None:
    class ExitingFactory:
        def helios_register_tool_parsers(self, register: Register) -> None:
            register(100001, self.build, name="exiting")

        @staticmethod
        def build(context: ParserContext) -> Any:
            raise SystemExit("syntax data unusable")

    with pytest.raises(StartupError) as caught:
        FrontendHarness(tokenizer, third_party(), plugins=[ExitingFactory()])
    assert str(caught.value).endswith("rejects the core's syntax data: SystemExit: syntax data unusable")


def test_an_operators_interrupt_while_plugins_load_still_stops_startup() -> None:
    class InterruptedEntryPoint(FakeEntryPoint):
        def load(self) -> Any:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C arrives while this plugin imports
            return UpperPlugin()

    before = signal.getsignal(signal.SIGINT)
    slow = InterruptedEntryPoint("slow", "helios_slow", "helios", dist("helios-slow"))
    with pytest.raises(KeyboardInterrupt):
        PluginHost(entry_points=[slow], environ={}).start()
    assert signal.getsignal(signal.SIGINT) is before


def test_parser_context_tools_lookup() -> None:
    context = ParserContext(
        ct.FrontendContract(), vocabulary=SimpleNamespace(single_token=lambda t: None), tools=(ToolSpec("a"),)
    )
    assert context.tool("a") == ToolSpec("a") and context.tool("b") is None
