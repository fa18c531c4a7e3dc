"""Random damage to whole core files: every change is either rejected with a HeliosError or harmless.

"Harmless" is defined strictly: a damaged file may only be accepted when everything read from it (the
signed description, its signers, the resource encoding and every decoded resource) is identical to
what the original gives.

The signed body names the layout it was written for (``layout``), so re-wrapping a signed body in
another container layout is rejected; snapshots still compare the resource encoding (zstd frames or
sealed chunks) rather than the layout label.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helios_core.container import CoreFile, Layout, TrustStore
from helios_core.errors import HeliosError

if TYPE_CHECKING:
    from conftest import MakeCore, SplitCore

LAYOUTS: list[Layout] = ["payload", "logical-v6", "logical-v4"]


@dataclass(frozen=True)
class Snapshot:
    """Everything a caller can read from a core."""

    encoding: str
    namespace: str
    signers: tuple[str, ...]
    description: bytes
    resources: dict[str, bytes]


ReadSnapshot = Callable[[Path], Snapshot]


def snapshot(path: Path, trust: TrustStore, core_key: bytes, namespace: str) -> Snapshot:
    """Open, verify and read everything; raises HeliosError when the core is rejected."""
    with CoreFile.open(path, trust, core_key=core_key) as core:
        core.authorize(namespace)
        core.verify_resources()
        described = b"".join(
            [
                core.contract.SerializeToString(deterministic=True),
                core.execution.SerializeToString(deterministic=True),
                core.description.encode(),
                b"" if core.rebuild is None else core.rebuild.SerializeToString(deterministic=True),
                *(c.SerializeToString(deterministic=True) for c in core.weight_catalogs),
                *(r.SerializeToString(deterministic=True) for r in core.resources.values()),
            ]
        )
        decoded = {rid: bytes(core.read_resource(rid, r.kind)) for rid, r in core.resources.items()}
        encoding = "sealed" if core.layout == "logical-v4" else "zstd"
        return Snapshot(encoding, core.publisher_namespace, core.signer_key_ids, described, decoded)


@dataclass(frozen=True)
class Original:
    data: bytes = field(repr=False)
    header_end: int
    snapshot: Snapshot = field(repr=False)


@pytest.fixture(scope="module")
def read_snapshot(trust: TrustStore, core_key: bytes, namespace: str) -> ReadSnapshot:
    return lambda path: snapshot(path, trust, core_key, namespace)


@pytest.fixture(scope="module")
def originals(
    tmp_path_factory: pytest.TempPathFactory,
    make_core: MakeCore,
    read_snapshot: ReadSnapshot,
    split_core: SplitCore,
) -> dict[str, Original]:
    directory = tmp_path_factory.mktemp("originals")
    result: dict[str, Original] = {}
    for layout in LAYOUTS:
        path = make_core(directory / f"{layout}.core", layout)
        data = path.read_bytes()
        _, header_end = split_core(data)
        result[layout] = Original(data, header_end, read_snapshot(path))
    return result


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mutated") / "mutated.core"


def check(path: Path, data: bytes, read_snapshot: ReadSnapshot, original: Snapshot) -> bool:
    """Write ``data`` and read it fully; True when rejected, False when accepted unchanged."""
    path.write_bytes(data)
    try:
        seen = read_snapshot(path)
    except HeliosError:
        return True
    assert seen == original, "a damaged core was accepted with different content"
    return False


@st.composite
def damage(draw: st.DrawFn, original: Original) -> list[tuple[int, int]]:
    """One to four (position, xor mask) pairs; half of them aimed at the unsigned header."""
    size = len(original.data)
    header_positions = st.integers(0, original.header_end - 1)
    anywhere = st.integers(0, size - 1)
    position = st.one_of(header_positions, anywhere)
    return draw(st.lists(st.tuples(position, st.integers(1, 255)), min_size=1, max_size=4))


@pytest.mark.parametrize("layout", LAYOUTS)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_damage_is_rejected_or_harmless(
    originals: dict[str, Original],
    scratch: Path,
    read_snapshot: ReadSnapshot,
    layout: Layout,
    data: st.DataObject,
) -> None:
    original = originals[layout]
    changes = data.draw(damage(original))
    mutated = bytearray(original.data)
    for position, mask in changes:
        mutated[position] ^= mask
    check(scratch, bytes(mutated), read_snapshot, original.snapshot)


@pytest.mark.parametrize("layout", LAYOUTS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_byte_replacement_in_stored_bytes_is_rejected(
    originals: dict[str, Original],
    scratch: Path,
    read_snapshot: ReadSnapshot,
    layout: Layout,
    data: st.DataObject,
) -> None:
    # Every stored byte is covered by a signed chunk hash: no change there can be harmless.
    original = originals[layout]
    position = data.draw(st.integers(original.header_end, len(original.data) - 1))
    value = data.draw(st.integers(0, 255).filter(lambda v: v != original.data[position]))
    mutated = bytearray(original.data)
    mutated[position] = value
    assert check(scratch, bytes(mutated), read_snapshot, original.snapshot)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_truncation_anywhere_is_rejected(
    originals: dict[str, Original], scratch: Path, read_snapshot: ReadSnapshot, layout: Layout
) -> None:
    original = originals[layout]
    for step in range(50):
        cut = len(original.data) * step // 50
        assert check(scratch, original.data[:cut], read_snapshot, original.snapshot), (
            f"truncation to {cut} bytes accepted"
        )
    assert check(scratch, original.data[:-1], read_snapshot, original.snapshot)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tail", [b"\x00", b"\xff" * 7, b"HELIOSC\x00", b"\x28\xb5\x2f\xfd\x20\x00\x01\x00\x00"])
def test_appended_bytes_are_rejected(
    originals: dict[str, Original], scratch: Path, read_snapshot: ReadSnapshot, layout: Layout, tail: bytes
) -> None:
    original = originals[layout]
    assert check(scratch, original.data + tail, read_snapshot, original.snapshot)


def test_unmodified_cores_are_accepted(
    originals: dict[str, Original], scratch: Path, read_snapshot: ReadSnapshot
) -> None:
    for original in originals.values():
        assert not check(scratch, original.data, read_snapshot, original.snapshot)
