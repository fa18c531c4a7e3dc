"""Request preparation: from a decoded chat or completions request to a PreparedRequest and its output plan.

Owns the CPU work between HTTP decoding and the model queue, run on a pool of ``frontend_workers``
threads: refusing unsupported fields, rendering and encoding the conversation (chat template,
tokenizer, input-vocabulary check), the initial envelope state, sampling (request values over core
defaults), the output limit (default ``min(core default, context - prompt)``), string and token
stops, and the structured-output format, compiled here once so an invalid schema is a 400 before
anything is queued; the compiled grammar travels with the request (``PreparedRequest.grammar``), so
the model worker never compiles. Every invalid request raises ``PromptError`` or ``InvalidRequest`` (400). A
request that is valid but outside the prepared capacities (context, output) is rejected by the
model worker at admission (503), as the contract says; only a prompt that *certainly* cannot fit
the context (a lower bound on its tokens reaches it) is refused here, with the same permanent
``AdmissionRefused``, before it is rendered or tokenized in full. Client text is shielded so it
never encodes as control tokens (:mod:`helios_core.frontend.prompt_encoding`).

A chat prompt also gets its layout (``PreparedRequest.layout``, a
:class:`~helios_core.contract.PromptLayout`) where it changes what the scheduler does: on a core that
declares prefix-boundary rules, each message's role and the token offset where its rendering ends
(only where rendering the conversation up to it gives a prefix of the whole rendering), whether tools
were rendered and whether reasoning was stripped; and, for ``continue_final_message``, the offset
where the continued assistant message's content starts (the prompt is rendered without the generation
prompt and cut right after that content, which is located exactly by rendering a marker in its place).

:class:`Frontend` is built once per app and shared by the preparation threads: its members are
read-only after construction (the grammar compiler serialises its own compilation).

A legacy completions request (:func:`prepare_completion`) takes the same path without the chat
template: its ``prompt`` string is encoded raw (:meth:`PromptEncoder.encode_raw
<helios_core.frontend.prompt_encoding.PromptEncoder.encode_raw>`), or its token ids are checked
against the input vocabulary, and sampling, the output limit and string stops resolve exactly as
for chat. Its problems name ``prompt`` where chat's name ``messages``.

A chat request's images (``image_url`` parts of user messages) are refused on a core that takes none
(``Frontend.images.accepts_images``), counted and decoded within the operator's
:class:`~helios_core.server.image_input.ImageLimits` before rendering; the template sees each as a
``{"type": "image"}`` content part (a message without images keeps its joined text, as before), and
after encoding :meth:`ImageFrontend.expand <helios_core.server.images.ImageFrontend.expand>` replaces
each image sentinel by its image's span (``PreparedRequest.images``); the layout's offsets and the
context check count the expanded prompt. An ``ImageInputError`` is a 400 naming the content part
(``messages[1].content[0]: ...``). Legacy completions take no images.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import msgspec

from helios_core.contract import PrefixBoundaries, PromptLayout, PromptMessage
from helios_core.errors import PromptError
from helios_core.frontend.bootstrap import (
    RENDER_VARIABLES,
    Bootstrap,
    SamplingError,
    resolve_sampling,
    resolved_settings,
)
from helios_core.frontend.detokenizer import IncrementalDetokenizer
from helios_core.frontend.formats import (
    AnswerFrames,
    ToolCallFormat,
    ToolChoiceError,
    answer_frames,
    envelope_reasoning,
    parse_response_format,
    prepared_format_json,
)
from helios_core.frontend.prompt_encoding import ClientTextShield, PromptTooLong, utf8_length
from helios_core.frontend.stops import check_stop_compatibility, parse_string_stops, parse_token_stops
from helios_core.frontend.structured import Grammar, GrammarCompiler, GrammarError
from helios_core.plugin_api import (
    CLOSED_ENVELOPE,
    EnvelopeState,
    OutputPipeline,
    TokenizerVocabulary,
    ToolGrammarError,
    ToolSpec,
)
from helios_core.plugins.grammar import COMPACT_JSON
from helios_core.plugins.host import PluginHost, SelectedFrontend
from helios_core.plugins.images import DecodedImage, ImageInputError
from helios_core.plugins.tag_grammar import FUNCTION_NAME
from helios_core.runtime.messages import PreparedRequest, PromptImage, SamplingParams
from helios_core.runtime.startup import RunningModel
from helios_core.sampling import SAMPLING_PARAMETERS, SamplingParameter, choice_seed, fresh_seed
from helios_core.server.errors import AdmissionRefused, InvalidRequest
from helios_core.server.image_input import ImageLimits, decode_image_url
from helios_core.server.images import ImageFrontend
from helios_core.server.schemas import (
    LOGIT_BIAS_BAN,
    LOGIT_BIAS_ONLY,
    MAX_LOGIT_BIAS,
    AssistantMessage,
    ChatCompletionRequest,
    CompletionRequest,
    Content,
    DeveloperMessage,
    ImagePart,
    Message,
    SystemMessage,
    TextPart,
    ToolMessage,
    UserContent,
    UserMessage,
    completion_unsupported_fields,
    unsupported_fields,
)
from helios_core.wire import contract_pb2 as ct

__all__ = ["Frontend", "Prepared", "prepare", "prepare_completion"]


class Frontend:
    """The read-only frontend state preparation needs, built once at app startup."""

    def __init__(
        self, running: RunningModel, plugin_host: PluginHost | None = None, image_limits: ImageLimits | None = None
    ) -> None:
        contract = running.verified.contract
        self.bootstrap: Bootstrap = running.bootstrap
        self.context_tokens = contract.serving.context_tokens
        self.sampled_size = contract.sampled_size
        self.eos_token_ids = frozenset(contract.eos_token_ids)
        self.vocabulary = TokenizerVocabulary(running.bootstrap.tokenizer)
        host = plugin_host if plugin_host is not None else PluginHost().start()
        self.selected: SelectedFrontend = host.resolve(running.bootstrap.frontend, self.vocabulary)
        self.supports_tools = running.bootstrap.frontend.tool_parser != ct.TOOL_PARSER_NONE
        self.boundaries = PrefixBoundaries.of(running.bootstrap.frontend)
        """The core's prefix-boundary rules: with any, chat prompts carry their message layout."""
        self.logprobs_top_n, self.supports_prompt_logprobs = _logprob_capabilities(running)
        self.scores_images = any(
            graph.operation == ct.OPERATION_SCORED_PREFILL and graph.takes_images
            for graph in running.model.selection.graphs.values()
        )
        """Whether a scored prefill program takes images (prompt logprobs of a prompt with images)."""
        envelope = self.selected.reasoning_envelope
        self.reasoning = envelope_reasoning(
            running.bootstrap.frontend, envelope.factory if envelope is not None else _no_reasoning_envelope
        )
        """The think-tag syntax structured output admits before the answer, or None (see structured)."""
        self.grammar_compiler: GrammarCompiler = running.grammar_compiler
        self.images = ImageFrontend.of(contract, self.selected)
        """The core's image preparation and layout (``accepts_images`` False on a text-only core)."""
        self.image_limits = image_limits if image_limits is not None else ImageLimits()
        """What one request's images may cost (the ``--image-*`` run options)."""

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
    return top, _prompt_logprobs_asked(frontend, request)


def _prompt_logprobs_asked(frontend: Frontend, request: ChatCompletionRequest | CompletionRequest) -> bool:
    """Whether the request asks for ``prompt_logprobs`` (400 on a core without scored prefill programs)."""
    asked = request.prompt_logprobs is not None
    if asked and not frontend.supports_prompt_logprobs:
        raise InvalidRequest("prompt_logprobs are not supported by this core", "prompt_logprobs")
    return asked


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
    continuous_usage: bool = False
    """``stream_options.continuous_usage_stats`` (with ``include_usage``): every chunk carries the usage so far."""
    logprobs: bool = False
    """Present ``choices[0].logprobs`` (the request's ``top_logprobs`` is on ``request``)."""
    prompt_logprobs: bool = False
    """Present ``prompt_logprobs`` (JSON top level; SSE first chunk); for an echoed completion, the
    prompt tokens' logprobs."""
    echo: str | None = None
    """A completion's echoed prompt text (presented before the generated text), None without echo."""
    prompt_field: str = "messages"
    """The request field the prompt comes from: an admission rejection naming the prompt names it."""
    output_limit_field: str = "max_tokens"
    """The request field the output limit comes from (``max_completion_tokens`` where a chat request sent
    it): an admission rejection naming the output limit names it."""
    single_call: bool = False
    """``parallel_tool_calls: false``: present the first tool call the model makes, drop any after it."""
    choice_prompt_logprobs: bool = False
    """A completion that asked for ``prompt_logprobs``: its choice carries the prompt tokens' logprobs list."""
    choices: tuple[PreparedRequest, ...] = ()
    """A response of several choices (``n`` > 1): one engine request a choice, ``request`` with the id
    ``<response id>-<index>`` and the choice's seed (:func:`choice_requests`); empty for one choice."""

    def choice_requests(self) -> tuple[PreparedRequest, ...]:
        """The engine requests whose events make the response: :attr:`choices`, or ``request`` alone."""
        return self.choices or (self.request,)

    def pipeline(self, frontend: Frontend) -> OutputPipeline:
        """A fresh output pipeline (reasoning and tool parsers) for this request."""
        return frontend.selected.pipeline(
            frontend.vocabulary,
            tools=self.tools,
            envelope=self.envelope,
            structured_answer=self.structured,
            single_call=self.single_call,
        )


def _text(content: Content | None, shield: ClientTextShield) -> str:
    """The message text as the template sees it (control-token spellings shielded)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return shield.shield(content)
    return shield.shield("".join(part.text for part in content))


def _user_content(content: UserContent, shield: ClientTextShield) -> str | list[dict[str, str]]:
    """A user message's content as the template sees it: its text (as :func:`_text`) when it holds no
    image, else its parts in order, ``{"type": "text", "text": ...}`` (shielded) and ``{"type": "image"}``
    (where the template writes the core's image sentinel)."""
    if isinstance(content, str):
        return _text(content, shield)
    if not any(isinstance(part, ImagePart) for part in content):
        return _text([part for part in content if isinstance(part, TextPart)], shield)
    return [
        {"type": "text", "text": shield.shield(part.text)} if isinstance(part, TextPart) else {"type": "image"}
        for part in content
    ]


def _text_bytes(content: Content | UserContent | None) -> int:
    """UTF-8 bytes of a message's text, without joining or encoding it."""
    if content is None:
        return 0
    if isinstance(content, str):
        return utf8_length(content)
    return sum(utf8_length(part.text) for part in content if isinstance(part, TextPart))


def _image_parts(request: ChatCompletionRequest) -> list[tuple[str, ImagePart]]:
    """The request's image parts in prompt order, each with where it is (``messages[i].content[j]``)."""
    return [
        (f"messages[{index}].content[{position}]", part)
        for index, message in enumerate(request.messages)
        if isinstance(message, UserMessage) and not isinstance(message.content, str)
        for position, part in enumerate(message.content)
        if isinstance(part, ImagePart)
    ]


@contextmanager
def _naming_image_part(locations: Sequence[str]) -> Iterator[None]:
    """Turn an ``ImageInputError`` into an ``InvalidRequest`` (400) whose message starts with the content
    part of the image at fault (``messages[1].content[0]: ...``), where the error names one."""
    try:
        yield
    except ImageInputError as exc:
        where = locations[exc.index] if exc.index is not None and 0 <= exc.index < len(locations) else None
        raise InvalidRequest(f"{where}: {exc}" if where is not None else str(exc), "messages") from exc


def _decode_images(frontend: Frontend, parts: Sequence[tuple[str, ImagePart]]) -> list[DecodedImage]:
    """The request's images decoded within the operator's limits (400 when the core takes no images,
    when there are too many, or naming the part of one that cannot be used)."""
    if not parts:
        return []
    if not frontend.images.accepts_images:
        raise InvalidRequest("this model does not accept image input", "messages")
    limits = frontend.image_limits
    if len(parts) > limits.max_count:
        raise InvalidRequest(
            f"the request carries {len(parts)} images, more than this server's limit of {limits.max_count} per request",
            "messages",
        )
    with _naming_image_part([where for where, _ in parts]):
        return [decode_image_url(part.image_url.url, limits, index=index) for index, (_, part) in enumerate(parts)]


def _expand_images(
    frontend: Frontend, prompt_ids: list[int], images: Sequence[DecodedImage], locations: Sequence[str]
) -> tuple[list[int], list[PromptImage]]:
    """The prompt with each image sentinel replaced by its image's span (a core that takes images; a
    text-only core's prompt is returned as it is), and the spans; the expanded prompt must fit the
    context (503, permanent, as an unexpanded one)."""
    if not frontend.images.accepts_images:
        return prompt_ids, []
    with _naming_image_part(locations):
        expanded, spans = frontend.images.expand(prompt_ids, images)
    if len(expanded) >= frontend.context_tokens:
        raise AdmissionRefused(
            f"the prompt holds {len(expanded)} tokens with its images, which does not fit the core's context of "
            f"{frontend.context_tokens} tokens",
            "messages",
            permanent=True,
        )
    return expanded, spans


def _expanded_layout(layout: PromptLayout | None, images: Sequence[PromptImage]) -> PromptLayout | None:
    """``layout`` (token offsets into the prompt before its images were expanded) with every offset moved
    past the spans that replaced the image sentinels before it."""
    if layout is None or not images:
        return layout

    def expanded(offset: int) -> int:
        grown = 0
        for image in images:  # in prompt order; ``image.start - grown`` is where its sentinel was
            if image.start - grown >= offset:
                break
            grown += image.length - 1
        return offset + grown

    return msgspec.structs.replace(
        layout,
        messages=tuple(PromptMessage(message.role, expanded(message.end)) for message in layout.messages),
        continuation=expanded(layout.continuation) if layout.continuation >= 0 else -1,
    )


def _refuse_oversize_messages(frontend: Frontend, request: ChatCompletionRequest) -> None:
    """Refuse (503, permanent) before rendering when the message text alone cannot fit the context.

    Each token covers at most the vocabulary's longest entry, so the message text's UTF-8 bytes
    divided by that length is a lower bound on the prompt's tokens."""
    size = sum(_text_bytes(message.content) for message in request.messages)
    bound = frontend.bootstrap.encoder.lower_bound_tokens(size)
    if bound >= frontend.context_tokens:
        raise AdmissionRefused(
            f"the messages hold {size} bytes of text, at least {bound} tokens, which does not fit the core's "
            f"context of {frontend.context_tokens} tokens",
            "messages",
            permanent=True,
        )


def _arguments(text: str, where: str, shield: ClientTextShield) -> Any:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise InvalidRequest(f"{where}.function.arguments is not JSON: {exc}", "messages") from exc
    return shield.shield_value(value)


def _template_message(message: Message, index: int, shield: ClientTextShield) -> dict[str, Any]:
    """One message as chat templates expect it (OpenAI shape; tool-call arguments as objects), every
    client string shielded so its control-token spellings stay plain text."""
    if isinstance(message, SystemMessage | DeveloperMessage):
        return {"role": "system", "content": _text(message.content, shield)}
    if isinstance(message, UserMessage):
        return {"role": "user", "content": _user_content(message.content, shield)}
    if isinstance(message, ToolMessage):
        result = {
            "role": "tool",
            "content": _text(message.content, shield),
            "tool_call_id": shield.shield_value(message.tool_call_id),
        }
        if message.name is not None:
            result["name"] = shield.shield(message.name)
        return result
    if message.audio is not None:
        raise InvalidRequest(f"messages[{index}].audio is not supported by this server", "messages")
    if message.function_call is not None:
        raise InvalidRequest(
            f"messages[{index}].function_call is not supported by this server (send earlier calls as tool_calls)",
            "messages",
        )
    out: dict[str, Any] = {"role": "assistant", "content": _text(message.content, shield)}
    reasoning = message.reasoning_content if message.reasoning_content is not None else message.reasoning
    if reasoning is not None:
        out["reasoning_content"] = shield.shield(reasoning)
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": shield.shield_value(call.id),
                "type": "function",
                "function": {
                    "name": shield.shield(call.function.name),
                    "arguments": _arguments(
                        call.function.arguments, f"messages[{index}].tool_calls[{position}]", shield
                    ),
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


def request_sampling_fields(
    request_type: type[msgspec.Struct] = ChatCompletionRequest,
    parameters: Iterable[SamplingParameter] = SAMPLING_PARAMETERS,
) -> tuple[str, ...]:
    """The sampling settings a request of ``request_type`` may name: each declared setting (but the seed,
    passed on its own) that the request schema has a field of the same name for."""
    return tuple(name for name in resolved_settings(parameters) if name in request_type.__struct_fields__)


_REQUEST_SAMPLING = request_sampling_fields()


_COMPLETION_SAMPLING = request_sampling_fields(CompletionRequest)


def _sampling(
    frontend: Frontend, request: ChatCompletionRequest | CompletionRequest, names: Sequence[str] = _REQUEST_SAMPLING
) -> SamplingParams:
    explicit = {name: getattr(request, name) for name in names}
    bootstrap = frontend.bootstrap
    try:  # each value within its meaningful range and the type the core packs it as; no seed: a fresh one
        settings = resolve_sampling(
            bootstrap.sampling_defaults, explicit, seed=request.seed, limits=bootstrap.sampling_limits
        )
    except SamplingError as exc:
        raise InvalidRequest(str(exc), exc.field) from exc
    return settings


def _first_mask(grammar: Grammar, field: str, subject: str | None = None) -> None:
    """Run ``grammar``'s matcher over its first token, as the worker will: compute the first mask, take
    the lowest id it allows and compute the next mask. A schema that compiles but whose matcher fails at
    once (a self-referencing ``$ref``, a ``$defs`` loop, a ``pattern`` its lexer cannot build, a mask that
    needs more work than the compiler's :class:`~helios_core.frontend.structured.GrammarLimits` allow) is
    then a 400 here rather than a failure in the model worker. It also warms the grammar: the worker's
    first mask of a matcher copied from it afterwards is several times faster."""
    matcher = grammar.matcher()
    try:
        mask = matcher.mask()
        words = mask.nonzero()[0]
        if words.shape[0]:
            word = int(words[0])
            bits = int(mask[word]) & 0xFFFFFFFF
            matcher.advance(word * 32 + (bits & -bits).bit_length() - 1)
            matcher.mask()
    except GrammarError as exc:
        raise InvalidRequest(f"{subject or field}: the schema cannot be enforced: {exc}", field) from exc


_NO_PARAMETERS: Mapping[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
"""The parameters of a function declared without ``parameters``: none, as OpenAI defines it (a forced call's
arguments are ``{}``)."""


def _first_parameter_masks(frontend: Frontend, fmt: ToolCallFormat) -> None:
    """:func:`_first_mask` over each callable function's parameters schema on its own: a forced call's
    grammar reaches the arguments only after the call's opener and name, so a schema whose matcher fails
    at once would otherwise fail the request mid-generation. A schema that compiles only inside the tool
    syntax's own grammar (not as plain JSON) is left to it."""
    for name, schema in fmt.tools:
        if fmt.choice is not None and name != fmt.choice:
            continue
        where = f"tools: function {name!r} parameters"
        try:
            bare = frontend.grammar_compiler.schema_grammar({**schema, "x-guidance": dict(COMPACT_JSON)}, where)
        except PromptError:
            continue
        _first_mask(bare, "tools", where)


def _tools(frontend: Frontend, request: ChatCompletionRequest) -> tuple[list[dict[str, Any]], tuple[ToolSpec, ...]]:
    """The tools as the chat template sees them, and the specs calls are parsed against. With ``tool_choice:
    "none"`` the tools stay in the prompt (as OpenAI and vLLM keep them: the prompt, and its cached prefix,
    are those of the same conversation with tools) but no call is parsed; a core without a tool syntax
    ignores them then."""
    none = request.tool_choice == "none"
    if not request.tools or (none and not frontend.supports_tools):
        return [], ()
    if not frontend.supports_tools:
        raise InvalidRequest("this model does not support tools", "tools")
    names = [tool.function.name for tool in request.tools]
    for index, name in enumerate(names):
        if not FUNCTION_NAME.fullmatch(name):  # the names OpenAI accepts, which every tool syntax can write
            raise InvalidRequest(
                f"tools[{index}].function.name {name[:80]!r} must be 1 to 64 characters of a-z, A-Z, 0-9, _ or -",
                "tools",
            )
    if len(set(names)) != len(names):
        raise InvalidRequest("tools must have distinct function names", "tools")
    for index, tool in enumerate(request.tools):
        kind = (tool.function.parameters or {}).get("type", "object")
        if kind != "object":
            raise InvalidRequest(
                f"tools[{index}].function.parameters must be a JSON schema of type 'object' (a function's "
                f"arguments are an object), not {json.dumps(kind)[:80]}",
                "tools",
            )
    rendered = []
    specs = []
    for tool in request.tools:
        function: dict[str, Any] = {"name": tool.function.name, "parameters": tool.function.parameters or {}}
        if tool.function.description is not None:
            function["description"] = tool.function.description
        rendered.append({"type": "function", "function": function})
        parameters = tool.function.parameters
        specs.append(ToolSpec(tool.function.name, _NO_PARAMETERS if parameters is None else parameters))
    return rendered, () if none else tuple(specs)


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
    # the selected tool plugin writes the call; a syntax whose calls live in frames may continue an
    # open frame header (its grammar then says so)
    names = {spec.name for spec in specs}
    fmt: ToolCallFormat | None = None
    refused: PromptError | None = None
    grammar = frontend.selected.tool_grammar
    if name is None or name in names:
        try:
            fmt = ToolCallFormat.for_frontend(
                [(spec.name, spec.parameters) for spec in specs],
                name,
                frontend.bootstrap.frontend,
                open_header=envelope.open_header is not None,
                grammar=grammar.factory if grammar is not None else _no_tool_grammar,
            )
        except (ToolChoiceError, ToolGrammarError) as exc:
            refused = exc
    thinking = envelope.initially_reasoning and frontend.reasoning is not None
    continues_header = fmt.open_header if fmt is not None else isinstance(refused, ToolGrammarError)
    if envelope != CLOSED_ENVELOPE and not (thinking or continues_header):
        raise InvalidRequest(
            "tool_choice 'required' or a named function is not supported where this core's prompt leaves generation",
            "tool_choice",
        )
    if name is not None and name not in names:
        raise InvalidRequest(
            f"tool_choice names function {name!r}, which is not among the request's tools", "tool_choice"
        )
    if isinstance(refused, ToolGrammarError):  # a tool the syntax cannot write: the schema's own 400
        raise InvalidRequest(str(refused), "tools") from refused
    if fmt is None:
        raise InvalidRequest(str(refused), "tool_choice") from refused
    return fmt


@contextmanager
def _naming_field(*fields: str) -> Iterator[None]:
    """Turn a frontend ``PromptError`` into an ``InvalidRequest`` whose ``param`` is the request field
    its message starts with (the first of ``fields`` when it names none of them)."""
    try:
        yield
    except PromptError as exc:
        text = str(exc)
        named = [field for field in fields if re.match(re.escape(field) + r"\b", text)]
        raise InvalidRequest(text, max(named, key=len) if named else fields[0]) from exc


def _no_reasoning_envelope(frontend: ct.FrontendContract) -> None:
    """The envelope of a reasoning parser that declares none."""
    return None


def _no_tool_grammar(request: object) -> None:
    """The tool grammar of a tool parser whose plugin registered none: it constrains no call."""
    return None


def _recipient_frames(frontend: Frontend, specs: Sequence[ToolSpec], envelope: EnvelopeState) -> AnswerFrames | None:
    """The frames the selected reasoning plugin writes a structured answer in (``None`` when it
    frames none): on recipient-header cores reasoning frames, frames calling the request's tools
    (none with ``tool_choice`` ``"none"``), the answer frame. A tool the syntax cannot write is a
    400 of its own (``ToolGrammarError``, raised as is)."""
    selected = frontend.selected.reasoning_envelope
    if selected is None:
        return None
    try:
        return answer_frames(
            frontend.bootstrap.frontend,
            [(spec.name, spec.parameters) for spec in specs],
            open_header=envelope.open_header is not None,
            envelope=selected.factory,
        )
    except ToolGrammarError:
        raise
    except PromptError as exc:
        raise InvalidRequest(str(exc), "response_format") from exc


def _max_tokens(frontend: Frontend, request: ChatCompletionRequest, prompt_tokens: int) -> tuple[int, str | None]:
    """The chat request's output limit and the field that set it (None: the default)."""
    explicit = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    return _output_limit(frontend, explicit, field, prompt_tokens), field if explicit is not None else None


def _output_limit(frontend: Frontend, explicit: int | None, field: str, prompt_tokens: int) -> int:
    """The request's output limit: ``explicit`` (positive, else 400 naming ``field``) or the default."""
    if explicit is not None:
        if explicit <= 0:
            raise InvalidRequest(f"{field} must be positive, not {explicit}", field)
        return explicit
    # The core default within what the context leaves; a prompt that fills the context keeps one
    # token so the worker's admission check (503) reports the overflow.
    return max(min(frontend.bootstrap.max_output_tokens, frontend.context_tokens - prompt_tokens), 1)


def _min_tokens(requested: int | None, limit: int, limit_field: str | None) -> int:
    """The request's ``min_tokens`` (0 when absent): at least 0 and at most the output ``limit`` (a 400
    naming ``min_tokens`` otherwise); ``limit_field`` is the field that set the limit, None for the default."""
    if requested is None:
        return 0
    if requested < 0:
        raise InvalidRequest(f"min_tokens must be at least 0, not {requested}", "min_tokens")
    if requested > limit:
        source = f"{limit_field}={limit}" if limit_field is not None else f"the default output limit of {limit} tokens"
        raise InvalidRequest(f"min_tokens={requested} exceeds {source}", "min_tokens")
    return requested


def _logit_bias(frontend: Frontend, bias: dict[str, float] | None) -> tuple[list[int], list[int]]:
    """(the ids a request's ``logit_bias`` bans, the ids it samples among alone), each ascending.

    -100 never samples a token and 100 samples only among the tokens given 100, as OpenAI describes the
    two ends; 0 changes nothing. Sampling takes a mask, not an added bias, so any other value is a 400
    naming ``logit_bias``, as are keys that are not ids of the core's sampled vocabulary."""
    if not bias:
        return [], []
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"logit_bias names {len(bias)} tokens; at most {MAX_LOGIT_BIAS}", "logit_bias")
    banned: list[int] = []
    only: list[int] = []
    for key, value in bias.items():
        token = int(key) if key.isascii() and key.isdecimal() and len(key) <= 12 else -1  # no 5000-digit int()
        if not 0 <= token < frontend.sampled_size:
            raise InvalidRequest(
                f"logit_bias key {key!r} is not a token id of this core's vocabulary [0, {frontend.sampled_size})",
                "logit_bias",
            )
        if value == LOGIT_BIAS_BAN:
            banned.append(token)
        elif value == LOGIT_BIAS_ONLY:
            only.append(token)
        elif value != 0.0:
            raise InvalidRequest(
                f"logit_bias value {value!r} for token {token} is not supported: -100 never samples a token, "
                "100 samples only among the tokens given 100, 0 changes nothing",
                "logit_bias",
            )
    return sorted(banned), sorted(only)


def prepare(frontend: Frontend, request: ChatCompletionRequest, request_id: str) -> Prepared:
    """Validate and prepare ``request`` (runs on a preparation thread)."""
    _check_unsupported(request)
    if not request.messages:
        raise InvalidRequest("messages must contain at least one message", "messages")
    template_tools, tool_specs = _tools(frontend, request)
    _refuse_oversize_messages(frontend, request)
    image_parts = _image_parts(request)
    images = _decode_images(frontend, image_parts)
    shield = frontend.bootstrap.encoder.shield()
    messages = [_template_message(message, index, shield) for index, message in enumerate(request.messages)]
    shielded_tools = shield.shield_value(template_tools) if template_tools else None
    variables = _client_template_variables(frontend, request, shield)
    continuing = _continues_final_message(request)
    rendered = frontend.bootstrap.render(
        messages,
        tools=shielded_tools,
        input_chars=shield.input_chars,
        add_generation_prompt=request.add_generation_prompt is not False and not continuing,
        client_variables=variables,
    )
    content_start = -1
    if continuing:
        rendered, content_start = _open_final_message(frontend, messages, shielded_tools, variables, rendered, shield)
    prompt_ids = _encode(frontend, rendered, shield)
    layout = _prompt_layout(
        frontend, messages, shielded_tools, variables, rendered, prompt_ids, shield, content_start=content_start
    )
    prompt_ids, prompt_images = _expand_images(frontend, prompt_ids, images, [where for where, _ in image_parts])
    layout = _expanded_layout(layout, prompt_images)
    sampling = _sampling(frontend, request)
    top_logprobs, prompt_logprobs = _logprob_settings(frontend, request)
    if prompt_logprobs and images and not frontend.scores_images:
        raise InvalidRequest(
            "prompt_logprobs are not supported for a prompt with images by this core: its scored prefill "
            "programs take no images",
            "prompt_logprobs",
        )

    string_stops, token_stops = _request_stops(frontend, request)
    envelope = frontend.envelope(rendered)
    tool_format = _tool_call_format(frontend, request, tool_specs, envelope)
    with _naming_field("response_format"):
        response_format = parse_response_format(request.response_format)
    with _naming_field("stop"):
        check_stop_compatibility(string_stops, token_stops, response_format is not None)
    format_text = None
    grammar: Grammar | None = None  # compiled here, once: the worker only instantiates its matcher
    reasoning, initially = frontend.reasoning, envelope.initially_reasoning
    if reasoning is not None and reasoning.close and rendered.rstrip().endswith(reasoning.close.rstrip()):
        reasoning = None  # the prompt closed reasoning (a template's thinking switched off): the answer comes at once
    if response_format is not None:
        frames = _recipient_frames(frontend, tool_specs, envelope)
        # an invalid schema is a 400 now, and so is one whose matcher cannot compute its first mask
        with _naming_field("response_format"):
            grammar = frontend.grammar_compiler.compile(
                response_format, reasoning=reasoning, initially_reasoning=initially, frames=frames
            )
        _first_mask(grammar, "response_format")
        if reasoning is not None or frames is not None:  # free text first: the answer's schema alone too
            with _naming_field("response_format"):
                answer = frontend.grammar_compiler.schema_grammar(response_format.schema, "response_format")
            _first_mask(answer, "response_format")
        format_text = prepared_format_json(
            request.response_format or {}, reasoning, initially_reasoning=initially, frames=frames
        )
    elif tool_format is not None:
        if string_stops:
            raise InvalidRequest("stop cannot be combined with tool_choice 'required' or a named function", "stop")
        # an invalid tool schema is a 400 now, and so is one whose matcher cannot compute its first mask
        with _naming_field("tools"):
            grammar = frontend.grammar_compiler.compile(tool_format, reasoning=reasoning, initially_reasoning=initially)
        _first_mask(grammar, "tools")
        _first_parameter_masks(frontend, tool_format)
        format_text = prepared_format_json(json.loads(tool_format.to_json()), reasoning, initially_reasoning=initially)

    observe_ids = bool(request.return_token_ids)
    observe_times = bool(request.return_token_timestamps)
    max_tokens, limit_field = _max_tokens(frontend, request, len(prompt_ids))
    banned_ids, only_ids = _logit_bias(frontend, request.logit_bias)
    prepared = PreparedRequest(
        request_id=request_id,
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        sampling=sampling,
        ignore_eos=bool(request.ignore_eos),
        min_tokens=_min_tokens(request.min_tokens, max_tokens, limit_field),
        banned_ids=banned_ids,
        only_ids=only_ids,
        skip_special_tokens=request.skip_special_tokens is not False,
        string_stops=string_stops,
        token_stops=token_stops,
        response_format=format_text,
        observe_timestamps=observe_times,
        top_logprobs=top_logprobs,
        prompt_logprobs=prompt_logprobs,
        grammar=grammar,
        layout=layout,
        images=prompt_images,
    )
    include_usage, continuous_usage = _usage_options(request)
    return Prepared(
        request=prepared,
        tools=tool_specs,
        envelope=envelope,
        structured=response_format is not None,
        stream=bool(request.stream),
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        return_token_ids=observe_ids,
        return_token_timestamps=observe_times,
        logprobs=top_logprobs >= 0,
        prompt_logprobs=prompt_logprobs,
        output_limit_field="max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens",
        single_call=request.parallel_tool_calls is False,
        choices=_choices(frontend, prepared, request.n, request.seed),
    )


def _usage_options(request: ChatCompletionRequest | CompletionRequest) -> tuple[bool, bool]:
    """``stream_options``' ``include_usage``, and ``continuous_usage_stats`` (which needs it)."""
    options = request.stream_options
    include = bool(options is not None and options.include_usage)
    return include, include and bool(options is not None and options.continuous_usage_stats)


def _choices(
    frontend: Frontend, request: PreparedRequest, count: int | None, seed: int | None
) -> tuple[PreparedRequest, ...]:
    """The engine requests of ``count`` choices (none for one): ``request`` under the ids
    ``<id>-0`` .. ``<id>-<count - 1>``, choice ``i`` seeded ``seed + i`` (wrapped within the core's seeds) when
    the request names a seed, else each with a fresh seed (choice 0 keeps the one preparation drew)."""
    if count is None or count <= 1:
        return ()
    limits = frontend.bootstrap.sampling_limits
    first = request.sampling.seed
    seeds = [choice_seed(first, index, limits) if seed is not None else fresh_seed(limits) for index in range(count)]
    seeds[0] = first
    return tuple(
        msgspec.structs.replace(
            request,
            request_id=f"{request.request_id}-{index}",
            sampling=msgspec.structs.replace(request.sampling, seed=choice),
        )
        for index, choice in enumerate(seeds)
    )


def _continues_final_message(request: ChatCompletionRequest) -> bool:
    """Whether the request continues its final message (which must then be the assistant's)."""
    if not request.continue_final_message:
        return False
    final = request.messages[-1]
    if not isinstance(final, AssistantMessage):
        raise InvalidRequest(
            "continue_final_message needs the final message to be an assistant message; "
            f"messages[{len(request.messages) - 1}] is a {type(final).__struct_config__.tag} message",
            "messages",
        )
    return True


def _client_template_variables(
    frontend: Frontend, request: ChatCompletionRequest, shield: ClientTextShield
) -> dict[str, Any] | None:
    """The request's ``chat_template_kwargs``, shielded as client text (their strings stay plain text);
    None when absent or empty. A name the renderer sets itself or a template global is a 400."""
    if not request.chat_template_kwargs:
        return None
    reserved = RENDER_VARIABLES | frontend.bootstrap.template.globals.keys()
    taken = sorted(name for name in request.chat_template_kwargs if name in reserved)
    if taken:
        raise InvalidRequest(
            f"chat_template_kwargs may not set {', '.join(map(repr, taken))}: the server sets "
            f"{'it' if len(taken) == 1 else 'them'} (use the request's own fields for messages, tools and "
            "add_generation_prompt)",
            "chat_template_kwargs",
        )
    shielded: dict[str, Any] = shield.shield_value(dict(request.chat_template_kwargs))
    return shielded


def _open_final_message(
    frontend: Frontend,
    messages: list[dict[str, Any]],
    tools: Any,
    variables: Mapping[str, Any] | None,
    rendered: str,
    shield: ClientTextShield,
) -> tuple[str, int]:
    """(``rendered`` cut right after the final assistant message's content, the character offset where that
    content starts).

    The content is located exactly, not searched for: the conversation is rendered once more with the
    content replaced by a marker no client text contains, and the real rendering must hold the content
    (or the content without surrounding whitespace, for templates that trim it) exactly where the marker
    was, after the same text. A template that does not render the content verbatim is a 400."""
    content = messages[-1]["content"]
    if not content:
        raise InvalidRequest(
            "continue_final_message needs the final assistant message to have content to continue", "messages"
        )
    marker = f"\ue002{secrets.token_hex(8)}\ue003"
    probe = frontend.bootstrap.render(
        [*messages[:-1], {**messages[-1], "content": marker}],
        tools=tools,
        input_chars=shield.input_chars,
        add_generation_prompt=False,
        client_variables=variables,
    )
    start = probe.find(marker)
    if start >= 0 and probe.count(marker) == 1 and rendered.startswith(probe[:start]):
        for text in (content, content.strip()):
            if text and rendered.startswith(text, start):
                return rendered[: start + len(text)], start
    raise InvalidRequest(
        "continue_final_message: the chat template does not render the final assistant message's content "
        "verbatim, so it cannot be continued",
        "messages",
    )


_LAYOUT_ROLES = {
    "system": ct.MESSAGE_ROLE_SYSTEM,
    "user": ct.MESSAGE_ROLE_USER,
    "assistant": ct.MESSAGE_ROLE_ASSISTANT,
    "tool": ct.MESSAGE_ROLE_TOOL,
}
"""The ``MessageRole`` of each role the template sees (a developer message is rendered, and counts, as a
system message)."""


def _prompt_layout(
    frontend: Frontend,
    messages: list[dict[str, Any]],
    tools: Any,
    variables: Mapping[str, Any] | None,
    rendered: str,
    prompt_ids: list[int],
    shield: ClientTextShield,
    *,
    content_start: int,
) -> PromptLayout | None:
    """The rendered prompt's layout for the scheduler; None when it would change nothing (the core declares
    no prefix-boundary rules and no assistant message is continued).

    ``content_start`` is the character offset of a continued final message's content in ``rendered`` (-1
    when none is continued); that message is open, so it has no end in the layout."""
    history = len(messages) - 1 if content_start >= 0 else len(messages)
    continuation = -1
    if content_start >= 0:
        continuation = _token_offsets(frontend, rendered, prompt_ids, shield, [content_start])[0]
    if not frontend.boundaries.restricted:
        return PromptLayout(continuation=continuation) if continuation >= 0 else None
    flags = PromptLayout(
        tools=tools is not None,
        reasoning_stripped=_reasoning_stripped(messages[:history], rendered),
        continuation=continuation,
    )
    ends: list[tuple[int, int]] = []  # (role, character offset where the message's rendering ends)
    for index in range(history):
        role = _LAYOUT_ROLES[messages[index]["role"]]
        if not frontend.boundaries.allows(role, flags):
            continue  # no rule allows a cut after it: its end is never needed
        prefix = frontend.bootstrap.render(
            messages[: index + 1],
            tools=tools,
            input_chars=shield.input_chars,
            add_generation_prompt=False,
            client_variables=variables,
        )
        if rendered.startswith(prefix):  # else its rendering depends on later messages: no boundary there
            ends.append((role, len(prefix)))
    offsets = _token_offsets(frontend, rendered, prompt_ids, shield, [end for _, end in ends])
    return msgspec.structs.replace(
        flags, messages=tuple(PromptMessage(role, offset) for (role, _), offset in zip(ends, offsets, strict=True))
    )


def _reasoning_stripped(messages: Sequence[dict[str, Any]], rendered: str) -> bool:
    """Some assistant message carries reasoning that the rendered prompt does not hold."""
    return any(
        message["role"] == "assistant"
        and message.get("reasoning_content")
        and message["reasoning_content"] not in rendered
        for message in messages
    )


def _token_offsets(
    frontend: Frontend, rendered: str, prompt_ids: list[int], shield: ClientTextShield, positions: Sequence[int]
) -> list[int]:
    """For each character offset of ``rendered`` (non-decreasing), the number of leading prompt ids that lie
    wholly before it.

    The text between consecutive offsets is encoded piece by piece (linear in the prompt); when the pieces'
    ids join into ``prompt_ids``, each offset is a token boundary and its count is exact. When they do not (a
    token of the whole prompt spans an offset), each offset gets the ids that the encoding of the text before
    it shares with the prompt, lowered so the counts never decrease; those ids lie wholly before it."""
    encoder = frontend.bootstrap.encoder
    joined: list[int] = []
    counts: list[int] = []
    previous = 0
    for position in positions:
        joined.extend(encoder.encode(rendered[previous:position], shield))
        counts.append(len(joined))
        previous = position
    joined.extend(encoder.encode(rendered[previous:], shield))
    if joined == prompt_ids:
        return counts
    shared = [_shared_prefix(encoder.encode(rendered[:position], shield), prompt_ids) for position in positions]
    for index in range(len(shared) - 2, -1, -1):
        shared[index] = min(shared[index], shared[index + 1])
    return shared


def _shared_prefix(ids: Sequence[int], prompt_ids: Sequence[int]) -> int:
    count = 0
    for mine, theirs in zip(ids, prompt_ids, strict=False):
        if mine != theirs:
            break
        count += 1
    return count


def _encode(frontend: Frontend, rendered: str, shield: ClientTextShield) -> list[int]:
    """Prompt ids of ``rendered`` (client text as plain text); a prompt that certainly cannot fit the
    context is refused (503, permanent) as soon as that is known, without tokenizing all of it."""
    context = frontend.context_tokens
    try:
        ids: Sequence[int] = frontend.bootstrap.encoder.encode(rendered, shield, limit=context)
    except PromptTooLong as exc:
        size = f"{exc.utf8_bytes} bytes, " if exc.utf8_bytes is not None else ""
        raise AdmissionRefused(
            f"the prompt holds {size}at least {exc.tokens} tokens, which does not fit the core's context of "
            f"{context} tokens",
            "messages",
            permanent=True,
        ) from exc
    limit = frontend.bootstrap.input_vocabulary
    bad = [i for i in ids if not 0 <= i < limit]
    if bad:
        raise PromptError(f"prompt token ids {bad[:5]} lie outside the input vocabulary [0, {limit})")
    if not ids:
        raise PromptError("the rendered prompt is empty")
    return list(ids)


_PROMPT_SHAPES = "prompt must be a string, a list of token ids, or a one-element list of either"


def _completion_prompt(frontend: Frontend, prompt: str | list[int | str | list[int]]) -> tuple[list[int], str]:
    """(prompt ids, prompt text) of a completions ``prompt``. A string is encoded raw; ids are checked
    against the input vocabulary and their text is their decoding (special tokens kept)."""
    if isinstance(prompt, list):
        if not prompt:
            raise InvalidRequest("prompt must not be empty", "prompt")
        if all(isinstance(item, int) for item in prompt):
            return _completion_ids(frontend, [item for item in prompt if isinstance(item, int)])
        if len(prompt) > 1:
            if all(isinstance(item, str | list) for item in prompt):
                raise InvalidRequest(
                    f"prompt: {len(prompt)} prompts in one request are not supported by this server "
                    "(send one request per prompt)",
                    "prompt",
                )
            raise InvalidRequest(_PROMPT_SHAPES, "prompt")
        (only,) = prompt
        if isinstance(only, list):
            return _completion_ids(frontend, only)
        if not isinstance(only, str):  # unreachable: a one-element list of ints is ids
            raise InvalidRequest(_PROMPT_SHAPES, "prompt")
        prompt = only
    if not prompt:
        raise InvalidRequest("prompt must not be empty", "prompt")
    context = frontend.context_tokens
    try:
        ids = frontend.bootstrap.encoder.encode_raw(prompt, limit=context)
    except PromptTooLong as exc:
        raise _prompt_beyond_context(exc.tokens, context, exc.utf8_bytes) from exc
    if not ids:
        raise InvalidRequest("prompt encodes to no tokens", "prompt")
    _check_vocabulary(frontend, ids)
    if len(ids) >= context:
        raise _prompt_beyond_context(len(ids), context, None)
    return ids, prompt


def _completion_ids(frontend: Frontend, ids: list[int]) -> tuple[list[int], str]:
    if not ids:
        raise InvalidRequest("prompt must not be empty", "prompt")
    _check_vocabulary(frontend, ids)
    if len(ids) >= frontend.context_tokens:
        raise _prompt_beyond_context(len(ids), frontend.context_tokens, None)
    text: str = frontend.bootstrap.tokenizer.decode(ids, skip_special_tokens=False)
    return ids, text


def _check_vocabulary(frontend: Frontend, ids: Sequence[int]) -> None:
    limit = frontend.bootstrap.input_vocabulary
    bad = [i for i in ids if not 0 <= i < limit]
    if bad:
        raise InvalidRequest(f"prompt token ids {bad[:5]} lie outside the input vocabulary [0, {limit})", "prompt")


def _prompt_beyond_context(tokens: int, context: int, utf8_bytes: int | None) -> AdmissionRefused:
    size = f"{utf8_bytes} bytes, " if utf8_bytes is not None else ""
    return AdmissionRefused(
        f"the prompt holds {size}at least {tokens} tokens, which does not fit the core's context of {context} tokens",
        "prompt",
        permanent=True,
    )


def prompt_pieces(frontend: Frontend, ids: Sequence[int]) -> list[str]:
    """The text each prompt id completes (special tokens kept; a token ending inside a character
    completes ""), so the pieces concatenate to the prompt's decoding."""
    detokenizer = IncrementalDetokenizer(frontend.bootstrap.tokenizer)
    pieces = [detokenizer.push(token_id) for token_id in ids]
    if pieces:
        pieces[-1] += detokenizer.flush()
    return pieces


def _completion_logprobs(frontend: Frontend, request: CompletionRequest) -> tuple[int, bool]:
    """(top_logprobs for the PreparedRequest, -1 when logprobs are off; whether prompt scores are needed:
    for echoed logprobs, or for ``prompt_logprobs``)."""
    asked = _prompt_logprobs_asked(frontend, request)
    if request.logprobs is None:
        return -1, asked
    if frontend.logprobs_top_n is None:
        raise InvalidRequest("logprobs are not supported by this core", "logprobs")
    if request.logprobs > frontend.logprobs_top_n:
        raise InvalidRequest(
            f"logprobs={request.logprobs} exceeds this core's limit of {frontend.logprobs_top_n}", "logprobs"
        )
    echoed = bool(request.echo)
    if echoed and not frontend.supports_prompt_logprobs:
        raise InvalidRequest("echo with logprobs is not supported by this core (no prompt scoring)", "echo")
    return request.logprobs, echoed or asked


def _request_stops(
    frontend: Frontend, request: ChatCompletionRequest | CompletionRequest
) -> tuple[list[str], list[list[int]]]:
    """A request's string stops and token-stop sequences, checked (a 400 naming the stop field at fault)."""
    with _naming_field("stop", "stop_token_ids", "stop_token_sequences"):
        string_stops = parse_string_stops(request.stop)
        token_stops = parse_token_stops(request.stop_token_ids, request.stop_token_sequences, frontend.sampled_size)
    return list(string_stops), [list(sequence) for sequence in token_stops]


def prepare_completion(frontend: Frontend, request: CompletionRequest, request_id: str) -> Prepared:
    """Validate and prepare a legacy completions ``request`` (runs on a preparation thread)."""
    problems = completion_unsupported_fields(request)
    if problems:
        field, message = problems[0]
        raise InvalidRequest(message, field)
    prompt_ids, prompt_text = _completion_prompt(frontend, request.prompt)
    sampling = _sampling(frontend, request, _COMPLETION_SAMPLING)
    top_logprobs, scored = _completion_logprobs(frontend, request)
    string_stops, token_stops = _request_stops(frontend, request)
    with _naming_field("stop"):
        check_stop_compatibility(string_stops, token_stops, False)
    max_tokens = _output_limit(frontend, request.max_tokens, "max_tokens", len(prompt_ids))
    banned_ids, only_ids = _logit_bias(frontend, request.logit_bias)
    prepared = PreparedRequest(
        request_id=request_id,
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        sampling=sampling,
        ignore_eos=bool(request.ignore_eos),
        min_tokens=_min_tokens(
            request.min_tokens, max_tokens, "max_tokens" if request.max_tokens is not None else None
        ),
        banned_ids=banned_ids,
        only_ids=only_ids,
        skip_special_tokens=request.skip_special_tokens is not False,
        string_stops=string_stops,
        token_stops=token_stops,
        observe_timestamps=bool(request.return_token_timestamps),
        top_logprobs=top_logprobs,
        prompt_logprobs=scored,
    )
    include_usage, continuous_usage = _usage_options(request)
    return Prepared(
        request=prepared,
        tools=(),
        envelope=CLOSED_ENVELOPE,
        structured=False,
        stream=bool(request.stream),
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        return_token_ids=bool(request.return_token_ids),
        return_token_timestamps=bool(request.return_token_timestamps),
        logprobs=top_logprobs >= 0,
        prompt_logprobs=scored,
        echo=prompt_text if request.echo else None,
        prompt_field="prompt",
        choice_prompt_logprobs=request.prompt_logprobs is not None,
        choices=_choices(frontend, prepared, request.n, request.seed),
    )
