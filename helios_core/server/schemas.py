"""The OpenAI request schemas of the HTTP server: chat completions and legacy completions.

Owns the msgspec Structs a ``POST /v1/chat/completions`` or ``POST /v1/completions`` body decodes
into, and the strict decoder made for each. Every struct forbids unknown fields and decoding is strict (no coercion of
strings to numbers or of integers to booleans), so an unknown or ill-typed field is an invalid
request naming the field. Semantic checks that need the core (stops, sampling ranges, formats,
vocabulary ids) belong to :mod:`helios_core.server.preparation`; refusals of documented fields this
server does not implement belong to :func:`unsupported_fields`. Nesting is bounded here too:
:func:`decode_request` refuses a field whose arrays and objects nest deeper than
:data:`MAX_JSON_DEPTH` (a tool call's ``arguments`` text included), with a scan that does not
recurse, so no later step (rendering, schema compilation, encoding) can exhaust the stack. The
completions ``prompt`` decodes as a string or a list of ids, strings or id lists; which of those
shapes a request may use is preparation's decision (:func:`helios_core.server.preparation.prepare_completion`).
A user message's content array may hold ``image_url`` parts (:class:`ImagePart`) beside text parts;
the content of every other message takes text parts only, and an image part there is refused
naming the part (``messages[i].content[j]``). Reading and decoding the images is preparation's
(:mod:`helios_core.server.image_input`).

Changed by the server owners when the accepted OpenAI surface changes; docs/http-api.md lists it.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

from helios_core.server.errors import InvalidRequest

__all__ = [
    "MAX_JSON_DEPTH",
    "AssistantMessage",
    "ChatCompletionRequest",
    "CompletionRequest",
    "DeveloperMessage",
    "FunctionCall",
    "FunctionDefinition",
    "ImagePart",
    "ImageURL",
    "Message",
    "StreamOptions",
    "SystemMessage",
    "TextPart",
    "Tool",
    "ToolCallMessage",
    "ToolMessage",
    "UserContent",
    "UserMessage",
    "completion_unsupported_fields",
    "decode_completion_request",
    "decode_request",
    "json_text_depth",
    "unsupported_fields",
]


class TextPart(msgspec.Struct, tag_field="type", tag="text", forbid_unknown_fields=True, frozen=True):
    """One text part of a message's content array: ``{"type": "text", "text": ...}``."""

    text: str


class ImageURL(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """An image part's image: a ``data:`` URL (or an ``http(s)`` URL where the operator allows them)."""

    url: str
    detail: Literal["auto", "low", "high"] | None = None
    """Accepted for compatibility; every image is prepared as the core's image preparation says."""


class ImagePart(msgspec.Struct, tag_field="type", tag="image_url", forbid_unknown_fields=True, frozen=True):
    """One image part of a user message's content array: ``{"type": "image_url", "image_url": {"url": ...}}``."""

    image_url: ImageURL


Content = str | list[TextPart]
"""Content of system, developer, assistant and tool messages: text only (any other part type is refused)."""

UserContent = str | list[TextPart | ImagePart]
"""Content of a user message: text and image parts (other part types are refused)."""


class SystemMessage(msgspec.Struct, tag_field="role", tag="system", forbid_unknown_fields=True, frozen=True):
    content: Content
    name: str | None = None


class DeveloperMessage(msgspec.Struct, tag_field="role", tag="developer", forbid_unknown_fields=True, frozen=True):
    """OpenAI's newer name for system instructions; rendered as a system message."""

    content: Content
    name: str | None = None


class UserMessage(msgspec.Struct, tag_field="role", tag="user", forbid_unknown_fields=True, frozen=True):
    content: UserContent
    name: str | None = None


class FunctionCall(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    name: str
    arguments: str
    """JSON object text, as OpenAI sends it."""


class ToolCallMessage(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A tool call of an earlier assistant turn."""

    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class AssistantMessage(msgspec.Struct, tag_field="role", tag="assistant", forbid_unknown_fields=True, frozen=True):
    content: Content | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    """The same reasoning under the name newer vLLM releases use; ``reasoning_content`` wins when both are
    sent."""
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    """Citations OpenAI attaches to a returned message; accepted when a client sends the message back, and
    not rendered."""
    audio: dict[str, Any] | None = None
    """An earlier audio answer's reference; only null is accepted (this server keeps no audio)."""
    function_call: FunctionCall | None = None
    """The legacy single function call; only null is accepted (earlier calls travel in ``tool_calls``)."""


class ToolMessage(msgspec.Struct, tag_field="role", tag="tool", forbid_unknown_fields=True, frozen=True):
    content: Content
    tool_call_id: str
    name: str | None = None
    """The called function's name, which some clients send back with its result (passed to the template)."""


Message = SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage


class FunctionDefinition(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    type: Literal["function"]
    function: FunctionDefinition


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None
    continuous_usage_stats: bool | None = None
    """vLLM's extension: with ``include_usage``, every chunk carries the usage so far."""


class ChatCompletionRequest(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A chat-completions request: the documented OpenAI fields plus the Helios extensions.

    ``None`` means "absent" everywhere; observation flags accept only booleans or null.
    """

    messages: list[Message]
    model: str | None = None
    # sampling and limits
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    # output shape
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # bookkeeping OpenAI accepts and this server ignores
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    logit_bias: dict[str, float] | None = None
    """Token id (a decimal string) to bias: -100 never samples the id, 100 samples only among the ids
    given 100, 0 changes nothing; other values are refused (see ``preparation``)."""
    # documented OpenAI fields this server refuses unless neutral
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    # Helios extensions
    return_token_ids: bool | None = None
    return_token_timestamps: bool | None = None
    stop_token_ids: list[int] | None = None
    stop_token_sequences: list[list[int]] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    """vLLM-style: the first this many output tokens are never EOS or a ``stop_token_ids`` id, and no stop
    is looked for in them; at most the output limit."""
    prompt_logprobs: int | None = None
    """vLLM-style: 0 returns each prompt token's logprob given its prefix; alternatives (> 0) are refused."""
    add_generation_prompt: bool | None = None
    """vLLM-style: false renders the conversation without the template's generation prompt (absent: true,
    unless ``continue_final_message`` is true)."""
    continue_final_message: bool | None = None
    """vLLM-style: true leaves the final message, which must be the assistant's, open so generation
    continues its content; not with ``add_generation_prompt: true``."""
    skip_special_tokens: bool | None = None
    """vLLM-style: false presents generated special tokens that no output syntax spells (absent: true)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM-style: extra variables for the chat template (``{"enable_thinking": false}``), over the core's
    own template variables; names the server sets itself are refused."""


class CompletionRequest(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A legacy completions request (``POST /v1/completions``): the OpenAI fields plus the sampling
    extensions chat accepts. ``None`` means "absent" everywhere.

    ``prompt`` is a string, a list of token ids, or a one-element list of either; anything else the
    union admits (several prompts, a list mixing ids and strings) is refused at preparation.
    """

    prompt: str | list[int | str | list[int]]
    model: str | None = None
    # sampling and limits
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_token_sequences: list[list[int]] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    """As on chat."""
    skip_special_tokens: bool | None = None
    """vLLM-style: false presents generated special tokens that no output syntax spells (absent: true)."""
    # output shape
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logprobs: int | None = None
    """Legacy form: how many top alternatives per token (0: the sampled token's logprob only)."""
    echo: bool | None = None
    # Helios (and vLLM) extensions, as on chat
    return_token_ids: bool | None = None
    return_token_timestamps: bool | None = None
    prompt_logprobs: int | None = None
    """0 returns each prompt token's logprob given its prefix (``choices[0].prompt_logprobs``)."""
    logit_bias: dict[str, float] | None = None
    """As on chat."""
    # bookkeeping OpenAI accepts and this server ignores
    user: str | None = None
    # documented OpenAI fields this server refuses unless neutral
    n: int | None = None
    best_of: int | None = None
    suffix: str | None = None


_DECODER = msgspec.json.Decoder(ChatCompletionRequest)
_COMPLETION_DECODER = msgspec.json.Decoder(CompletionRequest)

MAX_LOGIT_BIAS = 1024
"""The most token ids one ``logit_bias`` may name."""

LOGIT_BIAS_BAN = -100.0
"""The ``logit_bias`` value that never samples its token."""

LOGIT_BIAS_ONLY = 100.0
"""The ``logit_bias`` value that samples only among the tokens given it."""

MAX_CHOICES = 128
"""The most choices (``n``) one request may ask for, as OpenAI allows."""

MAX_JSON_DEPTH = 64
"""How deep arrays and objects may nest in one request field: the field's own value is level 1, so
``"response_format": {"json_schema": {"schema": {...}}}`` is already three levels. A tool call's
``arguments`` text, parsed during preparation, is held to the same limit counted from its own root.
Real JSON schemas and tool arguments stay far below it; a deeper field is a 400 naming it."""

_MISPLACED_IMAGE = re.compile(r"Invalid value 'image_url' - at `\$\.(?P<part>messages\[\d+\]\.content\[\d+\])\.type`")
"""msgspec's refusal of an image part in a message whose content takes text parts only."""

_JSON_TOKENS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[][{},]', re.DOTALL)
"""Strings (skipped whole, escapes included) and the structural characters the depth scan needs."""


def decode_request(body: bytes) -> ChatCompletionRequest:
    """Strictly decode a request body and bound its nesting.

    Raises ``msgspec.ValidationError`` or ``msgspec.DecodeError`` for a malformed or ill-typed body,
    and :class:`InvalidRequest` naming the field when one nests deeper than :data:`MAX_JSON_DEPTH`.
    """
    try:
        request = _DECODER.decode(body)
    except RecursionError:  # nesting deep enough to exhaust the decoder's stack: name the field
        raise _too_deep(_deepest_field(body)) from None
    except msgspec.ValidationError as exc:  # only user messages take image parts: say so
        misplaced = _MISPLACED_IMAGE.fullmatch(str(exc))
        if misplaced is None:
            raise
        raise InvalidRequest(
            f"{misplaced['part']}: image parts are only accepted in user messages", "messages"
        ) from None
    problem = _nesting_problem(request)
    if problem is not None:
        raise _too_deep(*problem)
    return request


def decode_completion_request(body: bytes) -> CompletionRequest:
    """Strictly decode a legacy completions body (errors as :func:`decode_request`). Its fields nest at
    most three levels (``prompt`` as a list of id lists), so only the decoder's own depth guard applies."""
    try:
        return _COMPLETION_DECODER.decode(body)
    except RecursionError:
        raise _too_deep(_deepest_field(body)) from None


def _too_deep(field: str | None, where: str | None = None) -> InvalidRequest:
    return InvalidRequest(
        f"{where or field or 'the request body'} nests arrays and objects more than {MAX_JSON_DEPTH} levels deep; "
        f"at most {MAX_JSON_DEPTH} are allowed",
        field,
    )


def json_text_depth(text: bytes) -> int:
    """The deepest nesting of arrays and objects in JSON text (0 for a scalar), found without
    recursion. Brackets inside well-formed strings do not count; in malformed text every bracket
    outside a terminated string counts, which never reports less than a parser would reach."""
    depth = deepest = 0
    for match in _JSON_TOKENS.finditer(text):
        token = match.group()
        if token in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        elif token in (b"]", b"}"):
            depth = max(depth - 1, 0)
    return deepest


def _deepest_field(body: bytes) -> str | None:
    """The first top-level field of ``body`` whose value nests deeper than MAX_JSON_DEPTH (a raw scan,
    for bodies too deep to decode)."""
    depth = 0
    expect_key = False
    field: str | None = None
    for match in _JSON_TOKENS.finditer(body):
        token = match.group()
        if token in (b"[", b"{"):
            depth += 1
            expect_key = depth == 1 and token == b"{"
            if depth > MAX_JSON_DEPTH + 1:  # the body's own object is one level above its fields
                return field
        elif token in (b"]", b"}"):
            depth = max(depth - 1, 0)
        elif token == b",":
            expect_key = depth == 1
        elif depth == 1 and expect_key:  # a string: the next top-level field's name
            try:
                field = msgspec.json.decode(token, type=str)
            except msgspec.DecodeError:
                field = None
            expect_key = False
    return None


def _nesting_problem(request: ChatCompletionRequest) -> tuple[str, str | None] | None:
    """(field, where) of the first field nesting deeper than MAX_JSON_DEPTH, or None. Iterative: the
    decoded values are walked with an explicit stack."""
    for field in request.__struct_fields__:
        value = getattr(request, field)
        if not isinstance(value, list | dict | msgspec.Struct):
            continue
        stack: list[tuple[Any, int]] = [(value, 1)]
        while stack:
            node, depth = stack.pop()
            if depth > MAX_JSON_DEPTH:
                return field, None
            if isinstance(node, dict):
                children: Any = node.values()
            elif isinstance(node, list):
                children = node
            else:
                children = [getattr(node, name) for name in node.__struct_fields__]
            stack.extend((child, depth + 1) for child in children if isinstance(child, list | dict | msgspec.Struct))
    for index, message in enumerate(request.messages):
        if isinstance(message, AssistantMessage) and message.tool_calls:
            for position, call in enumerate(message.tool_calls):
                arguments = call.function.arguments.encode()
                brackets = arguments.count(b"[") + arguments.count(b"{")  # a bound that skips most scans
                if brackets > MAX_JSON_DEPTH and json_text_depth(arguments) > MAX_JSON_DEPTH:
                    return "messages", f"messages[{index}].tool_calls[{position}].function.arguments"
    return None


def unsupported_fields(request: ChatCompletionRequest) -> list[tuple[str, str]]:
    """(field, message) for every documented field whose value this server does not implement."""
    problems: list[tuple[str, str]] = []

    def refuse(field: str, what: str) -> None:
        problems.append((field, f"{field}: {what} is not supported by this server"))

    if request.n is not None and not 1 <= request.n <= MAX_CHOICES:
        problems.append(("n", f"n must lie in [1, {MAX_CHOICES}], not {request.n}"))
    if request.top_logprobs is not None:
        if not request.logprobs:
            problems.append(("top_logprobs", "top_logprobs requires logprobs=true"))
        elif request.top_logprobs < 0:
            problems.append(("top_logprobs", f"top_logprobs must be >= 0, not {request.top_logprobs}"))
    problems.extend(_observation_problems(request))
    if request.modalities is not None and request.modalities != ["text"]:
        refuse("modalities", f"modalities={request.modalities!r} (only ['text'])")
    if request.audio is not None:
        refuse("audio", "audio output")
    if request.prediction is not None:
        refuse("prediction", "predicted outputs")
    if request.reasoning_effort is not None:
        refuse("reasoning_effort", f"reasoning_effort={request.reasoning_effort!r}")
    if request.verbosity is not None:
        refuse("verbosity", f"verbosity={request.verbosity!r}")
    if request.web_search_options is not None:
        refuse("web_search_options", "web search")
    if request.functions is not None:
        refuse("functions", "the deprecated functions field (use tools)")
    if request.function_call is not None:
        refuse("function_call", "the deprecated function_call field (use tool_choice)")
    if request.store:
        refuse("store", "store=true")
    if request.service_tier not in (None, "auto", "default"):
        refuse("service_tier", f"service_tier={request.service_tier!r}")
    if request.stream_options is not None and not request.stream:
        problems.append(("stream_options", "stream_options is only allowed when stream is true"))
    choice = request.tool_choice
    if isinstance(choice, str) and choice not in ("auto", "none", "required"):
        refuse("tool_choice", f"tool_choice={choice!r} (only 'auto', 'none', 'required' or a named function)")
    if request.continue_final_message and request.add_generation_prompt:
        problems.append(
            (
                "continue_final_message",
                "continue_final_message and add_generation_prompt cannot both be true "
                "(set add_generation_prompt to false to continue the final assistant message)",
            )
        )
    return problems


def completion_unsupported_fields(request: CompletionRequest) -> list[tuple[str, str]]:
    """(field, message) for every completions field whose value this server does not implement."""
    problems: list[tuple[str, str]] = []

    def refuse(field: str, what: str) -> None:
        problems.append((field, f"{field}: {what} is not supported by this server"))

    if request.n is not None and not 1 <= request.n <= MAX_CHOICES:
        problems.append(("n", f"n must lie in [1, {MAX_CHOICES}], not {request.n}"))
    if request.best_of is not None and request.best_of != (request.n or 1):
        refuse("best_of", f"best_of={request.best_of} (only as many candidates as choices, n)")
    if request.suffix is not None:
        refuse("suffix", "a suffix (insertion)")
    if request.logprobs is not None and request.logprobs < 0:
        problems.append(("logprobs", f"logprobs must be >= 0, not {request.logprobs}"))
    if request.echo and request.logprobs is not None and request.logprobs > 0:
        refuse(
            "echo",
            f"echo with logprobs={request.logprobs} (prompt tokens have no top alternatives; use logprobs=0)",
        )
    if request.stream_options is not None and not request.stream:
        problems.append(("stream_options", "stream_options is only allowed when stream is true"))
    problems.extend(_observation_problems(request))
    return problems


def _observation_problems(request: ChatCompletionRequest | CompletionRequest) -> list[tuple[str, str]]:
    """(field, message) for the observation extensions' values this server refuses (chat and completions)."""
    problems: list[tuple[str, str]] = []
    if request.prompt_logprobs is not None:
        if request.prompt_logprobs < 0:
            problems.append(("prompt_logprobs", f"prompt_logprobs must be >= 0, not {request.prompt_logprobs}"))
        elif request.prompt_logprobs > 0:
            problems.append(
                (
                    "prompt_logprobs",
                    f"prompt_logprobs={request.prompt_logprobs}: top alternatives for prompt tokens are not supported "
                    "(use 0 for the prompt tokens' own logprobs)",
                )
            )
    if request.return_token_timestamps and not request.return_token_ids:
        problems.append(("return_token_timestamps", "return_token_timestamps requires return_token_ids=true"))
    return problems
