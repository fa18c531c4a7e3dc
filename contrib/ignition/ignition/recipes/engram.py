"""Engram for the Llama recipe: a seeded hashed n-gram memory table read through host staging.

Owns what ``ignition build llama-synthetic --engram`` adds to a core: the table's hash (n-gram orders 2
and 3, two heads per order, one small prime per (order, head), seeded odd int64 multipliers), its seeded
float32 rows in the WEIGHTS resource ``engram.table`` (rows of every (order, head) band, in band order),
the transport entry ``engram.rows`` ``[P, gathered rows x row width]`` the runtime stages each packed
token's rows into (one copy per execution frame: the two host staging frames), the projection
``engram.proj`` ``[hidden, gathered rows x row width]``, and the ``linear_add`` node that adds the
projected rows to the residual stream right after the token embedding (the input of the first layer).

The hash is the runtime's (:mod:`helios_core.runtime.engram`): for the packed token at position ``p``,
``mix_n = XOR over i < n of t_{p-i} * m_i`` (wrapping int64, ``pad_id`` before the start), and the row of
head ``h`` of order ``n`` is ``mix_n mod prime_{n,h}`` past the bands before it. The host hashes every
input id, so the decode programs of an Engram core take their pending token from the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from helios_core.wire import manifest_pb2 as mf
from ignition.preparation.program import ManifestBuilder, ProgramBuilder, View, WeightResource, prefix

ENGRAM_TABLE_RESOURCE = "engram.table"
ENGRAM_ROWS_ENTRY = "engram.rows"
ENGRAM_SEED = 0xE4A6
"""Seed of the synthetic table's multipliers, rows and projection."""


@dataclass(frozen=True)
class EngramShape:
    """The hash and row geometry of one Engram table."""

    max_order: int
    heads_per_order: int
    primes: tuple[int, ...]
    """Per (order, head), order-major."""
    row_width: int
    pad_id: int = 0

    @property
    def gathered(self) -> int:
        """Rows a packed token gathers."""
        return (self.max_order - 1) * self.heads_per_order

    @property
    def table_rows(self) -> int:
        return sum(self.primes)

    @property
    def staged_width(self) -> int:
        """Values a packed token's staged row holds (its gathered rows side by side)."""
        return self.gathered * self.row_width


def engram_shape(hidden: int) -> EngramShape:
    """The table of a synthetic shape of ``hidden`` width: max order 3, 2 heads an order, small primes,
    rows of ``hidden / 4`` values (at least 8)."""
    return EngramShape(max_order=3, heads_per_order=2, primes=(61, 67, 71, 73), row_width=max(hidden // 4, 8))


@dataclass(frozen=True)
class EngramViews:
    """What the programs read: the staged rows and the projection."""

    rows: View
    projection: View


def engram_multipliers(shape: EngramShape, seed: int = ENGRAM_SEED) -> tuple[int, ...]:
    """One odd int64 multiplier per offset 0..max_order-1, seeded."""
    draws = np.random.default_rng(seed).integers(0, 2**62, size=shape.max_order, dtype=np.int64)
    return tuple(int(d) * 2 + 1 for d in draws)


def declare_engram(
    builder: ManifestBuilder, shape: EngramShape, hidden: int, packed: int, *, bf16: bool, seed: int = ENGRAM_SEED
) -> EngramViews:
    """Declare the table (its resource and ``EngramTable``), the staging entry of ``packed`` tokens and the
    projection weight (bf16 when asked; the table rows stay float32)."""
    rng = np.random.default_rng(seed + 1)
    table = rng.standard_normal((shape.table_rows, shape.row_width)).astype(np.float32)
    projection = (rng.standard_normal((hidden, shape.staged_width)) / np.sqrt(shape.staged_width)).astype(np.float32)
    resource = builder.weight_resources.setdefault(ENGRAM_TABLE_RESOURCE, WeightResource(ENGRAM_TABLE_RESOURCE))
    if resource.nbytes:
        raise ValueError(f"resource {ENGRAM_TABLE_RESOURCE!r} is declared twice")
    resource.append(table.astype("<f4").tobytes())
    rows = builder.transport_entry(ENGRAM_ROWS_ENTRY, mf.DTYPE_F32, [packed, shape.staged_width])
    builder.manifest.engram_tables.add(
        name="engram",
        buffer=ENGRAM_ROWS_ENTRY,
        row_nbytes=shape.row_width * 4,
        rows=packed * shape.gathered,
        resource_id=ENGRAM_TABLE_RESOURCE,
        table_rows=shape.table_rows,
        row_width=shape.row_width,
        dtype=mf.DTYPE_F32,
        max_order=shape.max_order,
        heads_per_order=shape.heads_per_order,
        primes=list(shape.primes),
        multipliers=list(engram_multipliers(shape, seed)),
        pad_id=shape.pad_id,
        frames=2,
    )
    weight = builder.weight("engram.proj", projection, "weights.engram", bf16=bf16)
    return EngramViews(rows=rows, projection=weight)


def add_engram(prog: ProgramBuilder, views: EngramViews, h: View, label: str) -> None:
    """``h += staged rows @ projection.T`` over the program's ``h.shape[0]`` packed tokens."""
    tokens = h.shape[0]
    prog.node(
        "linear_add",
        {"x": prefix(views.rows, tokens), "weight": views.projection, "residual": h, "out": h},
        name=f"{label}engram",
    )
