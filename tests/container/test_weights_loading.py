"""Weights resources decoded a few at once (``helios_core.backends.weights_loading``): the same bytes as a
sequential read, in the caller's order, the first damaged resource's own error, no thread or partial state
left behind, and at most ``workers + 1`` host arrays alive."""

from __future__ import annotations

import os
import threading
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from helios_core.backends import weights_loading
from helios_core.backends.weights_loading import DecodedResource, decode_resources
from helios_core.container import CHUNK_NBYTES, CoreFile, Layout, ResourceInput, TrustStore
from helios_core.errors import CoreFormatError, IntegrityError
from helios_core.wire import container_pb2, manifest_pb2

if TYPE_CHECKING:
    from conftest import MakeCore

WEIGHTS = container_pb2.RESOURCE_KIND_WEIGHTS
MODULE = container_pb2.RESOURCE_KIND_MODULE
IDS = [f"w{i}" for i in range(7)]


def _weights() -> list[ResourceInput]:
    """Seven weights resources of different sizes: compressible, incompressible, multi-chunk, empty."""
    pattern = bytes((i * 37 + i // 7) % 251 for i in range(3000))
    return [
        ResourceInput("w0", WEIGHTS, pattern * 40),
        ResourceInput("w1", WEIGHTS, os.urandom(CHUNK_NBYTES + 12345)),  # two stored chunks
        ResourceInput("w2", WEIGHTS, bytes(300_000)),
        ResourceInput("w3", WEIGHTS, os.urandom(70_000)),
        ResourceInput("w4", WEIGHTS, b""),
        ResourceInput("w5", WEIGHTS, pattern * 7 + os.urandom(999)),
        ResourceInput("w6", WEIGHTS, os.urandom(5)),
        ResourceInput("m0", MODULE, b"\x7fELF" + bytes(range(256))),
    ]


def _decode_threads() -> list[str]:
    return [thread.name for thread in threading.enumerate() if thread.name.startswith("helios-decode")]


@pytest.mark.parametrize("layout", ["payload", "logical-v6", "logical-v4"])
@pytest.mark.parametrize("workers", [1, 3])
def test_decoded_resources_equal_the_sequential_reads_in_the_callers_order(
    tmp_path: Path,
    make_core: MakeCore,
    trust: TrustStore,
    core_key: bytes,
    namespace: str,
    layout: Layout,
    workers: int,
) -> None:
    path = make_core(tmp_path / "x.core", layout, resources=_weights())
    order = ["w5", "w1", "w4", "w0", "w6", "w2", "w3", "w1"]  # a repeated id is decoded once
    seen: list[tuple[str, DecodedResource]] = []
    with CoreFile.open(path, trust, core_key=core_key) as core:
        core.authorize(namespace)
        decode_resources(core, order, WEIGHTS, lambda rid, data: seen.append((rid, data)), workers=workers)
        assert [rid for rid, _ in seen] == ["w5", "w1", "w4", "w0", "w6", "w2", "w3"]
        for rid, data in seen:
            assert data.dtype == np.uint8 and data.ndim == 1 and data.flags.c_contiguous and data.flags.writeable
            assert data.tobytes() == bytes(core.read_resource(rid, WEIGHTS))
    assert _decode_threads() == []


def test_a_damaged_resource_among_several_raises_its_own_integrity_error(
    tmp_path: Path, make_core: MakeCore, trust: TrustStore, namespace: str
) -> None:
    path = make_core(tmp_path / "x.core", resources=_weights(), sibling_files={"w3": "w3.bin", "w5": "w5.bin"})
    for name in ("w3.bin", "w5.bin"):  # two damaged resources: the first one in the caller's order is named
        sibling = bytearray((tmp_path / name).read_bytes())
        sibling[len(sibling) // 2] ^= 0x01
        (tmp_path / name).write_bytes(sibling)
    consumed: list[str] = []
    with CoreFile.open(path, trust) as core:
        core.authorize(namespace)
        damaged = r"^resource 'w3': stored chunk 0 .* does not match its signed SHA-256"
        with pytest.raises(IntegrityError, match=damaged):
            decode_resources(core, IDS, WEIGHTS, lambda rid, data: consumed.append(rid), workers=3)
        assert consumed == ["w0", "w1", "w2"]
        assert _decode_threads() == []  # every decoding thread ended before the error propagated
        with pytest.raises(IntegrityError, match=r"^resource 'w5': stored chunk 0 "):
            decode_resources(core, ["w6", "w5", "w3"], WEIGHTS, lambda rid, data: None, workers=2)


def test_other_failures_keep_their_types_and_stop_the_pool(
    tmp_path: Path, make_core: MakeCore, trust: TrustStore, namespace: str
) -> None:
    path = make_core(tmp_path / "x.core", resources=_weights())
    with CoreFile.open(path, trust) as core:
        core.authorize(namespace)
        with pytest.raises(CoreFormatError, match=r"^this core has no resource 'nope'"):
            decode_resources(core, ["w0", "nope", "w1"], WEIGHTS, lambda rid, data: None, workers=2)
        with pytest.raises(CoreFormatError, match=r"^resource 'm0' is declared as RESOURCE_KIND_MODULE"):
            decode_resources(core, ["w0", "m0"], WEIGHTS, lambda rid, data: None, workers=2)

        def refuse(rid: str, data: DecodedResource) -> None:
            raise ValueError(f"no room for {rid}")

        with pytest.raises(ValueError, match=r"^no room for w0$"):
            decode_resources(core, IDS, WEIGHTS, refuse, workers=3)
        assert _decode_threads() == []
        with pytest.raises(ValueError, match=r"^workers must be at least 1, not 0$"):
            decode_resources(core, IDS, WEIGHTS, refuse, workers=0)


def test_at_most_workers_plus_one_host_arrays_are_alive(
    tmp_path: Path, make_core: MakeCore, trust: TrustStore, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = make_core(tmp_path / "x.core", resources=_weights())
    lock = threading.Lock()
    alive = [0, 0]  # now, most
    decode = weights_loading.decode_resource

    def released() -> None:
        with lock:
            alive[0] -= 1

    def counted(core: CoreFile, resource_id: str, kind: int) -> DecodedResource:
        data = decode(core, resource_id, kind)
        with lock:
            alive[0] += 1
            alive[1] = max(alive[1], alive[0])
        weakref.finalize(data, released)
        return data

    monkeypatch.setattr(weights_loading, "decode_resource", counted)

    def slow(rid: str, data: DecodedResource) -> None:
        time.sleep(0.05)  # the decoders run ahead as far as they may

    with CoreFile.open(path, trust) as core:
        core.authorize(namespace)
        decode_resources(core, IDS, WEIGHTS, slow, workers=2)
    assert alive == [0, 3]


def test_the_reference_backend_loads_every_weights_resource_or_none(tmp_path: Path) -> None:
    from ignition.build import build_core
    from ignition.recipes.llama import Capacities
    from ignition.recipes.synthetic import synthetic_declaration

    from helios_core.backends.reference import ReferenceBackend
    from helios_core.container.keys import generate_keys, load_private_key
    from helios_core.loading import TrustSettings, open_core

    keys = generate_keys(tmp_path / "keys")
    path = tmp_path / "tiny.core"
    caps = Capacities(
        max_rows=1, prefill_tokens=(16,), decode_rows=(1,), page_tokens=16, cache_pages=8, context=64, snapshots=0
    )
    build_core(
        synthetic_declaration("tiny", seed=2), path, caps=caps, signing_key=load_private_key(keys["signing"]),
        namespace="acme/tiny",
    )  # fmt: skip
    settings = TrustSettings((keys["public"],), "acme/tiny", None)
    verified = open_core(path, settings, check_resources=False)
    try:
        buffers = verified.contract.execution.buffers
        wanted = sorted({d.resource_id for d in buffers if d.role == manifest_pb2.BUFFER_ROLE_WEIGHTS})
        assert len(wanted) > 2
        table: dict[str, DecodedResource] = {}
        backend = ReferenceBackend(verified.contract, verified.core, cache_pages=8, state_rows=1, resources=table)
        assert sorted(table) == wanted
        for rid, data in table.items():
            assert data.tobytes() == bytes(verified.core.read_resource(rid, WEIGHTS))
        backend.close()
        location = verified.core._locations[wanted[-1]]  # damage the last weights resource's stored bytes
    finally:
        verified.close()
    raw = bytearray(path.read_bytes())
    raw[location.offset + location.length // 2] ^= 0x01
    path.write_bytes(raw)
    verified = open_core(path, settings, check_resources=False)
    try:
        table = {}
        with pytest.raises(IntegrityError, match=rf"^resource '{wanted[-1]}': stored chunk 0 "):
            ReferenceBackend(verified.contract, verified.core, cache_pages=8, state_rows=1, resources=table)
        assert table == {}  # no resource joined the shared table
        assert _decode_threads() == []
    finally:
        verified.close()
