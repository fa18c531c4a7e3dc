"""Building execution manifests: buffers, weight resources, transport and programs.

Owns the bookkeeping a recipe would otherwise repeat: registering buffers
once, packing weight arrays into resources at recorded offsets, declaring
transport entries, and writing program nodes that name op-catalogue
operators over buffer views. Recipes say *what* the model computes; this
module turns it into ``ExecutionManifest`` messages.

Tensor-parallel builds (``ManifestBuilder(tensor_parallel=N)``) declare a per-rank weight as N
``BufferDecl`` of one name, rank 0..N-1, each filled from a resource of its own rank
(:meth:`ManifestBuilder.rank_weight`); every other buffer is declared once (rank 0: replicated).
Such a builder also lists each rank's stored tensors as a ``WeightCatalog`` (version 1): a whole
shard, or the parts a recipe names within it (:class:`CatalogPart`: a source tensor's real rows of a
zero-padded or packed shard).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from helios_core.wire import container_pb2 as cb
from helios_core.wire import contract_pb2 as ct
from helios_core.wire import manifest_pb2 as mf

WEIGHT_ALIGNMENT = 64
"""Byte alignment of each weight buffer inside its resource."""

_NUMPY_TO_WIRE: dict[np.dtype[np.generic], int] = {
    np.dtype(np.float32): mf.DTYPE_F32,
    np.dtype(np.float16): mf.DTYPE_F16,
    np.dtype(np.int32): mf.DTYPE_I32,
    np.dtype(np.int64): mf.DTYPE_I64,
    np.dtype(np.uint8): mf.DTYPE_U8,
    np.dtype(np.uint32): mf.DTYPE_U32,
    np.dtype(np.uint64): mf.DTYPE_U64,
}


@dataclass(frozen=True)
class View:
    """A contiguous view of a buffer or transport entry."""

    buffer: str
    shape: tuple[int, ...]
    element_offset: int = 0

    def to_wire(self) -> mf.BufferView:
        return mf.BufferView(buffer=self.buffer, element_offset=self.element_offset, shape=list(self.shape))


@dataclass
class WeightResource:
    """Weight arrays packed into one resource's decoded bytes."""

    id: str
    parts: list[bytes] = field(default_factory=list)
    nbytes: int = 0
    rank: int = 0
    """The tensor-parallel rank that loads it (0 also for the resources every rank shares)."""

    def append(self, data: bytes) -> int:
        pad = (-self.nbytes) % WEIGHT_ALIGNMENT
        if pad:
            self.parts.append(b"\0" * pad)
            self.nbytes += pad
        offset = self.nbytes
        self.parts.append(data)
        self.nbytes += len(data)
        return offset

    def payload(self) -> bytes:
        return b"".join(self.parts)


AttributeValue = int | float | str | Sequence[int] | Sequence[float]


class ProgramBuilder:
    """Nodes of one program, in execution order."""

    def __init__(self, name: str, operation: int) -> None:
        self.program = mf.ProgramDecl(name=name, operation=operation)  # type: ignore[arg-type]
        self._names: set[str] = set()

    def node(
        self,
        op: str,
        args: Mapping[str, View],
        attributes: Mapping[str, AttributeValue] | None = None,
        *,
        name: str | None = None,
        version: int = 1,
    ) -> None:
        """Append a node naming ``op`` at ``version`` over ``args``."""
        base = name or op
        unique = base
        counter = 1
        while unique in self._names:
            counter += 1
            unique = f"{base}.{counter}"
        self._names.add(unique)
        node = self.program.nodes.add(name=unique)
        node.op.name = op
        node.op.version = version
        for arg_name, view in args.items():
            node.args.add(name=arg_name, view=view.to_wire())
        for attr_name, value in (attributes or {}).items():
            set_attribute(node, attr_name, value)


def set_attribute(node: mf.Node, name: str, value: AttributeValue) -> None:
    """Append attribute ``name`` to ``node``: an int (bools as 0/1), float, string, ints or floats."""
    attr = node.attributes.add(name=name)
    if isinstance(value, bool | int):
        attr.int_value = int(value)
    elif isinstance(value, float):
        attr.float_value = value
    elif isinstance(value, str):
        attr.string_value = value
    elif all(isinstance(v, int) for v in value):
        attr.ints.values.extend(int(v) for v in value)
    else:
        attr.floats.values.extend(float(v) for v in value)


class ManifestBuilder:
    """Accumulates buffers, transport entries, programs and weight resources."""

    def __init__(self, *, frames: int = 2, abi_label: str = "helios-exec-1", tensor_parallel: int = 0) -> None:
        """``tensor_parallel`` N >= 1 declares an N-rank manifest (``ranks = N``) with weight catalogs;
        0 a one-rank manifest without them."""
        if tensor_parallel < 0:
            raise ValueError(f"tensor_parallel must be 0 (none) or a rank count, got {tensor_parallel}")
        self.tensor_parallel = tensor_parallel
        self.ranks = max(tensor_parallel, 1)
        self.manifest = mf.ExecutionManifest(abi_label=abi_label, ranks=self.ranks, op_catalogue=1)
        self.manifest.transport.frames = frames
        self._buffers: dict[str, mf.BufferDecl] = {}
        self._transport: dict[str, mf.TransportEntry] = {}
        self.weight_resources: dict[str, WeightResource] = {}
        self._catalog: list[tuple[int | None, cb.CatalogTensor]] = []
        """Every weights buffer's stored view: (its rank, or None when every rank loads it, the view)."""

    # -- buffers ---------------------------------------------------------
    def buffer(
        self,
        name: str,
        role: int,
        dtype: int,
        shape: Sequence[int],
        *,
        leading_symbol: int = mf.DIM_SYMBOL_UNSPECIFIED,
    ) -> View:
        """Declare a device buffer; returns a view of the whole buffer."""
        if name in self._buffers or name in self._transport:
            raise ValueError(f"buffer {name!r} declared twice")
        decl = self.manifest.buffers.add(name=name, role=role, dtype=dtype)  # type: ignore[arg-type]
        for index, size in enumerate(shape):
            symbol = leading_symbol if index == 0 else mf.DIM_SYMBOL_UNSPECIFIED
            decl.shape.add(size=int(size), symbol=symbol)  # type: ignore[arg-type]
        self._buffers[name] = decl
        return View(name, tuple(int(s) for s in shape))

    def weight(
        self,
        name: str,
        array: npt.NDArray[np.generic],
        resource_id: str,
        *,
        bf16: bool = False,
        source: str | None = None,
    ) -> View:
        """Declare a weights buffer holding ``array`` (stored as bf16 bit patterns when asked), loaded by
        every rank; ``source`` names the tensor in the weight catalogs (default: ``name``)."""
        if resource_id in self.weight_resources and self.weight_resources[resource_id].rank != 0:
            raise ValueError(f"resource {resource_id!r} belongs to rank {self.weight_resources[resource_id].rank}")
        resource = self.weight_resources.setdefault(resource_id, WeightResource(resource_id))
        dtype, offset = self._store(resource, array, bf16)
        view = self.buffer(name, mf.BUFFER_ROLE_WEIGHTS, dtype, array.shape)
        decl = self._buffers[name]
        decl.resource_id = resource_id
        decl.resource_offset = offset
        self._catalog.append((None, _catalog_tensor(source or name, resource_id, offset, dtype, array.shape)))
        return view

    def rank_weight(
        self,
        name: str,
        shards: Sequence[npt.NDArray[np.generic]],
        resource_id: str,
        *,
        bf16: bool = False,
        source: str | None = None,
        parts: Sequence[Sequence[CatalogPart]] | None = None,
    ) -> View:
        """Declare a per-rank weights buffer: one ``BufferDecl`` named ``name`` for each rank r, holding
        ``shards[r]``, stored in the resource ``{resource_id}.rank{r}`` of rank r (shards of one shape).

        Rank r's weight catalog lists ``parts[r]`` (each at its start within the stored shard), or,
        without ``parts``, the whole shard under ``source`` (default: ``name``)."""
        if len(shards) != self.ranks:
            raise ValueError(f"per-rank weight {name!r} has {len(shards)} shards for {self.ranks} ranks")
        if parts is not None and len(parts) != self.ranks:
            raise ValueError(f"per-rank weight {name!r} lists catalog parts of {len(parts)} ranks, not {self.ranks}")
        shapes = {tuple(shard.shape) for shard in shards}
        if len(shapes) != 1:
            raise ValueError(f"the shards of per-rank weight {name!r} differ in shape: {sorted(shapes)}")
        if name in self._buffers or name in self._transport:
            raise ValueError(f"buffer {name!r} declared twice")
        view: View | None = None
        for rank, shard in enumerate(shards):
            rid = f"{resource_id}.rank{rank}"
            resource = self.weight_resources.setdefault(rid, WeightResource(rid, rank=rank))
            if resource.rank != rank:
                raise ValueError(f"resource {rid!r} belongs to rank {resource.rank}, not {rank}")
            dtype, offset = self._store(resource, shard, bf16)
            decl = self.manifest.buffers.add(
                name=name,
                role=mf.BUFFER_ROLE_WEIGHTS,
                dtype=dtype,  # type: ignore[arg-type]
                resource_id=rid,
                resource_offset=offset,
                rank=rank,
            )
            for size in shard.shape:
                decl.shape.add(size=int(size))
            if rank == 0:
                self._buffers[name] = decl
            if parts is None:
                self._catalog.append((rank, _catalog_tensor(source or name, rid, offset, dtype, shard.shape)))
                continue
            itemsize = 2 if dtype == mf.DTYPE_BF16 else shard.dtype.itemsize
            for part in parts[rank]:
                if part.start < 0 or part.start + math.prod(part.shape) > shard.size:
                    raise ValueError(f"catalog part {part.name!r} lies outside rank {rank}'s shard of {name!r}")
                start = offset + part.start * itemsize
                self._catalog.append((rank, _catalog_tensor(part.name, rid, start, dtype, part.shape)))
            view = View(name, tuple(int(s) for s in shard.shape))
        if view is None:
            raise ValueError(f"per-rank weight {name!r} has no shards")
        return view

    def weight_catalogs(self) -> list[cb.WeightCatalog]:
        """One catalog (version 1) a rank of a tensor-parallel manifest: the weights every rank loads and
        that rank's own, in declaration order; none for a manifest built without ``tensor_parallel``."""
        if not self.tensor_parallel:
            return []
        catalogs = []
        for rank in range(self.ranks):
            catalog = cb.WeightCatalog(version=1, rank=rank)
            catalog.tensors.extend(tensor for owner, tensor in self._catalog if owner in (None, rank))
            catalogs.append(catalog)
        return catalogs

    @staticmethod
    def _store(resource: WeightResource, array: npt.NDArray[np.generic], bf16: bool) -> tuple[int, int]:
        """Append ``array``'s bytes (bf16 bit patterns when asked) to ``resource``; returns (dtype, offset)."""
        if bf16:
            data = _to_bf16_bits(np.ascontiguousarray(array, dtype=np.float32))
            dtype: int = mf.DTYPE_BF16
        else:
            contiguous = np.ascontiguousarray(array)
            data = contiguous.tobytes()
            dtype = _NUMPY_TO_WIRE[contiguous.dtype]
        return dtype, resource.append(data)

    def transport_entry(self, name: str, dtype: int, shape: Sequence[int]) -> View:
        """Declare a host-fed transport destination (replicated per frame by the runtime)."""
        if name in self._buffers or name in self._transport:
            raise ValueError(f"transport entry {name!r} declared twice")
        entry = self.manifest.transport.entries.add(name=name, dtype=dtype, shape=list(shape))  # type: ignore[arg-type]
        self._transport[name] = entry
        return View(name, tuple(int(s) for s in shape))

    def entry(self, name: str) -> mf.TransportEntry:
        return self._transport[name]

    def completion(self, field_id: int, buffer: str) -> None:
        """Register a completion record field held by ``buffer``."""
        self.manifest.completion.add(field=field_id, buffer=buffer)  # type: ignore[arg-type]

    def add_program(self, program: ProgramBuilder) -> None:
        self.manifest.programs.append(program.program)


@dataclass(frozen=True)
class CatalogPart:
    """A tensor a rank's weight catalog lists inside one of its stored per-rank shards (a source tensor's
    real rows or columns, where the shard also holds padding or other tensors)."""

    name: str
    """The source tensor's name."""
    start: int
    """The element of the stored shard (row-major) where the part's first element lies."""
    shape: tuple[int, ...]
    """The part's real extent (its rows keep the stored shard's row length)."""


def _catalog_tensor(name: str, resource_id: str, offset: int, dtype: int, shape: Sequence[int]) -> cb.CatalogTensor:
    return cb.CatalogTensor(
        name=name,
        resource_id=resource_id,
        byte_offset=offset,
        dtype=dtype,  # type: ignore[arg-type]
        shape=[int(s) for s in shape],
    )


_BF16_CHUNK = 1 << 20
_BF16_POOL: list[ThreadPoolExecutor] = []


def _to_bf16_bits(values: npt.NDArray[np.float32]) -> bytes:
    """Round-to-nearest-even float32 -> bfloat16 bit patterns.

    ``(bits + 0x7FFF + ((bits >> 16) & 1)) >> 16`` in uint32 arithmetic (its wrap-around is exactly
    the 16-bit truncation of the wider sum), in chunks of 1 Mi values on a thread pool: numpy
    releases the GIL, so large weights round on every core.
    """
    bits = np.ascontiguousarray(values, dtype=np.float32).reshape(-1).view(np.uint32)
    out = np.empty(bits.size, dtype=np.uint16)

    def work(begin: int) -> None:
        word = bits[begin : begin + _BF16_CHUNK]
        rounded = word >> np.uint32(16)
        rounded &= np.uint32(1)
        rounded += np.uint32(0x7FFF)
        rounded += word
        rounded >>= np.uint32(16)
        out[begin : begin + _BF16_CHUNK] = rounded

    starts = range(0, bits.size, _BF16_CHUNK)
    if bits.size <= _BF16_CHUNK:
        for begin in starts:
            work(begin)
    else:
        if not _BF16_POOL:
            _BF16_POOL.append(ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="bf16"))
        list(_BF16_POOL[0].map(work, starts))
    return out.tobytes()


def prefix(view: View, *leading: int) -> View:
    """The view restricted to its first ``leading`` extents (contiguous prefix)."""
    shape = (*leading, *view.shape[len(leading) :])
    if math.prod(shape) > math.prod(view.shape):
        raise ValueError(f"prefix {shape} exceeds {view.shape} of {view.buffer}")
    return View(view.buffer, shape, view.element_offset)


def binding(
    destination: str,
    source: int,
    indexing: int,
    *,
    padding: int = 0,
    offset: int = 0,
    constant: int = 0,
) -> ct.ValueBinding:
    """A ValueBinding message."""
    return ct.ValueBinding(
        destination=destination,
        source=source,  # type: ignore[arg-type]
        indexing=indexing,  # type: ignore[arg-type]
        padding=padding,
        offset=offset,
        constant=constant,
    )
