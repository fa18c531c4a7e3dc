"""Reading core files: ``CoreFile`` verifies, parses and streams one core's resources.

Owns the read side of the container format (the write side is ``writer``). ``CoreFile.open``:

1. reads the header: the magic, the body length (capped before anything is allocated) and the
   ``CoreBody``; ``format_version`` must be 2;
2. verifies the signed envelope (payload, or ProtectedIndex 4 or 6) with the operator's trust store,
   and only then parses the signed ``DeploymentBody`` or ``ModelIndex``;
3. checks every resource's commitments (4 MiB chunks, digest count, sealing parameters), the
   decoded-length limit of its kind (``limits``: tokenizer, chat template and module are read into
   memory whole, so an over-limit one is refused before any byte of it is read), and the unsigned
   ``LocationSet``: one location per resource, lengths equal to the signed stored lengths, plain
   sibling file names, and every file (the core after its header, and each sibling file from
   offset 0) exactly tiled by its resources, so no byte is unaccounted for.

Resource bytes are read only after ``authorize`` accepted the signed publisher namespace. Reading
streams the stored bytes through ``frames.StoredChunkReader`` (each 4 MiB slice is checked against its
signed SHA-256 before it is decoded) into ``frames.FrameDecoder`` or ``sealing.SealedDecoder``.
"""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import Final

from google.protobuf.message import DecodeError

from helios_core.container.frames import (
    CHUNK_NBYTES,
    FORMAT_VERSION,
    HEADER_NBYTES,
    MAGIC,
    MAX_BODY_NBYTES,
    SIGNED_LAYOUTS,
    FrameDecoder,
    Layout,
    ResourceDecoder,
    StoredChunkReader,
    check_sibling_name,
    chunk_count,
    read_at,
)
from helios_core.container.keys import StrPath, TrustStore, verify_envelope
from helios_core.container.limits import check_decoded_limit
from helios_core.container.sealing import (
    SealedDecoder,
    check_core_key,
    check_sealing_parameters,
    sealed_nbytes,
)
from helios_core.errors import CoreFormatError, TrustError
from helios_core.wire import container_pb2, contract_pb2, manifest_pb2

__all__ = ["CoreFile"]

_PIECE_NBYTES: Final = 1024 * 1024
"""Size of the pieces ``iter_resource`` yields and ``verify_resources`` decodes into."""
_LAYOUT_OF_INDEX_VERSION: Final[Mapping[int, Layout]] = {6: "logical-v6", 4: "logical-v4"}
_KNOWN_KINDS: Final = frozenset(container_pb2.ResourceKind.values()) - {container_pb2.RESOURCE_KIND_UNSPECIFIED}

SignedBody = container_pb2.DeploymentBody | container_pb2.ModelIndex


def _kind_name(kind: int) -> str:
    try:
        return container_pb2.ResourceKind.Name(kind)
    except ValueError:
        return str(kind)


class CoreFile:
    """One opened, signature-verified core file. Use ``CoreFile.open``; close it (or use ``with``)."""

    layout: Layout
    format_version: int
    publisher_namespace: str
    signer_key_ids: tuple[str, ...]
    contract: contract_pb2.ServingContract
    execution: manifest_pb2.ExecutionManifest
    resources: Mapping[str, container_pb2.ExecutableResource]
    description: str
    rebuild: container_pb2.RebuildManifest | None
    weight_catalogs: tuple[container_pb2.WeightCatalog, ...]

    def __init__(
        self,
        *,
        path: Path,
        fd: int,
        layout: Layout,
        signer_key_ids: tuple[str, ...],
        body: SignedBody,
        locations: Mapping[str, container_pb2.ResourceLocation],
        core_key: bytes | None,
    ) -> None:
        self.path = path
        self._fd: int | None = fd
        self.layout = layout
        self.format_version = FORMAT_VERSION
        self.publisher_namespace = body.publisher_namespace
        self.signer_key_ids = signer_key_ids
        self.contract = body.contract
        self.execution = body.execution
        self.resources = MappingProxyType({resource.id: resource for resource in body.resources})
        self.description = body.description
        self.rebuild = body.rebuild if body.HasField("rebuild") else None
        self.weight_catalogs = tuple(body.weight_catalogs)
        self._locations = locations
        self._core_key = core_key
        self._authorized = False

    # ----------------------------------------------------------------------------------- opening

    @classmethod
    def open(cls, path: StrPath, trust: TrustStore, core_key: bytes | None = None) -> CoreFile:
        """Open ``path``, verify its signature with ``trust`` and parse its description.

        Reads the header only; resources are read later, after ``authorize``. ``core_key`` is the
        operator's 32-byte key for ProtectedIndex 4 cores.
        """
        path = Path(path)
        if core_key is not None:
            check_core_key(core_key)
        fd = open_regular_file(path, "core file")
        try:
            core_body, header_end, file_nbytes = _read_core_body(fd, path)
            layout, envelope = _select_body(core_body)
            what = "payload" if layout == "payload" else "protected index"
            signer_key_ids = verify_envelope(envelope, trust, what=what)
            body = _parse_signed_body(envelope.signed_bytes, layout)
            _check_resources(body, layout)
            locations = _check_locations(core_body.locations, body, path, header_end, file_nbytes)
            return cls(
                path=path,
                fd=fd,
                layout=layout,
                signer_key_ids=signer_key_ids,
                body=body,
                locations=locations,
                core_key=core_key,
            )
        except BaseException:
            os.close(fd)
            raise

    # ------------------------------------------------------------------------------------- trust

    def authorize(self, acceptance: str) -> None:
        """Accept the core: ``acceptance`` must equal the signed publisher namespace exactly."""
        if not isinstance(acceptance, str) or acceptance != self.publisher_namespace:
            raise TrustError(
                f"acceptance {acceptance!r} does not equal this core's signed publisher namespace "
                f"{self.publisher_namespace!r} (compared exactly: case and whitespace count). Review the "
                "publisher's terms and pass that namespace as the acceptance string to accept them"
            )
        self._authorized = True

    # ----------------------------------------------------------------------------------- reading

    def read_resource(self, resource_id: str, expected_kind: int) -> bytearray:
        """The whole decoded resource in one buffer of its signed decoded length.

        A capped kind (tokenizer, chat template, module) is checked against its limit before the
        buffer is allocated; decoding never writes past the signed length.
        """
        decoded: list[bytearray] = []

        def allocate(nbytes: int) -> memoryview:
            decoded.append(bytearray(nbytes))
            return memoryview(decoded[0])

        self.read_resource_into(resource_id, expected_kind, allocate)
        return decoded[0]

    def read_resource_into(self, resource_id: str, expected_kind: int, allocate: Callable[[int], memoryview]) -> None:
        """Decode the whole resource into the buffer ``allocate(decoded_nbytes)`` returns.

        The same checks as :meth:`read_resource`: ``allocate`` is called once, only after the limit of a
        capped kind and the resource's frame header were checked, and must return a writable buffer of
        exactly that many bytes. It may be uninitialized memory: every byte of it is written, or an error is
        raised and its contents mean nothing. Safe to call from several threads at once on one open core.
        """
        resource = self._readable(resource_id, expected_kind)
        check_decoded_limit(resource.id, resource.kind, resource.decoded_nbytes)
        with _OpenedSource(self, resource) as stored:
            decoder = self._decoder(resource, stored)  # checks the frame header before anything is allocated
            view = memoryview(allocate(resource.decoded_nbytes)).cast("B")
            if view.readonly or len(view) != resource.decoded_nbytes:
                raise ValueError(
                    f"resource {resource.id!r} decodes to {resource.decoded_nbytes} bytes; the buffer allocated "
                    f"holds {len(view)}{' and is read-only' if view.readonly else ''}"
                )
            filled = 0
            while filled < len(view):
                produced = decoder.readinto(view[filled:])
                if produced == 0:
                    break
                filled += produced
            decoder.finish()

    def iter_resource(self, resource_id: str, expected_kind: int) -> Iterator[memoryview]:
        """The decoded resource in pieces of at most 1 MiB, each a fresh buffer.

        Everything is checked as it streams: a piece is only yielded once its stored bytes matched
        their signed digests, and the iterator raises at the end if the resource is malformed.
        """
        resource = self._readable(resource_id, expected_kind)
        return self._pieces(resource, reuse=False)

    def verify_resources(self, progress: Callable[[str, int, int], None] | None = None) -> None:
        """Decode every resource, checking all commitments and lengths, and discard the output.

        ``progress`` is called as ``progress(resource_id, done, total)`` after each resource.
        """
        total = len(self.resources)
        for done, resource in enumerate(self.resources.values(), start=1):
            self._readable(resource.id, resource.kind)
            for _ in self._pieces(resource, reuse=True):
                pass
            if progress is not None:
                progress(resource.id, done, total)

    def _pieces(self, resource: container_pb2.ExecutableResource, *, reuse: bool) -> Iterator[memoryview]:
        with _OpenedSource(self, resource) as stored:
            decoder = self._decoder(resource, stored)
            scratch = bytearray(min(_PIECE_NBYTES, resource.decoded_nbytes)) if reuse else None
            left = resource.decoded_nbytes
            while left:
                piece = memoryview(scratch if scratch is not None else bytearray(min(_PIECE_NBYTES, left)))
                produced = decoder.readinto(piece)
                if produced == 0:
                    break
                left -= produced
                yield piece[:produced]
            decoder.finish()

    def _readable(self, resource_id: str, expected_kind: int) -> container_pb2.ExecutableResource:
        if self._fd is None:
            raise CoreFormatError(f"core file {str(self.path)!r} is closed; open it again to read resources")
        if not self._authorized:
            raise TrustError(
                f"resource {resource_id!r} was read before authorize(); accept the core by passing its "
                f"publisher namespace {self.publisher_namespace!r} to authorize() first"
            )
        resource = self.resources.get(resource_id)
        if resource is None:
            raise CoreFormatError(f"this core has no resource {resource_id!r}; it has {sorted(self.resources)[:20]}")
        if resource.kind != expected_kind:
            raise CoreFormatError(
                f"resource {resource_id!r} is declared as {_kind_name(resource.kind)} but is used as "
                f"{_kind_name(expected_kind)}; the execution manifest and the resource disagree"
            )
        if self.layout == "logical-v4" and self._core_key is None:
            raise TrustError(
                f"resource {resource_id!r} is sealed (ProtectedIndex 4): a core key is needed to read it; "
                "open the core with the operator's core key file (32 raw bytes or 64 hex characters)"
            )
        return resource

    def _decoder(self, resource: container_pb2.ExecutableResource, stored: StoredChunkReader) -> ResourceDecoder:
        if self.layout == "logical-v4":
            if self._core_key is None:  # _readable already refused; kept for the type checker
                raise TrustError(f"resource {resource.id!r} is sealed: a core key is needed to read it")
            return SealedDecoder(
                stored,
                resource_id=resource.id,
                core_key=self._core_key,
                decoded_nbytes=resource.decoded_nbytes,
                plain_chunk_nbytes=resource.sealed.plain_chunk_nbytes,
                nonce_prefix=resource.sealed.nonce_prefix,
            )
        return FrameDecoder(stored, resource.decoded_nbytes, what=f"resource {resource.id!r}")

    # ------------------------------------------------------------------------------- lifetime

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> CoreFile:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"CoreFile({str(self.path)!r}, layout={self.layout!r}, namespace={self.publisher_namespace!r}, "
            f"resources={len(self.resources)})"
        )


def open_regular_file(path: Path, what: str, hint: str = "") -> int:
    """A read-only descriptor of the regular file ``path``, or a CoreFormatError naming ``what`` and why it
    cannot be read (missing, unreadable, a directory, a FIFO or device: opened without blocking, then
    refused, so a FIFO never hangs the reader)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise CoreFormatError(f"cannot open {what} {str(path)!r}: {exc.strerror or exc}{hint}") from exc
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise CoreFormatError(f"cannot open {what} {str(path)!r}: it is {kind}{hint}")
    if hasattr(os, "set_blocking"):
        os.set_blocking(fd, True)
    return fd


class _OpenedSource:
    """The verified stored bytes of one resource, with its sibling file open while in use."""

    def __init__(self, core: CoreFile, resource: container_pb2.ExecutableResource) -> None:
        self._core = core
        self._resource = resource
        self._sibling_fd: int | None = None

    def __enter__(self) -> StoredChunkReader:
        location = self._core._locations[self._resource.id]
        fd = self._core._fd
        if location.file:
            sibling = self._core.path.with_name(location.file)
            fd = self._sibling_fd = open_regular_file(
                sibling, f"sibling file of resource {self._resource.id!r}", hint="; keep sibling files next to the core"
            )
        if fd is None:
            raise CoreFormatError(f"core file {str(self._core.path)!r} is closed")
        return StoredChunkReader(
            fd,
            location.offset,
            location.length,
            list(self._resource.chunk_sha256),
            what=f"resource {self._resource.id!r}",
        )

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._sibling_fd is not None:
            os.close(self._sibling_fd)
            self._sibling_fd = None


# ------------------------------------------------------------------------------ header checks


def _read_core_body(fd: int, path: Path) -> tuple[container_pb2.CoreBody, int, int]:
    """The CoreBody, the offset just after it and the file size."""
    file_nbytes = os.fstat(fd).st_size
    header = read_at(fd, HEADER_NBYTES, 0)
    if len(header) < HEADER_NBYTES:
        raise CoreFormatError(
            f"{str(path)!r} is {file_nbytes} bytes, too short to be a Helios core (the header alone is "
            f"{HEADER_NBYTES} bytes)"
        )
    if header[: len(MAGIC)] != MAGIC:
        raise CoreFormatError(
            f"{str(path)!r} is not a Helios core: it starts with {header[: len(MAGIC)]!r}, not {MAGIC!r}"
        )
    (body_nbytes,) = struct.unpack_from("<Q", header, len(MAGIC))
    if body_nbytes > MAX_BODY_NBYTES:
        raise CoreFormatError(
            f"{str(path)!r} declares a {body_nbytes}-byte CoreBody, over the {MAX_BODY_NBYTES}-byte limit; "
            "the file is damaged or not a Helios core"
        )
    if HEADER_NBYTES + body_nbytes > file_nbytes:
        raise CoreFormatError(
            f"{str(path)!r} is truncated: its header declares a {body_nbytes}-byte CoreBody but only "
            f"{max(file_nbytes - HEADER_NBYTES, 0)} bytes follow"
        )
    data = read_at(fd, body_nbytes, HEADER_NBYTES)
    if len(data) != body_nbytes:
        raise CoreFormatError(f"{str(path)!r} changed size while it was read")
    core_body = container_pb2.CoreBody()
    try:
        core_body.ParseFromString(data)
    except DecodeError as exc:
        raise CoreFormatError(f"{str(path)!r} has a malformed CoreBody ({exc}); the file is damaged") from exc
    if core_body.format_version != FORMAT_VERSION:
        raise CoreFormatError(
            f"{str(path)!r} has container format version {core_body.format_version}; this runtime reads "
            f"format version {FORMAT_VERSION} only. Re-export the core or use a matching Helios"
        )
    return core_body, HEADER_NBYTES + body_nbytes, file_nbytes


def _select_body(core_body: container_pb2.CoreBody) -> tuple[Layout, container_pb2.SignedEnvelope]:
    which = core_body.WhichOneof("body")
    if which == "payload":
        return "payload", core_body.payload
    if which == "protected_index":
        index = core_body.protected_index
        layout = _LAYOUT_OF_INDEX_VERSION.get(index.version)
        if layout is None:
            raise CoreFormatError(
                f"the core has ProtectedIndex version {index.version}; this runtime reads versions 4 and 6"
            )
        if not index.HasField("index"):
            raise CoreFormatError("the core's ProtectedIndex has no signed index")
        return layout, index.index
    raise CoreFormatError("the CoreBody has neither a payload nor a protected index; the file is damaged")


def _parse_signed_body(signed_bytes: bytes, layout: Layout, *, verified: bool = True) -> SignedBody:
    """The signed description; ``verified`` says its signature was checked, so a body that does not parse
    was signed that way (the publisher's fault) rather than, possibly, damaged after signing."""
    body: SignedBody = container_pb2.DeploymentBody() if layout == "payload" else container_pb2.ModelIndex()
    try:
        body.ParseFromString(signed_bytes)
    except DecodeError as exc:
        cause = (
            "the publisher wrote a malformed core"
            if verified
            else "its signature was not checked, so it may have been damaged after signing (pass --trust-key to check)"
        )
        raise CoreFormatError(f"the signed {type(body).__name__} does not parse ({exc}); {cause}") from exc
    if body.layout != SIGNED_LAYOUTS[layout]:
        raise CoreFormatError(
            f"the signed description was written for layout {body.layout} but is stored as a {layout} core; "
            "the container was re-wrapped or damaged"
        )
    return body


def _check_resources(body: SignedBody, layout: Layout) -> None:
    seen: set[str] = set()
    nonce_prefixes: set[bytes] = set()
    for resource in body.resources:
        what = f"resource {resource.id!r}"
        if not resource.id:
            raise CoreFormatError("a signed resource has an empty id")
        if resource.id in seen:
            raise CoreFormatError(f"resource id {resource.id!r} appears twice in the signed description")
        seen.add(resource.id)
        if resource.kind not in _KNOWN_KINDS:
            raise CoreFormatError(f"{what} has kind {resource.kind}, which this runtime does not know")
        check_decoded_limit(resource.id, resource.kind, resource.decoded_nbytes)
        if resource.chunk_nbytes != CHUNK_NBYTES:
            raise CoreFormatError(f"{what} has chunk_nbytes {resource.chunk_nbytes}; it must be {CHUNK_NBYTES} (4 MiB)")
        expected_chunks = chunk_count(resource.stored_nbytes)
        if len(resource.chunk_sha256) != expected_chunks:
            raise CoreFormatError(
                f"{what} has {len(resource.chunk_sha256)} chunk digests for {resource.stored_nbytes} stored "
                f"bytes; expected {expected_chunks}"
            )
        if any(len(digest) != 32 for digest in resource.chunk_sha256):
            raise CoreFormatError(f"{what} has a chunk digest that is not 32 bytes (SHA-256)")
        if layout == "logical-v4":
            _check_sealing(resource, what, nonce_prefixes)
        else:
            if resource.HasField("sealed"):
                raise CoreFormatError(f"{what} carries AES-GCM sealing, which only ProtectedIndex 4 uses")
            if resource.stored_nbytes == 0:
                raise CoreFormatError(f"{what} has no stored bytes; it must be one zstd frame")


def _check_sealing(resource: container_pb2.ExecutableResource, what: str, nonce_prefixes: set[bytes]) -> None:
    if not resource.HasField("sealed"):
        raise CoreFormatError(f"{what} has no sealing parameters; every ProtectedIndex 4 resource needs them")
    sealed = resource.sealed
    check_sealing_parameters(resource.decoded_nbytes, sealed.plain_chunk_nbytes, sealed.nonce_prefix, what=what)
    if sealed.nonce_prefix in nonce_prefixes:
        raise CoreFormatError(f"{what} reuses another resource's nonce prefix; the core is unsafe to read")
    nonce_prefixes.add(sealed.nonce_prefix)
    expected = sealed_nbytes(resource.decoded_nbytes, sealed.plain_chunk_nbytes)
    if resource.stored_nbytes != expected:
        raise CoreFormatError(
            f"{what} stores {resource.stored_nbytes} bytes, but {resource.decoded_nbytes} bytes sealed in "
            f"{sealed.plain_chunk_nbytes}-byte chunks take {expected}"
        )


def _check_locations(
    location_set: container_pb2.LocationSet,
    body: SignedBody,
    path: Path,
    header_end: int,
    file_nbytes: int,
) -> Mapping[str, container_pb2.ResourceLocation]:
    stored_nbytes = {resource.id: resource.stored_nbytes for resource in body.resources}
    locations: dict[str, container_pb2.ResourceLocation] = {}
    regions: dict[str, list[tuple[int, int, str]]] = {}
    for location in location_set.locations:
        rid = location.resource_id
        if rid not in stored_nbytes:
            raise CoreFormatError(f"the LocationSet names resource {rid!r}, which the signed description lacks")
        if rid in locations:
            raise CoreFormatError(f"the LocationSet locates resource {rid!r} twice")
        if location.file:
            check_sibling_name(location.file, what=f"the location of resource {rid!r}")
        if location.length != stored_nbytes[rid]:
            raise CoreFormatError(
                f"the location of resource {rid!r} is {location.length} bytes long, but its signed stored "
                f"length is {stored_nbytes[rid]}"
            )
        locations[rid] = location
        regions.setdefault(location.file, []).append((location.offset, location.length, rid))
    missing = [rid for rid in stored_nbytes if rid not in locations]
    if missing:
        raise CoreFormatError(f"the LocationSet does not locate resources {missing[:20]}; the core is incomplete")
    regions.setdefault("", [])  # the core file itself must be tiled even when it holds no resource
    for file_name, file_regions in regions.items():
        if file_name:
            sibling = path.with_name(file_name)
            try:
                info = os.stat(sibling)
            except OSError as exc:
                raise CoreFormatError(
                    f"sibling file {str(sibling)!r} is missing ({exc.strerror or exc}); keep sibling files "
                    "next to the core"
                ) from exc
            if not stat.S_ISREG(info.st_mode):
                raise CoreFormatError(f"sibling file {str(sibling)!r} is not a regular file")
            _check_tiling(str(sibling), file_regions, 0, info.st_size)
        else:
            _check_tiling(str(path), file_regions, header_end, file_nbytes)
    return MappingProxyType(locations)


def _check_tiling(name: str, regions: list[tuple[int, int, str]], start: int, file_nbytes: int) -> None:
    """The regions must cover [start, file_nbytes) exactly: no overlap, no gap, nothing after."""
    position = start
    for offset, length, rid in sorted(regions):
        if offset != position:
            raise CoreFormatError(
                f"resource {rid!r} is located at offset {offset} of {name!r}, but the previous data ends at "
                f"{position}; stored resources must follow each other without gaps or overlaps"
            )
        position += length
    if position != file_nbytes:
        if position > file_nbytes:
            raise CoreFormatError(
                f"{name!r} is {file_nbytes} bytes, but its resources end at {position}; the file is truncated"
            )
        raise CoreFormatError(
            f"{name!r} has {file_nbytes - position} trailing bytes after its last resource (ends at "
            f"{position}); the file is damaged or was appended to"
        )
