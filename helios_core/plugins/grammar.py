"""Grammar hooks: the values a tool-syntax or reasoning plugin hands the core for constrained output.

Owns the types of the two grammar registration hooks (see :mod:`helios_core.plugins.hookspecs`):

* ``ToolGrammarFactory``: ``ToolGrammarRequest -> GrammarFragment | None``. Given the request's
  tools, the forced function (``None``: any of them) and the core's syntax data, a tool-syntax
  plugin writes the grammar of exactly one call in its family. ``None`` says the syntax data
  cannot constrain calls (the request gets a 400).
* ``ReasoningEnvelopeFactory``: ``FrontendContract -> ReasoningEnvelope``. A reasoning plugin says
  what a constrained output may hold around its answer: delimited reasoning before it
  (``DelimitedReasoning``; the core writes that part of the grammar), or frames the answer itself
  lives in (``AnswerFrames``, a fragment with a hole named :data:`ANSWER_RULE`).

A ``GrammarFragment`` is text in llguidance's Lark dialect. Its rule ``start`` generates the whole
text the fragment stands for; it is defined once and never referenced inside the fragment (the
core renames it when it composes the fragment with an envelope). Marker texts are not written into
the fragment: ``GrammarWriter.marker`` names a rule the core defines when it compiles, matching the
text as the tokenizer's added tokens it spells (the longest at each position) and the text between
them literally, so one fragment serves every tokenizer. Rule names starting with ``helios_`` (any
case) and the rule ``answer`` belong to the core.

Plugins import these through :mod:`helios_core.plugin_api`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from helios_core.errors import PromptError
from helios_core.plugins import frontend_contract as contract

__all__ = [
    "ANSWER_RULE",
    "COMPACT_JSON",
    "AnswerFrames",
    "DelimitedEnvelope",
    "DelimitedReasoning",
    "GrammarFragment",
    "GrammarUnsupported",
    "GrammarWriter",
    "ReasoningEnvelope",
    "ReasoningEnvelopeFactory",
    "ToolChoice",
    "ToolGrammarError",
    "ToolGrammarFactory",
    "ToolGrammarRequest",
]

ANSWER_RULE = "answer"
"""The rule an ``AnswerFrames`` fragment references for the answer document; the core defines it."""

COMPACT_JSON: Mapping[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""llguidance ``x-guidance`` options of compact JSON (one space after ``:`` and ``,``, no other
whitespace): generated arguments stay short and bounded, where flexible whitespace lets a sampler
emit whitespace forever. Put it under ``"x-guidance"`` in a schema written with ``%json``."""

_RULE_NAME = re.compile(r"[a-z_][a-z0-9_]*")


class GrammarUnsupported(PromptError):
    """The core's syntax data cannot constrain this output (for instance a frame text is not
    declared); the request gets a 400 naming the field that asked for it."""


class ToolGrammarError(PromptError):
    """A tool of the request cannot be written in this core's tool syntax (its name, a parameter
    name or a schema keyword the syntax cannot enforce); the request gets a 400 naming it."""


@dataclass(frozen=True)
class GrammarFragment:
    """A grammar in llguidance's Lark dialect whose rule ``start`` generates the text it stands for.

    ``markers``: ``(rule name, text)`` pairs; the core adds a rule of that name matching the text
    (added tokens as those tokens). ``open_header``: the fragment starts inside a header the prompt
    left open (set only when the request said one is open and the syntax can continue it).
    """

    lark: str
    markers: tuple[tuple[str, str], ...] = ()
    open_header: bool = False

    def to_json(self) -> dict[str, Any]:
        """The JSON form carried in ``PreparedRequest.response_format``."""
        return {"lark": self.lark, "markers": dict(self.markers), "open_header": self.open_header}

    @classmethod
    def from_json(cls, value: object) -> GrammarFragment:
        """Read :meth:`to_json`'s form back.

        Raises:
            ValueError: a malformed field.
        """
        if not isinstance(value, Mapping):
            raise ValueError("a grammar fragment must be an object")
        lark, markers, open_header = value.get("lark"), value.get("markers", {}), value.get("open_header", False)
        if not isinstance(lark, str) or not isinstance(markers, Mapping) or not isinstance(open_header, bool):
            raise ValueError("a grammar fragment needs lark text, a markers object and a boolean open_header")
        for name, text in markers.items():
            if not isinstance(name, str) or not _RULE_NAME.fullmatch(name) or not isinstance(text, str) or not text:
                raise ValueError(f"marker {name!r} must be a lower-case rule name with non-empty text")
        return cls(lark, tuple(sorted((str(k), str(v)) for k, v in markers.items())), open_header)


class GrammarWriter:
    """Collects the marker rules of one fragment.

    ``marker(text)`` returns the name of a rule matching ``text`` (``marker_0``, ``marker_1``, ...;
    one per distinct text); ``fragment(rules)`` joins Lark rules into a ``GrammarFragment`` with
    those markers. Use one writer per fragment.
    """

    def __init__(self) -> None:
        self._names: dict[str, str] = {}

    def marker(self, text: str) -> str:
        """The rule matching ``text``. Raises ``ValueError`` on empty text."""
        if not text:
            raise ValueError("a marker needs text")
        if text not in self._names:
            self._names[text] = f"marker_{len(self._names)}"
        return self._names[text]

    def fragment(self, rules: Iterable[str], *, open_header: bool = False) -> GrammarFragment:
        """The fragment of ``rules`` (one Lark rule or lexeme per item) and the markers used."""
        markers = tuple(sorted((name, text) for text, name in self._names.items()))
        return GrammarFragment("\n".join(rules), markers, open_header)


@dataclass(frozen=True)
class ToolGrammarRequest:
    """What a tool grammar is written for.

    ``tools``: ``(name, JSON-schema parameters)`` of each tool of the request, in request order;
    ``choice``: the one function that must be called, or ``None`` for any of them (``tool_choice``
    ``"required"``); ``frontend``: the core's selections and syntax data (``tool_syntax``,
    ``reasoning_syntax``, ``plugin_parameters_json``); ``open_header``: the prompt ends inside a
    frame header the syntax may continue (recipient-header frames).
    """

    tools: tuple[tuple[str, Mapping[str, Any]], ...]
    choice: str | None
    frontend: contract.FrontendContract
    open_header: bool = False

    def callable_tools(self) -> list[tuple[int, str, Mapping[str, Any]]]:
        """``(index, name, parameters)`` of each tool the output may call (index in ``tools``)."""
        return [
            (index, name, parameters)
            for index, (name, parameters) in enumerate(self.tools)
            if self.choice is None or name == self.choice
        ]


ToolGrammarFactory = Callable[[ToolGrammarRequest], GrammarFragment | None]
"""Writes the grammar of one call (``None``: this syntax data cannot constrain calls); raises
``ToolGrammarError`` for a tool it cannot write."""


@dataclass(frozen=True)
class ToolChoice:
    """The tools an output may call and the forced name (``None``: any of them)."""

    tools: tuple[tuple[str, Mapping[str, Any]], ...]
    choice: str | None = None

    def to_json(self) -> dict[str, Any]:
        tools = [{"name": name, "parameters": dict(schema)} for name, schema in self.tools]
        return {"tools": tools, "choice": self.choice}

    @classmethod
    def from_json(cls, value: object) -> ToolChoice:
        """Read :meth:`to_json`'s form back. Raises ``ValueError`` on a malformed field."""
        if not isinstance(value, Mapping):
            raise ValueError("tools must be an object")
        tools, choice = value.get("tools"), value.get("choice")
        if not isinstance(tools, list) or not (choice is None or isinstance(choice, str)):
            raise ValueError("tools must be a list and choice a string or null")
        pairs: list[tuple[str, Mapping[str, Any]]] = []
        for tool in tools:
            name = tool.get("name") if isinstance(tool, Mapping) else None
            schema = tool.get("parameters") if isinstance(tool, Mapping) else None
            if not isinstance(name, str) or not isinstance(schema, Mapping):
                raise ValueError("each tool needs a string name and an object of parameters")
            pairs.append((name, schema))
        if choice is not None and choice not in {name for name, _ in pairs}:
            raise ValueError(f"choice {choice!r} is not among the tools")
        return cls(tuple(pairs), choice)


@dataclass(frozen=True)
class DelimitedReasoning:
    """Reasoning the output may hold before its answer: ``open``, free text that never spells
    ``close`` (nor ``terminal_marker``, which ends reasoning implicitly), ``close``, at most two
    newlines. The core writes this part of the grammar, omitting ``open`` when the prompt already
    opened reasoning."""

    open: str
    close: str
    terminal_marker: str = ""


@dataclass(frozen=True)
class AnswerFrames:
    """Frames a structured answer is written in, when the reasoning syntax frames the answer itself.

    ``grammar``: its rule ``start`` generates the whole output and references :data:`ANSWER_RULE`
    for the answer document (a JSON schema the core supplies). ``markers``: named texts of the
    frames (descriptive, ``marker(name)``); ``calls``: the tools frames may call before (or instead
    of) the answer; ``open_header``: the prompt already holds the first frame's header start.
    """

    grammar: GrammarFragment
    markers: tuple[tuple[str, str], ...] = ()
    calls: ToolChoice | None = None
    open_header: bool = False

    def marker(self, name: str) -> str:
        """The frame text ``name`` (``""`` when absent)."""
        return dict(self.markers).get(name, "")

    def to_json(self) -> dict[str, Any]:
        """The JSON form carried in ``PreparedRequest.response_format``."""
        return {
            "grammar": self.grammar.to_json(),
            "markers": dict(self.markers),
            "calls": None if self.calls is None else self.calls.to_json(),
            "open_header": self.open_header,
        }

    @classmethod
    def from_json(cls, value: object) -> AnswerFrames:
        """Read :meth:`to_json`'s form back. Raises ``ValueError`` on a malformed field."""
        if not isinstance(value, Mapping):
            raise ValueError("frames must be an object")
        markers, calls, open_header = value.get("markers"), value.get("calls"), value.get("open_header")
        if (
            not isinstance(markers, Mapping)
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in markers.items())
            or not isinstance(open_header, bool)
        ):
            raise ValueError("frames need a markers object of texts and a boolean open_header")
        return cls(
            grammar=GrammarFragment.from_json(value.get("grammar")),
            markers=tuple(sorted((str(k), str(v)) for k, v in markers.items())),
            calls=None if calls is None else ToolChoice.from_json(calls),
            open_header=open_header,
        )


class ReasoningEnvelope(Protocol):
    """What a reasoning syntax lets a constrained output hold around its answer (built once per
    core by a ``ReasoningEnvelopeFactory``)."""

    def delimiters(self) -> DelimitedReasoning | None:
        """The reasoning the output may hold before the answer or the call, or ``None``."""
        ...

    def answer_frames(
        self, tools: Sequence[tuple[str, Mapping[str, Any]]], *, open_header: bool
    ) -> AnswerFrames | None:
        """The frames a structured answer is written in (``None``: the answer is not framed).

        ``tools``: the tools frames may call (empty with ``tool_choice`` ``"none"``). Raises
        ``PromptError`` when the syntax data cannot frame an answer, ``ToolGrammarError`` for a tool
        it cannot write."""
        ...


ReasoningEnvelopeFactory = Callable[[contract.FrontendContract], ReasoningEnvelope | None]
"""Builds the reasoning envelope of a core from its syntax data (``None``: the core's syntax data
declares no envelope)."""


@dataclass(frozen=True)
class DelimitedEnvelope:
    """A ``ReasoningEnvelope`` of delimited reasoning only (``None``: no reasoning envelope)."""

    reasoning: DelimitedReasoning | None = None

    def delimiters(self) -> DelimitedReasoning | None:
        return self.reasoning

    def answer_frames(
        self, tools: Sequence[tuple[str, Mapping[str, Any]]], *, open_header: bool
    ) -> AnswerFrames | None:
        return None
