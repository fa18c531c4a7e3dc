"""Structured output: response_format parsing, llguidance grammar masks in the kernels' layout,
random walks and reference-kernel sampling that always yield schema-valid JSON."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import pytest
from ignition.recipes.synthetic import byte_level_tokenizer
from tokenizers import Tokenizer

from helios_core.backends import reference_kernels as rk
from helios_core.errors import ContractError
from helios_core.frontend.bootstrap import PromptError
from helios_core.frontend.formats import ResponseFormat, parse_response_format
from helios_core.frontend.structured import GrammarCompiler, GrammarError, GrammarMatcher
from helios_core.wire import contract_pb2 as ct

SAMPLED = 259  # 256 byte tokens + <|endoftext|>, <|im_start|>, <|im_end|>
WIDTH = 320
WORDS = 10
EOS = 258
MAX_TOKENS = 400

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["alpha", "beta", "gamma"]},
        "count": {"type": "integer", "minimum": -3, "maximum": 42},
        "tags": {
            "type": "array",
            "items": {"type": "string", "pattern": "^[a-z]{0,4}$"},
            "minItems": 1,
            "maxItems": 3,
        },
        "flag": {"type": "boolean"},
    },
    "required": ["kind", "count", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    synthetic = byte_level_tokenizer()
    assert synthetic.vocab_size == SAMPLED and synthetic.special_ids["<|im_end|>"] == EOS
    tokenizer = Tokenizer.from_str(synthetic.json)
    return GrammarCompiler(tokenizer, sampled_size=SAMPLED, logits_width=WIDTH, eos_token_ids=[EOS])


def schema_format(schema: dict[str, Any] = SCHEMA) -> ResponseFormat:
    fmt = parse_response_format({"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert fmt is not None
    return fmt


def allowed_ids(mask: np.ndarray) -> set[int]:
    return set(np.flatnonzero(rk.unpack_allowed_mask(mask[None, :], WORDS * 32)[0]).tolist())


def text_of(ids: list[int]) -> str:
    return bytes(t for t in ids if t < 256).decode("utf-8")


def check_invariants(matcher: GrammarMatcher) -> set[int]:
    mask = matcher.mask()
    assert mask.dtype == np.int32 and mask.shape == (WORDS,)
    ids = allowed_ids(mask)
    assert ids and max(ids) < SAMPLED  # padding ids are never allowed
    assert (EOS in ids) == matcher.is_accepting  # EOS exactly when the document may end
    assert not ids & {256, 257}  # other special tokens never
    return ids


# A small validator for the schema keywords these tests use (jsonschema is used as well when installed).
def validate(doc: Any, schema: dict[str, Any]) -> None:
    if "enum" in schema:
        assert doc in schema["enum"]
    kind = schema.get("type")
    if kind == "object":
        assert isinstance(doc, dict)
        props = schema.get("properties", {})
        assert set(schema.get("required", [])) <= set(doc)
        if schema.get("additionalProperties") is False:
            assert set(doc) <= set(props)
        for key, value in doc.items():
            if key in props:
                validate(value, props[key])
    elif kind == "integer":
        assert isinstance(doc, int) and not isinstance(doc, bool)
        assert schema.get("minimum", doc) <= doc <= schema.get("maximum", doc)
    elif kind == "boolean":
        assert isinstance(doc, bool)
    elif kind == "string":
        assert isinstance(doc, str)
        if "pattern" in schema:
            assert re.search(schema["pattern"], doc)
    elif kind == "array":
        assert isinstance(doc, list)
        assert schema.get("minItems", 0) <= len(doc) <= schema.get("maxItems", len(doc))
        for item in doc:
            validate(item, schema["items"])
    try:
        import jsonschema
    except ImportError:
        return
    jsonschema.validate(doc, schema)


def test_validator_rejects_what_the_schema_forbids() -> None:
    validate({"kind": "beta", "count": 42, "tags": ["ab"], "flag": True}, SCHEMA)
    for bad in (
        {"kind": "delta", "count": 1, "tags": ["a"]},
        {"kind": "beta", "count": 43, "tags": ["a"]},
        {"kind": "beta", "count": 1, "tags": []},
        {"kind": "beta", "count": 1, "tags": ["abcde"]},
        {"kind": "beta", "tags": ["a"]},
        {"kind": "beta", "count": 1, "tags": ["a"], "extra": 0},
    ):
        with pytest.raises(AssertionError):
            validate(bad, SCHEMA)


# --- response_format parsing -------------------------------------------------------------------


def test_text_and_absent_formats_are_unconstrained() -> None:
    assert parse_response_format(None) is None
    assert parse_response_format({"type": "text"}) is None


def test_json_object_and_json_schema_parse() -> None:
    expected = ResponseFormat(kind="json_object", schema={"type": "object"})
    assert parse_response_format({"type": "json_object"}) == expected
    fmt = parse_response_format(
        {"type": "json_schema", "json_schema": {"name": "a-b_1", "description": "d", "schema": SCHEMA, "strict": True}}
    )
    assert fmt == ResponseFormat(kind="json_schema", schema=SCHEMA, name="a-b_1", strict=True)
    fmt = parse_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": None}})
    assert fmt is not None and fmt.strict is None


TYPE_MESSAGE = "response_format.type must be one of 'text', 'json_object', 'json_schema'"
NAME_MESSAGE = "response_format.json_schema.name must be 1 to 64 characters of a-z, A-Z, 0-9, _ or -"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("json_object", "response_format must be an object"),
        ([], "response_format must be an object"),
        ({}, TYPE_MESSAGE),
        ({"type": "xml"}, TYPE_MESSAGE),
        ({"type": None}, TYPE_MESSAGE),
        ({"type": "text", "schema": {}}, "response_format: unknown field(s) 'schema'"),
        ({"type": "json_object", "json_schema": {}}, "response_format: unknown field(s) 'json_schema'"),
        (
            {"type": "json_schema", "json_schema": {"name": "a", "schema": {}}, "strict": True, "extra": 1},
            "response_format: unknown field(s) 'extra', 'strict'",
        ),
        ({"type": "json_schema"}, "response_format.json_schema is required when type is 'json_schema'"),
        ({"type": "json_schema", "json_schema": "{}"}, "response_format.json_schema must be an object"),
        (
            {"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "schema_": {}}},
            "response_format.json_schema: unknown field(s) 'schema_'",
        ),
        ({"type": "json_schema", "json_schema": {"schema": {}}}, NAME_MESSAGE),
        ({"type": "json_schema", "json_schema": {"name": "has space", "schema": {}}}, NAME_MESSAGE),
        ({"type": "json_schema", "json_schema": {"name": "a" * 65, "schema": {}}}, NAME_MESSAGE),
        (
            {"type": "json_schema", "json_schema": {"name": "a", "description": 3, "schema": {}}},
            "response_format.json_schema.description must be a string",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "strict": "yes"}},
            "response_format.json_schema.strict must be a boolean or null",
        ),
        ({"type": "json_schema", "json_schema": {"name": "a"}}, "response_format.json_schema.schema is required"),
        (
            {"type": "json_schema", "json_schema": {"name": "a", "schema": None}},
            "response_format.json_schema.schema must be a JSON object",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "a", "schema": '{"type": "object"}'}},
            "response_format.json_schema.schema must be a JSON object",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}},
            "response_format.json_schema.schema must be a JSON object",
        ),
    ],
)
def test_malformed_response_formats(value: object, message: str) -> None:
    with pytest.raises(PromptError) as info:
        parse_response_format(value)
    assert str(info.value) == message


def test_schema_errors_surface_at_compile_time(compiler: GrammarCompiler) -> None:
    with pytest.raises(PromptError) as info:
        compiler.compile(schema_format({"type": "objectx"}))
    assert str(info.value) == "response_format.json_schema.schema: Invalid type: objectx"
    with pytest.raises(PromptError, match=r"^response_format\.json_schema\.schema: .+"):
        compiler.compile(schema_format({"type": "string", "pattern": "(unclosed"}))


# --- geometry ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sampled", "width", "eos", "message"),
    [
        (321, 320, [258], "sampled_size must lie in"),
        (259, 320, [], "at least one EOS"),
        (259, 320, [259], "outside the sampled vocabulary"),
    ],
)
def test_inconsistent_geometry_is_a_contract_error(sampled: int, width: int, eos: list[int], message: str) -> None:
    tokenizer = Tokenizer.from_str(byte_level_tokenizer().json)
    with pytest.raises(ContractError, match=message):
        GrammarCompiler(tokenizer, sampled_size=sampled, logits_width=width, eos_token_ids=eos)


# --- masks -------------------------------------------------------------------------------------


def test_json_object_start_and_inside(compiler: GrammarCompiler) -> None:
    fmt = parse_response_format({"type": "json_object"})
    assert fmt is not None
    matcher = compiler.compile(fmt).matcher()
    mask = matcher.mask()
    assert not mask.flags.writeable
    assert check_invariants(matcher) == {ord("{")}  # llguidance allows no leading whitespace
    assert mask[ord("{") >> 5] == np.int32(1 << (ord("{") & 31))  # LSB-first: word 3, bit 27
    assert not matcher.finished and not matcher.is_accepting
    matcher.advance(ord("{"))
    assert check_invariants(matcher) == {ord(c) for c in ' \t\n\r"}'}  # no letters, no EOS yet
    for ch in b'"k" : [1, {"b": null}, "<|im_end|>"]':
        assert ch in check_invariants(matcher)
        matcher.advance(ch)
    assert not matcher.is_accepting
    matcher.advance(ord("}"))
    assert matcher.is_accepting and matcher.finished
    assert check_invariants(matcher) == {EOS}
    matcher.advance(EOS)
    assert matcher.finished


def test_literal_delimiters_inside_a_string_are_text(compiler: GrammarCompiler) -> None:
    matcher = compiler.compile(schema_format({"type": "string"})).matcher()
    ids: list[int] = []
    for ch in b'"<|im_end|></think>':
        assert ch in check_invariants(matcher)
        matcher.advance(ch)
        ids.append(ch)
    assert EOS not in check_invariants(matcher)  # the delimiter token itself is not answer text
    matcher.advance(ord('"'))
    ids.append(ord('"'))
    assert json.loads(text_of(ids)) == "<|im_end|></think>"


def test_disallowed_tokens_raise(compiler: GrammarCompiler) -> None:
    matcher = compiler.compile(schema_format()).matcher()
    for bad, message in (
        (ord("a"), "not allowed"),
        (EOS, "not allowed"),
        (257, "not allowed"),
        (SAMPLED, "outside the sampled vocabulary"),
        (-1, "outside the sampled vocabulary"),
    ):
        with pytest.raises(GrammarError, match=message):
            matcher.advance(bad)
    matcher.advance(ord("{"))  # a rejected token leaves the matcher usable
    with pytest.raises(GrammarError):
        matcher.advance(ord("}"))  # required properties are missing


def test_matchers_of_one_grammar_are_independent(compiler: GrammarCompiler) -> None:
    grammar = compiler.compile(schema_format())
    first, second = grammar.matcher(), grammar.matcher()
    first.advance(ord("{"))
    assert allowed_ids(second.mask()) == {ord("{")}
    assert ord('"') in allowed_ids(first.mask())


# --- whole documents ---------------------------------------------------------------------------


def finish(matcher: GrammarMatcher, ids: list[int]) -> Any:
    assert matcher.finished, f"not finished after {len(ids)} tokens: {text_of(ids)!r}"
    assert check_invariants(matcher) == {EOS}
    matcher.advance(EOS)
    assert matcher.finished
    doc = json.loads(text_of(ids))
    validate(doc, SCHEMA)
    return doc


@pytest.mark.parametrize("seed", range(30))
def test_random_walks_yield_valid_documents(compiler: GrammarCompiler, seed: int) -> None:
    rng = np.random.default_rng(seed)
    matcher = compiler.compile(schema_format()).matcher()
    ids: list[int] = []
    while not matcher.finished and len(ids) < MAX_TOKENS:
        choice = int(rng.choice(sorted(check_invariants(matcher))))
        matcher.advance(choice)
        if choice != EOS:
            ids.append(choice)
    finish(matcher, ids)


def test_reference_sampler_with_the_mask_yields_valid_documents(compiler: GrammarCompiler) -> None:
    grammar = compiler.compile(schema_format())
    one_f = np.ones(1, dtype=np.float32)
    zeros_f = np.zeros(1, dtype=np.float32)
    for seed in range(10):
        rng = np.random.default_rng(1000 + seed)
        matcher = grammar.matcher()
        ids: list[int] = []
        counts = np.zeros((1, WIDTH), dtype=np.int32)
        step = 0
        while not matcher.finished and step < MAX_TOKENS:
            logits = rng.standard_normal((1, WIDTH)).astype(np.float32)
            result = rk.sample(
                logits,
                temperature=one_f,
                top_k=np.zeros(1, dtype=np.int32),
                top_p=one_f,
                min_p=zeros_f,
                repetition_penalty=one_f,
                frequency_penalty=zeros_f,
                presence_penalty=zeros_f,
                prompt_presence=np.zeros((1, WIDTH), dtype=np.uint8),
                output_counts=counts,
                seed=np.array([seed], dtype=np.uint64),
                step=np.array([step], dtype=np.int64),
                vocab_limit=SAMPLED,
                allowed_mask=matcher.mask()[None, :],
                constrained=np.ones(1, dtype=np.uint8),
            )
            token = int(result.ids[0])
            assert token in check_invariants(matcher)
            matcher.advance(token)
            counts[0, token] += 1
            step += 1
            if token != EOS:
                ids.append(token)
        finish(matcher, ids)


def test_json_object_grammar_is_compiled_once(compiler: GrammarCompiler) -> None:
    fmt = parse_response_format({"type": "json_object"})
    assert fmt is not None
    assert compiler.compile(fmt) is compiler.compile(fmt)


# --- whitespace between an answer's tokens -----------------------------------------------------------


def accepts(matcher: GrammarMatcher, text: str) -> bool:
    """Whether the matcher takes every byte of ``text`` in turn."""
    for byte in text.encode():
        try:
            matcher.advance(byte)
        except GrammarError:
            return False
    return True


PRETTY = '{\n  "kind": "alpha",\n  "count": 1,\n  "tags": [\n    "a"\n  ]\n}'
COMPACT = '{"kind":"alpha","count":1,"tags":["a"]}'
SPACED = '{"kind": "alpha", "count": 1, "tags": ["a"]}'


@pytest.mark.parametrize("reasoning", [None, ct.ReasoningSyntax(open="<think>", close="</think>")])
def test_an_answer_holds_compact_or_pretty_json_but_no_free_whitespace(
    compiler: GrammarCompiler, reasoning: ct.ReasoningSyntax | None
) -> None:
    grammar = compiler.compile(schema_format(), reasoning=reasoning)
    for text in (PRETTY, COMPACT, SPACED, "{" + " " * 32 + '"kind"', '{\r\n\t"kind"'):
        assert accepts(grammar.matcher(), text), text
    for text in ("{\n\n", "{" + " " * 33, '{"kind"\n\n', '{"kind":' + "\t" * 33, "{\n \n"):
        assert not accepts(grammar.matcher(), text), text
    any_object = parse_response_format({"type": "json_object"})
    assert any_object is not None
    assert not accepts(compiler.compile(any_object, reasoning=reasoning).matcher(), "{" + "\n" * 2)


def test_a_schema_with_its_own_llguidance_options_keeps_them(compiler: GrammarCompiler) -> None:
    flexible = compiler.compile(schema_format({"type": "object", "x-guidance": {}}))
    assert accepts(flexible.matcher(), "{" + "\n" * 40 + "}")  # llguidance's own default: any whitespace
    compact = compiler.compile(schema_format({"type": "object", "x-guidance": {"whitespace_flexible": False}}))
    assert not accepts(compact.matcher(), "{ ")
