"""Every golden fixture core keeps loading: it opens, authorizes, verifies and validates.

The fixtures in ``tests/fixtures/cores`` are never regenerated; older contract versions must keep
their implicit defaults (version 1 histogram/mask geometry, version 1-2 packed-token capacities).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from helios_core.container.keys import TrustStore, load_core_key
from helios_core.container.reader import CoreFile
from helios_core.contract import (
    PreparedContract,
    RuntimeCapabilities,
    check_runtime_support,
    prepare_contract,
)
from helios_core.wire import contract_pb2 as ct

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "cores"
KEYS = FIXTURES / "keys"
NAMESPACE = "helios-fixtures/golden"

# name -> (layout, contract version)
GOLDEN = {
    "payload-v3": ("payload", 3),
    "contract-v2": ("payload", 2),
    "contract-v1": ("payload", 1),
    "logical-v6": ("logical-v6", 3),
    "logical-v4": ("logical-v4", 3),
    "abi-label": ("payload", 3),
}


def open_golden(name: str) -> CoreFile:
    trust = TrustStore.from_paths([KEYS / "signing.pub.pem"])
    core_key = load_core_key(KEYS / "core.key") if name == "logical-v4" else None
    return CoreFile.open(FIXTURES / f"{name}.core", trust, core_key=core_key)


def prepare_golden(name: str) -> tuple[PreparedContract, ct.ServingContract]:
    with open_golden(name) as core:
        return prepare_contract(core.contract, core.execution, list(core.resources.values())), core.contract


@pytest.mark.parametrize("name", list(GOLDEN))
def test_golden_fixture_opens_verifies_and_validates(name: str) -> None:
    layout, version = GOLDEN[name]
    with open_golden(name) as core:
        assert core.layout == layout
        assert core.publisher_namespace == NAMESPACE
        core.authorize(NAMESPACE)
        core.verify_resources()
        prepared = prepare_contract(core.contract, core.execution, list(core.resources.values()))
    check_runtime_support(prepared, RuntimeCapabilities())
    assert prepared.version == version
    assert {g.name for g in prepared.graphs.values()} == {p.name for p in prepared.execution.programs}
    assert prepared.graphs_for(ct.OPERATION_DECODE)


def test_abi_label_fixture_carries_an_unfamiliar_label() -> None:
    prepared, _ = prepare_golden("abi-label")
    reference, _ = prepare_golden("payload-v3")
    assert prepared.execution.abi_label != reference.execution.abi_label


def test_version_1_fixture_defaults_histogram_and_mask_geometry() -> None:
    prepared, serving = prepare_golden("contract-v1")
    vocabulary = serving.model.vocabulary
    assert (vocabulary.histogram_width, vocabulary.mask_words) == (0, 0)
    assert vocabulary.logits_width > 0
    assert prepared.logits_width == vocabulary.logits_width
    assert prepared.histogram_width == prepared.logits_width
    assert prepared.mask_words == math.ceil(prepared.logits_width / 32)


@pytest.mark.parametrize("name", ["contract-v1", "contract-v2"])
def test_older_fixtures_default_packed_token_capacity(name: str) -> None:
    prepared, _ = prepare_golden(name)
    decode = prepared.graphs_for(ct.OPERATION_DECODE)
    assert len(decode) == 3
    for graph in decode:
        assert graph.contract.extents.packed_token_capacity == 0
        extents = graph.extents
        assert extents.packed_token_capacity == extents.batch_capacity * extents.token_capacity


def test_version_3_fixture_declares_packed_token_capacity() -> None:
    prepared, _ = prepare_golden("payload-v3")
    for graph in prepared.graphs.values():
        assert graph.contract.extents.packed_token_capacity == graph.extents.packed_token_capacity > 0
