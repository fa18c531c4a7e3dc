"""zstd resource frames and 4 MiB chunk commitments (helios_core.container.frames)."""

from __future__ import annotations

import hashlib
import io
import os
import tracemalloc
from pathlib import Path

import pytest
import zstandard

from helios_core.container.frames import (
    CHUNK_NBYTES,
    MAX_WINDOW_NBYTES,
    FrameDecoder,
    StoredChunkReader,
    check_sibling_name,
    chunk_count,
    chunk_digests,
    encode_frame,
    parse_frame_header,
)
from helios_core.errors import CoreFormatError, IntegrityError

TEXT = b"the quick brown fox jumps over the lazy dog. " * 2000  # 90,000 bytes


def rebuild_header(frame: bytes, *, window_log: int, content_nbytes: int | None = None, dict_id: int = 0) -> bytes:
    """The same blocks behind a new header: not single-segment, an explicit window, 4-byte FCS."""
    header = parse_frame_header(frame, what="test frame")
    assert header is not None
    content = header.content_nbytes if content_nbytes is None else content_nbytes
    descriptor = 0x80 | (0x04 if header.has_checksum else 0) | (0x01 if dict_id else 0)
    new_header = b"\x28\xb5\x2f\xfd" + bytes([descriptor, (window_log - 10) << 3])
    if dict_id:
        new_header += bytes([dict_id])
    new_header += (content or 0).to_bytes(4, "little")
    return new_header + frame[header.header_nbytes :]


def decode(tmp_path: Path, stored: bytes, decoded_nbytes: int) -> bytes:
    """Decode stored bytes the way the reader does, through a file and the verified chunk reader."""
    path = tmp_path / "stored.bin"
    path.write_bytes(stored)
    fd = os.open(path, os.O_RDONLY)
    try:
        reader = StoredChunkReader(fd, 0, len(stored), chunk_digests(stored), what="resource 'r'")
        decoder = FrameDecoder(reader, decoded_nbytes, what="resource 'r'")
        out = bytearray(decoded_nbytes)
        view = memoryview(out)
        filled = 0
        while filled < decoded_nbytes:
            produced = decoder.readinto(view[filled:])
            if produced == 0:
                break
            filled += produced
        decoder.finish()
        return bytes(out)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------------- encoding


def test_encode_frame_is_one_level3_frame_with_content_size() -> None:
    frame = encode_frame(TEXT)
    params = zstandard.get_frame_parameters(frame)
    assert params.content_size == len(TEXT)
    assert params.window_size <= MAX_WINDOW_NBYTES
    assert frame == zstandard.ZstdCompressor(level=3, write_content_size=True, write_checksum=True).compress(TEXT)
    assert zstandard.ZstdDecompressor().decompress(frame) == TEXT
    assert encode_frame(memoryview(TEXT)) == frame


def test_encode_frame_of_empty_data() -> None:
    frame = encode_frame(b"")
    assert zstandard.get_frame_parameters(frame).content_size == 0


def test_constants() -> None:
    assert CHUNK_NBYTES == 4194304
    assert MAX_WINDOW_NBYTES == 8 * 1024 * 1024


@pytest.mark.parametrize(
    ("stored_nbytes", "count"),
    [(0, 0), (1, 1), (CHUNK_NBYTES - 1, 1), (CHUNK_NBYTES, 1), (CHUNK_NBYTES + 1, 2), (3 * CHUNK_NBYTES, 3)],
)
def test_chunk_count(stored_nbytes: int, count: int) -> None:
    assert chunk_count(stored_nbytes) == count


def test_chunk_digests_cover_4mib_slices_of_stored_bytes() -> None:
    stored = os.urandom(2 * CHUNK_NBYTES + 12345)
    digests = chunk_digests(stored)
    assert digests == [
        hashlib.sha256(stored[:CHUNK_NBYTES]).digest(),
        hashlib.sha256(stored[CHUNK_NBYTES : 2 * CHUNK_NBYTES]).digest(),
        hashlib.sha256(stored[2 * CHUNK_NBYTES :]).digest(),
    ]
    assert chunk_digests(b"") == []
    assert chunk_digests(memoryview(stored)) == digests


# --------------------------------------------------------------------- verified chunk reading


def _reader(tmp_path: Path, stored: bytes, digests: list[bytes]) -> tuple[StoredChunkReader, int]:
    path = tmp_path / "chunks.bin"
    path.write_bytes(b"prefix" + stored)
    fd = os.open(path, os.O_RDONLY)
    return StoredChunkReader(fd, len(b"prefix"), len(stored), digests, what="resource 'r'"), fd


def test_stored_chunk_reader_reads_multi_chunk_data(tmp_path: Path) -> None:
    stored = os.urandom(2 * CHUNK_NBYTES + 7)
    reader, fd = _reader(tmp_path, stored, chunk_digests(stored))
    try:
        pieces = []
        while piece := reader.read(1_000_000):
            pieces.append(piece)
        assert b"".join(pieces) == stored
        assert reader.remaining == 0
    finally:
        os.close(fd)


def test_tampered_chunk_releases_no_byte_of_it(tmp_path: Path) -> None:
    stored = bytearray(os.urandom(2 * CHUNK_NBYTES + 7))
    digests = chunk_digests(stored)
    stored[CHUNK_NBYTES + 5] ^= 0x01  # second chunk
    reader, fd = _reader(tmp_path, bytes(stored), digests)
    try:
        released = bytearray()
        with pytest.raises(IntegrityError, match=r"stored chunk 1 .*does not match its signed SHA-256"):
            while piece := reader.read(65536):
                released += piece
        assert len(released) == CHUNK_NBYTES  # exactly the verified first chunk, nothing of the second
    finally:
        os.close(fd)


def test_tampered_first_chunk_fails_before_the_first_byte(tmp_path: Path) -> None:
    stored = bytearray(TEXT)
    digests = chunk_digests(stored)
    stored[-1] ^= 0x80
    reader, fd = _reader(tmp_path, bytes(stored), digests)
    try:
        with pytest.raises(IntegrityError):
            reader.read(1)
    finally:
        os.close(fd)


def test_digest_count_must_match_stored_length(tmp_path: Path) -> None:
    with pytest.raises(CoreFormatError, match="expected 1"):
        _reader(tmp_path, TEXT, [])


def test_file_shorter_than_its_location(tmp_path: Path) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(TEXT[:100])
    fd = os.open(path, os.O_RDONLY)
    try:
        reader = StoredChunkReader(fd, 0, len(TEXT), chunk_digests(TEXT), what="resource 'r'")
        with pytest.raises(CoreFormatError, match="truncated"):
            reader.read(10)
    finally:
        os.close(fd)


def test_multi_chunk_frame_decodes(tmp_path: Path) -> None:
    data = os.urandom(CHUNK_NBYTES + 100_000)  # incompressible: the frame spans two chunks
    frame = encode_frame(data)
    assert chunk_count(len(frame)) == 2
    assert decode(tmp_path, frame, len(data)) == data


# ------------------------------------------------------------------------------- frame checks


def test_frame_roundtrip(tmp_path: Path) -> None:
    assert decode(tmp_path, encode_frame(TEXT), len(TEXT)) == TEXT
    assert decode(tmp_path, encode_frame(b""), 0) == b""


@pytest.mark.parametrize("cut", [1, 4, 5, 100])
def test_truncated_frame_is_rejected(tmp_path: Path, cut: int) -> None:
    # Cutting 1..4 bytes removes only the checksum: zstd itself would return every decoded byte.
    frame = encode_frame(TEXT)
    with pytest.raises(CoreFormatError, match="truncated zstd frame"):
        decode(tmp_path, frame[:-cut], len(TEXT))


def test_truncated_frame_header_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(CoreFormatError, match="truncated zstd frame"):
        decode(tmp_path, encode_frame(TEXT)[:5], len(TEXT))


def test_second_frame_is_rejected(tmp_path: Path) -> None:
    frame = encode_frame(TEXT)
    with pytest.raises(CoreFormatError, match="after its zstd frame"):
        decode(tmp_path, frame + frame, len(TEXT))


def test_second_frame_is_rejected_even_when_lengths_add_up(tmp_path: Path) -> None:
    half = len(TEXT) // 2
    no_size = zstandard.ZstdCompressor(level=3, write_content_size=False)
    stored = no_size.compress(TEXT[:half]) + no_size.compress(TEXT[half:])
    with pytest.raises(CoreFormatError, match="after its zstd frame"):
        decode(tmp_path, stored, len(TEXT))


def test_skippable_frame_after_the_frame_is_rejected(tmp_path: Path) -> None:
    skippable = b"\x50\x2a\x4d\x18" + (4).to_bytes(4, "little") + b"abcd"
    with pytest.raises(CoreFormatError, match="after its zstd frame"):
        decode(tmp_path, encode_frame(TEXT) + skippable, len(TEXT))


@pytest.mark.parametrize("tail", [b"\x00", b"trailing garbage"])
def test_trailing_bytes_are_rejected(tmp_path: Path, tail: bytes) -> None:
    with pytest.raises(CoreFormatError, match="after its zstd frame"):
        decode(tmp_path, encode_frame(TEXT) + tail, len(TEXT))


def test_not_a_zstd_frame(tmp_path: Path) -> None:
    with pytest.raises(CoreFormatError, match="does not start with a zstd frame"):
        decode(tmp_path, b"PK\x03\x04" + TEXT[:100], 100)


@pytest.mark.parametrize("signed", [len(TEXT) - 1, len(TEXT) + 1, 0])
def test_content_size_must_equal_signed_length(tmp_path: Path, signed: int) -> None:
    with pytest.raises(CoreFormatError, match=f"its signed decoded length is {signed}"):
        decode(tmp_path, encode_frame(TEXT), signed)


def test_overshoot_without_content_size_stops_at_the_signed_length(tmp_path: Path) -> None:
    huge = bytes(64 * 1024 * 1024)  # 64 MiB of zeros: a frame of a few KiB
    frame = zstandard.ZstdCompressor(level=3, write_content_size=False).compress(huge)
    del huge
    tracemalloc.start()
    try:
        with pytest.raises(CoreFormatError, match="more than its signed decoded length of 1000 bytes"):
            decode(tmp_path, frame, 1000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * 1024 * 1024


def test_undershoot_without_content_size(tmp_path: Path) -> None:
    frame = zstandard.ZstdCompressor(level=3, write_content_size=False).compress(TEXT)
    with pytest.raises(CoreFormatError, match=f"decodes to {len(TEXT)} bytes, but its signed decoded length"):
        decode(tmp_path, frame, len(TEXT) + 10)


def test_window_of_exactly_8mib_is_accepted(tmp_path: Path) -> None:
    frame = rebuild_header(encode_frame(TEXT), window_log=23)
    assert zstandard.get_frame_parameters(frame).window_size == MAX_WINDOW_NBYTES
    assert decode(tmp_path, frame, len(TEXT)) == TEXT


def test_window_over_8mib_is_rejected_without_a_large_allocation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Declares a 16 MiB window and a 64 MiB content size; the blocks are a real frame's.
    frame = rebuild_header(encode_frame(TEXT), window_log=24, content_nbytes=64 * 1024 * 1024)
    assert zstandard.get_frame_parameters(frame).window_size == 16 * 1024 * 1024
    created: list[object] = []
    real = zstandard.ZstdDecompressor

    def spy(*args: object, **kwargs: object) -> object:
        created.append(kwargs)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(zstandard, "ZstdDecompressor", spy)
    tracemalloc.start()
    try:
        with pytest.raises(CoreFormatError, match="needs a 16777216-byte window, over the 8388608-byte limit"):
            decode(tmp_path, frame, 64 * 1024 * 1024)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert created == []  # rejected from the header: no decoder (and no window) was ever set up
    assert peak < 1024 * 1024


def test_zstd_stream_decoder_also_caps_the_window() -> None:
    # Defence in depth: the streaming decoder FrameDecoder builds refuses the same frame on its own.
    frame = rebuild_header(encode_frame(TEXT), window_log=24)
    assert zstandard.ZstdDecompressor().decompress(frame) == TEXT  # a valid frame apart from its window
    capped = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW_NBYTES)
    with pytest.raises(zstandard.ZstdError, match="too much memory"):
        capped.stream_reader(io.BytesIO(frame)).read(100)


def test_dictionary_frame_is_rejected(tmp_path: Path) -> None:
    frame = rebuild_header(encode_frame(TEXT), window_log=20, dict_id=7)
    with pytest.raises(CoreFormatError, match="needs dictionary 7"):
        decode(tmp_path, frame, len(TEXT))


def test_reserved_header_bit_is_rejected(tmp_path: Path) -> None:
    frame = bytearray(encode_frame(TEXT))
    frame[4] |= 0x08
    with pytest.raises(CoreFormatError, match="reserved bit"):
        decode(tmp_path, bytes(frame), len(TEXT))


def test_reserved_block_type_is_rejected(tmp_path: Path) -> None:
    frame = bytearray(encode_frame(TEXT))
    header = parse_frame_header(frame, what="test")
    assert header is not None
    frame[header.header_nbytes] |= 0x06  # block type 3
    with pytest.raises(CoreFormatError, match="reserved type"):
        decode(tmp_path, bytes(frame), len(TEXT))


def test_corrupt_block_is_a_format_error(tmp_path: Path) -> None:
    frame = bytearray(encode_frame(TEXT))
    header = parse_frame_header(frame, what="test")
    assert header is not None
    for position in range(header.header_nbytes + 3, len(frame) - 4):
        frame[position] ^= 0x5A
    with pytest.raises(CoreFormatError):
        decode(tmp_path, bytes(frame), len(TEXT))


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "../x", "/abs", "a\\b", "C:x", "nul\x00"])
def test_sibling_names_must_be_plain(name: str) -> None:
    with pytest.raises(CoreFormatError, match="not a plain file name"):
        check_sibling_name(name, what="test")


@pytest.mark.parametrize("name", ["w0.bin", "model.core.part-1", "..hidden"])
def test_plain_sibling_names_pass(name: str) -> None:
    check_sibling_name(name, what="test")
