"""The sampling parameter declaration on ``SamplingParams`` and every table derived from it.

Each table that handles sampling values (packing row sources, the scheduler's column types and their
exactness, the op catalogue's ``sample`` inputs, bootstrap's ranges and resolution, server preparation,
Ignition's value bindings) must agree with the declaration, and a parameter added to a declaration must
reach each derivation without another list to edit.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Annotated

import msgspec
import numpy as np
import pytest
from ignition.build import assemble
from ignition.preparation.contract import SUB, sampling_bindings, sampling_value_bindings
from ignition.preparation.program import binding
from ignition.recipes.llama import Capacities
from ignition.recipes.synthetic import synthetic_declaration

from helios_core.backends import reference_kernels as rk
from helios_core.frontend.bootstrap import (
    SAMPLING_RANGES,
    SamplingError,
    resolve_sampling,
    resolved_settings,
    sampling_ranges,
)
from helios_core.loading import open_core
from helios_core.ops.catalogue import lookup, sample_inputs
from helios_core.runtime.packing import _ROW_SOURCES, Lane, LaneBatch, sampling_row_sources
from helios_core.sampling import (
    NONZERO_FIELDS,
    SAMPLING_FIELDS,
    SAMPLING_PARAMETERS,
    SamplingField,
    SamplingParams,
    declared_parameters,
)
from helios_core.server.preparation import request_sampling_fields
from helios_core.server.schemas import ChatCompletionRequest
from helios_core.wire import contract_pb2 as ct
from tests.runtime.conftest import FIXTURES, fixture_settings

ROOT = Path(__file__).resolve().parent.parent
INF = float("inf")

DECLARED = (
    ("temperature", ct.VALUE_SOURCE_TEMPERATURE, "float", 1.0, (0, INF, False), False),
    ("top_p", ct.VALUE_SOURCE_TOP_P, "float", 1.0, (0, 1, True), True),
    ("top_k", ct.VALUE_SOURCE_TOP_K, "int", 0, (0, INF, False), False),
    ("min_p", ct.VALUE_SOURCE_MIN_P, "float", 0.0, (0, 1, False), False),
    ("repetition_penalty", ct.VALUE_SOURCE_REPETITION_PENALTY, "float", 1.0, (0, INF, True), True),
    ("frequency_penalty", ct.VALUE_SOURCE_FREQUENCY_PENALTY, "float", 0.0, (-2, 2, False), False),
    ("presence_penalty", ct.VALUE_SOURCE_PRESENCE_PENALTY, "float", 0.0, (-2, 2, False), False),
    ("seed", ct.VALUE_SOURCE_SEED_BITS, "seed", 0, (0, 2**64 - 1, False), False),
)
"""(name, source, kind, neutral value, meaningful range, zero means nothing) of every parameter, in order."""

EXTRA_SOURCE = 9999
"""A value source no contract defines, for a hypothetical parameter."""


class Extended(msgspec.Struct, frozen=True):
    """A declaration with one parameter more than Helios has (``typical_p``)."""

    temperature: Annotated[
        float, SamplingField(source=ct.VALUE_SOURCE_TEMPERATURE, kind="float", meaningful=(0, INF, False))
    ] = 1.0
    typical_p: Annotated[
        float, SamplingField(source=EXTRA_SOURCE, kind="float", meaningful=(0, 1, True), nonzero=True)
    ] = 1.0
    seed: Annotated[int, SamplingField(source=ct.VALUE_SOURCE_SEED_BITS, kind="seed", meaningful=(0, 9, False))] = 0


def test_the_declaration_reads_every_field_in_order() -> None:
    found = tuple((p.name, p.source, p.kind, p.default, p.meaningful, p.nonzero) for p in SAMPLING_PARAMETERS)
    assert found == DECLARED
    assert [p.name for p in SAMPLING_PARAMETERS] == list(SamplingParams.__struct_fields__)
    assert [type(p.default) for p in SAMPLING_PARAMETERS] == [float, float, int, float, float, float, float, int]
    assert {p.kind: p.column_dtype for p in SAMPLING_PARAMETERS} == {
        "float": np.dtype(np.float64),
        "int": np.dtype(np.int64),
        "seed": np.dtype(np.uint64),
    }
    assert [p.kernel_input for p in SAMPLING_PARAMETERS] == [p.name for p in SAMPLING_PARAMETERS]
    assert dict(SAMPLING_FIELDS) == {source: name for name, source, *_ in DECLARED}
    assert frozenset({"top_p", "repetition_penalty"}) == NONZERO_FIELDS


def test_msgspec_ignores_the_declaration_metadata() -> None:
    params = SamplingParams(temperature=0.25, top_k=7, repetition_penalty=1.5, seed=2**64 - 1)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams) == params
    assert (
        msgspec.json.encode(params)
        == b'{"temperature":0.25,"top_k":7,"repetition_penalty":1.5,"seed":18446744073709551615}'
    )
    assert msgspec.json.decode(b"{}", type=SamplingParams) == SamplingParams()
    with pytest.raises(msgspec.ValidationError, match=r"Expected `int`, got `float` - at `\$.top_k`"):
        msgspec.json.decode(b'{"top_k": 1.5}', type=SamplingParams)


def test_a_field_must_carry_exactly_one_declaration() -> None:
    class Undeclared(msgspec.Struct, frozen=True):
        temperature: float = 1.0

    class Twice(msgspec.Struct, frozen=True):
        seed: Annotated[int, SamplingField(source=1, kind="seed", meaningful=(0, 1, False))] = 0
        other: Annotated[int, SamplingField(source=1, kind="int", meaningful=(0, 1, False))] = 0

    with pytest.raises(TypeError, match=r"^Undeclared.temperature must carry exactly one SamplingField, not 0$"):
        declared_parameters(Undeclared)
    with pytest.raises(ValueError, match=r"^Twice names a value source twice: \[1, 1\]$"):
        declared_parameters(Twice)
    with pytest.raises(ValueError, match=r"^unknown sampling kind 'double'; known: float, int, seed$"):
        SamplingField(source=1, kind="double", meaningful=(0, 1, False))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "value", "held"),
    [
        ("temperature", 0.5, True),
        ("temperature", 2**53, True),
        ("temperature", -(2**53), True),
        ("temperature", 2**53 + 1, False),
        ("temperature", True, True),
        ("temperature", np.float64(0.5), False),
        ("temperature", "0.5", False),
        ("top_k", 2**63 - 1, True),
        ("top_k", -(2**63), True),
        ("top_k", 2**63, False),
        ("top_k", 3.0, False),
        ("top_k", True, False),
        ("seed", 2**64 - 1, True),
        ("seed", 2**64, False),
        ("seed", -1, False),
        ("seed", np.uint64(3), False),
    ],
)
def test_a_column_holds_exactly_what_packs_as_itself(name: str, value: object, held: bool) -> None:
    parameter = next(p for p in SAMPLING_PARAMETERS if p.name == name)
    assert parameter.column_holds(value) is held


def test_packing_reads_each_parameter_from_the_lane_settings() -> None:
    settings = SamplingParams(
        temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1, frequency_penalty=0.25,
        presence_penalty=-0.5, seed=2**63 + 5,
    )  # fmt: skip
    lanes = [
        Lane(
            slot=2, generation=5, state_row=1, positions=[0, 1], cache_slots=[8, 9], page_table=[2], sampling=settings
        ),
        Lane(slot=0, generation=9, state_row=3, positions=[4], cache_slots=[12], page_table=[3]),
    ]
    assert {p.source: _ROW_SOURCES[p.source](lanes[0]) for p in SAMPLING_PARAMETERS} == {
        p.source: getattr(settings, p.name) for p in SAMPLING_PARAMETERS
    }
    assert lanes[1].sampling == SamplingParams()
    # Columns of the same lanes, as a batch carries them, give back the same settings.
    kinds = {p.source: p.column_dtype for p in SAMPLING_PARAMETERS}
    rows = {
        source: np.array([read(lane) for lane in lanes], dtype=kinds.get(source, np.int64))
        for source, read in _ROW_SOURCES.items()
    }
    batch = LaneBatch(
        count=2,
        rows=rows,
        tokens={
            ct.VALUE_SOURCE_PROMPT_POSITIONS: np.array([0, 1, 4], dtype=np.int64),
            ct.VALUE_SOURCE_CACHE_SLOT: np.array([8, 9, 12], dtype=np.int64),
        },
        page_source=np.array([[2], [3]], dtype=np.int64),
        page_index=np.array([0, 1], dtype=np.int64),
        page_counts=np.array([1, 1], dtype=np.int64),
    )
    restored = batch.to_lanes()
    assert [lane.sampling for lane in restored] == [settings, SamplingParams()]
    assert [type(getattr(restored[0].sampling, p.name)) for p in SAMPLING_PARAMETERS] == [
        float, float, int, float, float, float, float, int,
    ]  # fmt: skip


def test_the_sample_operator_takes_each_declared_input() -> None:
    spec = lookup("sample", 1)
    assert spec is not None
    assert spec.inputs == sample_inputs(SAMPLING_PARAMETERS)
    assert spec.inputs == (
        "logits", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
        "presence_penalty", "prompt_presence", "output_counts", "rows", "seed", "step", "active",
    )  # fmt: skip
    # The reference sampler takes every declared input by its name (the reference backend passes them so).
    kernel = inspect.signature(rk.sample).parameters
    assert all(kernel[p.kernel_input].kind is inspect.Parameter.KEYWORD_ONLY for p in SAMPLING_PARAMETERS)


def test_the_documented_catalogue_lists_the_sample_inputs_in_order() -> None:
    row = next(line for line in (ROOT / "docs" / "ops.md").read_text().splitlines() if line.startswith("| `sample` |"))
    documented = tuple(re.findall(r"`([a-z_]+)`", row.split("|")[2]))
    spec = lookup("sample", 1)
    assert spec is not None
    assert documented == spec.inputs


def test_bootstrap_ranges_and_resolution_follow_the_declaration() -> None:
    assert dict(SAMPLING_RANGES) == {name: meaningful for name, _, _, _, meaningful, _ in DECLARED}
    assert resolved_settings() == tuple(name for name, *_ in DECLARED if name != "seed")
    defaults_fields = ct.SamplingDefaults.DESCRIPTOR.fields_by_name
    assert all(name in defaults_fields for name in resolved_settings())
    # Request over core default over neutral value, for every setting.
    defaults = ct.SamplingDefaults(top_p=0.5, top_k=3, presence_penalty=1.0)
    settings = resolve_sampling(defaults, {"top_k": 9, "min_p": 0.25, "temperature": None}, seed=11)
    assert settings == SamplingParams(top_p=0.5, top_k=9, min_p=0.25, presence_penalty=1.0, seed=11)
    with pytest.raises(SamplingError, match=r"^top_p must lie in \(0, 1\], not 0$") as refused:
        resolve_sampling(ct.SamplingDefaults(), {"top_p": 0, "top_k": -1}, seed=1)
    assert refused.value.field == "top_p"


def test_the_request_schema_names_every_resolved_setting() -> None:
    assert request_sampling_fields() == resolved_settings()
    assert "seed" in ChatCompletionRequest.__struct_fields__


def test_ignition_binds_each_declared_setting_as_before() -> None:
    expected = [
        binding("temperature", ct.VALUE_SOURCE_TEMPERATURE, SUB),
        binding("top_p", ct.VALUE_SOURCE_TOP_P, SUB, padding=1),
        binding("top_k", ct.VALUE_SOURCE_TOP_K, SUB),
        binding("min_p", ct.VALUE_SOURCE_MIN_P, SUB),
        binding("repetition_penalty", ct.VALUE_SOURCE_REPETITION_PENALTY, SUB, padding=1),
        binding("frequency_penalty", ct.VALUE_SOURCE_FREQUENCY_PENALTY, SUB),
        binding("presence_penalty", ct.VALUE_SOURCE_PRESENCE_PENALTY, SUB),
        binding("seed", ct.VALUE_SOURCE_SEED_BITS, SUB),
    ]
    derived = sampling_value_bindings()
    assert [b.SerializeToString() for b in derived] == [b.SerializeToString() for b in expected]
    assert [b.SerializeToString() for b in sampling_bindings()[1:9]] == [b.SerializeToString() for b in expected]


def test_a_synthetic_core_binds_every_declared_setting_to_its_transport_entry() -> None:
    caps = Capacities(max_rows=2, prefill_tokens=(8,), decode_rows=(1, 2), page_tokens=4, cache_pages=16, context=32)
    serving, builder, _ = assemble(synthetic_declaration("tiny", seed=3), caps)
    transport = {entry.name for entry in builder.manifest.transport.entries}
    expected = [b.SerializeToString() for b in sampling_value_bindings()]
    sampling_sources = set(SAMPLING_FIELDS)
    sampling_graphs = 0
    for graph in serving.model.graphs:
        bound = [b.SerializeToString() for b in graph.bindings if b.source in sampling_sources]
        if bound:
            sampling_graphs += 1
            assert bound == expected, graph.name
    assert sampling_graphs == 6  # prefill, mixed, resume, scored prefill and two decode widths
    assert {p.name for p in SAMPLING_PARAMETERS} <= transport


def test_released_fixture_cores_bind_the_settings_as_ignition_derives_them() -> None:
    expected = [b.SerializeToString() for b in sampling_value_bindings()]
    verified = open_core(FIXTURES / "payload-v3.core", fixture_settings())
    verified.close()
    bound = {
        name: [b.SerializeToString() for b in graph.contract.bindings if b.source in SAMPLING_FIELDS]
        for name, graph in verified.contract.graphs.items()
    }
    sampling_graphs = {name for name, found in bound.items() if found}
    assert sampling_graphs == {
        "prefill_p16", "mixed_p16", "resume_p16", "scored_prefill_p16", "decode_b1", "decode_b2", "decode_b4",
    }  # fmt: skip
    assert all(bound[name] == expected for name in sampling_graphs)


def test_an_added_parameter_reaches_every_derived_table() -> None:
    extended = declared_parameters(Extended)
    assert [(p.name, p.source, p.kind, p.default, p.nonzero) for p in extended] == [
        ("temperature", ct.VALUE_SOURCE_TEMPERATURE, "float", 1.0, False),
        ("typical_p", EXTRA_SOURCE, "float", 1.0, True),
        ("seed", ct.VALUE_SOURCE_SEED_BITS, "seed", 0, False),
    ]
    typical = extended[1]
    assert typical.column_dtype == np.dtype(np.float64)
    assert typical.kernel_input == "typical_p"
    # Packing reads the lane's setting through the new source.
    lane = Lane(
        slot=0, generation=1, state_row=0, positions=[0], cache_slots=[0], page_table=[0],
        sampling=Extended(typical_p=0.75),  # type: ignore[arg-type]
    )  # fmt: skip
    readers = sampling_row_sources(extended)
    assert list(readers) == [ct.VALUE_SOURCE_TEMPERATURE, EXTRA_SOURCE, ct.VALUE_SOURCE_SEED_BITS]
    assert readers[EXTRA_SOURCE](lane) == 0.75
    # The sample operator takes it among the per-request settings, before the state.
    assert sample_inputs(extended) == (
        "logits", "temperature", "typical_p", "prompt_presence", "output_counts", "rows", "seed", "step", "active",
    )  # fmt: skip
    # Bootstrap's ranges and resolution, and Ignition's bindings (padded with 1: zero means nothing).
    assert sampling_ranges(extended) == {
        "temperature": (0, INF, False),
        "typical_p": (0, 1, True),
        "seed": (0, 9, False),
    }
    assert resolved_settings(extended) == ("temperature", "typical_p")
    assert [b.SerializeToString() for b in sampling_value_bindings(extended)] == [
        b.SerializeToString()
        for b in (
            binding("temperature", ct.VALUE_SOURCE_TEMPERATURE, SUB),
            binding("typical_p", EXTRA_SOURCE, SUB, padding=1),
            binding("seed", ct.VALUE_SOURCE_SEED_BITS, SUB),
        )
    ]
    # Requests name it where their schema has a field of its name.
    assert request_sampling_fields(ChatCompletionRequest, extended) == ("temperature",)

    class TypicalRequest(msgspec.Struct, frozen=True):
        typical_p: float | None = None
        temperature: float | None = None

    assert request_sampling_fields(TypicalRequest, extended) == ("temperature", "typical_p")
