"""Shared fixtures for the core container tests: keys, small cores of each layout, and file surgery.

Helpers are fixtures (some returning functions): the test files are plain modules, not a package, so
they do not import this module (``import conftest`` is ambiguous once other test directories have one).
Test files import its type aliases under ``TYPE_CHECKING`` only.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from helios_core.container import Layout, ResourceInput, TrustStore, write_core
from helios_core.container.frames import HEADER_NBYTES, MAGIC, SIGNED_LAYOUTS
from helios_core.container.writer import assemble_core
from helios_core.wire import container_pb2, contract_pb2, manifest_pb2

NAMESPACE = "acme/llama-synthetic"
CORE_KEY = bytes(range(32, 64))
SIGNING_SEED = bytes(range(32))


def _resources() -> list[ResourceInput]:
    pattern = bytes((i * 37 + i // 7) % 251 for i in range(3000))
    return [
        ResourceInput("w0", container_pb2.RESOURCE_KIND_WEIGHTS, pattern * 3 + bytes(2000)),
        ResourceInput("m0", container_pb2.RESOURCE_KIND_MODULE, b"\x7fELF" + bytes(range(256)) * 4),
        ResourceInput("tok", container_pb2.RESOURCE_KIND_TOKENIZER, b'{"model": "x"}', rank=1),
    ]


def counting_nonces() -> Callable[[int], bytes]:
    """A deterministic nonce source: 1, 2, 3, ... as 8-byte big-endian prefixes."""
    counter = iter(range(1, 2**32))

    def source(nbytes: int) -> bytes:
        return next(counter).to_bytes(nbytes, "big")

    return source


@pytest.fixture(scope="session")
def namespace() -> str:
    """The publisher namespace the test cores are signed with."""
    return NAMESPACE


@pytest.fixture(scope="session")
def core_key() -> bytes:
    """The core key of the logical-v4 test cores."""
    return CORE_KEY


@pytest.fixture(scope="session")
def signing_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(SIGNING_SEED)


@pytest.fixture(scope="session")
def other_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(bytes(range(100, 132)))


@pytest.fixture(scope="session")
def trust(signing_key: Ed25519PrivateKey) -> TrustStore:
    return TrustStore([signing_key.public_key()])


@pytest.fixture(scope="session")
def resources() -> list[ResourceInput]:
    return _resources()


def _contract() -> contract_pb2.ServingContract:
    return contract_pb2.ServingContract(served_name="served-model", context_tokens=4096)


MakeCore = Callable[..., Path]


@pytest.fixture(scope="session")
def make_core(signing_key: Ed25519PrivateKey) -> MakeCore:
    """Write a small valid core; keyword arguments override write_core's."""

    def make(path: Path, layout: Layout = "payload", **overrides: object) -> Path:
        arguments: dict[str, object] = {
            "namespace": NAMESPACE,
            "contract": _contract(),
            "execution": manifest_pb2.ExecutionManifest(),
            "resources": _resources(),
            "signing_key": signing_key,
            "layout": layout,
            "core_key": CORE_KEY if layout == "logical-v4" else None,
            "description": "a synthetic test core",
            "nonce_source": counting_nonces(),
        }
        arguments.update(overrides)
        write_core(path, **arguments)  # type: ignore[arg-type]
        return path

    return make


CraftCore = Callable[..., Path]


@pytest.fixture(scope="session")
def craft_core(signing_key: Ed25519PrivateKey) -> CraftCore:
    """Sign a hand-built description with given stored bytes (which need not match it)."""

    def craft(
        path: Path,
        described: Sequence[container_pb2.ExecutableResource],
        stored: Sequence[tuple[str, bytes]],
        *,
        layout: Layout = "payload",
        namespace: str = NAMESPACE,
        signing_keys: Sequence[Ed25519PrivateKey] | None = None,
        signed_body: bytes | None = None,
        format_version: int = 2,
        sibling_files: Mapping[str, str] | None = None,
    ) -> Path:
        body_type = container_pb2.DeploymentBody if layout == "payload" else container_pb2.ModelIndex
        if signed_body is None:
            body = body_type(publisher_namespace=namespace, resources=list(described), layout=SIGNED_LAYOUTS[layout])
            signed_body = body.SerializeToString(deterministic=True)
        assemble_core(
            path,
            layout=layout,
            signed_body=signed_body,
            stored=stored,
            signing_keys=[signing_key] if signing_keys is None else signing_keys,
            sibling_files=sibling_files,
            format_version=format_version,
        )
        return path

    return craft


def _split_core(data: bytes) -> tuple[container_pb2.CoreBody, int]:
    """The CoreBody of a core file's bytes and the offset just after it."""
    (body_nbytes,) = struct.unpack_from("<Q", data, len(MAGIC))
    body = container_pb2.CoreBody.FromString(data[HEADER_NBYTES : HEADER_NBYTES + body_nbytes])
    return body, HEADER_NBYTES + body_nbytes


SplitCore = Callable[[bytes], tuple[container_pb2.CoreBody, int]]


@pytest.fixture(scope="session")
def split_core() -> SplitCore:
    """The CoreBody of a core file's bytes and the offset just after it."""
    return _split_core


EditCoreBody = Callable[..., None]


@pytest.fixture(scope="session")
def edit_core_body() -> EditCoreBody:
    """Rewrite a core's (unsigned) CoreBody in place, keeping its stored bytes.

    ``edit(core_body)`` changes the message. With ``shift_offsets`` the core-file locations are moved
    by the change in header length, so they still point at the same stored bytes.
    """

    def edit(path: Path, change: Callable[[container_pb2.CoreBody], None], *, shift_offsets: bool = True) -> None:
        data = path.read_bytes()
        core_body, old_end = _split_core(data)
        change(core_body)
        new_end = old_end
        for _ in range(16):
            serialized = core_body.SerializeToString(deterministic=True)
            end = HEADER_NBYTES + len(serialized)
            if end == new_end or not shift_offsets:
                break
            for location in core_body.locations.locations:
                if not location.file:
                    location.offset += end - new_end
            new_end = end
        path.write_bytes(MAGIC + struct.pack("<Q", len(serialized)) + serialized + data[old_end:])

    return edit
