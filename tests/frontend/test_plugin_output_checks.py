"""What a parser plugin returns is checked where the pipeline calls it, and what it raises is wrapped.

A tool or reasoning parser returning something other than a list of ``OutputDelta`` with the field
types ``types.py`` declares, raising (``SystemExit`` included), or a factory that raises or returns
no parser, is a ``ParserPluginError`` naming the kind of parser, its identifier and implementation
(its own exception chained) before anything of the output is routed or accumulated.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from frontend_builders import base

from helios_core.errors import HeliosError
from helios_core.plugin_api import (
    GeneratedPiece,
    OutputDelta,
    OutputPipeline,
    Register,
    ToolCallDelta,
)
from helios_core.plugins import PluginHost
from helios_core.plugins.pipeline import ParserPluginError
from helios_core.wire import contract_pb2 as ct

TOOL_IDENTIFIER = 100061
REASONING_IDENTIFIER = 100062
PROBE_DISTRIBUTION = "helios-probe-plugin"
VOCABULARY = SimpleNamespace(single_token=lambda text: None)


class Probe:
    """A parser whose ``feed`` and ``finish`` return (or raise) what the test scripts."""

    def __init__(self, feed: Any = None, finish: Any = None) -> None:
        self._feed = feed
        self._finish = finish

    def feed(self, received: object) -> Any:
        return self._feed() if callable(self._feed) else [OutputDelta(content=str(getattr(received, "text", received)))]

    def finish(self) -> Any:
        return self._finish() if callable(self._finish) else []


class ProbePlugin:
    """Registers a tool parser and a reasoning parser in the third-party range, each built by its factory."""

    def __init__(self, *, tool: Any = Probe, reasoning: Any = Probe) -> None:
        self.tool, self.reasoning = tool, reasoning

    def helios_register_tool_parsers(self, register: Register) -> None:
        register(TOOL_IDENTIFIER, lambda context: self.tool(), name="probe-wrong-types")

    def helios_register_reasoning_parsers(self, register: Register) -> None:
        register(REASONING_IDENTIFIER, lambda context: self.reasoning(), name="probe-reasoning")


def _pipeline(plugin: ProbePlugin) -> OutputPipeline:
    host = PluginHost(autoload=False)
    host.plugin_manager.register(plugin, name=PROBE_DISTRIBUTION)
    frontend = base(ct.TOOL_PARSER_NONE)
    frontend.tool_parser = TOOL_IDENTIFIER
    frontend.reasoning_parser = REASONING_IDENTIFIER
    return host.resolve(frontend).pipeline(VOCABULARY)


TOOL = f"tool parser {TOOL_IDENTIFIER} (probe-wrong-types from {PROBE_DISTRIBUTION})"
REASONING = f"reasoning parser {REASONING_IDENTIFIER} (probe-reasoning from {PROBE_DISTRIBUTION})"


@pytest.mark.parametrize(
    ("returned", "problem"),
    [
        ("text", "returned str from feed(), not a list of OutputDelta"),
        ({"content": "x"}, "returned dict from feed(), not a list of OutputDelta"),
        (None, "returned None from feed(), not a list of OutputDelta"),
        ((OutputDelta(content="x"),), "returned tuple from feed(), not a list of OutputDelta"),
        (["x"], "returned a list holding str from feed(), not a list of OutputDelta"),
        ([OutputDelta(content=123)], "returned an OutputDelta from feed() whose content is int, not str or None"),  # type: ignore[arg-type]
        ([OutputDelta(reasoning=b"x")], "whose reasoning is bytes, not str or None"),  # type: ignore[arg-type]
        (
            [OutputDelta(tool_calls=[ToolCallDelta(0, "call_1", "f", "")])],  # type: ignore[arg-type]
            "whose tool_calls is list, not a tuple of ToolCallDelta",
        ),
        ([OutputDelta(tool_calls=({"index": 0},))], "whose tool_calls holds dict, not ToolCallDelta"),  # type: ignore[arg-type]
        ([OutputDelta(tool_calls=(ToolCallDelta(True, "c", "f", ""),))], "whose tool call index is bool, not int"),
        ([OutputDelta(tool_calls=(ToolCallDelta(0, 7, "f", ""),))], "tool call 0 has an id of type int"),  # type: ignore[arg-type]
        ([OutputDelta(tool_calls=(ToolCallDelta(0, "c", None, {}),))], "tool call 0 has arguments of type dict"),  # type: ignore[arg-type]
    ],
)
def test_a_tool_parser_returning_wrong_types_is_named(returned: Any, problem: str) -> None:
    pipeline = _pipeline(ProbePlugin(tool=lambda: Probe(feed=lambda: returned)))
    with pytest.raises(ParserPluginError) as caught:
        pipeline.feed(GeneratedPiece(1, "hello"))
    assert str(caught.value).startswith(f"{TOOL} ")
    assert problem in str(caught.value)
    assert isinstance(caught.value, HeliosError)  # the server ends only this request with it


def test_the_message_names_the_parser_kind_identifier_and_implementation() -> None:
    pipeline = _pipeline(ProbePlugin(tool=lambda: Probe(feed=lambda: "text")))
    with pytest.raises(ParserPluginError) as caught:
        pipeline.feed(GeneratedPiece(1, "hello"))
    assert str(caught.value) == (
        "tool parser 100061 (probe-wrong-types from helios-probe-plugin) returned str from feed(), "
        "not a list of OutputDelta"
    )


def test_nothing_of_a_rejected_output_is_accumulated() -> None:
    answers = iter([[OutputDelta(content="fine")], [OutputDelta(content=123)]])  # type: ignore[arg-type]
    pipeline = _pipeline(ProbePlugin(tool=lambda: Probe(feed=lambda: next(answers))))
    assert pipeline.feed(GeneratedPiece(1, "a")) == [OutputDelta(content="fine")]
    with pytest.raises(ParserPluginError, match="whose content is int"):
        pipeline.feed(GeneratedPiece(2, "b"))
    assert pipeline.finish().output.content == "fine"


def test_a_reasoning_parser_returning_wrong_types_at_finish_is_named() -> None:
    pipeline = _pipeline(ProbePlugin(reasoning=lambda: Probe(finish=lambda: None)))
    pipeline.feed(GeneratedPiece(1, "hello"))
    with pytest.raises(ParserPluginError) as caught:
        pipeline.finish()
    assert str(caught.value) == f"{REASONING} returned None from finish(), not a list of OutputDelta"


def test_a_tool_parser_returning_wrong_types_at_finish_is_named() -> None:
    pipeline = _pipeline(ProbePlugin(tool=lambda: Probe(finish=lambda: [OutputDelta(content=1.5)])))  # type: ignore[arg-type]
    with pytest.raises(ParserPluginError, match=r"^tool parser 100061 .* from finish\(\) whose content is float"):
        pipeline.finish()


class ParserBroke(Exception):
    pass


def _raise(exception: BaseException) -> Any:
    def raising() -> Any:
        raise exception

    return raising


@pytest.mark.parametrize(
    ("exception", "described"),
    [
        (ParserBroke("bad state"), "ParserBroke: bad state"),
        (KeyError("missing"), "KeyError: 'missing'"),
        (SystemExit(3), "SystemExit: 3"),
    ],
)
def test_an_exception_inside_a_parser_is_wrapped_naming_it(exception: BaseException, described: str) -> None:
    pipeline = _pipeline(ProbePlugin(tool=lambda: Probe(feed=_raise(exception))))
    with pytest.raises(ParserPluginError) as caught:
        pipeline.feed(GeneratedPiece(1, "hello"))
    assert str(caught.value) == f"{TOOL} failed in feed(): {described}"
    assert caught.value.__cause__ is exception


def test_an_exception_inside_a_reasoning_parser_is_wrapped_naming_it() -> None:
    broke = ParserBroke("no")
    pipeline = _pipeline(ProbePlugin(reasoning=lambda: Probe(feed=_raise(broke))))
    with pytest.raises(ParserPluginError) as caught:
        pipeline.feed([GeneratedPiece(1, "a")])
    assert str(caught.value) == f"{REASONING} failed in feed(): ParserBroke: no"
    assert caught.value.__cause__ is broke


def test_an_operators_interrupt_inside_a_parser_passes_through() -> None:
    pipeline = _pipeline(ProbePlugin(tool=lambda: Probe(feed=_raise(KeyboardInterrupt()))))
    with pytest.raises(KeyboardInterrupt):
        pipeline.feed(GeneratedPiece(1, "hello"))


def test_a_factory_failing_for_a_request_is_named() -> None:
    def failing() -> Any:
        raise ParserBroke("tools unusable")

    with pytest.raises(ParserPluginError) as caught:
        _pipeline(ProbePlugin(tool=failing))
    assert str(caught.value) == f"{TOOL} failed to build a parser: ParserBroke: tools unusable"
    assert isinstance(caught.value.__cause__, ParserBroke)
    with pytest.raises(ParserPluginError, match=r"^reasoning parser 100062 .* factory returned NoneType, not a parser"):
        _pipeline(ProbePlugin(reasoning=lambda: None))


def test_well_typed_output_flows_unchanged() -> None:
    call = ToolCallDelta(0, "call_1", "f", "")
    answers = iter([[OutputDelta(content="hi ")], [OutputDelta(tool_calls=(call,))], []])
    pipeline = _pipeline(ProbePlugin(tool=lambda: Probe(feed=lambda: next(answers))))
    assert pipeline.feed([GeneratedPiece(1, "a"), GeneratedPiece(2, "b"), GeneratedPiece(3, "c")]) == [
        OutputDelta(content="hi "),
        OutputDelta(tool_calls=(call,)),
    ]
    result = pipeline.finish()
    assert (result.output.content, result.finish_hint) == ("hi ", "tool_calls")


def test_subclasses_of_the_declared_types_are_accepted() -> None:
    class Text(str):
        pass

    pipeline = _pipeline(ProbePlugin(tool=lambda: Probe(feed=lambda: [OutputDelta(content=Text("sub"))])))
    assert pipeline.feed(GeneratedPiece(1, "a")) == [OutputDelta(content="sub")]


def test_a_pipeline_built_without_sources_names_the_parser_class() -> None:
    class Unnamed(Probe):
        pass

    pipeline = OutputPipeline(Probe(), Unnamed(feed=lambda: 5))
    with pytest.raises(ParserPluginError, match=r"^tool parser \(Unnamed\) returned int from feed\(\)"):
        pipeline.feed(GeneratedPiece(1, "x"))
