"""Building blocks of constrained call grammars for syntaxes that write each argument between markers.

Owns what the tag-style families (and third-party ones like them) share when writing a tool-call
grammar: the parameters of a tool's schema in order (``tag_parameters``), the Lark rule of one
argument value (``value_rule``: verbatim text for string schemas, compact JSON otherwise) and the
loop over the callable tools (``tag_call_rules``). Every refusal is a ``ToolGrammarError`` naming
the tool and parameter. Plugins import these through :mod:`helios_core.plugin_api`.

A string-typed value (kept verbatim by the parsers) is text that never spells a marker ending it
and never starts or ends with a newline, within the string's ``enum``/``const``, ``pattern`` and
length keywords; every other value is compact JSON of its schema (the parser decodes it). Strings
nested inside JSON values are not kept free of the markers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from helios_core.plugins.grammar import COMPACT_JSON, ToolGrammarError, ToolGrammarRequest
from helios_core.plugins.sections import STRING_TYPES, schema_type

__all__ = [
    "FUNCTION_NAME",
    "PARAMETER_KEY",
    "regex_literal",
    "tag_call_rules",
    "tag_parameters",
    "value_rule",
]

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""Function names a tag grammar writes."""

PARAMETER_KEY = re.compile(r"[^<>\s](?:[^<>\n]*[^<>\s])?")
"""Parameter names a tag grammar writes (no angle brackets, no newline, no outer whitespace)."""

_OBJECT_KEYS = frozenset({"type", "properties", "required", "additionalProperties", "description", "title", "$schema"})
_STRING_KEYS = frozenset(
    {"type", "description", "title", "default", "examples", "enum", "const", "pattern", "minLength", "maxLength"}
)


def tag_parameters(parameters: Mapping[str, Any], where: str) -> list[tuple[str, Mapping[str, Any], bool]]:
    """(name, schema, required) of each property of a tool's parameters, in schema order.

    Raises:
        ToolGrammarError: a schema keyword the tag families cannot enforce, or a required property
            without a schema.
    """
    unknown = sorted(str(key) for key in parameters if key not in _OBJECT_KEYS)
    if unknown:
        raise ToolGrammarError(
            f"{where}: schema keyword(s) {', '.join(unknown)} cannot be enforced in this core's tool syntax"
        )
    properties = parameters.get("properties", {})
    required = parameters.get("required", [])
    if not isinstance(properties, Mapping) or not isinstance(required, list):
        raise ToolGrammarError(f"{where}: properties must be an object and required a list")
    missing = [str(key) for key in required if key not in properties]
    if missing:
        raise ToolGrammarError(f"{where}: required parameter(s) {', '.join(missing)} have no schema")
    out: list[tuple[str, Mapping[str, Any], bool]] = []
    for key, schema in properties.items():
        if not isinstance(key, str) or not isinstance(schema, Mapping):
            raise ToolGrammarError(f"{where}: each property needs a schema object")
        out.append((key, schema, key in required))
    return out


def value_rule(
    rule: str,
    schema: Mapping[str, Any],
    terminators: Sequence[str],
    rules: list[str],
    where: str,
    closer: str = "",
) -> str:
    """A Lark expression for one argument value, appending the rules it needs to ``rules``.

    ``rule`` names the value's rule (its upper-case form names a verbatim value's lexeme);
    ``terminators`` are the marker texts a verbatim value must never spell. The expression is
    ``""`` when the only value is empty text.

    ``closer`` is plain text that directly follows the value in the call (``</parameter>``), which the
    expression then includes: a verbatim value's lexeme ends with it. The lexer never splits a lexeme it
    has extended, so a value lexeme followed by a separate text closer would take the closer's first
    bytes (``Paris</parameter``, a valid value) and then refuse its last one.
    """
    tail = f" {json.dumps(closer, ensure_ascii=False)}" if closer else ""
    if schema_type(schema) not in STRING_TYPES:
        try:
            text = json.dumps({**schema, "x-guidance": COMPACT_JSON})
        except (ValueError, TypeError) as exc:
            raise ToolGrammarError(f"{where}: {exc}") from exc
        rules.append(f"{rule}: %json {text}")
        return rule + tail
    string = _string_schema(schema, where)
    forbidden = "|".join(regex_literal(text) for text in terminators)
    literals = string.get("enum", [string["const"]] if "const" in string else None)
    if literals is not None:
        if not isinstance(literals, list) or not all(isinstance(v, str) for v in literals) or not literals:
            raise ToolGrammarError(f"{where}: a string enum must list strings")
        if any(text in v for v in literals for text in terminators):
            raise ToolGrammarError(f"{where}: an enum value spells a marker of this core's tool syntax")
        spelled = [json.dumps(v, ensure_ascii=False) for v in dict.fromkeys(literals) if v]
        if not spelled:
            return tail.strip()
        rules.append(f"{rule}: " + " | ".join(spelled))
        return (f"{rule}?" if "" in literals else rule) + tail
    low, high = string.get("minLength", 0), string.get("maxLength")
    if not isinstance(low, int) or not (high is None or isinstance(high, int)) or low < 0:
        raise ToolGrammarError(f"{where}: minLength and maxLength must be non-negative integers")
    if high == 0:
        return tail.strip()
    lexeme = rule.upper()
    parts = [
        f"/(?s:.{{{max(low, 1)},{'' if high is None else high}}})/",
        f"~/(?s:.*({forbidden}).*)/",
        "~/(?s:\\n.*|.*\\n)/",
    ]
    pattern = string.get("pattern")
    if pattern is not None:
        if not isinstance(pattern, str):
            raise ToolGrammarError(f"{where}: pattern must be a string")
        parts.append(f"/{_pattern_regex(pattern)}/")
    empty = low == 0 and (pattern is None or _matches_empty(pattern))
    if closer:
        rules.append(f"{lexeme}: (" + " & ".join(parts) + ")" + tail)
        return f"({lexeme} |{tail})" if empty else lexeme
    rules.append(f"{lexeme}: " + " & ".join(parts))
    return f"{lexeme}?" if empty else lexeme


def tag_call_rules(
    request: ToolGrammarRequest,
    *,
    terminators: Sequence[str],
    parameter: Callable[[str, Mapping[str, Any], str], str],
    call: Callable[[str, str], str],
    quoted_keys: bool = False,
    value_closer: str = "",
) -> tuple[list[tuple[int, str]], list[str]]:
    """(index and name of each callable tool, rules): rule ``call_INDEX`` is one call of that tool.

    ``parameter(key, schema, value)`` writes one argument around the value expression;
    ``call(name, parameters)`` writes a call around its parameter rules (required ones in schema
    order, optional ones may be skipped, in the same order). ``terminators``: the marker texts no
    verbatim value nor parameter name may spell; ``quoted_keys``: names are written in a quoted
    attribute (no ``"`` nor ``&``); ``value_closer``: plain text that directly follows every value, which
    the value expression ``parameter`` receives then already ends with (see :func:`value_rule`).

    Raises:
        ToolGrammarError: a name, parameter name or schema this syntax cannot write.
    """
    rules: list[str] = []
    called: list[tuple[int, str]] = []
    for index, name, parameters in request.callable_tools():
        where = f"tools ({name})"
        if not FUNCTION_NAME.fullmatch(name):
            raise ToolGrammarError(f"{where}: the function name cannot be written in this core's tool syntax")
        items: list[str] = []
        for number, (key, schema, required) in enumerate(tag_parameters(parameters, where)):
            unquotable = quoted_keys and ('"' in key or "&" in key)
            if not PARAMETER_KEY.fullmatch(key) or unquotable or any(text in key for text in terminators):
                raise ToolGrammarError(f"{where}: parameter name {key!r} cannot be written in this core's tool syntax")
            rule = f"p_{index}_{number}"
            value = value_rule(f"{rule}_v", schema, terminators, rules, f"{where}: parameter {key!r}", value_closer)
            rules.append(f"{rule}: {parameter(key, schema, value)}")
            items.append(rule if required else f"{rule}?")
        rules.append(f"call_{index}: {call(name, ' '.join(items))}")
        called.append((index, name))
    return called, rules


def _string_schema(schema: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    """The string schema a verbatim value must satisfy: the schema or its string ``anyOf`` branch."""
    if "type" not in schema and "enum" not in schema:
        branches = schema.get("anyOf")
        if isinstance(branches, list) and "oneOf" not in schema:
            for branch in branches:
                if isinstance(branch, Mapping) and schema_type(branch) in STRING_TYPES:
                    return _string_schema(branch, where)
        raise ToolGrammarError(f"{where}: this string schema cannot be enforced in this core's tool syntax")
    unknown = sorted(str(key) for key in schema if key not in _STRING_KEYS)
    if unknown:
        raise ToolGrammarError(
            f"{where}: keyword(s) {', '.join(unknown)} cannot be enforced in this core's tool syntax"
        )
    return schema


def _matches_empty(pattern: str) -> bool:
    """Whether ``pattern`` accepts the empty string (``False`` when Python cannot read it)."""
    try:
        return re.search(pattern, "") is not None
    except re.error:
        return False


def _pattern_regex(pattern: str) -> str:
    """A JSON-schema ``pattern`` (a search) as a whole-text regex for a Lark lexeme."""
    core = pattern[1:] if pattern.startswith("^") else pattern
    end = core.endswith("$") and not core.endswith("\\$")
    core = core[:-1] if end else core
    head = "" if pattern.startswith("^") else "(?s:.*)"
    return (head + f"(?:{core})" + ("" if end else "(?s:.*)")).replace("/", "\\/")


def regex_literal(text: str) -> str:
    """``text`` as a regex of its exact characters (each as ``\\x{...}``: nothing to escape)."""
    return "".join(f"\\x{{{ord(char):x}}}" for char in text)
