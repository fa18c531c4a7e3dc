"""Values and protocols crossing the boundary between the serving core and frontend plugins.

Owns the typed values (``GeneratedPiece`` in, ``OutputDelta`` / ``ToolCallDelta`` out,
``ParsedOutput`` / ``ToolCall`` at the end, ``ToolSpec``, ``EnvelopeState``, ``ParserContext``),
the parser protocols, the factory types a plugin registers (the image factories,
``VisionSettings -> ImagePreparer / ImageLayout``, are defined in :mod:`helios_core.plugins.images`
and re-exported here) and the ``Register`` callback. Plugins
import these through :mod:`helios_core.plugin_api`, never from here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from helios_core.plugins import frontend_contract as contract
from helios_core.plugins.images import ImageLayoutFactory, ImagePreparationFactory

__all__ = [
    "CLOSED_ENVELOPE",
    "EnvelopeState",
    "GeneratedPiece",
    "ImageLayoutFactory",
    "ImagePreparationFactory",
    "OutputDelta",
    "ParsedOutput",
    "ParserContext",
    "ReasoningParser",
    "ReasoningParserFactory",
    "Register",
    "TokenizerVocabulary",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "ToolParserFactory",
    "ToolSpec",
    "Vocabulary",
]


@dataclass(frozen=True)
class GeneratedPiece:
    """One generated token and the text it completes.

    The host detokenizes incrementally: ``text`` is ``""`` while a UTF-8 sequence is incomplete and
    then carries the whole completed character. A special token's text is its spelling."""

    token_id: int
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A streamed piece of tool call ``index``: ``id`` and ``name`` are sent once, in the call's
    first delta (whose ``arguments`` is ``""``); the concatenation of all ``arguments`` fragments
    of one index is the call's final JSON arguments string."""

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass(frozen=True)
class OutputDelta:
    """One streamed step of output: reasoning text, answer text and tool-call pieces."""

    reasoning: str | None = None
    content: str | None = None
    tool_calls: tuple[ToolCallDelta, ...] = ()


@dataclass(frozen=True)
class ToolCall:
    """A complete tool call; ``arguments`` is a JSON object text."""

    id: str
    name: str
    arguments: str


@dataclass
class ParsedOutput:
    """The final parse of one response; empty reasoning or content is ``None``."""

    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class ToolSpec:
    """One tool of the request: its function name and JSON-schema ``parameters`` object."""

    name: str
    parameters: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EnvelopeState:
    """Where the prompt leaves generation, computed by the host from the open assistant envelope.

    ``initially_reasoning``: the prompt pre-opened reasoning (e.g. it ends with the reasoning
    opener), so generation starts inside reasoning. ``open_header``: for recipient-header frames,
    the header text after the frame start that the prompt already holds (``"assistant"`` when the
    prompt ends with ``<|start|>assistant``); generation continues the header. ``open_recipient``:
    generation starts inside the body of a frame addressed to this recipient."""

    initially_reasoning: bool = False
    open_header: str | None = None
    open_recipient: str | None = None


CLOSED_ENVELOPE = EnvelopeState()
"""The envelope of a prompt that leaves nothing open (generation starts a fresh answer)."""


class Vocabulary(Protocol):
    """Token lookups a parser needs from the frontend tokenizer."""

    def single_token(self, text: str) -> int | None:
        """The id when the tokenizer encodes ``text`` as exactly one token, else ``None``."""
        ...


class TokenizerVocabulary:
    """``Vocabulary`` over a ``tokenizers.Tokenizer``."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[str, int | None] = {}

    def single_token(self, text: str) -> int | None:
        if not text:
            return None
        if text not in self._cache:
            ids = self._tokenizer.encode(text, add_special_tokens=False).ids
            self._cache[text] = int(ids[0]) if len(ids) == 1 else None
        return self._cache[text]


@dataclass(frozen=True)
class ParserContext:
    """Everything a parser factory receives for one request.

    ``frontend`` carries the selections and syntax data (``tool_syntax``, ``reasoning_syntax``,
    ``template_tokens``, ``plugin_parameters_json``). ``structured_answer``: the answer is an opaque
    grammar-constrained document; literal delimiters inside it remain answer text and the tool
    parser does not run on it."""

    frontend: contract.FrontendContract
    vocabulary: Vocabulary
    tools: tuple[ToolSpec, ...] = ()
    envelope: EnvelopeState = CLOSED_ENVELOPE
    structured_answer: bool = False

    def tool(self, name: str) -> ToolSpec | None:
        """The request's tool named ``name``, if declared."""
        for spec in self.tools:
            if spec.name == name:
                return spec
        return None


class ReasoningParser(Protocol):
    """Per-request parser of generated pieces into reasoning and content (and, for paired frame
    syntaxes, tool calls)."""

    def feed(self, piece: GeneratedPiece) -> list[OutputDelta]:
        """Consume one generated piece; return the deltas it releases."""
        ...

    def finish(self) -> list[OutputDelta]:
        """End of generation: release everything held back."""
        ...


class ToolParser(Protocol):
    """Per-request parser of the content stream into content and tool-call deltas."""

    def feed(self, text: str) -> list[OutputDelta]:
        """Consume content text; return the deltas it releases."""
        ...

    def finish(self) -> list[OutputDelta]:
        """End of generation: release everything held back and close open calls."""
        ...


ReasoningParserFactory = Callable[[ParserContext], ReasoningParser]
"""Builds a reasoning parser for one request; raises ``StartupError`` on unusable syntax data."""

ToolParserFactory = Callable[[ParserContext], ToolParser]
"""Builds a tool parser for one request; raises ``StartupError`` on unusable syntax data."""


class Register(Protocol):
    """The callback a registration hook receives."""

    def __call__(self, identifier: int, factory: Callable[..., Any], *, name: str, requires: int | None = None) -> None:
        """Provide ``factory`` for enum ``identifier`` under a readable implementation ``name``.

        ``requires`` (tool parsers only): the reasoning parser this tool parser only works with
        (its calls live in that parser's frames); a core pairing it with another is refused at
        startup."""
        ...
