"""The prepared contract: decoding, validation and load-time selection."""

from helios_core.contract.boundaries import PrefixBoundaries, PromptLayout, PromptMessage
from helios_core.contract.prepared import (
    EXPORTED_CONTRACT_VERSION,
    SUPPORTED_CONTRACT_VERSIONS,
    THIRD_PARTY_IDENTIFIERS,
    PreparedContract,
    PreparedGraph,
    RuntimeCapabilities,
    check_runtime_support,
    prepare_contract,
)
from helios_core.contract.selection import LoadOptions, Selection, select

__all__ = [
    "EXPORTED_CONTRACT_VERSION",
    "SUPPORTED_CONTRACT_VERSIONS",
    "THIRD_PARTY_IDENTIFIERS",
    "LoadOptions",
    "PrefixBoundaries",
    "PreparedContract",
    "PreparedGraph",
    "PromptLayout",
    "PromptMessage",
    "RuntimeCapabilities",
    "Selection",
    "check_runtime_support",
    "prepare_contract",
    "select",
]
