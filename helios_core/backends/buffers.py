"""Buffer storage rules shared by the backends: the numpy dtype of a wire dtype, a buffer's shape at load.

Owns how a ``BufferDecl`` becomes storage: symbolic leading extents (cache pages, state rows,
snapshot rows) resolved to the physical capacities chosen at load, the element type, and which buffers
hold per-page storage (what a page's copy to the host tier moves), and which declaration of a per-rank
buffer a tensor-parallel rank allocates. Every backend allocates through these functions, so their
buffers agree exactly.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from helios_core.dtypes import NUMPY_DTYPES, dtype_name
from helios_core.errors import ContractError, UnsupportedFeatureError
from helios_core.wire import manifest_pb2 as mf

SYMBOLIC = (mf.DIM_SYMBOL_CACHE_PAGES, mf.DIM_SYMBOL_STATE_ROWS, mf.DIM_SYMBOL_SNAPSHOT_ROWS)
"""Dimension symbols fixed at load; only a leading dimension may carry one."""


def numpy_dtype(name: str, dtype: int) -> np.dtype[Any]:
    """The numpy storage of a wire dtype; a dtype without one is an unsupported feature."""
    found = NUMPY_DTYPES.get(dtype)
    if found is None:
        raise UnsupportedFeatureError(f"buffer {name!r} has dtype {dtype_name(dtype)}, which has no numpy storage")
    return found


def runtime_shape(decl: mf.BufferDecl, *, cache_pages: int, state_rows: int, snapshot_rows: int) -> tuple[int, ...]:
    """A buffer's shape at load (snapshot rows 0: preparation's working-set count is kept)."""
    shape = []
    for index, dim in enumerate(decl.shape):
        if dim.symbol in SYMBOLIC:
            if index != 0:
                raise ContractError(f"buffer {decl.name!r}: only the leading dimension may be symbolic")
            if dim.symbol == mf.DIM_SYMBOL_CACHE_PAGES:
                shape.append(cache_pages)
            elif dim.symbol == mf.DIM_SYMBOL_STATE_ROWS:
                shape.append(state_rows)
            else:  # 0 (no capacity chosen at load) keeps preparation's working-set count
                shape.append(snapshot_rows or int(dim.size))
        else:
            shape.append(int(dim.size))
    return tuple(shape)


def paged_buffers(decls: Iterable[mf.BufferDecl]) -> list[str]:
    """Names of the buffers holding per-page storage (leading dimension ``CACHE_PAGES``), in declaration
    order: what a page's copy to and from the host tier moves."""
    return [d.name for d in decls if d.shape and d.shape[0].symbol == mf.DIM_SYMBOL_CACHE_PAGES]


def rank_declarations(execution: mf.ExecutionManifest, rank: int) -> dict[str, mf.BufferDecl]:
    """The buffer declarations rank ``rank`` allocates, in declaration order: a name declared once
    (replicated) as it is, a per-rank name (declared once for each rank) by its ``rank``'s declaration."""
    declared: dict[str, list[mf.BufferDecl]] = {}
    for decl in execution.buffers:
        declared.setdefault(decl.name, []).append(decl)
    chosen: dict[str, mf.BufferDecl] = {}
    for name, decls in declared.items():
        mine = decls[0] if len(decls) == 1 else next((d for d in decls if d.rank == rank), None)
        if mine is None:
            raise ContractError(f"per-rank buffer {name!r} has no declaration for rank {rank}")
        chosen[name] = mine
    return chosen
