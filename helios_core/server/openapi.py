"""The OpenAPI description of the chat and completions request bodies and of every error response.

Owns the translation of the msgspec JSON schemas of
:class:`~helios_core.server.schemas.ChatCompletionRequest` and
:class:`~helios_core.server.schemas.CompletionRequest` into Litestar's OpenAPI objects. The
controllers decode their bodies themselves (strict msgspec decoding; Litestar's own body parsing
coerces types), so Litestar cannot see the body type: this module adds the request body and its
component schemas to the generated document instead.

The request schema also states the values preparation refuses where JSON Schema can say so
(:data:`_REFUSALS`: ``messages`` not empty, ``max_tokens`` positive, the sampling ranges of
:data:`~helios_core.frontend.bootstrap.SAMPLING_RANGES`, the stop limits, the refused OpenAI fields
as ``null`` only). What it cannot say (the JSON nesting limit, limits of the served core such as
its vocabulary or ``top_logprobs``, rules joining two fields) is in the field descriptions and
docs/http-api.md. Every operation lists its error statuses with the OpenAI error object; 429 and
503 list ``Retry-After``, ``retry-after-ms`` and ``x-should-retry``. The render operations take the
same bodies as their generating endpoints and answer the prompt token ids; ``GET /ready`` and
``GET /v1/models`` list their 503 (not ready).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import msgspec
from litestar.openapi.spec import (
    OpenAPIHeader,
    OpenAPIMediaType,
    OpenAPIResponse,
    OpenAPIType,
    Operation,
    RequestBody,
    Schema,
)

from helios_core.frontend.bootstrap import SAMPLING_RANGES
from helios_core.frontend.stops import (
    MAX_STOP_SEQUENCE_TOKENS,
    MAX_STOP_TOKEN_IDS,
    MAX_STOP_TOKEN_SEQUENCES,
    MAX_STRING_STOP_BYTES,
    MAX_STRING_STOPS,
)
from helios_core.server.schemas import (
    LOGIT_BIAS_BAN,
    LOGIT_BIAS_ONLY,
    MAX_CHOICES,
    MAX_JSON_DEPTH,
    MAX_LOGIT_BIAS,
    ChatCompletionRequest,
    CompletionRequest,
)

__all__ = [
    "ChatOperation",
    "CompletionOperation",
    "ServerOperation",
    "chat_request_schema",
    "completion_request_schema",
    "error_schema",
]

_NESTED_ONE = {"items": "items", "additionalProperties": "additional_properties"}
_NESTED_MANY = {"anyOf": "any_of", "oneOf": "one_of", "allOf": "all_of"}
_PLAIN = {
    "title": "title",
    "description": "description",
    "enum": "enum",
    "const": "const",
    "required": "required",
    "minimum": "minimum",
    "maximum": "maximum",
    "minLength": "min_length",
    "maxLength": "max_length",
    "minItems": "min_items",
    "maxItems": "max_items",
    "exclusiveMinimum": "exclusive_minimum",
    "exclusiveMaximum": "exclusive_maximum",
    "minProperties": "min_properties",
    "maxProperties": "max_properties",
    "pattern": "pattern",
}


def _convert(node: Any, definitions: dict[str, Any]) -> Schema | bool:
    """Litestar's Schema for one JSON-schema node, with every ``$ref`` inlined (the schema is not
    recursive; Litestar regenerates ``components/schemas`` from its own registry, so references
    to components of ours would dangle)."""
    if isinstance(node, bool):
        return node
    if "$ref" in node:
        return _convert(definitions[node["$ref"].removeprefix("#/$defs/")], definitions)
    values: dict[str, Any] = {}
    if "type" in node:
        kind = node["type"]
        values["type"] = [OpenAPIType(k) for k in kind] if isinstance(kind, list) else OpenAPIType(kind)
    for key, name in _PLAIN.items():
        if key in node:
            values[name] = node[key]
    if "properties" in node:
        values["properties"] = {k: _convert(v, definitions) for k, v in node["properties"].items()}
    for key, name in _NESTED_ONE.items():
        if key in node:
            values[name] = _convert(node[key], definitions)
    for key, name in _NESTED_MANY.items():
        if key in node:
            values[name] = [_convert(v, definitions) for v in node[key]]
    return Schema(**values)


def _branch(node: dict[str, Any], kind: str) -> dict[str, Any]:
    """The member of ``node`` (a plain schema or an ``anyOf`` of alternatives) of JSON type ``kind``."""
    for member in node.get("anyOf", [node]):
        if member.get("type") == kind:
            return member  # type: ignore[no-any-return]
    raise KeyError(f"no {kind} alternative in {node!r}")


def _merge(target: dict[str, Any], extra: dict[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = value


def _narrow(kind: str, **constraints: Any) -> Callable[[dict[str, Any]], None]:
    """A refusal: merge ``constraints`` into the field's ``kind`` alternative."""

    def apply(node: dict[str, Any]) -> None:
        _merge(_branch(node, kind), constraints)

    return apply


def _each(*refusals: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def apply(node: dict[str, Any]) -> None:
        for refusal in refusals:
            refusal(node)

    return apply


def _null_only(node: dict[str, Any]) -> None:
    """A refusal of every value but null (a documented OpenAI field this server does not implement)."""
    description = node.get("description")
    node.clear()
    node.update(type="null", description=(description + " " if description else "") + "Not supported: null only.")


def _sampling_range(name: str) -> Callable[[dict[str, Any]], None]:
    low, high, open_low = SAMPLING_RANGES[name]
    kind = "integer" if name in ("top_k", "seed") else "number"
    bounds: dict[str, Any] = {"exclusiveMinimum" if open_low else "minimum": low}
    if high != float("inf"):
        bounds["maximum"] = high
    return _narrow(kind, **bounds)


_TOOL_CHOICE_OBJECT = {
    "properties": {
        "type": {"enum": ["function"]},
        "function": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
    },
    "required": ["type", "function"],
    "additionalProperties": False,
}

_REFUSALS: dict[str, Callable[[dict[str, Any]], None]] = {
    "messages": lambda node: node.update(minItems=1),
    "n": _narrow("integer", minimum=1, maximum=MAX_CHOICES),
    "max_tokens": _narrow("integer", minimum=1),
    "max_completion_tokens": _narrow("integer", minimum=1),
    "min_tokens": _narrow("integer", minimum=0),
    **{name: _sampling_range(name) for name in SAMPLING_RANGES},
    "top_logprobs": _narrow("integer", minimum=0),
    "prompt_logprobs": _narrow("integer", minimum=0, maximum=0),
    "stop": _each(_narrow("string", minLength=1), _narrow("array", maxItems=MAX_STRING_STOPS, items={"minLength": 1})),
    "stop_token_ids": _narrow("array", maxItems=MAX_STOP_TOKEN_IDS, items={"minimum": 0}),
    "stop_token_sequences": _narrow(
        "array",
        maxItems=MAX_STOP_TOKEN_SEQUENCES,
        items={"minItems": 1, "maxItems": MAX_STOP_SEQUENCE_TOKENS, "items": {"minimum": 0}},
    ),
    "response_format": _narrow(
        "object",
        properties={"type": {"enum": ["text", "json_object", "json_schema"]}},
        required=["type"],
    ),
    "tool_choice": _each(
        _narrow("string", enum=["auto", "none", "required"]), _narrow("object", **_TOOL_CHOICE_OBJECT)
    ),
    "store": _narrow("boolean", enum=[False]),
    "service_tier": _narrow("string", enum=["auto", "default"]),
    "modalities": _narrow("array", minItems=1, maxItems=1, items={"enum": ["text"]}),
    "logit_bias": _narrow(
        "object",
        maxProperties=MAX_LOGIT_BIAS,
        propertyNames={"pattern": "^[0-9]+$"},
        additionalProperties={"enum": [int(LOGIT_BIAS_BAN), 0, int(LOGIT_BIAS_ONLY)]},
    ),
    **{
        name: _null_only
        for name in (
            "audio",
            "prediction",
            "reasoning_effort",
            "verbosity",
            "web_search_options",
            "functions",
            "function_call",
        )
    },
}
"""Per field, how the schema states the values preparation refuses (see the module docstring)."""

_DESCRIPTIONS = {
    "stop": f"At most {MAX_STRING_STOP_BYTES} UTF-8 bytes in all; not with token stops or response_format.",
    "stop_token_ids": "Vocabulary ids of the served core.",
    "logit_bias": "Token ids of the served core: -100 never samples the token, 100 samples only among the tokens "
    "given 100, 0 changes nothing; other values are refused (sampling takes a mask, not an added bias).",
    "min_tokens": "vLLM-style; the first this many output tokens are never EOS or a stop_token_ids id, and no stop "
    "is looked for in them. At most the request's output limit.",
    "top_logprobs": "Requires logprobs: true; at most the served core's limit.",
    "stream_options": "Only with stream: true.",
    "return_token_timestamps": "Requires return_token_ids: true.",
    "add_generation_prompt": "vLLM-style; absent means true unless continue_final_message is true. False renders "
    "the conversation without the template's generation prompt.",
    "continue_final_message": "vLLM-style; true continues the final message, which must be an assistant message "
    "with content (its rendering is left open). Not with add_generation_prompt: true.",
    "chat_template_kwargs": "vLLM-style; extra chat-template variables over the core's own (such as "
    '{"enable_thinking": false}). Not messages, tools, add_generation_prompt, bos_token, eos_token or a '
    "template function's name.",
}


def _refuse(properties: dict[str, Any]) -> None:
    for name, refusal in _REFUSALS.items():
        refusal(properties[name])
    for name, text in _DESCRIPTIONS.items():
        properties[name]["description"] = text
    for name in ("response_format", "tools", "tool_choice"):
        properties[name]["description"] = f"Arrays and objects nest at most {MAX_JSON_DEPTH} levels deep."
    properties["messages"]["description"] = (
        f"At least one message. A tool call's arguments text nests at most {MAX_JSON_DEPTH} levels deep."
    )


@functools.cache
def chat_request_schema() -> Schema:
    """The chat request body's schema (ChatCompletionRequest with nested structs inlined, refusals stated)."""
    (root,), definitions = msgspec.json.schema_components([ChatCompletionRequest])
    root = copy.deepcopy(definitions[root["$ref"].removeprefix("#/$defs/")] if "$ref" in root else root)
    _refuse(root["properties"])
    schema = _convert(root, definitions)
    if isinstance(schema, bool):
        raise TypeError("the chat request schema is not an object schema")
    return schema


_COMPLETION_REFUSALS: dict[str, Callable[[dict[str, Any]], None]] = {
    "prompt": _each(_narrow("string", minLength=1), _narrow("array", minItems=1)),
    "n": _narrow("integer", minimum=1, maximum=MAX_CHOICES),
    "best_of": _narrow("integer", minimum=1, maximum=MAX_CHOICES),
    "max_tokens": _narrow("integer", minimum=1),
    **{name: _sampling_range(name) for name in SAMPLING_RANGES},
    "logprobs": _narrow("integer", minimum=0),
    "stop": _REFUSALS["stop"],
    "stop_token_ids": _REFUSALS["stop_token_ids"],
    "stop_token_sequences": _REFUSALS["stop_token_sequences"],
    "logit_bias": _REFUSALS["logit_bias"],
    "min_tokens": _REFUSALS["min_tokens"],
    "suffix": _null_only,
    "prompt_logprobs": _REFUSALS["prompt_logprobs"],
}

_COMPLETION_DESCRIPTIONS = {
    "prompt": "A string (encoded raw, without the chat template), a list of token ids, or a one-element list of "
    "either; several prompts are refused.",
    "logprobs": "Top alternatives per token (legacy form), at most the served core's limit; with echo only 0.",
    "stop": _DESCRIPTIONS["stop"].replace(" or response_format", ""),
    "stop_token_ids": _DESCRIPTIONS["stop_token_ids"],
    "logit_bias": _DESCRIPTIONS["logit_bias"],
    "min_tokens": _DESCRIPTIONS["min_tokens"],
    "stream_options": _DESCRIPTIONS["stream_options"],
    "return_token_timestamps": _DESCRIPTIONS["return_token_timestamps"],
}


@functools.cache
def completion_request_schema() -> Schema:
    """The legacy completions request body's schema (CompletionRequest, refusals stated)."""
    (root,), definitions = msgspec.json.schema_components([CompletionRequest])
    root = copy.deepcopy(definitions[root["$ref"].removeprefix("#/$defs/")] if "$ref" in root else root)
    properties = root["properties"]
    for name, refusal in _COMPLETION_REFUSALS.items():
        refusal(properties[name])
    for name, text in _COMPLETION_DESCRIPTIONS.items():
        properties[name]["description"] = text
    schema = _convert(root, definitions)
    if isinstance(schema, bool):
        raise TypeError("the completions request schema is not an object schema")
    return schema


@functools.cache
def error_schema() -> Schema:
    """The OpenAI error object every error response carries."""
    return Schema(
        type=OpenAPIType.OBJECT,
        required=["error"],
        properties={
            "error": Schema(
                type=OpenAPIType.OBJECT,
                required=["message", "type", "param", "code"],
                properties={
                    "message": Schema(type=OpenAPIType.STRING),
                    "type": Schema(type=OpenAPIType.STRING),
                    "param": Schema(type=[OpenAPIType.STRING, OpenAPIType.NULL]),
                    "code": Schema(type=OpenAPIType.INTEGER),
                },
            )
        },
    )


_SSE_EVENT = Schema(
    type=OpenAPIType.OBJECT,
    description="One server-sent event: a chat.completion.chunk or [DONE] as data; the terminal error event "
    "is named error and carries the error object.",
    required=["data"],
    properties={
        "event": Schema(type=OpenAPIType.STRING, enum=["message", "error"]),
        "data": Schema(type=OpenAPIType.STRING),
    },
)

_RETRY_HEADERS = {
    "Retry-After": OpenAPIHeader(
        schema=Schema(type=OpenAPIType.INTEGER),
        description="Whole seconds before a retry may pass (transient refusals; 1..60).",
    ),
    "retry-after-ms": OpenAPIHeader(
        schema=Schema(type=OpenAPIType.INTEGER),
        description="The same delay in milliseconds (1000..60000), read first by the official OpenAI clients.",
    ),
    "x-should-retry": OpenAPIHeader(
        schema=Schema(type=OpenAPIType.STRING, enum=["false"]),
        description="false: the same request can never succeed (a capacity of the served core).",
    ),
}

_CHAT_ERRORS = {
    400: "Invalid request: malformed, unknown or ill-typed field, unsupported or out-of-range value (error.param).",
    404: "The model is not served here.",
    413: "The request body is larger than the server accepts.",
    415: "The request body is not declared as application/json.",
    429: "Every admission permit is taken (queue_capacity + max_active requests); retry after Retry-After.",
    500: "Model execution, device or output handling failed (execution_error).",
    503: "Outside the served core's capacities (admission_rejected), cancelled by shutdown (cancelled), or the "
    "server is starting or draining (not_ready; draining also sends Connection: close).",
}

_NOT_READY = {503: "The server is starting (warm-up) or draining for shutdown (not_ready)."}

_RENDER_SUCCESS = Schema(
    type=OpenAPIType.OBJECT,
    description="The prompt token ids the same request would prefill; nothing is generated.",
    required=["id", "object", "model", "prompt_token_ids", "num_prompt_tokens"],
    properties={
        "id": Schema(type=OpenAPIType.STRING),
        "object": Schema(type=OpenAPIType.STRING, enum=["render"]),
        "model": Schema(type=OpenAPIType.STRING),
        "prompt_token_ids": Schema(type=OpenAPIType.ARRAY, items=Schema(type=OpenAPIType.INTEGER)),
        "num_prompt_tokens": Schema(type=OpenAPIType.INTEGER),
    },
)


def _error_responses(statuses: dict[int, str]) -> dict[str, OpenAPIResponse]:
    return {
        str(status): OpenAPIResponse(
            description=description,
            content={"application/json": OpenAPIMediaType(schema=error_schema())},
            headers=dict(_RETRY_HEADERS) if status in (429, 503) else None,
        )
        for status, description in statuses.items()
    }


@dataclasses.dataclass
class ServerOperation(Operation):
    """An operation of this server: Litestar's description plus the 500 every handler may answer."""

    def __post_init__(self) -> None:
        self.responses = {**(self.responses or {}), **_error_responses({500: _CHAT_ERRORS[500]})}


@dataclasses.dataclass
class ProbeOperation(Operation):
    """``GET /ready`` and ``GET /v1/models``: a server operation that is 503 until the server is ready."""

    def __post_init__(self) -> None:
        errors = _error_responses({500: _CHAT_ERRORS[500], **_NOT_READY})
        self.responses = {**(self.responses or {}), **errors}


def _render(operation: Operation, request_schema: Schema) -> None:
    operation.request_body = RequestBody(
        required=True, content={"application/json": OpenAPIMediaType(schema=request_schema)}
    )
    responses = dict(operation.responses or {})
    success = responses.get("200")
    if isinstance(success, OpenAPIResponse):
        success.description = "The prompt token ids"
        success.content = {"application/json": OpenAPIMediaType(schema=_RENDER_SUCCESS)}
    operation.responses = {**responses, **_error_responses(_CHAT_ERRORS)}


@dataclasses.dataclass
class ChatRenderOperation(Operation):
    """``POST /v1/chat/completions/render``: the chat request body and errors, the render result."""

    def __post_init__(self) -> None:
        _render(self, chat_request_schema())


@dataclasses.dataclass
class CompletionRenderOperation(Operation):
    """``POST /v1/completions/render``: the completion request body and errors, the render result."""

    def __post_init__(self) -> None:
        _render(self, completion_request_schema())


@dataclasses.dataclass
class ChatOperation(Operation):
    """The chat operation, with the request body Litestar cannot infer, its SSE form and its errors."""

    def __post_init__(self) -> None:
        self.request_body = RequestBody(
            required=True, content={"application/json": OpenAPIMediaType(schema=chat_request_schema())}
        )
        responses = dict(self.responses or {})
        success = responses.get("200")
        if isinstance(success, OpenAPIResponse):
            success.description = "A chat.completion (JSON), or a chat.completion.chunk stream when stream is true"
            success.content = {
                "application/json": OpenAPIMediaType(schema=Schema(type=OpenAPIType.OBJECT)),
                "text/event-stream": OpenAPIMediaType(schema=_SSE_EVENT),
            }
        self.responses = {**responses, **_error_responses(_CHAT_ERRORS)}


@dataclasses.dataclass
class CompletionOperation(Operation):
    """The legacy completions operation: its request body, its SSE form and its errors."""

    def __post_init__(self) -> None:
        self.request_body = RequestBody(
            required=True, content={"application/json": OpenAPIMediaType(schema=completion_request_schema())}
        )
        responses = dict(self.responses or {})
        success = responses.get("200")
        if isinstance(success, OpenAPIResponse):
            success.description = "A text_completion (JSON), or a text_completion stream when stream is true"
            success.content = {
                "application/json": OpenAPIMediaType(schema=Schema(type=OpenAPIType.OBJECT)),
                "text/event-stream": OpenAPIMediaType(schema=_SSE_EVENT),
            }
        self.responses = {**responses, **_error_responses(_CHAT_ERRORS)}
