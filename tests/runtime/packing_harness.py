"""Packing-level helpers of the runtime tests: the ``payload-v3`` fixture core's prepared contract,
staging buffers filled with a poison value, so that every byte a packer leaves alone stays visible, and
the comparison of completion results read as columns with those read lane by lane."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from helios_core.contract import PreparedContract
from helios_core.dtypes import NUMPY_DTYPES
from helios_core.loading import open_core
from helios_core.runtime.completion import CompletionError, LaneResult

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


def assert_same_results(
    by_batch: Iterable[LaneResult | CompletionError], by_list: Sequence[LaneResult | CompletionError]
) -> None:
    """Each lane's result read as columns equals the one read lane by lane: the same result, or an error
    with the same message."""
    for got, want in zip(by_batch, by_list, strict=True):
        if isinstance(want, CompletionError):
            assert isinstance(got, CompletionError) and str(got) == str(want)
        else:
            assert isinstance(got, LaneResult) and got == want
