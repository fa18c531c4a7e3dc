"""The output pipeline of one request: the reasoning parser first, the tool parser on its content.

Owns ``OutputPipeline`` (routing, accumulation into the final ``ParsedOutput``, the finish hint)
and ``PipelineResult``. The core builds one per request from the selected plugins' parsers
(``SelectedFrontend.pipeline``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from helios_core.plugins.types import (
    GeneratedPiece,
    OutputDelta,
    ParsedOutput,
    ReasoningParser,
    ToolCall,
    ToolParser,
)

__all__ = ["FinishHint", "OutputPipeline", "PipelineResult"]

FinishHint = Literal["tool_calls", "stop"]


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
    through. Deltas are accumulated for ``finish``."""

    def __init__(self, reasoning: ReasoningParser, tools: ToolParser, *, structured_answer: bool = False) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self._structured = structured_answer
        self._reasoning_text: list[str] = []
        self._content_text: list[str] = []
        self._calls: dict[int, _CallAccumulator] = {}

    def feed(self, pieces: GeneratedPiece | Sequence[GeneratedPiece]) -> list[OutputDelta]:
        """Consume the pieces one scheduling round generated; return the merged deltas."""
        batch = [pieces] if isinstance(pieces, GeneratedPiece) else list(pieces)
        out: list[OutputDelta] = []
        for piece in batch:
            self._route(self._reasoning.feed(piece), out)
        return self._record(out)

    def finish(self) -> PipelineResult:
        """End of generation: flush both parsers and return the final parse."""
        out: list[OutputDelta] = []
        self._route(self._reasoning.finish(), out)
        if not self._structured:
            out.extend(self._tools.finish())
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
                    out.extend(self._tools.feed(delta.content))
            if delta.tool_calls:
                out.append(OutputDelta(tool_calls=delta.tool_calls))

    def _record(self, deltas: list[OutputDelta]) -> list[OutputDelta]:
        merged: list[OutputDelta] = []
        for delta in deltas:
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


def _same_kind(a: OutputDelta, b: OutputDelta) -> bool:
    return (bool(a.reasoning), bool(a.content), bool(a.tool_calls)) == (
        bool(b.reasoning),
        bool(b.content),
        bool(b.tool_calls),
    )
