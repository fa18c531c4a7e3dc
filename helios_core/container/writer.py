"""Writing core files: encode resources, sign the description, lay out and write the bytes.

Owns the write side of the container format (the read side is ``reader``):

* ``encode_resource`` turns one ``ResourceInput`` into its signed ``ExecutableResource`` and stored
  bytes (one zstd level-3 frame, or AES-GCM sealed chunks for ``logical-v4``);
* ``write_core`` builds the ``DeploymentBody`` (payload) or ``ModelIndex`` (logical), signs it and
  writes the file;
* ``assemble_core`` is the lowest level: it signs given body bytes and lays out given stored bytes
  without checking that they agree, which is what tests need to build malformed cores.

Layout of what is written: the header, then the resources kept in the core file in the given order,
contiguous and with nothing after them; each sibling file holds its resources contiguously from
offset 0, also in the given order. Output is deterministic for the same inputs, apart from the random
``logical-v4`` nonce prefixes (inject ``nonce_source`` for reproducible fixtures). Files are written
to a temporary name and renamed into place.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from helios_core.container.frames import (
    CHUNK_NBYTES,
    FORMAT_VERSION,
    HEADER_NBYTES,
    LAYOUTS,
    SIGNED_LAYOUTS,
    Layout,
    check_sibling_name,
    chunk_digests,
    encode_frame,
    encode_header,
)
from helios_core.container.keys import sign_envelope
from helios_core.container.limits import check_decoded_limit
from helios_core.container.sealing import (
    DEFAULT_PLAIN_CHUNK_NBYTES,
    NONCE_PREFIX_NBYTES,
    check_core_key,
    seal_resource,
)
from helios_core.errors import CoreFormatError, TrustError
from helios_core.wire import container_pb2, contract_pb2, manifest_pb2

__all__ = ["ResourceInput", "assemble_core", "encode_resource", "write_core"]

Progress = Callable[[str, int, int], None]
"""Called as ``progress(resource_id, done, total)`` after each resource, counting resources."""

_INDEX_VERSIONS: dict[Layout, int] = {"logical-v6": 6, "logical-v4": 4}
_UINT32_MAX = 2**32 - 1


@dataclass(frozen=True)
class ResourceInput:
    """One resource to store: its id, ``ResourceKind``, decoded bytes and tensor-parallel rank."""

    id: str
    kind: int
    data: bytes
    rank: int = 0


def encode_resource(
    resource: ResourceInput,
    *,
    layout: Layout,
    core_key: bytes | None = None,
    nonce_prefix: bytes | None = None,
) -> tuple[container_pb2.ExecutableResource, bytes]:
    """The signed description and the stored bytes of one resource."""
    description = container_pb2.ExecutableResource(
        id=resource.id,
        kind=resource.kind,  # type: ignore[arg-type]
        decoded_nbytes=len(resource.data),
        chunk_nbytes=CHUNK_NBYTES,
        rank=resource.rank,
    )
    if layout == "logical-v4":
        if core_key is None or nonce_prefix is None:
            raise TrustError(f"resource {resource.id!r}: a logical-v4 core needs a core key and a nonce prefix")
        stored = seal_resource(resource.data, resource_id=resource.id, core_key=core_key, nonce_prefix=nonce_prefix)
        description.sealed.plain_chunk_nbytes = DEFAULT_PLAIN_CHUNK_NBYTES
        description.sealed.nonce_prefix = nonce_prefix
    else:
        stored = encode_frame(resource.data)
    description.stored_nbytes = len(stored)
    description.chunk_sha256.extend(chunk_digests(stored))
    return description, stored


def _check_inputs(
    resources: Sequence[ResourceInput],
    layout: str,
    core_key: bytes | None,
    sibling_files: Mapping[str, str],
    core_name: str,
) -> None:
    if layout not in LAYOUTS:
        raise CoreFormatError(f"unknown core layout {layout!r}; choose one of {LAYOUTS}")
    if layout == "logical-v4":
        if core_key is None:
            raise TrustError("a logical-v4 core seals its resources: pass the 32-byte core key (core_key=)")
        check_core_key(core_key)
    elif core_key is not None:
        raise CoreFormatError(f"a {layout} core is not sealed; pass core_key only with layout='logical-v4'")
    known_kinds = set(container_pb2.ResourceKind.values()) - {container_pb2.RESOURCE_KIND_UNSPECIFIED}
    seen: set[str] = set()
    for resource in resources:
        if not resource.id:
            raise CoreFormatError("a resource has an empty id; every resource needs a unique id")
        if resource.id in seen:
            raise CoreFormatError(f"resource id {resource.id!r} is used twice; ids must be unique")
        seen.add(resource.id)
        if resource.kind not in known_kinds:
            raise CoreFormatError(f"resource {resource.id!r} has kind {resource.kind}, not a ResourceKind")
        check_decoded_limit(resource.id, resource.kind, len(resource.data))
        if not 0 <= resource.rank <= _UINT32_MAX:
            raise CoreFormatError(f"resource {resource.id!r} has rank {resource.rank}, not a uint32")
    for resource_id, file_name in sibling_files.items():
        if resource_id not in seen:
            raise CoreFormatError(f"sibling_files names resource {resource_id!r}, which is not written")
        check_sibling_name(file_name, what=f"sibling_files[{resource_id!r}]")
        if file_name == core_name:
            raise CoreFormatError(f"sibling file {file_name!r} is the core file itself")


def write_core(
    path: Path,
    *,
    namespace: str,
    contract: contract_pb2.ServingContract,
    execution: manifest_pb2.ExecutionManifest,
    resources: Sequence[ResourceInput],
    signing_key: Ed25519PrivateKey,
    layout: Layout = "payload",
    core_key: bytes | None = None,
    description: str = "",
    rebuild: container_pb2.RebuildManifest | None = None,
    weight_catalogs: Sequence[container_pb2.WeightCatalog] = (),
    sibling_files: Mapping[str, str] | None = None,
    progress: Progress | None = None,
    nonce_source: Callable[[int], bytes] = os.urandom,
) -> None:
    """Write a signed core file at ``path`` (and the sibling files ``sibling_files`` asks for).

    ``sibling_files`` maps a resource id to the sibling file name that stores it. ``progress`` is
    called as ``progress(resource_id, done, total)`` after each resource is encoded.
    """
    path = Path(path)
    siblings = dict(sibling_files or {})
    _check_inputs(resources, layout, core_key, siblings, path.name)
    described: list[container_pb2.ExecutableResource] = []
    stored: list[tuple[str, bytes]] = []
    nonce_prefixes: set[bytes] = set()
    for done, resource in enumerate(resources, start=1):
        nonce_prefix = None
        if layout == "logical-v4":
            nonce_prefix = nonce_source(NONCE_PREFIX_NBYTES)
            if len(nonce_prefix) != NONCE_PREFIX_NBYTES or nonce_prefix in nonce_prefixes:
                raise CoreFormatError(
                    f"nonce_source gave {nonce_prefix.hex()!r} for resource {resource.id!r}; each resource "
                    f"needs {NONCE_PREFIX_NBYTES} fresh bytes"
                )
            nonce_prefixes.add(nonce_prefix)
        resource_description, resource_stored = encode_resource(
            resource, layout=layout, core_key=core_key, nonce_prefix=nonce_prefix
        )
        described.append(resource_description)
        stored.append((resource.id, resource_stored))
        if progress is not None:
            progress(resource.id, done, len(resources))
    body_fields = {
        "publisher_namespace": namespace,
        "contract": contract,
        "execution": execution,
        "resources": described,
        "rebuild": rebuild,
        "weight_catalogs": list(weight_catalogs),
        "description": description,
        "layout": SIGNED_LAYOUTS[layout],
    }
    body = (
        container_pb2.DeploymentBody(**body_fields)  # type: ignore[arg-type]
        if layout == "payload"
        else container_pb2.ModelIndex(**body_fields)  # type: ignore[arg-type]
    )
    assemble_core(
        path,
        layout=layout,
        signed_body=body.SerializeToString(deterministic=True),
        stored=stored,
        signing_keys=[signing_key],
        sibling_files=siblings,
    )


def assemble_core(
    path: Path,
    *,
    layout: Layout,
    signed_body: bytes,
    stored: Sequence[tuple[str, bytes]],
    signing_keys: Sequence[Ed25519PrivateKey],
    sibling_files: Mapping[str, str] | None = None,
    format_version: int = FORMAT_VERSION,
) -> None:
    """Sign ``signed_body`` and write it with ``stored`` ((resource id, stored bytes) in order).

    Does not check that the stored bytes match the body's commitments; ``write_core`` is the safe
    entry point.
    """
    path = Path(path)
    siblings = dict(sibling_files or {})
    envelope = sign_envelope(signed_body, signing_keys)
    core_body = container_pb2.CoreBody(format_version=format_version)
    if layout == "payload":
        core_body.payload.CopyFrom(envelope)
    else:
        core_body.protected_index.version = _INDEX_VERSIONS[layout]
        core_body.protected_index.index.CopyFrom(envelope)

    in_core = [(rid, data) for rid, data in stored if rid not in siblings]
    by_sibling: dict[str, list[tuple[str, bytes]]] = {}
    for rid, data in stored:
        if rid in siblings:
            by_sibling.setdefault(siblings[rid], []).append((rid, data))

    sibling_locations: list[container_pb2.ResourceLocation] = []
    for file_name, entries in by_sibling.items():
        offset = 0
        for rid, data in entries:
            sibling_locations.append(
                container_pb2.ResourceLocation(resource_id=rid, file=file_name, offset=offset, length=len(data))
            )
            offset += len(data)

    # The core-file offsets depend on the header length, which depends on the offsets' varint
    # lengths: iterate to the (least) fixed point; the length only grows, so this ends quickly.
    header_end = HEADER_NBYTES
    for _ in range(16):
        core_body.locations.Clear()
        offset = header_end
        for rid, data in in_core:
            core_body.locations.locations.append(
                container_pb2.ResourceLocation(resource_id=rid, offset=offset, length=len(data))
            )
            offset += len(data)
        core_body.locations.locations.extend(sibling_locations)
        body_bytes = core_body.SerializeToString(deterministic=True)
        if HEADER_NBYTES + len(body_bytes) == header_end:
            break
        header_end = HEADER_NBYTES + len(body_bytes)
    else:
        raise CoreFormatError("the core header length did not settle; this is a bug, please report it")

    for file_name, entries in by_sibling.items():
        _write_atomically(path.with_name(file_name), [data for _, data in entries])
    _write_atomically(path, [encode_header(body_bytes), body_bytes, *(data for _, data in in_core)])


def _write_atomically(path: Path, parts: Sequence[bytes]) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as handle:
            for part in parts:
                handle.write(part)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
