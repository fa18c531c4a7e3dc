"""Writing and reading whole core files, keys and trust (writer, reader, keys)."""

from __future__ import annotations

import hashlib
import os
import stat
import struct
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import zstandard
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from helios_core.container import (
    CHUNK_NBYTES,
    CoreFile,
    Layout,
    ResourceInput,
    TrustStore,
    encode_frame,
    generate_keys,
    key_id,
    load_core_key,
    load_private_key,
    load_public_key,
)
from helios_core.container.frames import HEADER_NBYTES, MAGIC, MAX_BODY_NBYTES, chunk_digests
from helios_core.container.sealing import seal_resource
from helios_core.container.writer import encode_resource
from helios_core.errors import CoreFormatError, HeliosError, IntegrityError, TrustError
from helios_core.wire import container_pb2, contract_pb2, manifest_pb2

if TYPE_CHECKING:
    from conftest import CraftCore, EditCoreBody, MakeCore, SplitCore

WEIGHTS = container_pb2.RESOURCE_KIND_WEIGHTS
MODULE = container_pb2.RESOURCE_KIND_MODULE
TOKENIZER = container_pb2.RESOURCE_KIND_TOKENIZER
LAYOUTS: list[Layout] = ["payload", "logical-v6", "logical-v4"]


def read_all(core: CoreFile, namespace: str) -> dict[str, bytes]:
    core.authorize(namespace)
    core.verify_resources()
    return {rid: bytes(core.read_resource(rid, resource.kind)) for rid, resource in core.resources.items()}


def frame_resource(rid: str, data: bytes, *, kind: int = WEIGHTS) -> tuple[container_pb2.ExecutableResource, bytes]:
    return encode_resource(ResourceInput(rid, kind, data), layout="payload")


def described(rid: str, stored: bytes, decoded_nbytes: int, kind: int = WEIGHTS) -> container_pb2.ExecutableResource:
    return container_pb2.ExecutableResource(
        id=rid,
        kind=kind,  # type: ignore[arg-type]
        decoded_nbytes=decoded_nbytes,
        stored_nbytes=len(stored),
        chunk_nbytes=CHUNK_NBYTES,
        chunk_sha256=chunk_digests(stored),
    )


# --------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("layout", LAYOUTS)
def test_roundtrip(
    tmp_path: Path,
    make_core: MakeCore,
    trust: TrustStore,
    resources: list[ResourceInput],
    layout: Layout,
    namespace: str,
    core_key: bytes,
) -> None:
    rebuild = container_pb2.RebuildManifest(recipe="llama-synthetic", toolkit_version="0.1")
    catalog = container_pb2.WeightCatalog(version=1, rank=0)
    progress: list[tuple[str, int, int]] = []
    path = make_core(
        tmp_path / "x.core",
        layout,
        rebuild=rebuild,
        weight_catalogs=[catalog],
        progress=lambda *a: progress.append(a),
    )
    assert progress == [("w0", 1, 3), ("m0", 2, 3), ("tok", 3, 3)]
    with CoreFile.open(path, trust, core_key=core_key) as core:
        assert core.layout == layout
        assert core.format_version == 2
        assert core.publisher_namespace == namespace
        assert core.signer_key_ids == trust.key_ids
        assert core.description == "a synthetic test core"
        assert core.contract == contract_pb2.ServingContract(served_name="served-model", context_tokens=4096)
        assert core.execution == manifest_pb2.ExecutionManifest()
        assert core.rebuild == rebuild
        assert core.weight_catalogs == (catalog,)
        assert list(core.resources) == ["w0", "m0", "tok"]
        assert core.resources["tok"].rank == 1
        core.authorize(namespace)
        verified: list[tuple[str, int, int]] = []
        core.verify_resources(progress=lambda *a: verified.append(a))
        assert verified == [("w0", 1, 3), ("m0", 2, 3), ("tok", 3, 3)]
        for resource in resources:
            decoded = core.read_resource(resource.id, resource.kind)
            assert isinstance(decoded, bytearray)
            assert decoded == resource.data
            assert b"".join(core.iter_resource(resource.id, resource.kind)) == resource.data


def test_empty_resources(
    tmp_path: Path, make_core: MakeCore, trust: TrustStore, core_key: bytes, namespace: str
) -> None:
    for layout in LAYOUTS:
        path = make_core(tmp_path / f"{layout}.core", layout, resources=[ResourceInput("e", WEIGHTS, b"")])
        with CoreFile.open(path, trust, core_key=core_key) as core:
            assert read_all(core, namespace) == {"e": b""}
            assert list(core.iter_resource("e", WEIGHTS)) == []


def test_no_resources(tmp_path: Path, make_core: MakeCore, trust: TrustStore, core_key: bytes, namespace: str) -> None:
    path = make_core(tmp_path / "x.core", resources=[])
    with CoreFile.open(path, trust, core_key=core_key) as core:
        assert read_all(core, namespace) == {}


def test_multi_chunk_resource_and_pieces(
    tmp_path: Path, make_core: MakeCore, trust: TrustStore, namespace: str, core_key: bytes
) -> None:
    data = os.urandom(2 * CHUNK_NBYTES + 5000)  # incompressible: three 4 MiB stored chunks
    path = make_core(tmp_path / "x.core", resources=[ResourceInput("big", WEIGHTS, data)])
    with CoreFile.open(path, trust, core_key=core_key) as core:
        assert len(core.resources["big"].chunk_sha256) == 3
        core.authorize(namespace)
        pieces = list(core.iter_resource("big", WEIGHTS))
        assert all(len(piece) <= 1024 * 1024 for piece in pieces)
        assert b"".join(pieces) == data
        assert core.read_resource("big", WEIGHTS) == data
    # Damage the third stored chunk: the first two still stream, then the reader stops.
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0x01
    path.write_bytes(raw)
    with CoreFile.open(path, trust, core_key=core_key) as core:
        core.authorize(namespace)
        with pytest.raises(IntegrityError, match="stored chunk 2"):
            core.read_resource("big", WEIGHTS)


def test_file_layout(
    tmp_path: Path, make_core: MakeCore, resources: list[ResourceInput], split_core: SplitCore
) -> None:
    path = make_core(tmp_path / "x.core")
    raw = path.read_bytes()
    assert raw[:8] == b"HELIOSC\x00"
    core_body, end = split_core(raw)
    assert core_body.format_version == 2
    assert core_body.WhichOneof("body") == "payload"
    body = container_pb2.DeploymentBody.FromString(core_body.payload.signed_bytes)
    offset = end
    for resource, description, location in zip(resources, body.resources, core_body.locations.locations, strict=True):
        stored = encode_frame(resource.data)
        assert description.chunk_nbytes == 4194304
        assert description.decoded_nbytes == len(resource.data)
        assert description.stored_nbytes == len(stored)
        assert list(description.chunk_sha256) == [hashlib.sha256(stored).digest()]
        assert (location.resource_id, location.file, location.offset, location.length) == (
            resource.id,
            "",
            offset,
            len(stored),
        )
        assert raw[offset : offset + len(stored)] == stored
        offset += len(stored)
    assert offset == len(raw)


def test_logical_layouts_write_protected_index(
    tmp_path: Path, make_core: MakeCore, namespace: str, split_core: SplitCore
) -> None:
    for layout, version in (("logical-v6", 6), ("logical-v4", 4)):
        core_body, _ = split_core(make_core(tmp_path / f"{layout}.core", layout).read_bytes())
        assert core_body.WhichOneof("body") == "protected_index"
        assert core_body.protected_index.version == version
        index = container_pb2.ModelIndex.FromString(core_body.protected_index.index.signed_bytes)
        assert index.publisher_namespace == namespace
        assert all(r.HasField("sealed") == (version == 4) for r in index.resources)


def test_v4_stored_bytes_are_sealed_chunks(
    tmp_path: Path,
    make_core: MakeCore,
    resources: list[ResourceInput],
    core_key: bytes,
    split_core: SplitCore,
) -> None:
    raw = make_core(tmp_path / "x.core", "logical-v4").read_bytes()
    core_body, _ = split_core(raw)
    index = container_pb2.ModelIndex.FromString(core_body.protected_index.index.signed_bytes)
    for number, (resource, description, location) in enumerate(
        zip(resources, index.resources, core_body.locations.locations, strict=True), start=1
    ):
        assert description.sealed.plain_chunk_nbytes == 1024 * 1024
        assert description.sealed.nonce_prefix == number.to_bytes(8, "big")  # the injected nonce source
        expected = seal_resource(
            resource.data,
            resource_id=resource.id,
            core_key=core_key,
            nonce_prefix=description.sealed.nonce_prefix,
        )
        assert raw[location.offset : location.offset + location.length] == expected


@pytest.mark.parametrize("layout", LAYOUTS)
def test_output_is_deterministic(tmp_path: Path, make_core: MakeCore, layout: Layout) -> None:
    first = make_core(tmp_path / "a.core", layout).read_bytes()
    second = make_core(tmp_path / "b.core", layout).read_bytes()
    assert first == second


def test_v4_nonce_prefixes_default_to_random(tmp_path: Path, make_core: MakeCore) -> None:
    first = make_core(tmp_path / "a.core", "logical-v4", nonce_source=os.urandom).read_bytes()
    second = make_core(tmp_path / "b.core", "logical-v4", nonce_source=os.urandom).read_bytes()
    assert first != second


def test_several_signatures_one_trusted(
    tmp_path: Path,
    craft_core: CraftCore,
    trust: TrustStore,
    signing_key: Ed25519PrivateKey,
    other_key: Ed25519PrivateKey,
    namespace: str,
) -> None:
    res, stored = frame_resource("w0", b"abc")
    path = craft_core(tmp_path / "x.core", [res], [("w0", stored)], signing_keys=[other_key, signing_key])
    with CoreFile.open(path, trust) as core:
        assert core.signer_key_ids == (key_id(signing_key.public_key()),)
        assert read_all(core, namespace) == {"w0": b"abc"}


# ------------------------------------------------------------------------- header rejections


def test_missing_file(tmp_path: Path, trust: TrustStore) -> None:
    with pytest.raises(CoreFormatError, match="cannot open core file"):
        CoreFile.open(tmp_path / "absent.core", trust)


def test_file_shorter_than_header(tmp_path: Path, trust: TrustStore) -> None:
    path = tmp_path / "x.core"
    path.write_bytes(MAGIC + b"\x01")
    with pytest.raises(CoreFormatError, match="too short to be a Helios core"):
        CoreFile.open(path, trust)


def test_bad_magic(tmp_path: Path, make_core: MakeCore, trust: TrustStore) -> None:
    path = make_core(tmp_path / "x.core")
    raw = bytearray(path.read_bytes())
    raw[6] = ord("D")
    path.write_bytes(raw)
    with pytest.raises(CoreFormatError, match="is not a Helios core: it starts with b'HELIOSD"):
        CoreFile.open(path, trust)


def test_body_length_over_cap_is_rejected_before_allocating(tmp_path: Path, trust: TrustStore) -> None:
    path = tmp_path / "x.core"
    with open(path, "wb") as handle:
        handle.write(MAGIC + struct.pack("<Q", MAX_BODY_NBYTES + 1))
        handle.truncate(HEADER_NBYTES + MAX_BODY_NBYTES + 1)  # sparse: the bytes are "there"
    tracemalloc.start()
    try:
        with pytest.raises(CoreFormatError, match=f"declares a {MAX_BODY_NBYTES + 1}-byte CoreBody, over the"):
            CoreFile.open(path, trust)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1024 * 1024


def test_body_length_beyond_end_of_file(tmp_path: Path, make_core: MakeCore, trust: TrustStore) -> None:
    path = make_core(tmp_path / "x.core")
    raw = bytearray(path.read_bytes())
    raw[8:16] = struct.pack("<Q", len(raw))
    path.write_bytes(raw)
    with pytest.raises(CoreFormatError, match="is truncated: its header declares"):
        CoreFile.open(path, trust)


def test_malformed_core_body(tmp_path: Path, trust: TrustStore) -> None:
    path = tmp_path / "x.core"
    garbage = b"\xff\xff\xff\xff\xff"
    path.write_bytes(MAGIC + struct.pack("<Q", len(garbage)) + garbage)
    with pytest.raises(CoreFormatError, match="malformed CoreBody"):
        CoreFile.open(path, trust)


@pytest.mark.parametrize("version", [0, 1, 3, 200])
def test_format_version_must_be_2(tmp_path: Path, craft_core: CraftCore, trust: TrustStore, version: int) -> None:
    res, stored = frame_resource("w0", b"abc")
    path = craft_core(tmp_path / "x.core", [res], [("w0", stored)], format_version=version)
    with pytest.raises(CoreFormatError, match=f"container format version {version}; this runtime reads"):
        CoreFile.open(path, trust)


def test_core_body_without_body(
    tmp_path: Path, make_core: MakeCore, edit_core_body: EditCoreBody, trust: TrustStore
) -> None:
    path = make_core(tmp_path / "x.core")
    edit_core_body(path, lambda body: body.ClearField("payload"))
    with pytest.raises(CoreFormatError, match="neither a payload nor a protected index"):
        CoreFile.open(path, trust)


@pytest.mark.parametrize("version", [0, 3, 5, 7])
def test_protected_index_version_must_be_4_or_6(
    tmp_path: Path, make_core: MakeCore, edit_core_body: EditCoreBody, trust: TrustStore, version: int
) -> None:
    path = make_core(tmp_path / "x.core", "logical-v6")

    def change(body: container_pb2.CoreBody) -> None:
        body.protected_index.version = version

    edit_core_body(path, change)
    with pytest.raises(CoreFormatError, match=f"ProtectedIndex version {version}; this runtime reads versions 4 and 6"):
        CoreFile.open(path, trust)


def test_protected_index_without_index(
    tmp_path: Path, make_core: MakeCore, edit_core_body: EditCoreBody, trust: TrustStore
) -> None:
    path = make_core(tmp_path / "x.core", "logical-v6")
    edit_core_body(path, lambda body: body.protected_index.ClearField("index"))
    with pytest.raises(CoreFormatError, match="no signed index"):
        CoreFile.open(path, trust)


@pytest.mark.parametrize(("stored_as", "read_as"), [("logical-v6", 4), ("logical-v4", 6)])
def test_unsigned_index_version_flip_is_caught(
    tmp_path: Path,
    make_core: MakeCore,
    edit_core_body: EditCoreBody,
    trust: TrustStore,
    stored_as: Layout,
    read_as: int,
    core_key: bytes,
) -> None:
    # ProtectedIndex.version lies outside the signature; the signed layout contradicts a flip.
    path = make_core(tmp_path / "x.core", stored_as)

    def change(body: container_pb2.CoreBody) -> None:
        body.protected_index.version = read_as

    edit_core_body(path, change)
    with pytest.raises(CoreFormatError, match="re-wrapped"):
        CoreFile.open(path, trust, core_key=core_key)


def test_payload_body_rewrapped_as_logical_core_is_rejected(
    tmp_path: Path, make_core: MakeCore, edit_core_body: EditCoreBody, trust: TrustStore
) -> None:
    path = make_core(tmp_path / "x.core", "payload")

    def rewrap(body: container_pb2.CoreBody) -> None:
        envelope = container_pb2.SignedEnvelope()
        envelope.CopyFrom(body.payload)
        body.protected_index.version = 6
        body.protected_index.index.CopyFrom(envelope)

    edit_core_body(path, rewrap)
    with pytest.raises(CoreFormatError, match="re-wrapped"):
        CoreFile.open(path, trust)


# -------------------------------------------------------------------------- trust rejections


def test_untrusted_signer_names_key_ids(tmp_path: Path, make_core: MakeCore, other_key: Ed25519PrivateKey) -> None:
    path = make_core(tmp_path / "x.core", signing_key=other_key)
    trusted = TrustStore([Ed25519PrivateKey.from_private_bytes(bytes(32)).public_key()])
    with pytest.raises(TrustError) as caught:
        CoreFile.open(path, trusted)
    message = str(caught.value)
    assert key_id(other_key.public_key()) in message
    assert trusted.key_ids[0] in message
    assert "no trusted key signed" in message


def test_empty_trust_store(tmp_path: Path, make_core: MakeCore) -> None:
    path = make_core(tmp_path / "x.core")
    with pytest.raises(TrustError, match="trusted keys are none"):
        CoreFile.open(path, TrustStore())


def test_no_signatures(tmp_path: Path, craft_core: CraftCore, trust: TrustStore) -> None:
    res, stored = frame_resource("w0", b"abc")
    path = craft_core(tmp_path / "x.core", [res], [("w0", stored)], signing_keys=[])
    with pytest.raises(TrustError, match="it is signed by none"):
        CoreFile.open(path, trust)


def test_bad_signature_by_trusted_key(
    tmp_path: Path, make_core: MakeCore, edit_core_body: EditCoreBody, trust: TrustStore
) -> None:
    path = make_core(tmp_path / "x.core")

    def change(body: container_pb2.CoreBody) -> None:
        signature = bytearray(body.payload.signatures[0].signature)
        signature[0] ^= 0x01
        body.payload.signatures[0].signature = bytes(signature)

    edit_core_body(path, change)
    with pytest.raises(IntegrityError, match=f"signature by trusted key '{trust.key_ids[0]}' does not verify"):
        CoreFile.open(path, trust)


def test_altered_signed_bytes(
    tmp_path: Path, make_core: MakeCore, edit_core_body: EditCoreBody, trust: TrustStore
) -> None:
    path = make_core(tmp_path / "x.core")

    def change(body: container_pb2.CoreBody) -> None:
        body.payload.signed_bytes = body.payload.signed_bytes.replace(b"acme", b"ACME")

    edit_core_body(path, change)
    with pytest.raises(IntegrityError, match="does not verify"):
        CoreFile.open(path, trust)


def test_trusted_key_with_other_algorithm(
    tmp_path: Path, make_core: MakeCore, edit_core_body: EditCoreBody, trust: TrustStore
) -> None:
    path = make_core(tmp_path / "x.core")

    def change(body: container_pb2.CoreBody) -> None:
        body.payload.signatures[0].algorithm = container_pb2.SIGNATURE_ALGORITHM_UNSPECIFIED

    edit_core_body(path, change)
    with pytest.raises(IntegrityError, match="not Ed25519"):
        CoreFile.open(path, trust)


def test_one_bad_trusted_signature_fails_even_beside_a_good_one(
    tmp_path: Path,
    craft_core: CraftCore,
    edit_core_body: EditCoreBody,
    signing_key: Ed25519PrivateKey,
    other_key: Ed25519PrivateKey,
) -> None:
    res, stored = frame_resource("w0", b"abc")
    path = craft_core(tmp_path / "x.core", [res], [("w0", stored)], signing_keys=[signing_key, other_key])

    def change(body: container_pb2.CoreBody) -> None:
        body.payload.signatures[1].signature = bytes(64)

    edit_core_body(path, change)
    both = TrustStore([signing_key.public_key(), other_key.public_key()])
    with pytest.raises(IntegrityError, match=key_id(other_key.public_key())):
        CoreFile.open(path, both)


def test_signed_garbage_is_verified_before_parsing(
    tmp_path: Path, craft_core: CraftCore, trust: TrustStore, other_key: Ed25519PrivateKey
) -> None:
    # Unparseable signed bytes: by an untrusted key it is a trust failure (never parsed) ...
    path = craft_core(tmp_path / "a.core", [], [], signed_body=b"\xff\xff\xff", signing_keys=[other_key])
    with pytest.raises(TrustError):
        CoreFile.open(path, trust)
    # ... and by a trusted key a format error, found only after the signature verified.
    path = craft_core(tmp_path / "b.core", [], [], signed_body=b"\xff\xff\xff")
    with pytest.raises(CoreFormatError, match="signed DeploymentBody does not parse"):
        CoreFile.open(path, trust)


@pytest.mark.parametrize(
    "acceptance",
    ["", "ACME/llama-synthetic", " acme/llama-synthetic", "acme/llama-synthetic\n", "acme/llama"],
)
def test_authorize_requires_the_exact_namespace(
    tmp_path: Path, make_core: MakeCore, trust: TrustStore, acceptance: str, namespace: str, core_key: bytes
) -> None:
    with CoreFile.open(make_core(tmp_path / "x.core"), trust, core_key=core_key) as core:
        with pytest.raises(TrustError, match="does not equal this core's signed publisher namespace"):
            core.authorize(acceptance)
        with pytest.raises(TrustError, match="before authorize"):
            core.read_resource("w0", WEIGHTS)
        core.authorize(namespace)
        assert core.read_resource("tok", TOKENIZER) == b'{"model": "x"}'


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reading_before_authorize(
    tmp_path: Path, make_core: MakeCore, trust: TrustStore, layout: Layout, core_key: bytes
) -> None:
    with CoreFile.open(make_core(tmp_path / "x.core", layout), trust, core_key=core_key) as core:
        with pytest.raises(TrustError, match="before authorize"):
            core.read_resource("w0", WEIGHTS)
        with pytest.raises(TrustError, match="before authorize"):
            core.iter_resource("w0", WEIGHTS)
        with pytest.raises(TrustError, match="before authorize"):
            core.verify_resources()


# ----------------------------------------------------------------------- resource rejections


def test_kind_mismatch(tmp_path: Path, make_core: MakeCore, trust: TrustStore, namespace: str, core_key: bytes) -> None:
    with CoreFile.open(make_core(tmp_path / "x.core"), trust, core_key=core_key) as core:
        core.authorize(namespace)
        with pytest.raises(
            CoreFormatError, match="declared as RESOURCE_KIND_WEIGHTS but is used as RESOURCE_KIND_MODULE"
        ):
            core.read_resource("w0", expected_kind=MODULE)
        with pytest.raises(CoreFormatError, match="declared as RESOURCE_KIND_WEIGHTS"):
            core.iter_resource("w0", MODULE)


def test_unknown_resource_id(
    tmp_path: Path, make_core: MakeCore, trust: TrustStore, namespace: str, core_key: bytes
) -> None:
    with CoreFile.open(make_core(tmp_path / "x.core"), trust, core_key=core_key) as core:
        core.authorize(namespace)
        with pytest.raises(CoreFormatError, match="no resource 'w9'"):
            core.read_resource("w9", WEIGHTS)


def test_read_after_close(
    tmp_path: Path, make_core: MakeCore, trust: TrustStore, namespace: str, core_key: bytes
) -> None:
    core = CoreFile.open(make_core(tmp_path / "x.core"), trust, core_key=core_key)
    core.authorize(namespace)
    core.close()
    core.close()
    with pytest.raises(CoreFormatError, match="is closed"):
        core.read_resource("w0", WEIGHTS)


def _tweak_resource(
    tmp_path: Path, craft_core: CraftCore, change: Callable[[container_pb2.ExecutableResource], None]
) -> Path:
    res, stored = frame_resource("w0", b"abc" * 100)
    change(res)
    return craft_core(tmp_path / "x.core", [res], [("w0", stored)])


@pytest.mark.parametrize("chunk_nbytes", [0, 1024 * 1024, 4194303, 4194305, 8 * 1024 * 1024])
def test_chunk_nbytes_must_be_4mib(tmp_path: Path, craft_core: CraftCore, trust: TrustStore, chunk_nbytes: int) -> None:
    def change(res: container_pb2.ExecutableResource) -> None:
        res.chunk_nbytes = chunk_nbytes

    path = _tweak_resource(tmp_path, craft_core, change)
    with pytest.raises(CoreFormatError, match=f"chunk_nbytes {chunk_nbytes}; it must be 4194304"):
        CoreFile.open(path, trust)


@pytest.mark.parametrize("digests", [[], [bytes(32)] * 2])
def test_chunk_digest_count_must_match(
    tmp_path: Path, craft_core: CraftCore, trust: TrustStore, digests: list[bytes]
) -> None:
    def change(res: container_pb2.ExecutableResource) -> None:
        del res.chunk_sha256[:]
        res.chunk_sha256.extend(digests)

    path = _tweak_resource(tmp_path, craft_core, change)
    with pytest.raises(CoreFormatError, match=f"has {len(digests)} chunk digests for .* expected 1"):
        CoreFile.open(path, trust)


def test_chunk_digest_must_be_sha256_sized(tmp_path: Path, craft_core: CraftCore, trust: TrustStore) -> None:
    def change(res: container_pb2.ExecutableResource) -> None:
        res.chunk_sha256[0] = res.chunk_sha256[0][:31]

    with pytest.raises(CoreFormatError, match="not 32 bytes"):
        CoreFile.open(_tweak_resource(tmp_path, craft_core, change), trust)


@pytest.mark.parametrize("kind", [0, 99])
def test_unknown_kind(tmp_path: Path, craft_core: CraftCore, trust: TrustStore, kind: int) -> None:
    def change(res: container_pb2.ExecutableResource) -> None:
        res.kind = kind  # type: ignore[assignment]

    with pytest.raises(CoreFormatError, match=f"has kind {kind}"):
        CoreFile.open(_tweak_resource(tmp_path, craft_core, change), trust)


def test_sealing_on_a_frame_resource(tmp_path: Path, craft_core: CraftCore, trust: TrustStore) -> None:
    def change(res: container_pb2.ExecutableResource) -> None:
        res.sealed.plain_chunk_nbytes = 1024

    with pytest.raises(CoreFormatError, match="only ProtectedIndex 4 uses"):
        CoreFile.open(_tweak_resource(tmp_path, craft_core, change), trust)


def test_duplicate_and_empty_resource_ids(tmp_path: Path, craft_core: CraftCore, trust: TrustStore) -> None:
    res, stored = frame_resource("w0", b"abc")
    path = craft_core(tmp_path / "a.core", [res, res], [("w0", stored)])
    with pytest.raises(CoreFormatError, match="'w0' appears twice"):
        CoreFile.open(path, trust)
    empty, stored = frame_resource("", b"abc")
    path = craft_core(tmp_path / "b.core", [empty], [("", stored)])
    with pytest.raises(CoreFormatError, match="empty id"):
        CoreFile.open(path, trust)


def test_zero_stored_bytes_is_not_a_frame(tmp_path: Path, craft_core: CraftCore, trust: TrustStore) -> None:
    path = craft_core(tmp_path / "x.core", [described("w0", b"", 0)], [("w0", b"")])
    with pytest.raises(CoreFormatError, match="no stored bytes"):
        CoreFile.open(path, trust)


def test_tampered_stored_bytes(
    tmp_path: Path, make_core: MakeCore, trust: TrustStore, namespace: str, core_key: bytes
) -> None:
    path = make_core(tmp_path / "x.core")
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x10  # inside the last resource ("tok")
    path.write_bytes(raw)
    with CoreFile.open(path, trust, core_key=core_key) as core:  # opening does not read resources
        core.authorize(namespace)
        assert core.read_resource("w0", WEIGHTS)
        with pytest.raises(IntegrityError, match="resource 'tok': stored chunk 0"):
            core.read_resource("tok", TOKENIZER)
        with pytest.raises(IntegrityError):
            core.verify_resources()


# ----------------------------------------------------- frames signed by a trusted publisher


def _signed_stored(tmp_path: Path, craft_core: CraftCore, stored: bytes, decoded_nbytes: int) -> Path:
    return craft_core(tmp_path / "x.core", [described("w0", stored, decoded_nbytes)], [("w0", stored)])


def _read_w0(path: Path, trust: TrustStore, namespace: str) -> bytes:
    with CoreFile.open(path, trust) as core:
        core.authorize(namespace)
        return bytes(core.read_resource("w0", WEIGHTS))


TEXT = b"weights " * 5000


def test_signed_truncated_frame(tmp_path: Path, craft_core: CraftCore, trust: TrustStore, namespace: str) -> None:
    path = _signed_stored(tmp_path, craft_core, encode_frame(TEXT)[:-2], len(TEXT))
    with pytest.raises(CoreFormatError, match="truncated zstd frame"):
        _read_w0(path, trust, namespace)


def test_signed_second_frame(tmp_path: Path, craft_core: CraftCore, trust: TrustStore, namespace: str) -> None:
    path = _signed_stored(tmp_path, craft_core, encode_frame(TEXT) * 2, len(TEXT))
    with pytest.raises(CoreFormatError, match="after its zstd frame"):
        _read_w0(path, trust, namespace)


def test_signed_trailing_bytes(tmp_path: Path, craft_core: CraftCore, trust: TrustStore, namespace: str) -> None:
    path = _signed_stored(tmp_path, craft_core, encode_frame(TEXT) + b"\x00\x00", len(TEXT))
    with pytest.raises(CoreFormatError, match="after its zstd frame"):
        _read_w0(path, trust, namespace)


@pytest.mark.parametrize("delta", [-1, 1])
def test_signed_decoded_length_mismatch(
    tmp_path: Path, craft_core: CraftCore, trust: TrustStore, delta: int, namespace: str
) -> None:
    path = _signed_stored(tmp_path, craft_core, encode_frame(TEXT), len(TEXT) + delta)
    with pytest.raises(CoreFormatError, match=f"signed decoded length is {len(TEXT) + delta}"):
        _read_w0(path, trust, namespace)


def test_signed_overshoot_without_content_size(
    tmp_path: Path, craft_core: CraftCore, trust: TrustStore, namespace: str
) -> None:
    frame = zstandard.ZstdCompressor(level=3, write_content_size=False).compress(TEXT)
    path = _signed_stored(tmp_path, craft_core, frame, 100)
    with pytest.raises(CoreFormatError, match="more than its signed decoded length of 100 bytes"):
        _read_w0(path, trust, namespace)


def test_signed_frame_with_large_window_allocates_nothing_large(
    tmp_path: Path, craft_core: CraftCore, trust: TrustStore, namespace: str
) -> None:
    params = zstandard.ZstdCompressionParameters.from_level(3, window_log=24, write_content_size=1)
    frame = bytearray(zstandard.ZstdCompressor(compression_params=params).compress(TEXT))
    # zstd shrinks the window to the small input; declare a 16 MiB window and a 256 MiB content size.
    header_nbytes = 6  # magic, descriptor (single segment, 2-byte content size) ...
    assert frame[4] & 0x20 and frame[4] >> 6 == 1
    declared = 256 * 1024 * 1024
    patched = b"\x28\xb5\x2f\xfd" + bytes([0x80 | (frame[4] & 0x04), 14 << 3]) + declared.to_bytes(4, "little")
    stored = patched + bytes(frame[header_nbytes + 1 :])
    assert zstandard.get_frame_parameters(stored).window_size == 16 * 1024 * 1024
    path = _signed_stored(tmp_path, craft_core, stored, declared)
    with CoreFile.open(path, trust) as core:
        core.authorize(namespace)
        tracemalloc.start()
        try:
            with pytest.raises(CoreFormatError, match="needs a 16777216-byte window, over the 8388608-byte limit"):
                core.read_resource("w0", WEIGHTS)
            with pytest.raises(CoreFormatError, match="window"):
                list(core.iter_resource("w0", WEIGHTS))
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < 1024 * 1024  # neither the 256 MiB output nor anything window-sized


# ------------------------------------------------------------------------- logical-v4 cores


def test_v4_without_core_key_opens_but_cannot_read(
    tmp_path: Path, make_core: MakeCore, trust: TrustStore, namespace: str
) -> None:
    with CoreFile.open(make_core(tmp_path / "x.core", "logical-v4"), trust) as core:
        assert core.contract.served_name == "served-model"
        assert core.resources["w0"].HasField("sealed")
        core.authorize(namespace)
        with pytest.raises(TrustError, match="a core key is needed"):
            core.read_resource("w0", WEIGHTS)
        with pytest.raises(TrustError, match="a core key is needed"):
            core.verify_resources()


def test_v4_wrong_core_key(tmp_path: Path, make_core: MakeCore, trust: TrustStore, namespace: str) -> None:
    with CoreFile.open(make_core(tmp_path / "x.core", "logical-v4"), trust, core_key=bytes(32)) as core:
        core.authorize(namespace)
        with pytest.raises(IntegrityError, match="core key is wrong"):
            core.read_resource("w0", WEIGHTS)


def test_core_key_of_wrong_length(tmp_path: Path, make_core: MakeCore, trust: TrustStore) -> None:
    with pytest.raises(TrustError, match="exactly 32 bytes"):
        CoreFile.open(make_core(tmp_path / "x.core", "logical-v4"), trust, core_key=bytes(16))


def _v4_resource(
    data: bytes, core_key: bytes, nonce: bytes = b"\x00" * 7 + b"\x01"
) -> tuple[container_pb2.ExecutableResource, bytes]:
    return encode_resource(
        ResourceInput("w0", WEIGHTS, data), layout="logical-v4", core_key=core_key, nonce_prefix=nonce
    )


def test_v4_resource_without_sealing(tmp_path: Path, craft_core: CraftCore, trust: TrustStore, core_key: bytes) -> None:
    res, stored = _v4_resource(b"abc", core_key)
    res.ClearField("sealed")
    path = craft_core(tmp_path / "x.core", [res], [("w0", stored)], layout="logical-v4")
    with pytest.raises(CoreFormatError, match="no sealing parameters"):
        CoreFile.open(path, trust, core_key=core_key)


def test_v4_stored_length_must_match_sealing(
    tmp_path: Path, craft_core: CraftCore, trust: TrustStore, core_key: bytes
) -> None:
    res, stored = _v4_resource(b"abc", core_key)
    res.decoded_nbytes = 4
    path = craft_core(tmp_path / "x.core", [res], [("w0", stored)], layout="logical-v4")
    with pytest.raises(CoreFormatError, match="stores 19 bytes, but 4 bytes sealed in 1048576-byte chunks take 20"):
        CoreFile.open(path, trust, core_key=core_key)


def test_v4_bad_nonce_prefix(tmp_path: Path, craft_core: CraftCore, trust: TrustStore, core_key: bytes) -> None:
    res, stored = _v4_resource(b"abc", core_key)
    res.sealed.nonce_prefix = b"\x01" * 4
    path = craft_core(tmp_path / "x.core", [res], [("w0", stored)], layout="logical-v4")
    with pytest.raises(CoreFormatError, match="4-byte nonce prefix"):
        CoreFile.open(path, trust, core_key=core_key)


def test_v4_reused_nonce_prefix(tmp_path: Path, craft_core: CraftCore, trust: TrustStore, core_key: bytes) -> None:
    first, first_stored = _v4_resource(b"abc", core_key)
    second, second_stored = encode_resource(
        ResourceInput("w1", WEIGHTS, b"def"),
        layout="logical-v4",
        core_key=core_key,
        nonce_prefix=first.sealed.nonce_prefix,
    )
    path = craft_core(
        tmp_path / "x.core",
        [first, second],
        [("w0", first_stored), ("w1", second_stored)],
        layout="logical-v4",
    )
    with pytest.raises(CoreFormatError, match="reuses another resource's nonce prefix"):
        CoreFile.open(path, trust, core_key=core_key)


# --------------------------------------------------------------------------- locations


def test_relocating_a_resource_into_a_sibling_file_needs_no_resigning(
    tmp_path: Path,
    make_core: MakeCore,
    trust: TrustStore,
    resources: list[ResourceInput],
    namespace: str,
    split_core: SplitCore,
) -> None:
    path = make_core(tmp_path / "x.core")
    raw = path.read_bytes()
    core_body, _ = split_core(raw)
    signed_before = core_body.payload.SerializeToString(deterministic=True)
    by_id = {loc.resource_id: raw[loc.offset : loc.offset + loc.length] for loc in core_body.locations.locations}
    # Move w0 into a sibling file and rewrite only the LocationSet.
    (tmp_path / "w0.bin").write_bytes(by_id["w0"])
    kept = [rid for rid in by_id if rid != "w0"]
    core_body.locations.Clear()
    core_body.locations.locations.add(resource_id="w0", file="w0.bin", offset=0, length=len(by_id["w0"]))
    for rid in kept:
        core_body.locations.locations.add(resource_id=rid, length=len(by_id[rid]))
    for _ in range(4):  # settle the offsets against the header length
        offset = HEADER_NBYTES + len(core_body.SerializeToString())
        for location in core_body.locations.locations[1:]:
            location.offset = offset
            offset += location.length
    serialized = core_body.SerializeToString()
    assert core_body.payload.SerializeToString(deterministic=True) == signed_before
    path.write_bytes(MAGIC + struct.pack("<Q", len(serialized)) + serialized + b"".join(by_id[rid] for rid in kept))
    with CoreFile.open(path, trust) as core:
        assert read_all(core, namespace) == {r.id: r.data for r in resources}
    # Tamper with the sibling: the signed chunk hashes still cover it.
    sibling = bytearray((tmp_path / "w0.bin").read_bytes())
    sibling[len(sibling) // 2] ^= 0x01
    (tmp_path / "w0.bin").write_bytes(sibling)
    with CoreFile.open(path, trust) as core:
        core.authorize(namespace)
        assert core.read_resource("m0", MODULE)
        with pytest.raises(IntegrityError, match="resource 'w0'"):
            core.read_resource("w0", WEIGHTS)
    # And without the sibling the core is incomplete.
    (tmp_path / "w0.bin").unlink()
    with pytest.raises(CoreFormatError, match=r"sibling file .*w0\.bin' is missing"):
        CoreFile.open(path, trust)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_writer_sibling_files(
    tmp_path: Path,
    make_core: MakeCore,
    trust: TrustStore,
    resources: list[ResourceInput],
    layout: Layout,
    split_core: SplitCore,
    core_key: bytes,
    namespace: str,
) -> None:
    path = make_core(tmp_path / "x.core", layout, sibling_files={"w0": "weights.bin", "tok": "weights.bin"})
    core_body, _ = split_core(path.read_bytes())
    files = {loc.resource_id: (loc.file, loc.offset) for loc in core_body.locations.locations}
    assert files["w0"] == ("weights.bin", 0)
    assert files["tok"][0] == "weights.bin" and files["tok"][1] > 0
    assert files["m0"][0] == ""
    with CoreFile.open(path, trust, core_key=core_key) as core:
        assert read_all(core, namespace) == {r.id: r.data for r in resources}


def _edit_location(
    tmp_path: Path,
    make_core: MakeCore,
    edit_core_body: EditCoreBody,
    change: Callable[[container_pb2.LocationSet], None],
) -> Path:
    path = make_core(tmp_path / "x.core")
    edit_core_body(path, lambda body: change(body.locations))
    return path


def test_resource_without_location(
    tmp_path: Path, make_core: MakeCore, edit_core_body: EditCoreBody, trust: TrustStore
) -> None:
    def change(locs: container_pb2.LocationSet) -> None:
        del locs.locations[-1]

    path = _edit_location(tmp_path, make_core, edit_core_body, change)
    with pytest.raises(CoreFormatError, match=r"does not locate resources \['tok'\]"):
        CoreFile.open(path, trust)


def test_duplicate_location(
    tmp_path: Path, make_core: MakeCore, edit_core_body: EditCoreBody, trust: TrustStore
) -> None:
    path = _edit_location(tmp_path, make_core, edit_core_body, lambda locs: locs.locations.append(locs.locations[0]))
    with pytest.raises(CoreFormatError, match="locates resource 'w0' twice"):
        CoreFile.open(path, trust)


def test_location_of_unknown_resource(
    tmp_path: Path, make_core: MakeCore, edit_core_body: EditCoreBody, trust: TrustStore
) -> None:
    def change(locs: container_pb2.LocationSet) -> None:
        locs.locations.add(resource_id="ghost", length=1)

    path = _edit_location(tmp_path, make_core, edit_core_body, change)
    with pytest.raises(CoreFormatError, match="names resource 'ghost', which the signed description lacks"):
        CoreFile.open(path, trust)


def test_location_length_must_equal_signed_stored_length(
    tmp_path: Path, make_core: MakeCore, edit_core_body: EditCoreBody, trust: TrustStore
) -> None:
    def change(locs: container_pb2.LocationSet) -> None:
        locs.locations[2].length -= 1

    path = _edit_location(tmp_path, make_core, edit_core_body, change)
    with pytest.raises(CoreFormatError, match=r"location of resource .tok. is .* its signed stored length"):
        CoreFile.open(path, trust)


@pytest.mark.parametrize("name", ["a/b", "../x.core", "/etc/passwd", "..", ".", "sub\\w0.bin"])
def test_location_file_must_be_a_plain_sibling_name(
    tmp_path: Path, make_core: MakeCore, edit_core_body: EditCoreBody, trust: TrustStore, name: str
) -> None:
    def change(locs: container_pb2.LocationSet) -> None:
        locs.locations[0].file = name

    path = _edit_location(tmp_path, make_core, edit_core_body, change)
    with pytest.raises(CoreFormatError, match="not a plain file name"):
        CoreFile.open(path, trust)


def test_gap_between_resources(
    tmp_path: Path,
    make_core: MakeCore,
    edit_core_body: EditCoreBody,
    trust: TrustStore,
    split_core: SplitCore,
) -> None:
    path = make_core(tmp_path / "x.core")
    raw = bytearray(path.read_bytes())
    core_body, _ = split_core(bytes(raw))
    second = core_body.locations.locations[1]
    raw[second.offset : second.offset] = b"\x00"  # one byte between w0 and m0

    def change(locs: container_pb2.LocationSet) -> None:
        for location in locs.locations[1:]:
            location.offset += 1

    path.write_bytes(raw)
    edit_core_body(path, lambda body: change(body.locations))
    with pytest.raises(CoreFormatError, match=r"resource 'm0' is located at offset .* without gaps or overlaps"):
        CoreFile.open(path, trust)


def test_overlapping_resources(
    tmp_path: Path, make_core: MakeCore, edit_core_body: EditCoreBody, trust: TrustStore
) -> None:
    def change(locs: container_pb2.LocationSet) -> None:
        locs.locations[1].offset -= 1

    path = _edit_location(tmp_path, make_core, edit_core_body, change)
    with pytest.raises(CoreFormatError, match="without gaps or overlaps"):
        CoreFile.open(path, trust)


def test_location_inside_the_header(
    tmp_path: Path, make_core: MakeCore, edit_core_body: EditCoreBody, trust: TrustStore
) -> None:
    path = make_core(tmp_path / "x.core")

    def change(body: container_pb2.CoreBody) -> None:
        body.locations.locations[0].offset = 0

    edit_core_body(path, change, shift_offsets=False)
    with pytest.raises(CoreFormatError, match="resource 'w0' is located at offset 0"):
        CoreFile.open(path, trust)


@pytest.mark.parametrize("tail", [b"\x00", b"HELIOSC\x00", encode_frame(b"x")])
def test_trailing_bytes_after_the_last_resource(
    tmp_path: Path, make_core: MakeCore, trust: TrustStore, tail: bytes
) -> None:
    path = make_core(tmp_path / "x.core")
    with open(path, "ab") as handle:
        handle.write(tail)
    with pytest.raises(CoreFormatError, match=f"has {len(tail)} trailing bytes after its last resource"):
        CoreFile.open(path, trust)


def test_core_file_truncated_inside_a_resource(tmp_path: Path, make_core: MakeCore, trust: TrustStore) -> None:
    path = make_core(tmp_path / "x.core")
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(CoreFormatError, match=r"resources end at .* the file is truncated"):
        CoreFile.open(path, trust)


def test_sibling_with_trailing_bytes(tmp_path: Path, make_core: MakeCore, trust: TrustStore) -> None:
    path = make_core(tmp_path / "x.core", sibling_files={"w0": "w0.bin"})
    with open(tmp_path / "w0.bin", "ab") as handle:
        handle.write(b"\x00")
    with pytest.raises(CoreFormatError, match=r"w0\.bin' has 1 trailing bytes"):
        CoreFile.open(path, trust)


def test_sibling_that_is_a_directory(tmp_path: Path, make_core: MakeCore, trust: TrustStore) -> None:
    path = make_core(tmp_path / "x.core", sibling_files={"w0": "w0.bin"})
    (tmp_path / "w0.bin").unlink()
    (tmp_path / "w0.bin").mkdir()
    with pytest.raises(CoreFormatError, match="not a regular file"):
        CoreFile.open(path, trust)


# ------------------------------------------------------------------------------ writer inputs


def test_writer_rejects_bad_inputs(tmp_path: Path, make_core: MakeCore, core_key: bytes) -> None:
    path = tmp_path / "x.core"
    duplicate = [ResourceInput("a", WEIGHTS, b""), ResourceInput("a", WEIGHTS, b"")]
    with pytest.raises(CoreFormatError, match="used twice"):
        make_core(path, resources=duplicate)
    with pytest.raises(CoreFormatError, match="empty id"):
        make_core(path, resources=[ResourceInput("", WEIGHTS, b"")])
    with pytest.raises(CoreFormatError, match="not a ResourceKind"):
        make_core(path, resources=[ResourceInput("a", 0, b"")])
    with pytest.raises(CoreFormatError, match="not a plain file name"):
        make_core(path, sibling_files={"w0": "../w0.bin"})
    with pytest.raises(CoreFormatError, match="not written"):
        make_core(path, sibling_files={"nope": "x.bin"})
    with pytest.raises(CoreFormatError, match="the core file itself"):
        make_core(path, sibling_files={"w0": "x.core"})
    with pytest.raises(TrustError, match="pass the 32-byte core key"):
        make_core(path, "logical-v4", core_key=None)
    with pytest.raises(CoreFormatError, match="pass core_key only with layout='logical-v4'"):
        make_core(path, "payload", core_key=core_key)
    with pytest.raises(CoreFormatError, match="needs 8 fresh bytes"):
        make_core(path, "logical-v4", nonce_source=lambda n: bytes(n))
    assert not path.exists()
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------- keys


def test_key_id_is_hex_sha256_of_the_raw_public_key(signing_key: Ed25519PrivateKey) -> None:
    raw = signing_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert key_id(signing_key.public_key()) == hashlib.sha256(raw).hexdigest()
    assert len(key_id(signing_key.public_key())) == 64


def test_generate_and_load_keys(tmp_path: Path) -> None:
    paths = generate_keys(tmp_path / "keys")
    assert {name: p.name for name, p in paths.items()} == {
        "signing": "signing.pem",
        "public": "signing.pub.pem",
        "core": "core.key",
    }
    assert stat.S_IMODE(paths["signing"].stat().st_mode) == 0o600
    assert stat.S_IMODE(paths["core"].stat().st_mode) == 0o600
    private = load_private_key(paths["signing"])
    public = load_public_key(paths["public"])
    assert key_id(private.public_key()) == key_id(public)
    assert len(load_core_key(paths["core"])) == 32
    store = TrustStore.from_paths([paths["public"]])
    assert store.contains(key_id(public)) and key_id(public) in store and len(store) == 1
    assert store.key_ids == (key_id(public),)
    with pytest.raises(HeliosError, match="refusing to overwrite"):
        generate_keys(tmp_path / "keys")


def test_generated_keys_write_and_read_a_core(tmp_path: Path, make_core: MakeCore, namespace: str) -> None:
    paths = generate_keys(tmp_path / "keys")
    core_key = load_core_key(paths["core"])
    path = make_core(
        tmp_path / "x.core", "logical-v4", signing_key=load_private_key(paths["signing"]), core_key=core_key
    )
    with CoreFile.open(path, TrustStore.from_paths([paths["public"]]), core_key=core_key) as core:
        assert read_all(core, namespace)["tok"] == b'{"model": "x"}'


def test_trust_store_get_unknown(trust: TrustStore) -> None:
    with pytest.raises(TrustError, match="is not trusted"):
        trust.get("00" * 32)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (bytes(range(32)), bytes(range(32))),
        (bytes(range(32)).hex().encode(), bytes(range(32))),
        (bytes(range(32)).hex().encode() + b"\n", bytes(range(32))),
        (bytes(range(32)).hex().upper().encode(), bytes(range(32))),
        (b"\n" * 32, b"\n" * 32),
    ],
)
def test_load_core_key(tmp_path: Path, content: bytes, expected: bytes) -> None:
    path = tmp_path / "core.key"
    path.write_bytes(content)
    assert load_core_key(path) == expected


@pytest.mark.parametrize(
    "content",
    [
        b"",
        bytes(31),
        bytes(33),
        b"ab" * 31,
        b"zz" * 32,
        b"ab" * 32 + b"\n\n",
        b"ab" * 32 + b" ",
        b" " + b"ab" * 32,
    ],
)
def test_load_core_key_rejects(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "core.key"
    path.write_bytes(content)
    with pytest.raises(TrustError, match="32 raw bytes or 64 hex characters"):
        load_core_key(path)


def test_key_loading_errors(tmp_path: Path, signing_key: Ed25519PrivateKey) -> None:
    public_pem = tmp_path / "pub.pem"
    public_pem.write_bytes(
        signing_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    with pytest.raises(TrustError, match="not an unencrypted PKCS#8 PEM private key"):
        load_private_key(public_pem)
    encrypted = tmp_path / "encrypted.pem"
    encrypted.write_bytes(
        signing_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"password"),
        )
    )
    with pytest.raises(TrustError, match="not an unencrypted PKCS#8"):
        load_private_key(encrypted)
    ec_key = ec.generate_private_key(ec.SECP256R1())
    ec_private = tmp_path / "ec.pem"
    ec_private.write_bytes(
        ec_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    with pytest.raises(TrustError, match="Ed25519"):
        load_private_key(ec_private)
    ec_public = tmp_path / "ec.pub.pem"
    ec_public.write_bytes(
        ec_key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    with pytest.raises(TrustError, match="Ed25519"):
        load_public_key(ec_public)
    with pytest.raises(TrustError, match="not a PEM public key"):
        load_public_key(tmp_path / "encrypted.pem")
    with pytest.raises(TrustError, match="cannot read the public key file"):
        TrustStore.from_paths([tmp_path / "absent.pem"])
