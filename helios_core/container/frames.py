"""Byte-level framing of a core file: the file header, zstd resource frames and chunk commitments.

Owns every fact about how bytes lie in a core file, independent of what they mean:

* the file header: ``MAGIC`` (8 bytes), a little-endian uint64 body length, then that many bytes of
  a serialized ``CoreBody`` (capped at ``MAX_BODY_NBYTES``);
* the layout names (``payload``, ``logical-v6``, ``logical-v4``) and sibling file names;
* chunk commitments: SHA-256 of each ``CHUNK_NBYTES`` slice of a resource's *stored* bytes, and
  ``StoredChunkReader``, which releases stored bytes only after their slice has been hashed and
  matched against the signed digest;
* zstd frames: ``encode_frame`` (exactly one level-3 frame with its content size) and
  ``FrameDecoder``, which decodes one verified frame with the window capped at
  ``MAX_WINDOW_NBYTES``, never produces more than the signed decoded length, and rejects truncated
  frames, second frames and trailing bytes. A ``FrameChecker`` walks the frame structure (header,
  block headers, checksum) over the same verified bytes, so these checks do not depend on how the
  zstd library treats the end of its input.

AES-GCM sealing lives in ``sealing``; signatures and keys in ``keys``. Change the formats here only
together with the writer, the reader and the golden fixture cores.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import IO, Final, Literal, Protocol, cast

import zstandard

from helios_core.errors import CoreFormatError, IntegrityError
from helios_core.wire import container_pb2

__all__ = [
    "CHUNK_NBYTES",
    "FORMAT_VERSION",
    "HEADER_NBYTES",
    "LAYOUTS",
    "MAGIC",
    "MAX_BODY_NBYTES",
    "MAX_WINDOW_NBYTES",
    "ZSTD_LEVEL",
    "FrameChecker",
    "FrameDecoder",
    "FrameHeader",
    "Layout",
    "ResourceDecoder",
    "StoredChunkReader",
    "check_sibling_name",
    "chunk_count",
    "chunk_digests",
    "encode_frame",
    "encode_header",
    "parse_frame_header",
    "read_at",
]

MAGIC: Final = b"HELIOSC\x00"
"""The first 8 bytes of every core file."""
HEADER_NBYTES: Final = len(MAGIC) + 8
"""Magic plus the little-endian uint64 length of the serialized ``CoreBody``."""
MAX_BODY_NBYTES: Final = 64 * 1024 * 1024
"""Largest serialized ``CoreBody`` a reader accepts; checked before anything is allocated."""
FORMAT_VERSION: Final = 2
"""The only ``CoreBody.format_version`` this runtime reads and writes."""

CHUNK_NBYTES: int = 4 * 1024 * 1024
"""Size of the stored-byte slices that ``ExecutableResource.chunk_sha256`` commits to."""
MAX_WINDOW_NBYTES: int = 8 * 1024 * 1024
"""Largest zstd window a reader accepts; bounds the decoder's memory."""
ZSTD_LEVEL: Final = 3
"""Compression level of every resource frame."""
MAX_BLOCK_NBYTES: Final = 128 * 1024
"""Largest zstd block (RFC 8878 Block_Maximum_Size)."""

Layout = Literal["payload", "logical-v6", "logical-v4"]

SIGNED_LAYOUTS: Final[Mapping[str, int]] = MappingProxyType(
    {
        "payload": container_pb2.SIGNED_LAYOUT_PAYLOAD,
        "logical-v6": container_pb2.SIGNED_LAYOUT_LOGICAL_V6,
        "logical-v4": container_pb2.SIGNED_LAYOUT_LOGICAL_V4,
    }
)
"""The signed layout value each container layout requires."""
"""How a core is laid out: a payload core, or a logical-resource core with ProtectedIndex 6 or 4."""
LAYOUTS: Final[tuple[Layout, ...]] = ("payload", "logical-v6", "logical-v4")

_ZSTD_MAGIC: Final = b"\x28\xb5\x2f\xfd"
_SHA256_NBYTES: Final = 32


def encode_header(body: bytes) -> bytes:
    """The file header (magic and length) for a serialized ``CoreBody``."""
    if len(body) > MAX_BODY_NBYTES:
        raise CoreFormatError(
            f"the CoreBody is {len(body)} bytes, over the {MAX_BODY_NBYTES}-byte limit readers accept; "
            "store large data as resources, not in the contract or manifest"
        )
    return MAGIC + struct.pack("<Q", len(body))


def check_sibling_name(name: str, *, what: str) -> None:
    """Reject a sibling file name that is not a plain file name in the core's directory."""
    if (
        not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\x00" in name
        or os.path.isabs(name)
        or (len(name) >= 2 and name[1] == ":")
    ):
        raise CoreFormatError(
            f"{what} names sibling file {name!r}, which is not a plain file name; a sibling file must "
            "lie in the core's own directory (no path separators, no '..', no absolute paths)"
        )


def chunk_count(stored_nbytes: int) -> int:
    """Number of ``CHUNK_NBYTES`` commitments for ``stored_nbytes`` stored bytes (0 when empty)."""
    return -(-stored_nbytes // CHUNK_NBYTES)


def chunk_digests(stored: bytes | bytearray | memoryview) -> list[bytes]:
    """SHA-256 of each ``CHUNK_NBYTES`` slice of ``stored``, in order."""
    view = memoryview(stored).cast("B")
    return [hashlib.sha256(view[start : start + CHUNK_NBYTES]).digest() for start in range(0, len(view), CHUNK_NBYTES)]


def encode_frame(data: bytes | memoryview) -> bytes:
    """``data`` as exactly one zstd level-3 frame with its content size and a checksum."""
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True, write_checksum=True)
    frame: bytes = compressor.compress(data)
    header = parse_frame_header(frame[:18], what="a newly encoded frame")
    if header is None or header.window_nbytes > MAX_WINDOW_NBYTES:
        raise CoreFormatError(
            "zstd produced a frame that readers would reject (window over "
            f"{MAX_WINDOW_NBYTES} bytes); this is a bug in the zstd build, report it"
        )
    return frame


@dataclass(frozen=True)
class FrameHeader:
    """The parsed header of a zstd frame (RFC 8878 §3.1.1.1)."""

    header_nbytes: int
    window_nbytes: int
    content_nbytes: int | None
    has_checksum: bool
    dictionary_id: int


def parse_frame_header(data: bytes | bytearray | memoryview, *, what: str) -> FrameHeader | None:
    """Parse the zstd frame header at the start of ``data``; None when more bytes are needed."""
    view = bytes(data[:18])
    if len(view) < 5:
        if _ZSTD_MAGIC.startswith(view):
            return None
        raise CoreFormatError(f"{what} does not start with a zstd frame")
    if view[:4] != _ZSTD_MAGIC:
        raise CoreFormatError(
            f"{what} does not start with a zstd frame (magic {view[:4].hex()}, expected "
            f"{_ZSTD_MAGIC.hex()}); each resource must be exactly one zstd frame"
        )
    descriptor = view[4]
    fcs_flag = descriptor >> 6
    single_segment = bool(descriptor & 0x20)
    if descriptor & 0x08:
        raise CoreFormatError(f"{what} has a zstd frame header with the reserved bit set")
    has_checksum = bool(descriptor & 0x04)
    dict_nbytes = (0, 1, 2, 4)[descriptor & 0x03]
    fcs_nbytes = (1 if single_segment else 0, 2, 4, 8)[fcs_flag]
    header_nbytes = 5 + (0 if single_segment else 1) + dict_nbytes + fcs_nbytes
    if len(view) < header_nbytes:
        return None
    pos = 5
    window_nbytes = 0
    if not single_segment:
        window_descriptor = view[pos]
        pos += 1
        window_log = 10 + (window_descriptor >> 3)
        window_base = 1 << window_log
        window_nbytes = window_base + (window_base // 8) * (window_descriptor & 0x07)
    dictionary_id = int.from_bytes(view[pos : pos + dict_nbytes], "little")
    pos += dict_nbytes
    content_nbytes: int | None = None
    if fcs_nbytes:
        content_nbytes = int.from_bytes(view[pos : pos + fcs_nbytes], "little")
        if fcs_nbytes == 2:
            content_nbytes += 256
    if single_segment:
        window_nbytes = content_nbytes or 0
    return FrameHeader(header_nbytes, window_nbytes, content_nbytes, has_checksum, dictionary_id)


class FrameChecker:
    """Walks the structure of exactly one zstd frame over bytes fed in order.

    It checks the header (window within ``MAX_WINDOW_NBYTES``, no dictionary, declared content size
    equal to the signed decoded length), each block header, the checksum, and that nothing follows
    the frame. Call ``finish`` after the last byte: a frame that has not ended is truncated.
    """

    def __init__(self, decoded_nbytes: int, *, what: str) -> None:
        self._decoded_nbytes = decoded_nbytes
        self._what = what
        self._state: Literal["header", "block_header", "block_body", "checksum", "done"] = "header"
        self._pending = bytearray()  # header or block header bytes collected so far
        self._skip = 0  # bytes left in the current block body or checksum
        self._last_block = False
        self.header: FrameHeader | None = None

    def feed(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        pos = 0
        while pos < len(view):
            if self._state == "done":
                raise CoreFormatError(
                    f"{self._what} has bytes after its zstd frame (a second frame or trailing bytes); "
                    "each resource must be exactly one frame"
                )
            if self._state in ("block_body", "checksum"):
                step = min(self._skip, len(view) - pos)
                self._skip -= step
                pos += step
                if self._skip == 0:
                    self._end_of_section()
                continue
            need = 18 if self._state == "header" else 3
            take = min(need - len(self._pending), len(view) - pos)
            self._pending += view[pos : pos + take]
            pos += take
            if self._state == "header":
                self._try_header()
            elif len(self._pending) == 3:
                self._block_header(int.from_bytes(self._pending, "little"))
                self._pending.clear()

    def _try_header(self) -> None:
        header = parse_frame_header(self._pending, what=self._what)
        if header is None:
            return
        if header.window_nbytes > MAX_WINDOW_NBYTES:
            raise CoreFormatError(
                f"{self._what} is a zstd frame that needs a {header.window_nbytes}-byte window, over the "
                f"{MAX_WINDOW_NBYTES}-byte limit; re-export the core with a current exporter"
            )
        if header.dictionary_id:
            raise CoreFormatError(
                f"{self._what} is a zstd frame that needs dictionary {header.dictionary_id}; Helios "
                "frames never use a dictionary"
            )
        if header.content_nbytes is not None and header.content_nbytes != self._decoded_nbytes:
            raise CoreFormatError(
                f"{self._what} is a zstd frame of {header.content_nbytes} decoded bytes, but its signed "
                f"decoded length is {self._decoded_nbytes}"
            )
        self.header = header
        # Bytes collected past the header belong to the first block header.
        rest = bytes(self._pending[header.header_nbytes :])
        self._pending.clear()
        self._state = "block_header"
        if rest:
            self.feed(rest)

    def _block_header(self, value: int) -> None:
        self._last_block = bool(value & 1)
        block_type = (value >> 1) & 0x03
        block_nbytes = value >> 3
        if block_type == 3:
            raise CoreFormatError(f"{self._what} has a zstd block of the reserved type")
        if block_nbytes > MAX_BLOCK_NBYTES:
            raise CoreFormatError(
                f"{self._what} has a {block_nbytes}-byte zstd block, over the {MAX_BLOCK_NBYTES}-byte limit"
            )
        self._skip = 1 if block_type == 1 else block_nbytes  # an RLE block stores one byte
        self._state = "block_body"
        if self._skip == 0:
            self._end_of_section()

    def _end_of_section(self) -> None:
        if self._state == "checksum":
            self._state = "done"
        elif not self._last_block:
            self._state = "block_header"
        elif self.header is not None and self.header.has_checksum:
            self._state, self._skip = "checksum", 4
        else:
            self._state = "done"

    def finish(self) -> None:
        if self._state != "done":
            raise CoreFormatError(
                f"{self._what} is a truncated zstd frame (it ends inside its {self._state.replace('_', ' ')})"
            )


class StoredChunkReader:
    """Reads one resource's stored bytes, releasing none before its slice matched its signed digest.

    Each ``CHUNK_NBYTES`` slice is read whole from ``fd`` at ``offset``, hashed and compared with
    ``digests``; only then are its bytes handed out. At most one slice is held at a time.
    """

    def __init__(self, fd: int, offset: int, length: int, digests: list[bytes], *, what: str) -> None:
        if len(digests) != chunk_count(length):
            raise CoreFormatError(
                f"{what} has {len(digests)} chunk digests for {length} stored bytes; expected {chunk_count(length)}"
            )
        self._fd = fd
        self._offset = offset
        self._length = length
        self._digests = digests
        self._what = what
        self._next_chunk = 0
        self._slice = memoryview(b"")
        self._pos = 0  # read position within the current slice

    @property
    def remaining(self) -> int:
        """Stored bytes not yet handed out."""
        consumed = min(self._next_chunk * CHUNK_NBYTES, self._length) - (len(self._slice) - self._pos)
        return self._length - consumed

    def _load_next_slice(self) -> None:
        index = self._next_chunk
        start = index * CHUNK_NBYTES
        nbytes = min(CHUNK_NBYTES, self._length - start)
        data = read_at(self._fd, nbytes, self._offset + start)
        if len(data) != nbytes:
            raise CoreFormatError(
                f"{self._what}: the file ends {nbytes - len(data)} bytes before its stored chunk {index} does; "
                "the core or its sibling file is truncated"
            )
        if hashlib.sha256(data).digest() != self._digests[index]:
            raise IntegrityError(
                f"{self._what}: stored chunk {index} (bytes {start}..{start + nbytes}) does not match its "
                "signed SHA-256; the core or its sibling file is damaged or was tampered with. "
                "Re-download or re-copy the core"
            )
        self._slice = memoryview(data)
        self._pos = 0
        self._next_chunk += 1

    def read(self, size: int = -1) -> bytes:
        """Up to ``size`` verified bytes (all remaining when negative); ``b""`` at the end."""
        if size < 0:
            size = self.remaining
        if size == 0:
            return b""
        if self._pos == len(self._slice):
            if self._next_chunk * CHUNK_NBYTES >= self._length:
                return b""
            self._load_next_slice()
        piece = bytes(self._slice[self._pos : self._pos + size])
        self._pos += len(piece)
        return piece

    def read_exact(self, size: int) -> bytes:
        """Exactly ``size`` verified bytes."""
        parts = []
        left = size
        while left:
            piece = self.read(left)
            if not piece:
                raise CoreFormatError(f"{self._what} ends {left} bytes early")
            parts.append(piece)
            left -= len(piece)
        return b"".join(parts)


def read_at(fd: int, nbytes: int, offset: int) -> bytes:
    """Up to ``nbytes`` bytes of ``fd`` at ``offset``; fewer only where the file ends."""
    parts = []
    left = nbytes
    while left:
        piece = os.pread(fd, left, offset + nbytes - left)
        if not piece:
            break
        parts.append(piece)
        left -= len(piece)
    return parts[0] if len(parts) == 1 else b"".join(parts)


class ResourceDecoder(Protocol):
    """Decodes one resource's verified stored bytes into caller buffers."""

    def readinto(self, out: memoryview) -> int:
        """Decode up to ``len(out)`` bytes into ``out``; 0 at the end of the resource."""
        ...

    def finish(self) -> None:
        """Check that the resource ended exactly where its signed lengths say."""
        ...


class _CheckedSource:
    """Verified stored bytes, each walked by a FrameChecker before the decoder may see it."""

    def __init__(self, stored: StoredChunkReader, checker: FrameChecker) -> None:
        self._stored = stored
        self._checker = checker
        self._pushback = b""

    def read(self, size: int = -1) -> bytes:
        if self._pushback:
            piece, self._pushback = self._pushback, b""
            return piece
        piece = self._stored.read(size)
        self._checker.feed(piece)
        return piece

    def prime_header(self) -> None:
        """Read and check the frame header before any output is allocated or decoded."""
        collected = b""
        while self._checker.header is None:
            piece = self._stored.read(18)
            if not piece:
                self._checker.finish()
            self._checker.feed(piece)
            collected += piece
        self._pushback = collected


class FrameDecoder:
    """Decodes exactly one verified zstd frame of a signed decoded length.

    The frame header is checked on construction, before any output buffer is needed. ``readinto``
    never writes past the signed length; ``finish`` rejects a frame that decodes to more or fewer
    bytes, is truncated, or is followed by anything.
    """

    _READ_NBYTES: Final = 128 * 1024

    def __init__(self, stored: StoredChunkReader, decoded_nbytes: int, *, what: str) -> None:
        self._what = what
        self._decoded_nbytes = decoded_nbytes
        self._produced = 0
        self._checker = FrameChecker(decoded_nbytes, what=what)
        self._source = _CheckedSource(stored, self._checker)
        self._stored = stored
        self._source.prime_header()
        decompressor = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW_NBYTES)
        source = cast("IO[bytes]", self._source)  # zstandard only calls its read()
        self._reader = decompressor.stream_reader(
            source, read_size=self._READ_NBYTES, read_across_frames=False, closefd=False
        )

    def readinto(self, out: memoryview) -> int:
        room = self._decoded_nbytes - self._produced
        if room == 0:
            return 0
        target = out[:room] if len(out) > room else out
        try:
            produced: int = self._reader.readinto(target)
        except zstandard.ZstdError as exc:
            raise CoreFormatError(f"{self._what} is not a valid zstd frame: {exc}") from exc
        self._produced += produced
        return produced

    def finish(self) -> None:
        try:
            overshoot = self._reader.read(1) if self._produced == self._decoded_nbytes else b""
        except zstandard.ZstdError as exc:
            raise CoreFormatError(f"{self._what} is not a valid zstd frame: {exc}") from exc
        if overshoot:
            raise CoreFormatError(
                f"{self._what} decodes to more than its signed decoded length of {self._decoded_nbytes} "
                "bytes; decoding stopped there"
            )
        while self._source.read(self._READ_NBYTES):
            pass  # every stored byte must be verified and walked; anything after the frame fails
        self._checker.finish()
        if self._produced != self._decoded_nbytes:
            raise CoreFormatError(
                f"{self._what} decodes to {self._produced} bytes, but its signed decoded length is "
                f"{self._decoded_nbytes}"
            )
