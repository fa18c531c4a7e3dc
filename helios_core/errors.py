"""The one error tree of Helios.

Every failure Helios reports to an operator or a caller is one of these classes. Each message says
what failed and, where there is something to do, what to do. Callers catch ``HeliosError`` to
handle any of them; the CLI and the HTTP layer map the subclasses to exit codes and statuses.

Owned by the core team; add a class here only when callers need to tell it apart from the others.
"""

from __future__ import annotations

__all__ = [
    "ContractError",
    "CoreFormatError",
    "HeliosError",
    "IntegrityError",
    "PromptError",
    "StartupError",
    "TrustError",
    "UnsupportedFeatureError",
]


class HeliosError(Exception):
    """Base class of every error Helios raises on purpose."""


class CoreFormatError(HeliosError):
    """A core file is malformed: bad magic, bad length, bad protobuf, bad zstd frame, bad location,
    a length mismatch or trailing bytes."""


class IntegrityError(HeliosError):
    """Stored or signed bytes do not match their commitment: a hash, signature or AES-GCM tag
    mismatch. The file was damaged or tampered with."""


class TrustError(HeliosError):
    """Trust was not established: no trusted key signed the core, the acceptance string does not
    equal the signed publisher namespace, resources were read before ``authorize``, or key material
    is missing or unusable."""


class ContractError(HeliosError):
    """The prepared serving contract or execution manifest is inconsistent or invalid."""


class UnsupportedFeatureError(ContractError):
    """The core declares a feature that this runtime does not implement yet."""


class StartupError(HeliosError):
    """The runtime could not start with the given core and options."""


class PromptError(HeliosError):
    """A request the frontend cannot turn into a prompt or an output format: a conversation the chat
    template cannot render, an invalid setting or schema (an invalid request)."""
