"""The OpenAPI description of the chat request body.

Owns the translation of the msgspec JSON schema of
:class:`~helios_core.server.schemas.ChatCompletionRequest` into Litestar's OpenAPI objects. The
chat controller decodes its body itself (strict msgspec decoding; Litestar's own body parsing
coerces types), so Litestar cannot see the body type: this module adds the request body and its
component schemas to the generated document instead.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import msgspec
from litestar.openapi.spec import OpenAPIMediaType, OpenAPIType, Operation, RequestBody, Schema

from helios_core.server.schemas import ChatCompletionRequest

__all__ = ["ChatOperation", "chat_request_schema"]

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


@functools.cache
def chat_request_schema() -> Schema:
    """The chat request body's schema (ChatCompletionRequest with nested structs inlined)."""
    (root,), definitions = msgspec.json.schema_components([ChatCompletionRequest])
    schema = _convert(root, definitions)
    if isinstance(schema, bool):
        raise TypeError("the chat request schema is not an object schema")
    return schema


@dataclasses.dataclass
class ChatOperation(Operation):
    """The chat operation, with the request body Litestar cannot infer."""

    def __post_init__(self) -> None:
        self.request_body = RequestBody(
            required=True, content={"application/json": OpenAPIMediaType(schema=chat_request_schema())}
        )
