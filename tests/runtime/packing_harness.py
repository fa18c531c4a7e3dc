"""Packing-level helpers of the runtime tests: the ``payload-v3`` fixture core's prepared contract and
staging buffers filled with a poison value, so that every byte a packer leaves alone stays visible."""

from __future__ import annotations

import numpy as np

from helios_core.contract import PreparedContract
from helios_core.dtypes import NUMPY_DTYPES
from helios_core.loading import open_core

from .conftest import FIXTURES, fixture_settings

POISON = 77
"""The value of every staged element before packing."""


def payload_contract() -> PreparedContract:
    """The prepared contract of the ``payload-v3`` golden fixture core (the core itself closed again)."""
    verified = open_core(FIXTURES / "payload-v3.core", fixture_settings())
    verified.close()
    return verified.contract


def poisoned_staging(contract: PreparedContract) -> dict[str, np.ndarray]:
    """One array a transport entry of ``contract``, of its shape and dtype, every element :data:`POISON`."""
    return {
        name: np.full(tuple(entry.shape), POISON, dtype=NUMPY_DTYPES[entry.dtype])
        for name, entry in contract.transport.items()
    }
