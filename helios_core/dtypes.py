"""Element types of the wire schema and their numpy equivalents.

Owns the one mapping from ``DType`` enum values to numpy dtypes and byte
sizes. bfloat16 has no numpy type: it is stored as ``uint16`` bit patterns.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Final

import numpy as np

from helios_core.wire import manifest_pb2 as mf

NUMPY_DTYPES: Final[MappingProxyType[int, np.dtype[np.generic]]] = MappingProxyType(
    {
        mf.DTYPE_F32: np.dtype(np.float32),
        mf.DTYPE_F16: np.dtype(np.float16),
        mf.DTYPE_BF16: np.dtype(np.uint16),
        mf.DTYPE_I32: np.dtype(np.int32),
        mf.DTYPE_I64: np.dtype(np.int64),
        mf.DTYPE_U8: np.dtype(np.uint8),
        mf.DTYPE_U32: np.dtype(np.uint32),
        mf.DTYPE_U64: np.dtype(np.uint64),
        mf.DTYPE_F64: np.dtype(np.float64),
    }
)
"""Numpy storage dtype of each wire dtype."""

FLOAT_DTYPES: Final = frozenset({mf.DTYPE_F32, mf.DTYPE_F16, mf.DTYPE_BF16, mf.DTYPE_F64})
INTEGER_DTYPES: Final = frozenset({mf.DTYPE_I32, mf.DTYPE_I64, mf.DTYPE_U8, mf.DTYPE_U32, mf.DTYPE_U64})


def itemsize(dtype: int) -> int:
    """Bytes per element of a wire dtype; raises KeyError for unknown values."""
    return NUMPY_DTYPES[dtype].itemsize


def dtype_name(dtype: int) -> str:
    """A short readable name (``f32``, ``bf16``...) for messages."""
    try:
        return mf.DType.Name(dtype).removeprefix("DTYPE_").lower()  # type: ignore[arg-type]
    except ValueError:
        return f"dtype#{dtype}"
