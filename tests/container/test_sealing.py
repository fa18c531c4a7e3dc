"""AES-256-GCM sealed chunks of ProtectedIndex 4 cores (helios_core.container.sealing)."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from helios_core.container.frames import StoredChunkReader, chunk_digests
from helios_core.container.sealing import (
    DEFAULT_PLAIN_CHUNK_NBYTES,
    SealedDecoder,
    check_sealing_parameters,
    seal_resource,
    sealed_chunk_count,
    sealed_nbytes,
)
from helios_core.errors import CoreFormatError, IntegrityError, TrustError

KEY = bytes(range(32))
NONCE = b"\x01\x02\x03\x04\x05\x06\x07\x08"
PLAIN = 64  # small plaintext chunks keep these tests fast


def seal(data: bytes, *, resource_id: str = "w0", key: bytes = KEY, nonce: bytes = NONCE) -> bytes:
    return seal_resource(data, resource_id=resource_id, core_key=key, nonce_prefix=nonce, plain_chunk_nbytes=PLAIN)


def unseal_pieces(
    tmp_path: Path,
    stored: bytes,
    decoded_nbytes: int,
    *,
    resource_id: str = "w0",
    key: bytes = KEY,
    nonce: bytes = NONCE,
    out: bytearray | None = None,
) -> bytes:
    """Decrypt through the verified chunk reader; pieces produced so far land in ``out``."""
    path = tmp_path / "sealed.bin"
    path.write_bytes(stored)
    fd = os.open(path, os.O_RDONLY)
    received = bytearray() if out is None else out
    try:
        reader = StoredChunkReader(fd, 0, len(stored), chunk_digests(stored), what="resource")
        decoder = SealedDecoder(
            reader,
            resource_id=resource_id,
            core_key=key,
            decoded_nbytes=decoded_nbytes,
            plain_chunk_nbytes=PLAIN,
            nonce_prefix=nonce,
        )
        piece = bytearray(10)  # smaller than a chunk: exercises partial hand-out
        while produced := decoder.readinto(memoryview(piece)):
            received += piece[:produced]
        decoder.finish()
        return bytes(received)
    finally:
        os.close(fd)


@pytest.mark.parametrize("nbytes", [0, 1, PLAIN - 1, PLAIN, PLAIN + 1, 3 * PLAIN, 3 * PLAIN + 17])
def test_roundtrip(tmp_path: Path, nbytes: int) -> None:
    data = os.urandom(nbytes)
    stored = seal(data)
    assert len(stored) == sealed_nbytes(nbytes, PLAIN)
    assert unseal_pieces(tmp_path, stored, nbytes) == data


def test_sizes() -> None:
    assert DEFAULT_PLAIN_CHUNK_NBYTES == 1024 * 1024
    assert sealed_chunk_count(0, PLAIN) == 1  # an empty resource is one empty chunk
    assert sealed_nbytes(0, PLAIN) == 16
    assert sealed_chunk_count(PLAIN, PLAIN) == 1
    assert sealed_chunk_count(PLAIN + 1, PLAIN) == 2
    assert sealed_nbytes(PLAIN + 1, PLAIN) == PLAIN + 1 + 32


def test_format_is_exactly_the_documented_one() -> None:
    data = bytes(range(200))  # chunks of 64, 64, 64, 8
    stored = seal(data)
    aead = AESGCM(KEY)
    position = 0
    for index in range(4):
        plain_nbytes = min(PLAIN, len(data) - index * PLAIN)
        sealed_chunk = stored[position : position + plain_nbytes + 16]
        nonce = NONCE + struct.pack(">I", index)
        associated = b"helios-v4" + b"w0" + struct.pack(">I", index) + struct.pack(">I", 4)
        assert aead.decrypt(nonce, sealed_chunk, associated) == data[index * PLAIN : index * PLAIN + plain_nbytes]
        position += plain_nbytes + 16
    assert position == len(stored)


def test_default_chunk_size_is_1mib() -> None:
    data = bytes(DEFAULT_PLAIN_CHUNK_NBYTES + 1)
    stored = seal_resource(data, resource_id="w0", core_key=KEY, nonce_prefix=NONCE)
    assert len(stored) == len(data) + 2 * 16


def test_wrong_key_fails_authentication(tmp_path: Path) -> None:
    data = b"secret weights" * 10
    with pytest.raises(IntegrityError, match="fails AES-GCM authentication; the core key is wrong"):
        unseal_pieces(tmp_path, seal(data), len(data), key=bytes(32))


def test_reordered_chunks_fail(tmp_path: Path) -> None:
    data = os.urandom(3 * PLAIN)
    stored = seal(data)
    step = PLAIN + 16
    reordered = stored[step : 2 * step] + stored[:step] + stored[2 * step :]
    with pytest.raises(IntegrityError, match="chunk 0 of 3"):
        unseal_pieces(tmp_path, reordered, len(data))


def test_chunk_spliced_from_another_resource_fails(tmp_path: Path) -> None:
    data = os.urandom(2 * PLAIN)
    mine = seal(data, resource_id="w0")
    theirs = seal(data, resource_id="w1")  # same key and nonce prefix: only the id differs
    spliced = mine[: PLAIN + 16] + theirs[PLAIN + 16 :]
    with pytest.raises(IntegrityError, match="chunk 1 of 2"):
        unseal_pieces(tmp_path, spliced, len(data))


def test_truncation_to_fewer_chunks_fails(tmp_path: Path) -> None:
    data = os.urandom(3 * PLAIN)
    stored = seal(data)
    # Drop the last chunk and claim the shorter length: the chunk count in the associated data differs.
    with pytest.raises(IntegrityError, match="chunk 0 of 2"):
        unseal_pieces(tmp_path, stored[: 2 * (PLAIN + 16)], 2 * PLAIN)


def test_no_unauthenticated_plaintext_is_handed_out(tmp_path: Path) -> None:
    data = os.urandom(3 * PLAIN)
    stored = bytearray(seal(data))
    stored[PLAIN + 16 + 3] ^= 0x01  # inside chunk 1's ciphertext
    received = bytearray()
    with pytest.raises(IntegrityError, match="chunk 1 of 3"):
        unseal_pieces(tmp_path, bytes(stored), len(data), out=received)
    assert bytes(received) == data[:PLAIN]


def test_extra_stored_bytes_after_the_last_chunk(tmp_path: Path) -> None:
    data = os.urandom(PLAIN)
    with pytest.raises(CoreFormatError, match="after its last sealed chunk"):
        unseal_pieces(tmp_path, seal(data) + b"\x00", len(data))


@pytest.mark.parametrize("key", [b"", bytes(16), bytes(31), bytes(33)])
def test_core_key_must_be_32_bytes(key: bytes) -> None:
    with pytest.raises(TrustError, match="exactly 32"):
        seal(b"x", key=key)


@pytest.mark.parametrize(
    ("plain", "nonce", "message"),
    [
        (0, NONCE, "plain_chunk_nbytes 0"),
        (16 * 1024 * 1024 + 1, NONCE, "plain_chunk_nbytes 16777217"),
        (PLAIN, NONCE[:7], "7-byte nonce prefix"),
        (PLAIN, NONCE + b"\x00", "9-byte nonce prefix"),
    ],
)
def test_sealing_parameters_are_checked(plain: int, nonce: bytes, message: str) -> None:
    with pytest.raises(CoreFormatError, match=message):
        check_sealing_parameters(100, plain, nonce, what="resource 'w0'")


def test_chunk_count_must_fit_uint32() -> None:
    with pytest.raises(CoreFormatError, match="more than 4294967295 sealed chunks"):
        check_sealing_parameters(2**32, 1, NONCE, what="resource 'w0'")
