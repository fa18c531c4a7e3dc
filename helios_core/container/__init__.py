"""Core files: the signed, framed container a prepared model core ships in.

``frames`` owns the byte framing (header, zstd frames, 4 MiB chunk commitments), ``sealing`` the
AES-GCM chunks of ProtectedIndex 4 cores, ``keys`` the Ed25519 keys, trust store and envelopes,
``limits`` the decoded-size limits of resources read whole, ``writer`` writes cores and ``reader``
opens, verifies and streams them. Import from here.
"""

from helios_core.container.frames import (
    CHUNK_NBYTES,
    FORMAT_VERSION,
    MAX_WINDOW_NBYTES,
    Layout,
    chunk_digests,
    encode_frame,
)
from helios_core.container.keys import (
    TrustStore,
    generate_keys,
    key_id,
    load_core_key,
    load_private_key,
    load_public_key,
)
from helios_core.container.limits import MAX_DECODED_NBYTES
from helios_core.container.reader import CoreFile
from helios_core.container.writer import ResourceInput, write_core

__all__ = [
    "CHUNK_NBYTES",
    "FORMAT_VERSION",
    "MAX_DECODED_NBYTES",
    "MAX_WINDOW_NBYTES",
    "CoreFile",
    "Layout",
    "ResourceInput",
    "TrustStore",
    "chunk_digests",
    "encode_frame",
    "generate_keys",
    "key_id",
    "load_core_key",
    "load_private_key",
    "load_public_key",
    "write_core",
]
