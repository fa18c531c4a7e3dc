"""AES-256-GCM sealed chunks: how ProtectedIndex version 4 cores store their resources.

Owns the sealing format described at ``SealedChunks`` in ``container.proto``: the decoded bytes are
cut into plaintext chunks of ``plain_chunk_nbytes`` (the last may be shorter; an empty resource is
one empty chunk), and chunk ``i`` of ``n`` is sealed with

* nonce ``nonce_prefix (8 bytes) || uint32_be(i)``,
* associated data ``b"helios-v4" || resource id (UTF-8) || uint32_be(i) || uint32_be(n)``,

and stored as its ciphertext followed by the 16-byte tag. Reordering, splicing between resources and
truncation therefore fail authentication. The 32-byte core key comes from the operator.

``seal_resource`` writes; ``SealedDecoder`` reads verified stored bytes (see
``frames.StoredChunkReader``) and decrypts them chunk by chunk into caller buffers.
"""

from __future__ import annotations

import struct
from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from helios_core.container.frames import StoredChunkReader
from helios_core.errors import CoreFormatError, IntegrityError, TrustError

__all__ = [
    "ASSOCIATED_DATA_PREFIX",
    "CORE_KEY_NBYTES",
    "DEFAULT_PLAIN_CHUNK_NBYTES",
    "MAX_PLAIN_CHUNK_NBYTES",
    "NONCE_PREFIX_NBYTES",
    "TAG_NBYTES",
    "SealedDecoder",
    "associated_data",
    "check_core_key",
    "check_sealing_parameters",
    "chunk_nonce",
    "seal_resource",
    "sealed_chunk_count",
    "sealed_nbytes",
]

CORE_KEY_NBYTES: Final = 32
"""AES-256 key length."""
TAG_NBYTES: Final = 16
"""AES-GCM tag stored after each chunk's ciphertext."""
NONCE_PREFIX_NBYTES: Final = 8
"""Random per-resource nonce prefix; the chunk index fills the remaining 4 nonce bytes."""
DEFAULT_PLAIN_CHUNK_NBYTES: Final = 1024 * 1024
"""Plaintext bytes per chunk that the writer uses."""
MAX_PLAIN_CHUNK_NBYTES: Final = 16 * 1024 * 1024
"""Largest plaintext chunk a reader accepts (bounds its chunk buffer)."""
ASSOCIATED_DATA_PREFIX: Final = b"helios-v4"
_MAX_CHUNKS: Final = 2**32 - 1


def check_core_key(core_key: bytes) -> None:
    """Reject a core key that is not 32 bytes."""
    if len(core_key) != CORE_KEY_NBYTES:
        raise TrustError(
            f"the core key is {len(core_key)} bytes; an AES-256 core key is exactly {CORE_KEY_NBYTES} "
            "bytes (a key file holds 32 raw bytes or 64 hex characters)"
        )


def sealed_chunk_count(decoded_nbytes: int, plain_chunk_nbytes: int) -> int:
    """Number of sealed chunks of a resource: ceil(decoded / plain), and 1 for an empty resource."""
    return max(1, -(-decoded_nbytes // plain_chunk_nbytes))


def sealed_nbytes(decoded_nbytes: int, plain_chunk_nbytes: int) -> int:
    """Stored length of a sealed resource: its plaintext plus one tag per chunk."""
    return decoded_nbytes + TAG_NBYTES * sealed_chunk_count(decoded_nbytes, plain_chunk_nbytes)


def chunk_nonce(nonce_prefix: bytes, index: int) -> bytes:
    return nonce_prefix + struct.pack(">I", index)


def associated_data(resource_id: str, index: int, count: int) -> bytes:
    return ASSOCIATED_DATA_PREFIX + resource_id.encode("utf-8") + struct.pack(">II", index, count)


def check_sealing_parameters(decoded_nbytes: int, plain_chunk_nbytes: int, nonce_prefix: bytes, *, what: str) -> None:
    """Reject sealing parameters a reader cannot use: chunk size, nonce prefix length, chunk count."""
    if not 0 < plain_chunk_nbytes <= MAX_PLAIN_CHUNK_NBYTES:
        raise CoreFormatError(
            f"{what} has plain_chunk_nbytes {plain_chunk_nbytes}; it must be between 1 and {MAX_PLAIN_CHUNK_NBYTES}"
        )
    if len(nonce_prefix) != NONCE_PREFIX_NBYTES:
        raise CoreFormatError(
            f"{what} has a {len(nonce_prefix)}-byte nonce prefix; it must be {NONCE_PREFIX_NBYTES} bytes"
        )
    if sealed_chunk_count(decoded_nbytes, plain_chunk_nbytes) > _MAX_CHUNKS:
        raise CoreFormatError(f"{what} has more than {_MAX_CHUNKS} sealed chunks; use larger chunks")


def seal_resource(
    data: bytes | memoryview,
    *,
    resource_id: str,
    core_key: bytes,
    nonce_prefix: bytes,
    plain_chunk_nbytes: int = DEFAULT_PLAIN_CHUNK_NBYTES,
) -> bytes:
    """The stored bytes of ``data`` sealed as ProtectedIndex 4 chunks."""
    check_core_key(core_key)
    view = memoryview(data).cast("B")
    what = f"resource {resource_id!r}"
    check_sealing_parameters(len(view), plain_chunk_nbytes, nonce_prefix, what=what)
    aead = AESGCM(core_key)
    count = sealed_chunk_count(len(view), plain_chunk_nbytes)
    sealed = bytearray()
    for index in range(count):
        plain = view[index * plain_chunk_nbytes : (index + 1) * plain_chunk_nbytes]
        sealed += aead.encrypt(
            chunk_nonce(nonce_prefix, index), bytes(plain), associated_data(resource_id, index, count)
        )
    return bytes(sealed)


class SealedDecoder:
    """Decrypts one resource's verified sealed chunks into caller buffers.

    Each chunk is authenticated whole into an internal buffer before any of it is handed out, so no
    unauthenticated plaintext ever reaches the caller.
    """

    def __init__(
        self,
        stored: StoredChunkReader,
        *,
        resource_id: str,
        core_key: bytes,
        decoded_nbytes: int,
        plain_chunk_nbytes: int,
        nonce_prefix: bytes,
    ) -> None:
        check_core_key(core_key)
        self._what = f"resource {resource_id!r}"
        check_sealing_parameters(decoded_nbytes, plain_chunk_nbytes, nonce_prefix, what=self._what)
        self._stored = stored
        self._resource_id = resource_id
        self._aead = AESGCM(core_key)
        self._decoded_nbytes = decoded_nbytes
        self._plain_chunk_nbytes = plain_chunk_nbytes
        self._nonce_prefix = nonce_prefix
        self._count = sealed_chunk_count(decoded_nbytes, plain_chunk_nbytes)
        self._next_index = 0
        self._plain = bytearray(min(plain_chunk_nbytes, decoded_nbytes))
        self._plain_view = memoryview(b"")  # the current chunk's plaintext not yet handed out

    def _open_next_chunk(self) -> None:
        index = self._next_index
        plain_nbytes = min(self._plain_chunk_nbytes, self._decoded_nbytes - index * self._plain_chunk_nbytes)
        sealed = self._stored.read_exact(plain_nbytes + TAG_NBYTES)
        target = memoryview(self._plain)[:plain_nbytes]
        try:
            if plain_nbytes:
                self._aead.decrypt_into(
                    chunk_nonce(self._nonce_prefix, index),
                    sealed,
                    associated_data(self._resource_id, index, self._count),
                    target,
                )
            else:
                self._aead.decrypt(
                    chunk_nonce(self._nonce_prefix, index),
                    sealed,
                    associated_data(self._resource_id, index, self._count),
                )
        except InvalidTag:
            raise IntegrityError(
                f"{self._what}: sealed chunk {index} of {self._count} fails AES-GCM authentication; the "
                "core key is wrong for this core (check --core-key) or the chunk was altered"
            ) from None
        self._plain_view = target
        self._next_index += 1

    def readinto(self, out: memoryview) -> int:
        if not self._plain_view:
            if self._next_index == self._count:
                return 0
            self._open_next_chunk()
            if not self._plain_view:  # the one empty chunk of an empty resource
                return 0
        nbytes = min(len(out), len(self._plain_view))
        out[:nbytes] = self._plain_view[:nbytes]
        self._plain_view = self._plain_view[nbytes:]
        return nbytes

    def finish(self) -> None:
        while self._next_index < self._count:
            self._open_next_chunk()
        if self._stored.remaining:
            raise CoreFormatError(f"{self._what} has {self._stored.remaining} stored bytes after its last sealed chunk")
