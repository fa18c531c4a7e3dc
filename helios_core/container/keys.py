"""Keys and signatures: Ed25519 publisher keys, the operator's trust store, core keys and envelopes.

Owns

* key ids: the lower-case hex SHA-256 of a raw 32-byte Ed25519 public key;
* key files: signing keys (PEM, PKCS#8, unencrypted), public keys (PEM, SubjectPublicKeyInfo) and
  core keys (32 raw bytes, or 64 hex characters with an optional newline), and ``generate_keys``;
* ``TrustStore``: the publisher keys an operator trusts;
* signed envelopes: ``sign_envelope`` and ``verify_envelope``, which checks a signature by a trusted
  key over the exact signed bytes before anyone parses them.

Loading the core and parsing what was signed is ``reader``'s job.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from helios_core.container.sealing import CORE_KEY_NBYTES
from helios_core.errors import HeliosError, IntegrityError, TrustError
from helios_core.wire import container_pb2

__all__ = [
    "TrustStore",
    "generate_keys",
    "key_id",
    "load_core_key",
    "load_private_key",
    "load_public_key",
    "load_public_keys",
    "sign_envelope",
    "verify_envelope",
]

StrPath = str | os.PathLike[str]

_SIGNING_KEY_FILE = "signing.pem"
_PUBLIC_KEY_FILE = "signing.pub.pem"
_CORE_KEY_FILE = "core.key"


def key_id(public_key: Ed25519PublicKey) -> str:
    """Lower-case hex SHA-256 of the raw 32-byte public key."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


KEY_FILE_MAX_NBYTES = 64 * 1024
"""The most a key file may hold (a PEM key is a few hundred bytes, a core key 32 or 65): a path to
something endless (``/dev/zero``) is refused after this much, not read until memory runs out."""


def _read_key_file(path: StrPath, what: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            data = handle.read(KEY_FILE_MAX_NBYTES + 1)
    except OSError as exc:
        raise TrustError(f"cannot read the {what} file {os.fspath(path)!r}: {exc.strerror or exc}") from exc
    if len(data) > KEY_FILE_MAX_NBYTES:
        raise TrustError(
            f"the {what} file {os.fspath(path)!r} holds more than {KEY_FILE_MAX_NBYTES} bytes; it is not a key file"
        )
    return data


def load_private_key(path: StrPath) -> Ed25519PrivateKey:
    """An Ed25519 signing key from an unencrypted PKCS#8 PEM file."""
    data = _read_key_file(path, "signing key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise TrustError(
            f"{os.fspath(path)!r} is not an unencrypted PKCS#8 PEM private key ({exc}); create one with "
            "generate_keys or `openssl genpkey -algorithm ed25519`"
        ) from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise TrustError(f"{os.fspath(path)!r} holds a {type(key).__name__}; Helios signs with Ed25519 keys")
    return key


def load_public_key(path: StrPath) -> Ed25519PublicKey:
    """An Ed25519 public key from a SubjectPublicKeyInfo PEM file of one key."""
    keys = load_public_keys(path)
    if len(keys) != 1:
        raise TrustError(f"{os.fspath(path)!r} holds {len(keys)} public keys; one was expected")
    return keys[0]


_PEM_BEGIN = b"-----BEGIN "


def load_public_keys(path: StrPath) -> list[Ed25519PublicKey]:
    """Every Ed25519 public key of a PEM file: one SubjectPublicKeyInfo block, or several one after
    another (a bundle, such as keys concatenated with ``cat``). Every block must be such a key."""
    data = _read_key_file(path, "public key")
    starts = []
    start = data.find(_PEM_BEGIN)
    while start >= 0:
        starts.append(start)
        start = data.find(_PEM_BEGIN, start + 1)
    starts = starts or [0]
    blocks = [data[start:end] for start, end in zip(starts, [*starts[1:], len(data)], strict=True)]
    keys = []
    for number, block in enumerate(blocks, 1):
        where = os.fspath(path) if len(blocks) == 1 else f"{os.fspath(path)} (PEM block {number} of {len(blocks)})"
        try:
            key = serialization.load_pem_public_key(block)
        except (ValueError, TypeError) as exc:
            raise TrustError(
                f"{where!r} is not a PEM public key ({exc}); ask the publisher for their signing.pub.pem"
            ) from exc
        if not isinstance(key, Ed25519PublicKey):
            raise TrustError(f"{where!r} holds a {type(key).__name__}; Helios trusts Ed25519 keys only")
        keys.append(key)
    return keys


def load_core_key(path: StrPath) -> bytes:
    """A 32-byte core key from a file of 32 raw bytes or 64 hex characters plus an optional newline."""
    data = _read_key_file(path, "core key")
    if len(data) == CORE_KEY_NBYTES:
        return data
    text = data[:-1] if data.endswith(b"\n") else data
    if len(text) == 2 * CORE_KEY_NBYTES:
        try:
            return bytes.fromhex(text.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            pass
    raise TrustError(
        f"core key file {os.fspath(path)!r} holds {len(data)} bytes; it must hold exactly {CORE_KEY_NBYTES} "
        f"raw bytes or {2 * CORE_KEY_NBYTES} hex characters with an optional trailing newline"
    )


def generate_keys(out_dir: StrPath) -> dict[str, Path]:
    """Write a new signing key, its public key and a core key into ``out_dir``.

    Returns the paths under the keys ``signing``, ``public`` and ``core``. Refuses to overwrite an
    existing file. The private files are created readable by their owner only.
    """
    directory = Path(out_dir)
    paths = {
        "signing": directory / _SIGNING_KEY_FILE,
        "public": directory / _PUBLIC_KEY_FILE,
        "core": directory / _CORE_KEY_FILE,
    }
    existing = [str(p) for p in paths.values() if p.exists()]
    if existing:
        raise HeliosError(
            f"refusing to overwrite existing key files {existing}; move them away or choose another directory"
        )
    signing_key = Ed25519PrivateKey.generate()
    contents = {
        "signing": (
            signing_key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
            0o600,
        ),
        "public": (
            signing_key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            ),
            0o644,
        ),
        "core": ((os.urandom(CORE_KEY_NBYTES).hex() + "\n").encode("ascii"), 0o600),
    }
    if directory.exists() and not directory.is_dir():
        raise HeliosError(f"cannot write keys into {str(directory)!r}: it exists and is not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise HeliosError(f"cannot create the key directory {str(directory)!r}: {exc.strerror or exc}") from exc
    for name, path in paths.items():
        data, mode = contents[name]
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        except FileExistsError as exc:
            raise HeliosError(f"refusing to overwrite existing key file {str(path)!r}") from exc
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
    return paths


class TrustStore:
    """The Ed25519 publisher keys an operator trusts, by key id."""

    def __init__(self, public_keys: Iterable[Ed25519PublicKey] = ()) -> None:
        self._keys: dict[str, Ed25519PublicKey] = {}
        for public_key in public_keys:
            self.add(public_key)

    @classmethod
    def from_paths(cls, paths: Iterable[StrPath]) -> TrustStore:
        """A store of the public keys in these PEM files (each one key or a bundle of several)."""
        return cls(key for path in paths for key in load_public_keys(path))

    def add(self, public_key: Ed25519PublicKey) -> str:
        """Trust ``public_key``; returns its key id."""
        identifier = key_id(public_key)
        self._keys[identifier] = public_key
        return identifier

    def contains(self, key_id: str) -> bool:
        return key_id in self._keys

    def get(self, key_id: str) -> Ed25519PublicKey:
        try:
            return self._keys[key_id]
        except KeyError:
            raise TrustError(f"key {key_id!r} is not trusted; trusted keys: {self.key_ids}") from None

    @property
    def key_ids(self) -> tuple[str, ...]:
        """Trusted key ids, sorted."""
        return tuple(sorted(self._keys))

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key_id: object) -> bool:
        return key_id in self._keys


def sign_envelope(signed_bytes: bytes, signing_keys: Sequence[Ed25519PrivateKey]) -> container_pb2.SignedEnvelope:
    """An envelope of ``signed_bytes`` with one Ed25519 signature per key."""
    envelope = container_pb2.SignedEnvelope(signed_bytes=signed_bytes)
    for signing_key in signing_keys:
        envelope.signatures.append(
            container_pb2.Signature(
                key_id=key_id(signing_key.public_key()),
                algorithm=container_pb2.SIGNATURE_ALGORITHM_ED25519,
                signature=signing_key.sign(signed_bytes),
            )
        )
    return envelope


def _shown_ids(ids: Sequence[str]) -> str:
    if not ids:
        return "none"
    shown = ", ".join(repr(i[:80]) for i in ids[:8])
    return shown + (f" and {len(ids) - 8} more" if len(ids) > 8 else "")


def verify_envelope(envelope: container_pb2.SignedEnvelope, trust: TrustStore, *, what: str) -> tuple[str, ...]:
    """Check the envelope's signatures by trusted keys; returns the key ids that verified.

    Every signature that claims a trusted key id must verify (else IntegrityError), and at least one
    must (else TrustError). Signatures by keys the operator does not trust are ignored.
    """
    verified: list[str] = []
    for signature in envelope.signatures:
        if not trust.contains(signature.key_id):
            continue
        if signature.algorithm != container_pb2.SIGNATURE_ALGORITHM_ED25519:
            raise IntegrityError(
                f"the {what} signature by trusted key {signature.key_id!r} uses algorithm "
                f"{int(signature.algorithm)}, not Ed25519; the core is damaged or was tampered with"
            )
        try:
            trust.get(signature.key_id).verify(signature.signature, envelope.signed_bytes)
        except InvalidSignature:
            raise IntegrityError(
                f"the {what} signature by trusted key {signature.key_id!r} does not verify: the signed "
                "bytes or the signature were altered. Re-download the core or ask its publisher"
            ) from None
        if signature.key_id not in verified:
            verified.append(signature.key_id)
    if not verified:
        present = [signature.key_id for signature in envelope.signatures]
        raise TrustError(
            f"no trusted key signed this core's {what}: it is signed by {_shown_ids(present)}; trusted "
            f"keys are {_shown_ids(trust.key_ids)}. Add the publisher's public key to the trust store "
            "if you trust this publisher"
        )
    return tuple(verified)
