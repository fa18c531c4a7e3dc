"""The OpenAI chat-completions request schema of the HTTP server.

Owns the msgspec Structs a ``POST /v1/chat/completions`` body decodes into, and the one strict
decoder made for them. Every struct forbids unknown fields and decoding is strict (no coercion of
strings to numbers or of integers to booleans), so an unknown or ill-typed field is an invalid
request naming the field. Semantic checks that need the core (stops, sampling ranges, formats,
vocabulary ids) belong to :mod:`helios_core.server.preparation`; refusals of documented fields this
server does not implement belong to :func:`unsupported_fields`.

Changed by the server owners when the accepted OpenAI surface changes; docs/http-api.md lists it.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

__all__ = [
    "AssistantMessage",
    "ChatCompletionRequest",
    "DeveloperMessage",
    "FunctionCall",
    "FunctionDefinition",
    "Message",
    "StreamOptions",
    "SystemMessage",
    "TextPart",
    "Tool",
    "ToolCallMessage",
    "ToolMessage",
    "UserMessage",
    "decode_request",
    "unsupported_fields",
]


class TextPart(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One text part of a message's content array (other part types are refused)."""

    type: Literal["text"]
    text: str


Content = str | list[TextPart]


class SystemMessage(msgspec.Struct, tag_field="role", tag="system", forbid_unknown_fields=True, frozen=True):
    content: Content
    name: str | None = None


class DeveloperMessage(msgspec.Struct, tag_field="role", tag="developer", forbid_unknown_fields=True, frozen=True):
    """OpenAI's newer name for system instructions; rendered as a system message."""

    content: Content
    name: str | None = None


class UserMessage(msgspec.Struct, tag_field="role", tag="user", forbid_unknown_fields=True, frozen=True):
    content: Content
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
    refusal: str | None = None


class ToolMessage(msgspec.Struct, tag_field="role", tag="tool", forbid_unknown_fields=True, frozen=True):
    content: Content
    tool_call_id: str


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
    # documented OpenAI fields this server refuses unless neutral
    logit_bias: dict[str, float] | None = None
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
    prompt_logprobs: int | None = None
    """vLLM-style: 0 returns each prompt token's logprob given its prefix; alternatives (> 0) are refused."""


_DECODER = msgspec.json.Decoder(ChatCompletionRequest)


def decode_request(body: bytes) -> ChatCompletionRequest:
    """Strictly decode a request body; raises ``msgspec.ValidationError`` or ``msgspec.DecodeError``."""
    return _DECODER.decode(body)


def unsupported_fields(request: ChatCompletionRequest) -> list[tuple[str, str]]:
    """(field, message) for every documented field whose value this server does not implement."""
    problems: list[tuple[str, str]] = []

    def refuse(field: str, what: str) -> None:
        problems.append((field, f"{field}: {what} is not supported by this server"))

    if request.n is not None and request.n != 1:
        refuse("n", f"n={request.n} (only one choice per request)")
    if request.top_logprobs is not None:
        if not request.logprobs:
            problems.append(("top_logprobs", "top_logprobs requires logprobs=true"))
        elif request.top_logprobs < 0:
            problems.append(("top_logprobs", f"top_logprobs must be >= 0, not {request.top_logprobs}"))
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
    if request.logit_bias:
        refuse("logit_bias", "a non-empty logit_bias")
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
    if request.return_token_timestamps and not request.return_token_ids:
        problems.append(("return_token_timestamps", "return_token_timestamps requires return_token_ids=true"))
    return problems
