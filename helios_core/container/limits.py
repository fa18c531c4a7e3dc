"""Decoded-size limits of the resources a runtime reads into host memory whole.

Owns ``MAX_DECODED_NBYTES`` and ``check_decoded_limit``. A resource's signed ``decoded_nbytes`` is
honest (the frame must decode to exactly that length), but a zstd frame of a few KiB can honestly
decode to hundreds of MiB. The tokenizer, the chat template and device-code modules are decoded into
one buffer each and then parsed or compiled as a whole, so their decoded lengths are capped here, by
kind, and checked from the signed description alone: ``CoreFile.open`` refuses an over-limit
resource before any resource byte is read or any output buffer allocated, and ``write_core``
refuses to write one. Weights and state-init resources are not capped this way: their size is what
the contract's buffers declare, and they are uploaded to the model's buffers.

The limits are part of the core format (docs/core-format.md). Raise one only together with that
page: every reader of that version must accept what a writer produces.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

from helios_core.errors import CoreFormatError
from helios_core.wire import container_pb2

__all__ = [
    "MAX_CHAT_TEMPLATE_NBYTES",
    "MAX_DECODED_NBYTES",
    "MAX_MODULE_NBYTES",
    "MAX_TOKENIZER_NBYTES",
    "check_decoded_limit",
]

_MIB: Final = 1024 * 1024

MAX_TOKENIZER_NBYTES: Final = 64 * _MIB
"""Largest decoded ``tokenizer.json``: several times the largest published tokenizers (about 33 MB)."""
MAX_CHAT_TEMPLATE_NBYTES: Final = 1 * _MIB
"""Largest decoded chat template: published templates are a few KiB to a few tens of KiB."""
MAX_MODULE_NBYTES: Final = 512 * _MIB
"""Largest decoded device-code module (one CUBIN or PTX image for one architecture)."""

MAX_DECODED_NBYTES: Final[Mapping[int, int]] = MappingProxyType(
    {
        container_pb2.RESOURCE_KIND_TOKENIZER: MAX_TOKENIZER_NBYTES,
        container_pb2.RESOURCE_KIND_CHAT_TEMPLATE: MAX_CHAT_TEMPLATE_NBYTES,
        container_pb2.RESOURCE_KIND_MODULE: MAX_MODULE_NBYTES,
    }
)
"""The decoded-length limit of each capped ``ResourceKind``; kinds not listed have none."""


def check_decoded_limit(resource_id: str, kind: int, decoded_nbytes: int) -> None:
    """Raise ``CoreFormatError`` when a resource of ``kind`` declares more decoded bytes than its limit."""
    limit = MAX_DECODED_NBYTES.get(kind)
    if limit is not None and decoded_nbytes > limit:
        raise CoreFormatError(
            f"resource {resource_id!r} declares {decoded_nbytes} decoded bytes, over the {limit}-byte limit "
            f"for {container_pb2.ResourceKind.Name(kind)} (read into memory whole); the core cannot be loaded"
        )
