"""The output pipeline of one request: the reasoning parser first, the tool parser on its content.

Owns ``OutputPipeline`` (routing, accumulation into the final ``ParsedOutput``, the finish hint),
``PipelineResult``, ``ParserSource`` (which implementation a parser is, for error messages) and
``ParserPluginError``. The core builds one pipeline per request from the selected plugins' parsers
(``SelectedFrontend.pipeline``).

Every call into a parser (``feed`` and ``finish`` of both) is guarded: an exception the parser
raises, ``SystemExit`` included but not an operator's ``KeyboardInterrupt``, is wrapped in a
``ParserPluginError`` naming the parser (the original chained), and what it returns is checked
against ``types.py`` (a list of ``OutputDelta`` whose fields have their declared types) before
anything of it is routed, accumulated or sent. The pipeline runs for every generated token, so the
check compares the classes of the returned objects only (exact classes; a subclass, such as a
``str`` subclass, takes the slower ``isinstance`` path, which accepts it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from helios_core.errors import HeliosError
from helios_core.plugins.types import (
    GeneratedPiece,
    OutputDelta,
    ParsedOutput,
    ReasoningParser,
    ToolCall,
    ToolCallDelta,
    ToolParser,
)

__all__ = ["FinishHint", "OutputPipeline", "ParserPluginError", "ParserSource", "PipelineResult"]

FinishHint = Literal["tool_calls", "stop"]


class ParserPluginError(HeliosError):
    """A tool or reasoning parser raised, or returned something other than its protocol declares.

    The message names the kind of parser, its identifier and its implementation; a parser's own
    exception is chained as ``__cause__``. It ends the one request whose output the parser was
    handling."""


@dataclass(frozen=True)
class ParserSource:
    """Which implementation a parser is: ``kind`` (``"tool parser"`` or ``"reasoning parser"``), its
    ``identifier``, implementation ``name`` and ``plugin`` (the distribution, or the name a plugin
    was registered under in process), each ``None`` when unknown."""

    kind: str
    identifier: int | None = None
    name: str | None = None
    plugin: str | None = None

    def __str__(self) -> str:
        """``tool parser 100061 (probe-wrong-types from helios-probe-plugin)``."""
        label = self.kind if self.identifier is None else f"{self.kind} {self.identifier}"
        implementation = " from ".join(part for part in (self.name, self.plugin) if part)
        return f"{label} ({implementation})" if implementation else label


@dataclass(frozen=True)
class PipelineResult:
    """What ``OutputPipeline.finish`` returns: the last deltas, the final parse and the finish hint
    (``"tool_calls"`` when any call was parsed)."""

    deltas: list[OutputDelta]
    output: ParsedOutput
    finish_hint: FinishHint


@dataclass
class _CallAccumulator:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)


class OutputPipeline:
    """Composes one request's reasoning parser and tool parser.

    Reasoning deltas pass through; content deltas go through the tool parser, unless the answer is
    a structured (opaque) document; tool-call deltas a paired reasoning parser produces pass
    through. Deltas are accumulated for ``finish``. With ``single_call`` (a request's
    ``parallel_tool_calls: false``) only the first tool call the parsers find is presented: the deltas of
    every later call are dropped, as is their text. ``reasoning_source`` and ``tool_source`` name the
    parsers in a ``ParserPluginError`` (default: the kind and the parser's class name)."""

    def __init__(
        self,
        reasoning: ReasoningParser,
        tools: ToolParser,
        *,
        structured_answer: bool = False,
        single_call: bool = False,
        reasoning_source: ParserSource | None = None,
        tool_source: ParserSource | None = None,
    ) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self._structured = structured_answer
        self._single_call = single_call
        self._first_call: int | None = None
        """The index of the first tool call seen (with ``single_call``, the only one presented)."""
        self._reasoning_source = reasoning_source or ParserSource("reasoning parser", name=type(reasoning).__name__)
        self._tool_source = tool_source or ParserSource("tool parser", name=type(tools).__name__)
        self._reasoning_text: list[str] = []
        self._content_text: list[str] = []
        self._calls: dict[int, _CallAccumulator] = {}

    def feed(self, pieces: GeneratedPiece | Sequence[GeneratedPiece]) -> list[OutputDelta]:
        """Consume the pieces one scheduling round generated; return the merged deltas."""
        batch = [pieces] if isinstance(pieces, GeneratedPiece) else list(pieces)
        out: list[OutputDelta] = []
        reasoning, source = self._reasoning, self._reasoning_source
        for piece in batch:
            try:
                deltas = reasoning.feed(piece)
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # a parser's own failure, SystemExit included: this request's error
                raise _raised(source, "feed", exc) from exc
            if deltas.__class__ is not list or not _exactly_typed(deltas):
                _check(deltas, source, "feed")
            self._route(deltas, out)
        return self._record(out)

    def finish(self) -> PipelineResult:
        """End of generation: flush both parsers and return the final parse."""
        out: list[OutputDelta] = []
        self._route(_finish(self._reasoning, self._reasoning_source), out)
        if not self._structured:
            out.extend(_finish(self._tools, self._tool_source))
        deltas = self._record(out)
        calls = [ToolCall(c.id, c.name, "".join(c.arguments)) for _, c in sorted(self._calls.items())]
        output = ParsedOutput(
            reasoning="".join(self._reasoning_text) or None,
            content="".join(self._content_text) or None,
            tool_calls=calls,
        )
        return PipelineResult(deltas, output, "tool_calls" if calls else "stop")

    def _route(self, deltas: list[OutputDelta], out: list[OutputDelta]) -> None:
        for delta in deltas:
            if delta.reasoning:
                out.append(OutputDelta(reasoning=delta.reasoning))
            if delta.content:
                if self._structured:
                    out.append(OutputDelta(content=delta.content))
                else:
                    try:
                        released = self._tools.feed(delta.content)
                    except KeyboardInterrupt:
                        raise
                    except BaseException as exc:  # a parser's own failure, SystemExit included
                        raise _raised(self._tool_source, "feed", exc) from exc
                    if released.__class__ is not list or not _exactly_typed(released):
                        _check(released, self._tool_source, "feed")
                    out.extend(released)
            if delta.tool_calls:
                out.append(OutputDelta(tool_calls=delta.tool_calls))

    def _record(self, deltas: list[OutputDelta]) -> list[OutputDelta]:
        merged: list[OutputDelta] = []
        for delta in deltas:
            if self._single_call and delta.tool_calls:
                delta = self._first_call_only(delta)
            if delta.reasoning:
                self._reasoning_text.append(delta.reasoning)
            if delta.content:
                self._content_text.append(delta.content)
            for call in delta.tool_calls:
                if call.id is not None and call.name is not None:
                    self._calls[call.index] = _CallAccumulator(call.id, call.name)
                self._calls[call.index].arguments.append(call.arguments)
            if not (delta.reasoning or delta.content or delta.tool_calls):
                continue
            if merged and _same_kind(merged[-1], delta):
                last = merged[-1]
                merged[-1] = OutputDelta(
                    reasoning=(last.reasoning or "") + delta.reasoning if delta.reasoning else last.reasoning,
                    content=(last.content or "") + delta.content if delta.content else last.content,
                    tool_calls=last.tool_calls + delta.tool_calls,
                )
            else:
                merged.append(delta)
        return merged

    def _first_call_only(self, delta: OutputDelta) -> OutputDelta:
        """``delta`` without the pieces of any tool call but the first one seen."""
        if self._first_call is None:
            self._first_call = delta.tool_calls[0].index
        kept = tuple(call for call in delta.tool_calls if call.index == self._first_call)
        if len(kept) == len(delta.tool_calls):
            return delta
        return OutputDelta(reasoning=delta.reasoning, content=delta.content, tool_calls=kept)


def _same_kind(a: OutputDelta, b: OutputDelta) -> bool:
    return (bool(a.reasoning), bool(a.content), bool(a.tool_calls)) == (
        bool(b.reasoning),
        bool(b.content),
        bool(b.tool_calls),
    )


def _finish(parser: ReasoningParser | ToolParser, source: ParserSource) -> list[OutputDelta]:
    """``parser.finish()``, guarded and checked as ``feed`` is."""
    try:
        deltas = parser.finish()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # a parser's own failure, SystemExit included: this request's error
        raise _raised(source, "finish", exc) from exc
    _check(deltas, source, "finish")
    return deltas


def _raised(source: ParserSource, hook: str, exc: BaseException) -> ParserPluginError:
    """The error for an exception ``source`` raised in ``hook`` (the caller chains ``exc``). An
    operator's ``KeyboardInterrupt`` is never wrapped; any other ``BaseException`` ends only the
    request."""
    return ParserPluginError(f"{source} failed in {hook}(): {_describe_exception(exc)}")


def _exactly_typed(deltas: list[OutputDelta]) -> bool:
    """The per-token fast path: every delta and field of exactly its declared class (subclasses,
    such as a ``str`` subclass, are left to ``_check``)."""
    for delta in deltas:
        if delta.__class__ is not OutputDelta:
            return False
        reasoning, content, tool_calls = delta.reasoning, delta.content, delta.tool_calls
        if reasoning is not None and reasoning.__class__ is not str:
            return False
        if content is not None and content.__class__ is not str:
            return False
        if tool_calls.__class__ is not tuple:
            return False
        if tool_calls and _delta_problem(delta) is not None:
            return False
    return True


def _check(returned: object, source: ParserSource, hook: str) -> None:
    """Raise a ``ParserPluginError`` unless ``returned`` is a list of ``OutputDelta`` whose fields
    have the types ``types.py`` declares."""
    if not isinstance(returned, list):
        raise ParserPluginError(f"{source} returned {_type_name(returned)} from {hook}(), not a list of OutputDelta")
    for delta in returned:
        if not isinstance(delta, OutputDelta):
            raise ParserPluginError(
                f"{source} returned a list holding {_type_name(delta)} from {hook}(), not a list of OutputDelta"
            )
        problem = _delta_problem(delta)
        if problem is not None:
            raise ParserPluginError(f"{source} returned an OutputDelta from {hook}() whose {problem}")


def _delta_problem(delta: OutputDelta) -> str | None:
    """What of ``delta`` does not have the type ``types.py`` declares, or ``None``."""
    reasoning, content, tool_calls = delta.reasoning, delta.content, delta.tool_calls
    if reasoning is not None and not isinstance(reasoning, str):
        return f"reasoning is {_type_name(reasoning)}, not str or None"
    if content is not None and not isinstance(content, str):
        return f"content is {_type_name(content)}, not str or None"
    if not isinstance(tool_calls, tuple):
        return f"tool_calls is {_type_name(tool_calls)}, not a tuple of ToolCallDelta"
    for call in tool_calls:
        if not isinstance(call, ToolCallDelta):
            return f"tool_calls holds {_type_name(call)}, not ToolCallDelta"
        if not isinstance(call.index, int) or isinstance(call.index, bool):
            return f"tool call index is {_type_name(call.index)}, not int"
        if call.id is not None and not isinstance(call.id, str):
            return f"tool call {call.index} has an id of type {_type_name(call.id)}, not str or None"
        if call.name is not None and not isinstance(call.name, str):
            return f"tool call {call.index} has a name of type {_type_name(call.name)}, not str or None"
        if not isinstance(call.arguments, str):
            return f"tool call {call.index} has arguments of type {_type_name(call.arguments)}, not str"
    return None


def _type_name(value: object) -> str:
    return "None" if value is None else type(value).__name__


def _describe_exception(exc: BaseException) -> str:
    """``Type: message`` on one line (``Type`` alone when there is no message)."""
    message = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__
