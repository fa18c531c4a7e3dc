"""Engram tables at load: every field the runtime stages rows from is checked, with exact messages.

Each test starts from the golden fixture made into a valid Engram core (``engram_parts``: host-owned pending
tokens in the decode programs, a ``[16, 4 x 8]`` F32 staging entry, a table of orders 2..3 with two heads an
order, its WEIGHTS resource and a compression table) and breaks exactly one rule.
"""

from __future__ import annotations

import re

import pytest

from helios_core.contract import RuntimeCapabilities, check_runtime_support
from helios_core.errors import ContractError, UnsupportedFeatureError
from helios_core.wire import container_pb2 as cb
from helios_core.wire import contract_pb2 as ct
from helios_core.wire import manifest_pb2 as mf

PRIMES = (5, 7, 11, 13)
ROW_WIDTH = 8
VOCABULARY = 259
"""The fixture's input vocabulary."""


def engram_parts(parts):
    """``parts`` with one valid Engram table (see the module docstring)."""
    for graph in parts.model.graphs:
        if graph.operation == ct.OPERATION_DECODE:
            graph.pending_token.binding_destination = "input_ids"
            graph.bindings.add(
                destination="input_ids",
                source=ct.VALUE_SOURCE_PENDING_TOKEN,
                indexing=ct.INDEXING_PACKED_TOKEN,
                padding=0,
            )
    parts.add_entry("engram.rows", mf.DTYPE_F32, (16, 4 * ROW_WIDTH))
    parts.resources.append(
        cb.ExecutableResource(
            id="engram.table", kind=cb.RESOURCE_KIND_WEIGHTS, decoded_nbytes=sum(PRIMES) * ROW_WIDTH * 4
        )
    )
    parts.resources.append(
        cb.ExecutableResource(id="engram.compression", kind=cb.RESOURCE_KIND_WEIGHTS, decoded_nbytes=VOCABULARY * 4)
    )
    parts.execution.engram_tables.add(
        name="engram",
        buffer="engram.rows",
        row_nbytes=ROW_WIDTH * 4,
        rows=16 * 4,
        resource_id="engram.table",
        table_rows=sum(PRIMES),
        row_width=ROW_WIDTH,
        dtype=mf.DTYPE_F32,
        max_order=3,
        heads_per_order=2,
        primes=list(PRIMES),
        multipliers=[3, -5, 7],
        pad_id=0,
        compression_resource_id="engram.compression",
        frames=2,
    )
    return parts


def table(parts) -> mf.EngramTable:
    return parts.execution.engram_tables[0]


def problems(parts) -> list[str]:
    """The problems validation lists (it must fail)."""
    with pytest.raises(ContractError) as caught:
        parts.prepare()
    text = str(caught.value)
    if text.startswith("invalid contract: "):
        return [text.removeprefix("invalid contract: ")]
    return re.sub(r"^invalid contract \(\d+ problems\): ", "", text).split("; ")


def rejects(parts, message: str) -> None:
    """Validation fails, ``message`` one of its problems."""
    assert message in problems(parts)


def test_a_valid_engram_core_loads_and_this_runtime_stages_it(parts) -> None:
    prepared = engram_parts(parts).prepare()
    check_runtime_support(prepared, RuntimeCapabilities())
    assert RuntimeCapabilities().engram is True


def test_a_runtime_without_engram_refuses_the_core(parts) -> None:
    prepared = engram_parts(parts).prepare()
    with pytest.raises(
        UnsupportedFeatureError,
        match=re.escape("the core declares Engram staging tables, which this runtime does not implement yet"),
    ):
        check_runtime_support(prepared, RuntimeCapabilities(engram=False))


def test_a_device_owned_pending_token_is_refused(parts) -> None:
    engram_parts(parts)
    parts.graph("decode_b2").pending_token.state_view = "pending_token"
    rejects(
        parts,
        "engram: graph 'decode_b2' reads a device-owned pending token; the host hashes every input id, so the "
        "pending token must be host-owned (binding_destination)",
    )


def test_frames_must_be_two(parts) -> None:
    table(engram_parts(parts)).frames = 3
    rejects(parts, "engram table 'engram': frames must be 2, not 3")


def test_the_transport_must_have_two_frames(parts) -> None:
    engram_parts(parts).execution.transport.frames = 1
    rejects(parts, "engram: tables stage through the transport's frames, which must be 2, not 1")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: setattr(t, "dtype", mf.DTYPE_I32), "dtype must be DTYPE_F32 or DTYPE_BF16, not DTYPE_I32"),
        (lambda t: setattr(t, "row_width", 0), "row_width must be positive"),
        (lambda t: setattr(t, "row_nbytes", 16), "row_nbytes is 16, but 8 values are 32 bytes"),
        (lambda t: setattr(t, "max_order", 1), "max_order must be at least 2, not 1"),
        (lambda t: setattr(t, "heads_per_order", 0), "heads_per_order must be positive"),
        (lambda t: t.multipliers.__setitem__(2, 8), "multiplier 2 must be odd, not 8"),
        (lambda t: setattr(t, "table_rows", 35), "table_rows is 35, but the primes sum to 36"),
        (lambda t: setattr(t, "rows", 60), "rows is 60, but 16 packed tokens gather 64"),
        (
            lambda t: t.multipliers.append(9),
            "4 multipliers, but max_order 3 needs 3 (one per offset)",
        ),
    ],
)
def test_malformed_table_fields_are_named(parts, edit, message: str) -> None:
    edit(table(engram_parts(parts)))
    rejects(parts, f"engram table 'engram': {message}")


def test_a_prime_must_be_positive(parts) -> None:
    table(engram_parts(parts)).primes[1] = 0
    with pytest.raises(ContractError) as caught:
        parts.prepare()
    assert "engram table 'engram': prime 1 must be positive and below 2**63, not 0" in str(caught.value)


def test_the_primes_must_cover_every_order_and_head(parts) -> None:
    t = table(engram_parts(parts))
    del t.primes[3]
    t.table_rows = sum(PRIMES[:3])
    rejects(parts, "engram table 'engram': 3 primes, but orders 2..3 with 2 heads need 4")


def test_the_table_resource_must_be_exactly_its_rows(parts) -> None:
    engram_parts(parts)
    parts.resources[-2].decoded_nbytes += 4
    rejects(parts, f"engram table 'engram': resource 'engram.table' decodes to {36 * 32 + 4} bytes, not {36 * 32}")


def test_the_table_resource_must_exist_and_be_weights(parts) -> None:
    table(engram_parts(parts)).resource_id = "missing"
    rejects(parts, "engram table 'engram': resource_id names unknown resource 'missing'")
    parts.resources[-2].kind = cb.RESOURCE_KIND_STATE_INIT
    table(parts).resource_id = "engram.table"
    rejects(
        parts,
        "engram table 'engram': resource 'engram.table' must be RESOURCE_KIND_WEIGHTS, not RESOURCE_KIND_STATE_INIT",
    )


def test_the_compression_table_holds_one_int32_per_input_id(parts) -> None:
    engram_parts(parts)
    parts.resources[-1].decoded_nbytes = 258 * 4
    rejects(parts, f"engram table 'engram': resource 'engram.compression' decodes to {258 * 4} bytes, not {259 * 4}")


def test_the_destination_must_be_a_transport_entry(parts) -> None:
    table(engram_parts(parts)).buffer = "frame_index"
    rejects(parts, "engram table 'engram': destination 'frame_index' is not a transport entry")


def test_the_destination_must_not_be_bound(parts) -> None:
    table(engram_parts(parts)).buffer = "positions"
    with pytest.raises(ContractError) as caught:
        parts.prepare()
    assert (
        "engram table 'engram': destination 'positions' is a binding destination; Engram staging alone writes it"
        in str(caught.value)
    )


def test_the_destination_has_the_rows_dtype_and_shape(parts) -> None:
    engram_parts(parts)
    parts.entry("engram.rows").dtype = mf.DTYPE_BF16
    rejects(parts, "engram table 'engram': destination 'engram.rows' is DTYPE_BF16, the rows DTYPE_F32")
    parts.entry("engram.rows").dtype = mf.DTYPE_F32
    parts.entry("engram.rows").shape[:] = [16, 31]
    rejects(parts, "engram table 'engram': destination 'engram.rows' has shape [16, 31], not [packed tokens, 32]")


def test_the_destination_holds_every_programs_packed_tokens(parts) -> None:
    engram_parts(parts)
    parts.entry("engram.rows").shape[:] = [8, 32]
    table(parts).rows = 8 * 4
    with pytest.raises(ContractError) as caught:
        parts.prepare()
    assert (
        "engram table 'engram': destination 'engram.rows' holds 8 packed tokens; graph 'prefill_p16' packs 16"
        in str(caught.value)
    )


def test_a_table_is_declared_once(parts) -> None:
    engram_parts(parts)
    copy = parts.execution.engram_tables.add()
    copy.CopyFrom(table(parts))
    with pytest.raises(ContractError) as caught:
        parts.prepare()
    text = str(caught.value)
    assert "engram table 'engram' is declared twice" in text
    assert "engram table 'engram': destination 'engram.rows' is another table's destination" in text
