"""Decoded-size limits of the resources read into memory whole (tokenizer, chat template, module).

The over-limit cores are signed and honest: each resource is one zstd frame of a few KiB of zeros
whose content size is the signed decoded length. They must be refused from the signed description
alone, before any output buffer is allocated, with one typed error line.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import zstandard

from helios_core.container import CHUNK_NBYTES, MAX_DECODED_NBYTES, CoreFile, Layout, ResourceInput, TrustStore
from helios_core.container.frames import chunk_digests
from helios_core.container.limits import MAX_CHAT_TEMPLATE_NBYTES, MAX_MODULE_NBYTES, MAX_TOKENIZER_NBYTES
from helios_core.errors import CoreFormatError
from helios_core.wire import container_pb2

if TYPE_CHECKING:
    from conftest import CraftCore, MakeCore

TOKENIZER = container_pb2.RESOURCE_KIND_TOKENIZER
CHAT_TEMPLATE = container_pb2.RESOURCE_KIND_CHAT_TEMPLATE
MODULE = container_pb2.RESOURCE_KIND_MODULE
WEIGHTS = container_pb2.RESOURCE_KIND_WEIGHTS
MIB = 1024 * 1024
PEAK_LIMIT = 4 * MIB
"""Traced Python allocations allowed while a rejected core is opened and read."""


def zeros_frame(decoded_nbytes: int, *, content_size: bool = True) -> bytes:
    """One zstd frame of ``decoded_nbytes`` zeros, compressed in 1 MiB pieces (never held decoded)."""
    compressor = zstandard.ZstdCompressor(level=3, write_content_size=content_size, write_checksum=True)
    stream = compressor.compressobj(size=decoded_nbytes if content_size else -1)
    piece = bytes(MIB)
    parts = []
    left = decoded_nbytes
    while left:
        step = min(left, MIB)
        parts.append(stream.compress(piece[:step]))
        left -= step
    parts.append(stream.flush())
    return b"".join(parts)


def described(rid: str, kind: int, stored: bytes, decoded_nbytes: int) -> container_pb2.ExecutableResource:
    return container_pb2.ExecutableResource(
        id=rid,
        kind=kind,  # type: ignore[arg-type]
        decoded_nbytes=decoded_nbytes,
        stored_nbytes=len(stored),
        chunk_nbytes=CHUNK_NBYTES,
        chunk_sha256=chunk_digests(stored),
    )


def signed_core(
    path: Path, craft_core: CraftCore, rid: str, kind: int, decoded_nbytes: int, layout: Layout = "payload"
) -> Path:
    """A signed core holding one honest all-zero resource of ``decoded_nbytes`` and a small weight."""
    stored = zeros_frame(decoded_nbytes)
    weight = zeros_frame(64)
    return craft_core(
        path,
        [described("w0", WEIGHTS, weight, 64), described(rid, kind, stored, decoded_nbytes)],
        [("w0", weight), (rid, stored)],
        layout=layout,
    )


def limit_error(rid: str, decoded_nbytes: int, kind_name: str, limit: int) -> str:
    return (
        f"resource {rid!r} declares {decoded_nbytes} decoded bytes, over the {limit}-byte limit for {kind_name} "
        "(read into memory whole); the core cannot be loaded"
    )


@pytest.fixture
def tracing() -> Iterator[None]:
    """Trace Python allocations while the test runs (``tracemalloc.get_traced_memory`` reads the peak)."""
    tracemalloc.start()
    try:
        yield
    finally:
        tracemalloc.stop()


def read_whole(path: Path, trust: TrustStore, namespace: str, rid: str, kind: int) -> bytearray:
    with CoreFile.open(path, trust) as core:
        core.authorize(namespace)
        return core.read_resource(rid, kind)


def test_the_limits_are_the_documented_ones() -> None:
    assert dict(MAX_DECODED_NBYTES) == {TOKENIZER: 64 * MIB, CHAT_TEMPLATE: 1 * MIB, MODULE: 512 * MIB}
    assert (MAX_TOKENIZER_NBYTES, MAX_CHAT_TEMPLATE_NBYTES, MAX_MODULE_NBYTES) == (64 * MIB, MIB, 512 * MIB)


@pytest.mark.parametrize("layout", ["payload", "logical-v6"])
@pytest.mark.parametrize(
    ("rid", "kind", "kind_name", "decoded_nbytes", "limit"),
    [
        ("tokenizer", TOKENIZER, "RESOURCE_KIND_TOKENIZER", 256 * MIB, 64 * MIB),
        ("tokenizer", TOKENIZER, "RESOURCE_KIND_TOKENIZER", 64 * MIB + 1, 64 * MIB),
        ("chat_template", CHAT_TEMPLATE, "RESOURCE_KIND_CHAT_TEMPLATE", 512 * MIB, MIB),
        ("chat_template", CHAT_TEMPLATE, "RESOURCE_KIND_CHAT_TEMPLATE", MIB + 1, MIB),
        ("sm_90a", MODULE, "RESOURCE_KIND_MODULE", 512 * MIB + 1, 512 * MIB),
    ],
)
def test_an_over_limit_resource_is_refused_before_anything_is_allocated(
    tmp_path: Path,
    craft_core: CraftCore,
    trust: TrustStore,
    namespace: str,
    tracing: None,
    layout: Layout,
    rid: str,
    kind: int,
    kind_name: str,
    decoded_nbytes: int,
    limit: int,
) -> None:
    path = signed_core(tmp_path / "big.core", craft_core, rid, kind, decoded_nbytes, layout)
    assert path.stat().st_size < 64 * 1024  # a few KiB that honestly decode to the declared length
    tracemalloc.reset_peak()
    with pytest.raises(CoreFormatError) as caught:
        read_whole(path, trust, namespace, rid, kind)
    _, peak = tracemalloc.get_traced_memory()
    assert str(caught.value) == limit_error(rid, decoded_nbytes, kind_name, limit)
    assert peak < PEAK_LIMIT


def test_a_resource_at_its_limit_is_read(
    tmp_path: Path, craft_core: CraftCore, trust: TrustStore, namespace: str
) -> None:
    path = signed_core(tmp_path / "at-limit.core", craft_core, "chat_template", CHAT_TEMPLATE, MIB)
    assert read_whole(path, trust, namespace, "chat_template", CHAT_TEMPLATE) == bytes(MIB)


def test_a_tokenizer_at_its_limit_opens(tmp_path: Path, craft_core: CraftCore, trust: TrustStore) -> None:
    path = signed_core(tmp_path / "at-limit.core", craft_core, "tokenizer", TOKENIZER, 64 * MIB)
    with CoreFile.open(path, trust) as core:
        assert core.resources["tokenizer"].decoded_nbytes == 64 * MIB


def test_weights_are_not_capped_by_kind(
    tmp_path: Path, craft_core: CraftCore, trust: TrustStore, namespace: str
) -> None:
    path = signed_core(tmp_path / "weights.core", craft_core, "w1", WEIGHTS, MIB + 1)
    assert read_whole(path, trust, namespace, "w1", WEIGHTS) == bytes(MIB + 1)


def test_a_frame_longer_than_its_signed_length_stops_there(
    tmp_path: Path, craft_core: CraftCore, trust: TrustStore, namespace: str, tracing: None
) -> None:
    stored = zeros_frame(256 * MIB, content_size=False)  # says nothing of its size; decodes to 256 MiB
    path = craft_core(
        tmp_path / "lying.core", [described("tokenizer", TOKENIZER, stored, 4096)], [("tokenizer", stored)]
    )
    tracemalloc.reset_peak()
    with pytest.raises(CoreFormatError) as caught:
        read_whole(path, trust, namespace, "tokenizer", TOKENIZER)
    _, peak = tracemalloc.get_traced_memory()
    assert str(caught.value) == (
        "resource 'tokenizer' decodes to more than its signed decoded length of 4096 bytes; decoding stopped there"
    )
    assert peak < PEAK_LIMIT


def test_the_writer_refuses_an_over_limit_resource(tmp_path: Path, make_core: MakeCore) -> None:
    template = ResourceInput("chat_template", CHAT_TEMPLATE, b"{{ x }}" + bytes(MIB))
    with pytest.raises(CoreFormatError) as caught:
        make_core(tmp_path / "x.core", resources=[template])
    assert str(caught.value) == limit_error("chat_template", MIB + 7, "RESOURCE_KIND_CHAT_TEMPLATE", MIB)
    assert not (tmp_path / "x.core").exists()
