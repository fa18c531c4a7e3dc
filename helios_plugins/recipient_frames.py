"""Constrained output in recipient-header frames: ATEM calls and structured answers.

Owns the grammars ``recipient_header`` registers for TOOL_PARSER_ATEM and
REASONING_PARSER_RECIPIENT_HEADER. A frame is ``START ROLE PREFIX RECIPIENT MESSAGE body CLOSER``;
``START``, ``MESSAGE``, ``END`` and ``END_OF_MESSAGE`` are markers (their tokens where the tokenizer
has them), the role and recipients are text.

* A required or named call (``atem_grammar``): any number of reasoning frames (to the reasoning
  recipient, free text, closed by end or end of message), then one frame holding one ATEM block
  with one invocation, closed by end of message. Its recipient is the generic tool recipient for
  ``"required"`` (when declared), else ``named_tool_prefix + NAME``.
* A structured answer (``RecipientFrames.from_contract``, the envelope's ``answer_frames``):
  reasoning frames and frames calling the request's tools (generic or named recipients), then the
  answer frame, addressed to the answer recipient and holding the document (then an optional end),
  or a last tool frame.

With an open header (the prompt ends with ``START ROLE``) the first frame starts at its recipient.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from helios_core.plugin_api import (
    ANSWER_RULE,
    AnswerFrames,
    DelimitedReasoning,
    GrammarFragment,
    GrammarUnsupported,
    GrammarWriter,
    ToolChoice,
    ToolGrammarRequest,
    contract,
)
from helios_plugins.tool_dsml import invoke_call

__all__ = ["RecipientEnvelope", "RecipientFrames", "atem_grammar", "header_markers", "recipient_envelope"]

# the RecipientHeaderSyntax texts a frame grammar needs; ``answer_recipient`` is the content
# recipient a structured answer is addressed to (see ``header_markers``)
_HEADER_MARKERS = (
    "start",
    "assistant_role",
    "recipient_prefix",
    "message",
    "end",
    "end_of_message",
    "reasoning_recipient",
    "answer_recipient",
    "generic_tool_recipient",
    "named_tool_prefix",
)
_FRAME_REQUIRED = ("start", "assistant_role", "message", "end_of_message")
_UNSUPPORTED = "tool_choice 'required' is not supported for this core's tool syntax"


def header_markers(header: contract.RecipientHeaderSyntax) -> dict[str, str]:
    """The frame texts of ``header`` by name.

    ``answer_recipient``, the content recipient a structured answer's frame is addressed to, is
    ``user`` when the syntax declares it among its content recipients, else the last declared one
    (``""``: a header without a recipient, which is content too).
    """
    texts = {name: str(getattr(header, name)) for name in _HEADER_MARKERS if name != "answer_recipient"}
    recipients = list(header.content_recipients)
    texts["answer_recipient"] = "user" if "user" in recipients else (recipients[-1] if recipients else "")
    return texts


class _Frames:
    """Writes frame rules for one fragment (``m``: the frame texts; markers through ``writer``)."""

    def __init__(self, texts: Mapping[str, str], writer: GrammarWriter) -> None:
        self.m = texts
        self.writer = writer

    def marker(self, name: str) -> str:
        return self.writer.marker(self.m[name])

    def reasoning_frame(self) -> str:
        """A reasoning frame after the role: the reasoning recipient, free text, then end (or end of message)."""
        closers = [self.marker(name) for name in ("end", "end_of_message") if self.m[name]]
        recipient = json.dumps(self.m["recipient_prefix"] + self.m["reasoning_recipient"])
        return f"{recipient} {self.marker('message')} FRAME_TEXT? ({' | '.join(closers)})"

    def frame_rules(self, open_header: bool, lead: list[str], finals: list[str]) -> list[str]:
        """``start``: any frames of the ``lead`` kinds, then one frame of a ``finals`` kind.

        Each kind is a frame's text after the assistant role (recipient, message marker, body,
        closer); with ``open_header`` the first frame's start and role are already in the prompt.
        """
        head = f"{self.marker('start')} {json.dumps(self.m['assistant_role'])}"
        rules = [f"final_frame: {head} final_suffix", "final_suffix: " + " | ".join(f"({k})" for k in finals)]
        if lead:
            rules += [f"lead_frame: {head} lead_suffix", "lead_suffix: " + " | ".join(f"({k})" for k in lead)]
            rules.append("FRAME_TEXT: /(?s:.+)/")
            start = "lead_suffix lead_frame* final_frame | final_suffix" if open_header else "lead_frame* final_frame"
        else:
            start = "final_suffix" if open_header else "final_frame"
        return [f"start: {start}", *rules]

    def lead(self) -> list[str]:
        return [self.reasoning_frame()] if self.m["reasoning_recipient"] else []


def _atem_calls(request: ToolGrammarRequest, writer: GrammarWriter) -> tuple[list[tuple[int, str]], list[str]] | None:
    """``call_INDEX``: the ATEM block of one call of each callable tool (a frame's body), or
    ``None`` when the syntax data lacks an element name or a frame text."""
    frontend = request.frontend
    syntax = frontend.tool_syntax
    atem = syntax.atem
    if syntax.WhichOneof("family") != "atem" or not frontend.reasoning_syntax.HasField("recipient_header"):
        return None
    texts = header_markers(frontend.reasoning_syntax.recipient_header)
    if not all((atem.block, atem.invoke, atem.parameter)) or not all(texts[name] for name in _FRAME_REQUIRED):
        return None
    prefix = atem.prefix
    call_open, call_close = syntax.opener or f"<{prefix}{atem.block}>", f"</{prefix}{atem.block}>"
    called, rules = invoke_call(
        request,
        parameter_tag=f"{prefix}{atem.parameter}",
        invoke_tag=f"{prefix}{atem.invoke}",
        typed=False,
        ends=(call_close, call_open),
    )
    wrapped = []
    for rule in rules:
        if rule.startswith("call_"):  # a call is the body of a frame: one block holding the invocation
            name, _, expression = rule.partition(": ")
            rule = f"{name}: {writer.marker(call_open)} {expression} {writer.marker(call_close)}"
        wrapped.append(rule)
    return called, wrapped


def _recipient(texts: Mapping[str, str], choice: str | None, name: str) -> str:
    """The recipient of the frame calling ``name`` under ``tool_choice``: the generic tool
    recipient for ``"required"`` (when declared), else ``named_tool_prefix + name``."""
    generic, named = texts["generic_tool_recipient"], texts["named_tool_prefix"]
    if choice is None and generic:
        recipient = generic
    elif named or not generic:
        recipient = named + name
    else:
        recipient = generic
    return json.dumps(texts["recipient_prefix"] + recipient)


def atem_grammar(request: ToolGrammarRequest) -> GrammarFragment | None:
    """Reasoning frames, then the frame of one ATEM call (``None`` without frame texts)."""
    writer = GrammarWriter()
    calls = _atem_calls(request, writer)
    if calls is None:
        return None
    called, rules = calls
    frames = _Frames(header_markers(request.frontend.reasoning_syntax.recipient_header), writer)
    eom = frames.marker("end_of_message")
    finals = [
        f"{_recipient(frames.m, request.choice, name)} {frames.marker('message')} call_{index} {eom}"
        for index, name in called
    ]
    return writer.fragment(
        [*frames.frame_rules(request.open_header, frames.lead(), finals), *rules], open_header=request.open_header
    )


class RecipientFrames:
    """Builds the frames a structured answer is written in on a recipient-header core."""

    @staticmethod
    def from_contract(
        frontend: contract.FrontendContract,
        tools: Sequence[tuple[str, Mapping[str, Any]]],
        *,
        open_header: bool = False,
    ) -> AnswerFrames | None:
        """The frames of a core with recipient-header reasoning (``None`` for any other core).

        Raises:
            GrammarUnsupported: the header syntax lacks a frame text, or the tools cannot be called
                in the core's tool syntax.
            ToolGrammarError: a tool cannot be written.
        """
        if frontend.reasoning_parser != contract.REASONING_PARSER_RECIPIENT_HEADER:
            return None
        texts = header_markers(frontend.reasoning_syntax.recipient_header)
        if not all(texts[name] for name in _FRAME_REQUIRED):
            raise GrammarUnsupported(
                "response_format is not supported: the core's recipient header syntax is incomplete"
            )
        writer = GrammarWriter()
        frames = _Frames(texts, writer)
        message, eom = frames.marker("message"), frames.marker("end_of_message")
        end = f" {frames.marker('end')}?" if texts["end"] else ""
        answer = f"{json.dumps(texts['recipient_prefix'] + texts['answer_recipient'])} {message} {ANSWER_RULE}{end}"
        pairs = tuple((name, schema) for name, schema in tools)
        rules: list[str] = []
        tool_frames: list[str] = []
        if pairs:
            calls = _atem_calls(ToolGrammarRequest(pairs, None, frontend, open_header), writer)
            if calls is None:
                raise GrammarUnsupported(_UNSUPPORTED)
            rules += calls[1]
            generic, named = texts["generic_tool_recipient"], texts["named_tool_prefix"]
            for index, (name, _) in enumerate(pairs):
                names = dict.fromkeys(r for r in (generic, named + name if named or not generic else "") if r)
                recipients = " | ".join(json.dumps(texts["recipient_prefix"] + r) for r in names)
                tool_frames.append(f"({recipients}) {message} call_{index} {eom}")
        lead = frames.lead() + tool_frames
        grammar = writer.fragment(
            [*frames.frame_rules(open_header, lead, [answer, *tool_frames]), *rules], open_header=open_header
        )
        return AnswerFrames(
            grammar=grammar,
            markers=tuple(sorted(texts.items())),
            calls=ToolChoice(pairs) if pairs else None,
            open_header=open_header,
        )


class RecipientEnvelope:
    """The reasoning envelope of recipient-header frames: no delimited reasoning; answers in frames."""

    def __init__(self, frontend: contract.FrontendContract) -> None:
        self._frontend = frontend

    def delimiters(self) -> DelimitedReasoning | None:
        return None

    def answer_frames(
        self, tools: Sequence[tuple[str, Mapping[str, Any]]], *, open_header: bool
    ) -> AnswerFrames | None:
        return RecipientFrames.from_contract(self._frontend, tools, open_header=open_header)


def recipient_envelope(frontend: contract.FrontendContract) -> RecipientEnvelope:
    """Factory of the recipient-header envelope."""
    return RecipientEnvelope(frontend)
