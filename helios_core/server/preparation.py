"""Request preparation: from a decoded chat request to a PreparedRequest and its output plan.

Owns the CPU work between HTTP decoding and the model queue, run on a pool of ``frontend_workers``
threads: refusing unsupported fields, rendering and encoding the conversation (chat template,
tokenizer, input-vocabulary check), the initial envelope state, sampling (request values over core
defaults), the output limit (default ``min(core default, context - prompt)``), string and token
stops, and the structured-output format, compiled here once so an invalid schema is a 400 before
anything is queued. Every invalid request raises ``PromptError`` or ``InvalidRequest`` (400). A
request that is valid but outside the prepared capacities (context, output) is *not* refused
here: the model worker rejects it at admission (503), as the contract says.

:class:`Frontend` is built once per app and shared by the preparation threads: its members are
read-only after construction (the grammar compiler serialises its own compilation).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from helios_core.frontend.bootstrap import Bootstrap, PromptError, resolve_sampling
from helios_core.frontend.stops import check_stop_compatibility, parse_string_stops, parse_token_stops
from helios_core.frontend.structured import (
    GrammarCompiler,
    RecipientFrames,
    ToolCallFormat,
    envelope_reasoning,
    parse_response_format,
    prepared_format_json,
)
from helios_core.plugin_api import CLOSED_ENVELOPE, EnvelopeState, OutputPipeline, TokenizerVocabulary, ToolSpec
from helios_core.plugins.host import PluginHost, SelectedFrontend
from helios_core.runtime.messages import PreparedRequest, SamplingParams
from helios_core.runtime.startup import RunningModel
from helios_core.server.errors import InvalidRequest
from helios_core.server.schemas import (
    ChatCompletionRequest,
    Content,
    DeveloperMessage,
    Message,
    SystemMessage,
    ToolMessage,
    UserMessage,
    unsupported_fields,
)
from helios_core.wire import contract_pb2 as ct

__all__ = ["Frontend", "Prepared", "prepare"]


class Frontend:
    """The read-only frontend state preparation needs, built once at app startup."""

    def __init__(self, running: RunningModel, plugin_host: PluginHost | None = None) -> None:
        contract = running.verified.contract
        self.bootstrap: Bootstrap = running.bootstrap
        self.context_tokens = contract.serving.context_tokens
        self.sampled_size = contract.sampled_size
        self.eos_token_ids = frozenset(contract.eos_token_ids)
        self.vocabulary = TokenizerVocabulary(running.bootstrap.tokenizer)
        host = plugin_host if plugin_host is not None else PluginHost().start()
        self.selected: SelectedFrontend = host.resolve(running.bootstrap.frontend, self.vocabulary)
        self.supports_tools = running.bootstrap.frontend.tool_parser != ct.TOOL_PARSER_NONE
        self.logprobs_top_n, self.supports_prompt_logprobs = _logprob_capabilities(running)
        self.reasoning = envelope_reasoning(running.bootstrap.frontend)
        """The think-tag syntax structured output admits before the answer, or None (see structured)."""
        self.grammar_compiler: GrammarCompiler = running.grammar_compiler

    def envelope(self, rendered: str) -> EnvelopeState:
        """Where the rendered prompt leaves generation.

        Derived only from the prompt's end: a prompt ending in the reasoning opener (trailing
        whitespace ignored) starts inside reasoning; a prompt ending in the recipient-header frame
        start plus the assistant role leaves that header open. Anything else is closed.
        """
        syntax = self.bootstrap.frontend.reasoning_syntax
        tail = rendered.rstrip()
        header = syntax.recipient_header
        if header.start and header.assistant_role and tail.endswith(header.start + header.assistant_role):
            return EnvelopeState(open_header=header.assistant_role)
        opener = self.reasoning.open if self.reasoning is not None else syntax.open
        if opener and tail.endswith(opener):
            return EnvelopeState(initially_reasoning=True)
        return CLOSED_ENVELOPE


_GENERATING = frozenset(
    {ct.OPERATION_PREFILL, ct.OPERATION_MIXED, ct.OPERATION_DECODE, ct.OPERATION_RESUME, ct.OPERATION_SCORED_PREFILL}
)


def _logprob_capabilities(running: RunningModel) -> tuple[int | None, bool]:
    """(top_n every selected generating program writes, None without sampled logprobs; any scored prefill)."""
    graphs = list(running.model.selection.graphs.values())
    generating = [g for g in graphs if g.operation in _GENERATING]
    sampled = bool(generating) and all(g.contract.logprobs.sampled for g in generating)
    top_n = min(g.contract.logprobs.top_n for g in generating) if sampled else None
    scored = any(g.operation == ct.OPERATION_SCORED_PREFILL for g in graphs)
    return top_n, scored


def _logprob_settings(frontend: Frontend, request: ChatCompletionRequest) -> tuple[int, bool]:
    """(top_logprobs for the PreparedRequest, -1 when logprobs are off; whether prompt logprobs are asked)."""
    top = -1
    if request.logprobs:
        if frontend.logprobs_top_n is None:
            raise InvalidRequest("logprobs are not supported by this core", "logprobs")
        top = request.top_logprobs if request.top_logprobs is not None else 0
        if top > frontend.logprobs_top_n:
            raise InvalidRequest(
                f"top_logprobs={top} exceeds this core's limit of {frontend.logprobs_top_n}", "top_logprobs"
            )
    prompt = request.prompt_logprobs is not None
    if prompt and not frontend.supports_prompt_logprobs:
        raise InvalidRequest("prompt_logprobs are not supported by this core", "prompt_logprobs")
    return top, prompt


@dataclass(frozen=True)
class Prepared:
    """A prepared request and what presentation needs to turn its events into a response."""

    request: PreparedRequest
    tools: tuple[ToolSpec, ...]
    envelope: EnvelopeState
    structured: bool
    stream: bool
    include_usage: bool
    return_token_ids: bool
    return_token_timestamps: bool
    logprobs: bool = False
    """Present ``choices[0].logprobs`` (the request's ``top_logprobs`` is on ``request``)."""
    prompt_logprobs: bool = False
    """Present ``prompt_logprobs`` (JSON top level; SSE first chunk)."""

    def pipeline(self, frontend: Frontend) -> OutputPipeline:
        """A fresh output pipeline (reasoning and tool parsers) for this request."""
        return frontend.selected.pipeline(
            frontend.vocabulary, tools=self.tools, envelope=self.envelope, structured_answer=self.structured
        )


def _text(content: Content | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


def _arguments(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise InvalidRequest(f"{where}.function.arguments is not JSON: {exc}", "messages") from exc


def _template_message(message: Message, index: int) -> dict[str, Any]:
    """One message as chat templates expect it (OpenAI shape; tool-call arguments as objects)."""
    if isinstance(message, SystemMessage | DeveloperMessage):
        return {"role": "system", "content": _text(message.content)}
    if isinstance(message, UserMessage):
        return {"role": "user", "content": _text(message.content)}
    if isinstance(message, ToolMessage):
        return {"role": "tool", "content": _text(message.content), "tool_call_id": message.tool_call_id}
    out: dict[str, Any] = {"role": "assistant", "content": _text(message.content)}
    if message.reasoning_content is not None:
        out["reasoning_content"] = message.reasoning_content
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.function.name,
                    "arguments": _arguments(call.function.arguments, f"messages[{index}].tool_calls[{position}]"),
                },
            }
            for position, call in enumerate(message.tool_calls)
        ]
    return out


def _check_unsupported(request: ChatCompletionRequest) -> None:
    problems = unsupported_fields(request)
    if problems:
        field, message = problems[0]
        raise InvalidRequest(message, field)


def _sampling(frontend: Frontend, request: ChatCompletionRequest) -> SamplingParams:
    explicit = {
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "repetition_penalty": request.repetition_penalty,
        "frequency_penalty": request.frequency_penalty,
        "presence_penalty": request.presence_penalty,
    }
    seed = request.seed if request.seed is not None else 0
    if seed < 0:
        raise InvalidRequest(f"seed must be >= 0, not {seed}", "seed")
    settings = resolve_sampling(frontend.bootstrap.sampling_defaults, explicit, seed=seed)
    return SamplingParams(
        temperature=settings.temperature,
        top_p=settings.top_p,
        top_k=settings.top_k,
        min_p=settings.min_p,
        repetition_penalty=settings.repetition_penalty,
        frequency_penalty=settings.frequency_penalty,
        presence_penalty=settings.presence_penalty,
        seed=settings.seed,
    )


def _tools(frontend: Frontend, request: ChatCompletionRequest) -> tuple[list[dict[str, Any]], tuple[ToolSpec, ...]]:
    if not request.tools or request.tool_choice == "none":
        return [], ()
    if not frontend.supports_tools:
        raise InvalidRequest("this model does not support tools", "tools")
    names = [tool.function.name for tool in request.tools]
    if len(set(names)) != len(names):
        raise InvalidRequest("tools must have distinct function names", "tools")
    rendered = []
    specs = []
    for tool in request.tools:
        function: dict[str, Any] = {"name": tool.function.name, "parameters": tool.function.parameters or {}}
        if tool.function.description is not None:
            function["description"] = tool.function.description
        rendered.append({"type": "function", "function": function})
        specs.append(ToolSpec(tool.function.name, tool.function.parameters or {}))
    return rendered, tuple(specs)


def _forced_tool(request: ChatCompletionRequest) -> tuple[bool, str | None]:
    """(whether tool_choice forces a call, the named function or None for any tool)."""
    choice = request.tool_choice
    if choice is None or isinstance(choice, str):
        return choice == "required", None
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str) or set(choice) - {"type", "function"}:
        raise InvalidRequest(
            'tool_choice must be \'auto\', \'none\', \'required\' or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    return True, name


def _tool_call_format(
    frontend: Frontend, request: ChatCompletionRequest, specs: Sequence[ToolSpec], envelope: EnvelopeState
) -> ToolCallFormat | None:
    """The constrained tool-call format of tool_choice 'required' or a named function, else None."""
    forced, name = _forced_tool(request)
    if not forced:
        return None
    if not request.tools:
        raise InvalidRequest("tool_choice 'required' or a named function needs tools", "tool_choice")
    if request.response_format is not None and request.response_format.get("type") != "text":
        raise InvalidRequest(
            "response_format cannot be combined with tool_choice 'required' or a named function", "tool_choice"
        )
    contract = frontend.bootstrap.frontend
    # an open recipient header is continued by the ATEM frame grammar (which starts at the recipient)
    open_header = envelope.open_header is not None and contract.tool_syntax.WhichOneof("family") == "atem"
    thinking = envelope.initially_reasoning and frontend.reasoning is not None
    if envelope != CLOSED_ENVELOPE and not (thinking or open_header):
        raise InvalidRequest(
            "tool_choice 'required' or a named function is not supported where this core's prompt leaves generation",
            "tool_choice",
        )
    if name is not None and name not in {spec.name for spec in specs}:
        raise InvalidRequest(
            f"tool_choice names function {name!r}, which is not among the request's tools", "tool_choice"
        )
    try:
        return ToolCallFormat.from_syntax(
            [(spec.name, spec.parameters) for spec in specs],
            name,
            contract.tool_syntax,
            contract.reasoning_syntax.recipient_header
            if contract.reasoning_parser == ct.REASONING_PARSER_RECIPIENT_HEADER
            else None,
            open_header=open_header,
        )
    except PromptError as exc:
        raise InvalidRequest(str(exc), "tool_choice") from exc


def _recipient_frames(frontend: Frontend, specs: Sequence[ToolSpec], envelope: EnvelopeState) -> RecipientFrames | None:
    """The recipient-header frames a structured answer keeps (``None`` on other cores): reasoning
    frames, frames calling the request's tools (none with ``tool_choice`` ``"none"``), the answer frame."""
    try:
        return RecipientFrames.from_contract(
            frontend.bootstrap.frontend,
            [(spec.name, spec.parameters) for spec in specs],
            open_header=envelope.open_header is not None,
        )
    except PromptError as exc:
        raise InvalidRequest(str(exc), "response_format") from exc


def _max_tokens(frontend: Frontend, request: ChatCompletionRequest, prompt_tokens: int) -> int:
    explicit = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    if explicit is not None:
        if explicit <= 0:
            field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
            raise InvalidRequest(f"{field} must be positive, not {explicit}", field)
        return explicit
    # The core default within what the context leaves; a prompt that fills the context keeps one
    # token so the worker's admission check (503) reports the overflow.
    return max(min(frontend.bootstrap.max_output_tokens, frontend.context_tokens - prompt_tokens), 1)


def prepare(frontend: Frontend, request: ChatCompletionRequest, request_id: str) -> Prepared:
    """Validate and prepare ``request`` (runs on a preparation thread)."""
    _check_unsupported(request)
    if not request.messages:
        raise InvalidRequest("messages must contain at least one message", "messages")
    template_tools, tool_specs = _tools(frontend, request)
    messages = [_template_message(message, index) for index, message in enumerate(request.messages)]
    rendered = frontend.bootstrap.render(messages, tools=template_tools or None)
    prompt_ids = _encode(frontend, rendered)
    sampling = _sampling(frontend, request)
    top_logprobs, prompt_logprobs = _logprob_settings(frontend, request)

    string_stops = parse_string_stops(request.stop)
    token_stops = parse_token_stops(request.stop_token_ids, request.stop_token_sequences, frontend.sampled_size)
    envelope = frontend.envelope(rendered)
    tool_format = _tool_call_format(frontend, request, tool_specs, envelope)
    response_format = parse_response_format(request.response_format)
    check_stop_compatibility(string_stops, token_stops, response_format is not None)
    format_text = None
    reasoning, initially = frontend.reasoning, envelope.initially_reasoning
    if response_format is not None:
        frames = _recipient_frames(frontend, tool_specs, envelope)
        # an invalid schema is a 400 now
        frontend.grammar_compiler.compile(
            response_format, reasoning=reasoning, initially_reasoning=initially, frames=frames
        )
        format_text = prepared_format_json(
            request.response_format or {}, reasoning, initially_reasoning=initially, frames=frames
        )
    elif tool_format is not None:
        if string_stops:
            raise InvalidRequest("stop cannot be combined with tool_choice 'required' or a named function", "stop")
        # an invalid tool schema is a 400 now
        frontend.grammar_compiler.compile(tool_format, reasoning=reasoning, initially_reasoning=initially)
        format_text = prepared_format_json(json.loads(tool_format.to_json()), reasoning, initially_reasoning=initially)

    observe_ids = bool(request.return_token_ids)
    observe_times = bool(request.return_token_timestamps)
    prepared = PreparedRequest(
        request_id=request_id,
        prompt_ids=prompt_ids,
        max_tokens=_max_tokens(frontend, request, len(prompt_ids)),
        sampling=sampling,
        ignore_eos=bool(request.ignore_eos),
        string_stops=list(string_stops),
        token_stops=[list(sequence) for sequence in token_stops],
        response_format=format_text,
        observe_timestamps=observe_times,
        top_logprobs=top_logprobs,
        prompt_logprobs=prompt_logprobs,
    )
    include_usage = bool(request.stream_options is not None and request.stream_options.include_usage)
    return Prepared(
        request=prepared,
        tools=tool_specs,
        envelope=envelope,
        structured=response_format is not None,
        stream=bool(request.stream),
        include_usage=include_usage,
        return_token_ids=observe_ids,
        return_token_timestamps=observe_times,
        logprobs=top_logprobs >= 0,
        prompt_logprobs=prompt_logprobs,
    )


def _encode(frontend: Frontend, rendered: str) -> list[int]:
    ids: Sequence[int] = frontend.bootstrap.tokenizer.encode(rendered, add_special_tokens=False).ids
    limit = frontend.bootstrap.input_vocabulary
    bad = [i for i in ids if not 0 <= i < limit]
    if bad:
        raise PromptError(f"prompt token ids {bad[:5]} lie outside the input vocabulary [0, {limit})")
    if not ids:
        raise PromptError("the rendered prompt is empty")
    return list(ids)
