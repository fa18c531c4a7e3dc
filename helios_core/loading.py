"""Opening a core for serving: trust, acceptance, resource checks and the prepared contract.

Owns the order of the trust steps every entry point follows (``helios
verify``, ``helios generate``, ``helios run``): verify the signature with the
operator's trusted keys, then parse; authorize with the operator's acceptance
string; check stored resources against their signed commitments; decode and
validate the contract. Operator configuration of trusted keys comes from
``--trust-key`` options and the ``HELIOS_TRUST_KEYS`` environment variable.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from helios_core.container.keys import TrustStore, load_core_key
from helios_core.container.reader import CoreFile
from helios_core.contract import PreparedContract, prepare_contract
from helios_core.errors import TrustError

TRUST_KEYS_ENV = "HELIOS_TRUST_KEYS"
"""Environment variable listing trusted publisher key files, separated by os.pathsep."""

TRUST_KEY_ENV = "HELIOS_TRUST_KEY"
"""The same list under the name ``helios run`` derives from its ``--trust-key`` option."""

ACCEPT_ENV = "HELIOS_ACCEPT"
"""Environment variable holding the operator's acceptance string."""

CORE_KEY_ENV = "HELIOS_CORE_KEY"
"""Environment variable naming the core key file of ProtectedIndex 4 cores."""


@dataclass(frozen=True)
class TrustSettings:
    """The operator's trust configuration."""

    trust_keys: tuple[Path, ...]
    acceptance: str | None
    core_key_path: Path | None

    @classmethod
    def resolve(
        cls, trust_keys: Sequence[Path] = (), acceptance: str | None = None, core_key: Path | None = None
    ) -> TrustSettings:
        """Explicit options first, then the environment."""
        keys = tuple(trust_keys)
        if not keys:  # HELIOS_TRUST_KEY, the name helios run's option gives it, means the same
            listed = os.environ.get(TRUST_KEYS_ENV) or os.environ.get(TRUST_KEY_ENV, "")
            keys = tuple(Path(p) for p in listed.split(os.pathsep) if p)
        if acceptance is None:
            acceptance = os.environ.get(ACCEPT_ENV)
        if core_key is None and os.environ.get(CORE_KEY_ENV):
            core_key = Path(os.environ[CORE_KEY_ENV])
        return cls(keys, acceptance, core_key)


@dataclass
class VerifiedCore:
    """An authorized core with its validated contract. Close it when done."""

    core: CoreFile
    contract: PreparedContract

    def close(self) -> None:
        self.core.close()


def open_core(
    path: Path,
    settings: TrustSettings,
    *,
    check_resources: bool = True,
    progress: Callable[[str, int, int], None] | None = None,
) -> VerifiedCore:
    """Verify, authorize, check and validate a core; raise a HeliosError subclass on any failure."""
    if not settings.trust_keys:
        raise TrustError(
            f"no trusted publisher keys: pass --trust-key PEM (or set {TRUST_KEYS_ENV}) to say whose cores you trust"
        )
    if settings.acceptance is None:
        raise TrustError(
            f"no acceptance string: pass --accept NAMESPACE (or set {ACCEPT_ENV}) after reviewing the publisher's terms"
        )
    trust = TrustStore.from_paths(settings.trust_keys)
    core_key = load_core_key(settings.core_key_path) if settings.core_key_path else None
    core = CoreFile.open(path, trust, core_key)
    try:
        core.authorize(settings.acceptance)
        if check_resources:
            core.verify_resources(progress)
        contract = prepare_contract(core.contract, core.execution, list(core.resources.values()))
    except BaseException:
        core.close()
        raise
    return VerifiedCore(core, contract)
