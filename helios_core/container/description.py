"""Describing a core without serving it: what ``helios inspect`` shows.

Owns :class:`CoreDescription`, the read-only summary of a core's signed
description, produced either from an opened, verified :class:`CoreFile` or —
explicitly unverified — straight from the file for inspection when the
operator has no key at hand. Nothing here reads resources.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from helios_core.container.frames import Layout
from helios_core.container.reader import (
    CoreFile,
    _parse_signed_body,
    _read_core_body,
    _select_body,
    open_regular_file,
)
from helios_core.wire import container_pb2, contract_pb2, manifest_pb2


@dataclass(frozen=True)
class CoreDescription:
    """The signed description of a core (verified or not, as ``verified`` says)."""

    path: Path
    verified: bool
    layout: Layout
    format_version: int
    publisher_namespace: str
    signer_key_ids: tuple[str, ...]
    contract: contract_pb2.ServingContract
    execution: manifest_pb2.ExecutionManifest
    resources: tuple[container_pb2.ExecutableResource, ...]
    description: str


def describe_verified(core: CoreFile) -> CoreDescription:
    """The description of an opened (signature-verified) core."""
    return CoreDescription(
        path=core.path,
        verified=True,
        layout=core.layout,
        format_version=core.format_version,
        publisher_namespace=core.publisher_namespace,
        signer_key_ids=core.signer_key_ids,
        contract=core.contract,
        execution=core.execution,
        resources=tuple(core.resources.values()),
        description=core.description,
    )


def read_unverified(path: Path) -> CoreDescription:
    """Parse a core's description WITHOUT checking its signature (inspection only, never serving)."""
    fd = open_regular_file(path, "core file")
    try:
        core_body, _, _ = _read_core_body(fd, Path(path))
    finally:
        os.close(fd)
    layout, envelope = _select_body(core_body)
    body = _parse_signed_body(envelope.signed_bytes, layout, verified=False)
    return CoreDescription(
        path=Path(path),
        verified=False,
        layout=layout,
        format_version=core_body.format_version,
        publisher_namespace=body.publisher_namespace,
        signer_key_ids=tuple(s.key_id for s in envelope.signatures),
        contract=body.contract,
        execution=body.execution,
        resources=tuple(body.resources),
        description=body.description,
    )
