"""``helios verify``, ``generate`` and ``run`` on signed cores whose frontend assets are over their limits.

Each core is the golden ``payload-v3`` fixture with its tokenizer or chat template replaced by an
honest zstd frame of a few KiB that decodes to hundreds of MiB of zeros, re-signed with the
fixture's test key. Every command must refuse it with one error line, quickly and without
allocating the decoded size.
"""

from __future__ import annotations

import struct
import tracemalloc
from pathlib import Path

import pytest
import zstandard

from helios_core.cli import main
from helios_core.container import CHUNK_NBYTES, load_private_key
from helios_core.container.frames import HEADER_NBYTES, MAGIC, chunk_digests, encode_frame
from helios_core.container.writer import assemble_core
from helios_core.wire import container_pb2

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "cores"
KEYS = FIXTURES / "keys"
NAMESPACE = "helios-fixtures/golden"
MIB = 1024 * 1024


def zeros_frame(decoded_nbytes: int) -> bytes:
    """One zstd frame of ``decoded_nbytes`` zeros with its content size, compressed in 1 MiB pieces."""
    stream = zstandard.ZstdCompressor(level=3, write_content_size=True).compressobj(size=decoded_nbytes)
    piece = bytes(MIB)
    parts = [stream.compress(piece) for _ in range(decoded_nbytes // MIB)]
    parts.append(stream.compress(piece[: decoded_nbytes % MIB]))
    parts.append(stream.flush())
    return b"".join(parts)


def fixture_with(target: Path, resource_id: str, stored: bytes, decoded_nbytes: int) -> Path:
    """``payload-v3.core`` with one resource replaced and the description re-signed with the fixture key."""
    data = (FIXTURES / "payload-v3.core").read_bytes()
    (body_nbytes,) = struct.unpack_from("<Q", data, len(MAGIC))
    core_body = container_pb2.CoreBody.FromString(data[HEADER_NBYTES : HEADER_NBYTES + body_nbytes])
    body = container_pb2.DeploymentBody.FromString(core_body.payload.signed_bytes)
    replaced = next(resource for resource in body.resources if resource.id == resource_id)
    replaced.decoded_nbytes = decoded_nbytes
    replaced.stored_nbytes = len(stored)
    del replaced.chunk_sha256[:]
    replaced.chunk_sha256.extend(chunk_digests(stored))
    assert replaced.chunk_nbytes == CHUNK_NBYTES
    kept = {loc.resource_id: data[loc.offset : loc.offset + loc.length] for loc in core_body.locations.locations}
    kept[resource_id] = stored
    assemble_core(
        target,
        layout="payload",
        signed_body=body.SerializeToString(deterministic=True),
        stored=[(loc.resource_id, kept[loc.resource_id]) for loc in core_body.locations.locations],
        signing_keys=[load_private_key(KEYS / "signing.pem")],
    )
    return target


@pytest.fixture(scope="module")
def big_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 256 MiB tokenizer in 8 KiB."""
    target = tmp_path_factory.mktemp("limits") / "big-tokenizer.core"
    return fixture_with(target, "tokenizer", zeros_frame(256 * MIB), 256 * MIB)


@pytest.fixture(scope="module")
def big_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 512 MiB chat template in 16 KiB."""
    target = tmp_path_factory.mktemp("limits") / "big-template.core"
    return fixture_with(target, "chat_template", zeros_frame(512 * MIB), 512 * MIB)


TOKENIZER_ERROR = (
    "resource 'tokenizer' declares 268435456 decoded bytes, over the 67108864-byte limit for "
    "RESOURCE_KIND_TOKENIZER (read into memory whole); the core cannot be loaded"
)
TEMPLATE_ERROR = (
    "resource 'chat_template' declares 536870912 decoded bytes, over the 1048576-byte limit for "
    "RESOURCE_KIND_CHAT_TEMPLATE (read into memory whole); the core cannot be loaded"
)
TRUST = ["--trust-key", str(KEYS / "signing.pub.pem"), "--accept", NAMESPACE]


def command(name: str, core: Path, messages: Path) -> list[str]:
    if name == "verify":
        return ["verify", str(core), *TRUST]
    if name == "generate":
        return ["generate", "--core", str(core), "--messages", str(messages), "--backend", "reference", *TRUST]
    return ["run", "--core", str(core), "--port", "0", "--backend", "reference", *TRUST]


@pytest.fixture
def messages(tmp_path: Path) -> Path:
    path = tmp_path / "messages.json"
    path.write_text('[{"role": "user", "content": "Hello there"}]', encoding="utf-8")
    return path


@pytest.mark.parametrize("name", ["verify", "generate", "run"])
@pytest.mark.parametrize(("which", "error"), [("big_tokenizer", TOKENIZER_ERROR), ("big_template", TEMPLATE_ERROR)])
def test_an_over_limit_frontend_asset_fails_with_one_line(
    name: str,
    which: str,
    error: str,
    messages: Path,
    request: pytest.FixtureRequest,
    capsys: pytest.CaptureFixture[str],
) -> None:
    core: Path = request.getfixturevalue(which)
    assert core.stat().st_size < (FIXTURES / "payload-v3.core").stat().st_size + 32 * 1024  # a few KiB more
    main(command(name, core, messages))  # once untraced: the modules the command imports are not what is measured
    capsys.readouterr()
    tracemalloc.start()
    try:
        code = main(command(name, core, messages))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    captured = capsys.readouterr()
    assert (code, captured.out, captured.err) == (1, "", f"helios {name}: error: {error}\n")
    assert peak < 16 * MIB


@pytest.mark.parametrize(("resource_id", "what"), [("tokenizer", "tokenizer"), ("chat_template", "chat template")])
@pytest.mark.parametrize("name", ["generate", "run"])
def test_a_frontend_asset_that_is_not_utf8_fails_with_one_line(
    resource_id: str, what: str, name: str, tmp_path: Path, messages: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    core = fixture_with(tmp_path / "latin1.core", resource_id, encode_frame(b"\xff\xfe"), 2)
    code = main(command(name, core, messages))
    captured = capsys.readouterr()
    assert (code, captured.out) == (1, "")
    assert captured.err == (
        f"helios {name}: error: the core's {what} (resource {resource_id!r}) is not UTF-8 text: 'utf-8' codec "
        "can't decode byte 0xff in position 0: invalid start byte\n"
    )
