"""The CUDA backend: captured programs executed as CUDA graphs on one NVIDIA GPU.

Owns, for one loaded core on one device, everything serving touches, from construction through the
confirmed execution drain of :meth:`CudaBackend.close`: the driver context (a
:class:`~helios_core.backends.cuda_driver.Context`, with its stream), every ``BufferDecl`` as one
device allocation (weights uploaded once from their WEIGHTS resources, decoded a few at once on host
threads by :mod:`~helios_core.backends.weights_loading`, everything else zeroed), the
modules and functions of the device's target, each execution frame's transport staging and
completion record, one instantiated CUDA graph per program and frame, and one event per frame (its
fence). Serving then only writes staging memory, launches graph executions and reads completion
records: no allocation, no compilation, no capture.

Transport (per frame, :func:`plan_transport`): entries are packed :data:`STAGING_ALIGNMENT`-aligned,
in declaration order, into one pinned host block with a device block of the same layout; a graph
starts with host-to-device copies of the spans of those bytes its launches reference
(:func:`copy_spans`: one copy, or one per run of referenced entries where an unreferenced stretch of
more than :data:`TRANSPORT_COPY_LIMIT` bytes lies between them). The exception are entries larger than
:data:`TRANSPORT_COPY_LIMIT` whose every binding is a source read for a few rows only
(:data:`SPARSE_SOURCES`: grammar masks, the prompt histogram; :func:`sparse_entries`): they live in one
mapped pinned host block that kernels read directly through its device address (zero copy). Whatever
a kernel reads whole stays copied however large: a zero-copy read crosses PCIe at every access, and
the page table, read by every attention launch of a round, made a batch-1 verification round of eight
query rows over a 1400-token history wait 2.7 ms for the GPU mapped against 1.36 ms copied (H200,
``benchmarks/speculative.py``; ``docs/benchmarks.md``).

Completion (per frame, :func:`plan_completion`): the COMPLETION buffers packed the same way into
one device block and a pinned host mirror; a graph ends with one device-to-host copy of the span of
completion bytes its launches reference.

Fences: :meth:`CudaBackend.run` launches the frame's graph on the context's stream and records the
frame's event. :meth:`CudaBackend.transport` waits for that event before handing out the staging
arrays (the host never rewrites staging the GPU may still read) and :meth:`CudaBackend.completion`
waits for it before handing out the mirror.

Graphs are built from the node list (:func:`graph_steps`): the copy-in nodes, then every launch of the
device's target in node and list order, each depending on the one before (a programmatic edge when
the launch is marked ``programmatic_wait``, programmatic launches are enabled and the previous node
is a kernel), then the copy-out node.

Collective nodes (the catalogue's ``COLLECTIVE_OPERATORS``: ``all_reduce``, ``all_gather``,
``broadcast``) have no launch: at the node's place in that chain the graph gets a child graph node
holding the NCCL call (:mod:`~helios_core.backends.nccl`) captured on a stream in thread-local mode
(:meth:`~helios_core.backends.cuda_driver.Context.capture`), joined to its neighbours by plain edges:
the kernel after it waits for it to finish, never as a programmatic dependent, whatever its
``programmatic_wait``. What each collective reads and writes (:func:`plan_collective`): its ``x`` and
``out`` views of device buffers (never transport entries or completion buffers), the same dtype, the
element counts the operator fixes. A backend holds one rank (``rank``, default 0) on one device: it
allocates that rank's declaration of each per-rank buffer
(:func:`~helios_core.backends.buffers.rank_declarations`), uploads it from that rank's WEIGHTS
resources, and runs its collectives on the NCCL communicator it is given (:func:`check_rank`: rank
``r`` of a group of the core's size; a core of several ranks is refused without one). A one-rank core
with collective nodes gets a one-rank communicator of its own, so each collective is a copy on the
device (nothing at all when ``out`` is ``x``). The communicator is destroyed by
:meth:`CudaBackend.close` after the graphs that hold its collectives. A core without collective nodes
never loads NCCL. The ranks of a core run as one backend a GPU behind
:class:`~helios_core.backends.ranks.RankedBackend` (``helios_core.runtime.native_model``), all reading one
host staging a frame (:class:`FrameStaging`, :func:`allocate_staging`: page-locked and portable, so each
GPU's copy-in nodes read it, its mapped block at each context's own address of it).

Launch parameters resolve buffer names to this frame's transport and completion addresses and to the
shared buffers' addresses otherwise
(:func:`frame_addresses`); an empty buffer name passes a null address.

Host tier of cache pages (:meth:`CudaBackend.reserve_host_pages`, once, at load): one page-locked host
block of ``count`` slots, each holding one page of every buffer with a ``CACHE_PAGES`` leading
dimension (its planes at :data:`STAGING_ALIGNMENT`-aligned offsets). :meth:`CudaBackend.copy_page_to_host`
and :meth:`CudaBackend.copy_page_to_device` enqueue one asynchronous copy per plane on the stream the
graphs run on and return at once: stream order places each copy after every round launched before it
and before every round launched after, and each round's frame fence (recorded after its graph) covers
the copies enqueued before that round; :meth:`CudaBackend.drain` and :meth:`CudaBackend.close`
synchronize the stream, so no copy outlives the backend. The host tier of checkpoints
(:meth:`CudaBackend.reserve_host_snapshots`) is laid out and copied the same way, one slot holding a
request's rows of every buffer with a ``SNAPSHOT_ROWS`` leading dimension
(:meth:`CudaBackend.copy_snapshot_to_host`, :meth:`CudaBackend.copy_snapshot_to_device`).

Buffer shapes follow the reference backend exactly (:func:`runtime_shape`): a leading
``CACHE_PAGES`` or ``STATE_ROWS`` dimension takes the load-time extent, ``SNAPSHOT_ROWS`` the chosen
snapshot rows (0 keeps preparation's count).

Its size: graph building, staging, fences, completion and tuning of one backend over one device
context, which all share its buffer and graph tables; the driver bindings live in
:mod:`~helios_core.backends.cuda_driver`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np
from numpy.typing import NDArray

from helios_core.backends.buffers import SYMBOLIC, numpy_dtype, paged_buffers, rank_declarations, runtime_shape
from helios_core.backends.cuda_driver import Context, CudaError, GraphBuilder, HostBuffer, open_context, pack_params
from helios_core.backends.nccl import NcclCommunicator, NcclError, NcclUnavailableError, load_library, nccl_dtype
from helios_core.backends.weights_loading import DecodedResource, decode_resources
from helios_core.container.reader import CoreFile
from helios_core.contract.prepared import PreparedContract
from helios_core.errors import ContractError, HeliosError, StartupError, UnsupportedFeatureError
from helios_core.ops.catalogue import COLLECTIVE_OPERATORS
from helios_core.wire import container_pb2 as cb
from helios_core.wire import contract_pb2 as ct
from helios_core.wire import manifest_pb2 as mf

__all__ = [
    "STAGING_ALIGNMENT",
    "TRANSPORT_COPY_LIMIT",
    "BlockLayout",
    "CollectiveCall",
    "CudaBackend",
    "FrameStaging",
    "GraphStep",
    "Slot",
    "TransportLayout",
    "allocate_staging",
    "check_rank",
    "check_staging",
    "check_targets",
    "copy_spans",
    "frame_addresses",
    "graph_steps",
    "launch_span",
    "plan_collective",
    "plan_completion",
    "plan_transport",
    "reserved_device_nbytes",
    "runtime_shape",
    "sparse_entries",
]

AnyArray = NDArray[Any]

TRANSPORT_COPY_LIMIT = 64 * 1024
"""Transport entries read for a few rows only (:data:`SPARSE_SOURCES`) and larger than this many bytes
stay in mapped host memory that kernels read in place; every other entry is copied to the device by
each graph that reads it. Also the longest unreferenced stretch a graph's copy-in spans
(:func:`copy_spans`)."""

SPARSE_SOURCES = frozenset(
    {ct.VALUE_SOURCE_GRAMMAR_MASK, ct.VALUE_SOURCE_CANDIDATE_GRAMMAR_MASKS, ct.VALUE_SOURCE_PROMPT_HISTOGRAM}
)
"""Value sources whose rows a program reads only for some lanes (constrained lanes, lanes with
penalties): large entries of these alone may be mapped rather than copied."""

STAGING_ALIGNMENT = 256
"""Byte alignment of every entry within a staging, mapped or completion block."""


# ----------------------------------------------------------------------------------------------
# pure planning: shapes, layouts, spans, addresses (no driver involved)
# ----------------------------------------------------------------------------------------------


def _align(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


@dataclass(frozen=True)
class Slot:
    """One array's place in a block: byte offset, byte size, dtype and shape."""

    name: str
    offset: int
    nbytes: int
    dtype: np.dtype[Any]
    shape: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class BlockLayout:
    """Arrays packed into one allocation, each at an aligned offset, in declaration order."""

    slots: Mapping[str, Slot]
    nbytes: int
    """Bytes of the block (a multiple of the alignment; 0 when it holds nothing)."""


@dataclass(frozen=True)
class TransportLayout:
    """One frame's transport: the copied block and the mapped block."""

    copied: BlockLayout
    mapped: BlockLayout

    def slot(self, name: str) -> tuple[Slot, bool] | None:
        """The entry's slot and whether it is mapped; None for a name that is no entry."""
        found = self.copied.slots.get(name)
        if found is not None:
            return found, False
        found = self.mapped.slots.get(name)
        return None if found is None else (found, True)


def plan_block(
    arrays: Iterable[tuple[str, np.dtype[Any], tuple[int, ...]]], alignment: int = STAGING_ALIGNMENT
) -> BlockLayout:
    """Pack ``(name, dtype, shape)`` arrays at ``alignment``-aligned offsets, in the given order."""
    slots: dict[str, Slot] = {}
    cursor = 0
    for name, dtype, shape in arrays:
        offset = _align(cursor, alignment)
        nbytes = math.prod(shape) * dtype.itemsize
        slots[name] = Slot(name, offset, nbytes, dtype, shape)
        cursor = offset + nbytes
    return BlockLayout(slots, _align(cursor, alignment))


def sparse_entries(contract: PreparedContract) -> frozenset[str]:
    """Transport entries every binding of which, in every graph, is one of :data:`SPARSE_SOURCES`."""
    sources: dict[str, set[int]] = {}
    for graph in contract.graphs.values():
        for binding in graph.contract.bindings:
            sources.setdefault(binding.destination, set()).add(int(binding.source))
    return frozenset(name for name, bound in sources.items() if bound <= SPARSE_SOURCES)


def plan_transport(
    transport: mf.Transport,
    *,
    sparse: Iterable[str] = (),
    copy_limit: int = TRANSPORT_COPY_LIMIT,
    alignment: int = STAGING_ALIGNMENT,
) -> TransportLayout:
    """Place each transport entry: an entry named in ``sparse`` (read for a few rows only) of more than
    ``copy_limit`` bytes in the mapped block, every other entry in the copied block."""
    sparse = frozenset(sparse)
    copied: list[tuple[str, np.dtype[Any], tuple[int, ...]]] = []
    mapped: list[tuple[str, np.dtype[Any], tuple[int, ...]]] = []
    for entry in transport.entries:
        dtype = numpy_dtype(entry.name, entry.dtype)
        shape = tuple(int(s) for s in entry.shape)
        large = math.prod(shape) * dtype.itemsize > copy_limit
        (mapped if large and entry.name in sparse else copied).append((entry.name, dtype, shape))
    return TransportLayout(plan_block(copied, alignment), plan_block(mapped, alignment))


def plan_completion(
    decls: Sequence[mf.BufferDecl], shapes: Mapping[str, tuple[int, ...]], alignment: int = STAGING_ALIGNMENT
) -> BlockLayout:
    """Place each COMPLETION buffer of ``decls`` (at its runtime shape) in one block."""
    return plan_block(
        ((d.name, numpy_dtype(d.name, d.dtype), shapes[d.name]) for d in decls if d.role == mf.BUFFER_ROLE_COMPLETION),
        alignment,
    )


def target_launches(program: mf.ProgramDecl, target: str) -> list[tuple[mf.Node, mf.KernelLaunch]]:
    """The program's launches for ``target``, in node order and, within a node, list order."""
    return [(node, launch) for node in program.nodes for launch in node.launches if launch.target == target]


@dataclass(frozen=True)
class GraphStep:
    """One node of a program's graph chain: a kernel launch, or a collective (``launch`` None)."""

    node: mf.Node
    launch: mf.KernelLaunch | None


def graph_steps(program: mf.ProgramDecl, target: str) -> list[GraphStep]:
    """The program's graph chain in node order: each ``target`` launch (list order within a node) and
    each collective node once, where it stands."""
    steps: list[GraphStep] = []
    for node in program.nodes:
        if node.op.name in COLLECTIVE_OPERATORS:
            steps.append(GraphStep(node, None))
            continue
        steps.extend(GraphStep(node, launch) for launch in node.launches if launch.target == target)
    return steps


@dataclass(frozen=True)
class CollectiveCall:
    """What one collective node asks of NCCL: buffers and element offsets, counts, element type, root."""

    operator: str
    source: str
    source_offset: int
    """Element offset of ``x`` in ``source``."""
    destination: str
    destination_offset: int
    count: int
    """Elements each rank contributes (``x``'s elements)."""
    dtype: int
    """Wire dtype of both buffers."""
    root: int = 0


def plan_collective(
    node: mf.Node, dtypes: Mapping[str, int], elements: Mapping[str, int], ranks: int
) -> CollectiveCall:
    """Check a collective node against its buffers (``dtypes`` and ``elements``: every device buffer's wire
    dtype and element count) and say what NCCL is asked; :class:`ContractError` names what is wrong."""
    where = f"node {node.name!r} ({node.op.name})"
    args = {arg.name: arg.view for arg in node.args}
    missing = [name for name in ("x", "out") if name not in args]
    if missing:
        raise ContractError(f"{where} lacks its {' and '.join(missing)} argument")
    x, out = args["x"], args["out"]
    for role, view in (("x", x), ("out", out)):
        if view.buffer not in dtypes:
            raise ContractError(
                f"{where}: {role} names {view.buffer!r}, which is no device buffer (a collective reads and writes "
                "buffers, never transport entries or completion buffers)"
            )
        end = int(view.element_offset) + math.prod(int(s) for s in view.shape)
        if end > elements[view.buffer]:
            raise ContractError(
                f"{where}: {role} ends at element {end} of {view.buffer!r}, which holds {elements[view.buffer]}"
            )
    if dtypes[x.buffer] != dtypes[out.buffer]:
        raise ContractError(f"{where}: x ({x.buffer!r}) and out ({out.buffer!r}) have different dtypes")
    count = math.prod(int(s) for s in x.shape)
    produced = math.prod(int(s) for s in out.shape)
    attributes = {attr.name: attr for attr in node.attributes}
    root = 0
    if node.op.name == "all_gather":
        if produced != ranks * count:
            raise ContractError(f"{where}: out holds {produced} elements, not {ranks} ranks x {count}")
        if "axis" not in attributes:
            raise ContractError(f"{where} lacks its axis attribute")
        axis = int(attributes["axis"].int_value)
        shape = [int(s) for s in x.shape]
        if not -len(shape) <= axis < len(shape):
            raise ContractError(f"{where}: axis {axis} is outside x of shape {shape}")
        if ranks > 1 and math.prod(shape[: axis % len(shape)]) != 1:
            raise UnsupportedFeatureError(
                f"{where}: gathering along axis {axis} of x of shape {shape} interleaves the ranks' rows, which the "
                "CUDA backend does not do; gather along the leading axis"
            )
    else:
        if produced != count:
            raise ContractError(f"{where}: out holds {produced} elements and x {count}; they must be equal")
        if node.op.name == "broadcast" and "root" in attributes:
            root = int(attributes["root"].int_value)
            if not 0 <= root < ranks:
                raise ContractError(f"{where}: root {root} is outside the ranks [0, {ranks})")
    return CollectiveCall(
        node.op.name, x.buffer, int(x.element_offset), out.buffer, int(out.element_offset), count, dtypes[x.buffer],
        root,
    )  # fmt: skip


def _named_slots(program: mf.ProgramDecl, target: str, block: BlockLayout) -> list[Slot]:
    """The non-empty slots of ``block`` that an address parameter of the program's ``target`` launches
    names, by offset."""
    named = {
        param.buffer
        for _node, launch in target_launches(program, target)
        for param in launch.params
        if param.kind == mf.PARAM_KIND_ADDRESS and param.buffer
    }
    return sorted((block.slots[n] for n in named if n in block.slots and block.slots[n].nbytes), key=lambda s: s.offset)


def launch_span(program: mf.ProgramDecl, target: str, block: BlockLayout) -> tuple[int, int] | None:
    """The byte span ``[start, end)`` of ``block`` covering every slot that an address parameter of the
    program's ``target`` launches names; None when they name none (or only empty slots)."""
    slots = _named_slots(program, target, block)
    if not slots:
        return None
    return slots[0].offset, max(slot.end for slot in slots)


def copy_spans(
    program: mf.ProgramDecl, target: str, block: BlockLayout, *, gap: int = TRANSPORT_COPY_LIMIT
) -> list[tuple[int, int]]:
    """Byte spans ``[start, end)`` of ``block``, by offset, covering every slot the program's ``target``
    launches name: one span, split wherever more than ``gap`` bytes no launch names lie between two
    named slots (so a round does not copy another program's large entries); empty when none is named."""
    spans: list[tuple[int, int]] = []
    for slot in _named_slots(program, target, block):
        if spans and slot.offset - spans[-1][1] <= gap:
            spans[-1] = (spans[-1][0], max(spans[-1][1], slot.end))
        else:
            spans.append((slot.offset, slot.end))
    return spans


def frame_addresses(
    shared: Mapping[str, int],
    transport: TransportLayout,
    copied_base: int,
    mapped_base: int,
    completion: BlockLayout,
    completion_base: int,
) -> dict[str, int]:
    """Device address of every name a launch parameter of one frame may use.

    Transport entries resolve into the frame's device block (copied) or the device address of its
    mapped block; completion buffers into the frame's completion block; every other buffer to its
    shared allocation.
    """
    addresses = {name: copied_base + slot.offset for name, slot in transport.copied.slots.items()}
    addresses.update({name: mapped_base + slot.offset for name, slot in transport.mapped.slots.items()})
    addresses.update(shared)
    addresses.update({name: completion_base + slot.offset for name, slot in completion.slots.items()})
    return addresses


def check_targets(execution: mf.ExecutionManifest, architecture: str) -> None:
    """The core must have launches for ``architecture`` on every node of every program but its collective
    nodes (which have none: the backend runs them through NCCL)."""
    rebuild = f"rebuild it with `ignition build --targets reference,{architecture}`"
    targets = list(execution.targets)
    if architecture not in targets:
        built = f"targets {', '.join(targets)}" if targets else "no GPU target (reference only)"
        raise StartupError(f"the core has {built}, not this GPU's {architecture}; {rebuild}")
    for program in list(execution.programs) + list(execution.tuning_programs):
        if not program.nodes:
            raise StartupError(f"program {program.name!r} has no {architecture} launches; {rebuild}")
        for node in program.nodes:
            if node.op.name in COLLECTIVE_OPERATORS:
                continue
            if not any(launch.target == architecture for launch in node.launches):
                raise StartupError(
                    f"program {program.name!r} node {node.name!r} has no {architecture} launch; {rebuild}"
                )


def reserved_device_nbytes(
    execution: mf.ExecutionManifest,
    *,
    state_rows: int,
    snapshot_rows: int,
    frames: int,
    sparse: Iterable[str] = (),
    copy_limit: int = TRANSPORT_COPY_LIMIT,
    rank: int = 0,
) -> int:
    """Device bytes of everything but the cache planes: buffers, and each frame's copied transport
    block and completion block (what the CUDA backend of ``rank`` allocates besides its cache);
    ``sparse`` as for :func:`plan_transport`."""
    total = 0
    shapes: dict[str, tuple[int, ...]] = {}
    decls = tuple(rank_declarations(execution, rank).values())
    for decl in decls:
        shape = runtime_shape(decl, cache_pages=0, state_rows=state_rows, snapshot_rows=snapshot_rows)
        shapes[decl.name] = shape
        if decl.role in (mf.BUFFER_ROLE_CACHE_PLANE, mf.BUFFER_ROLE_COMPLETION):
            continue
        total += _align(math.prod(shape) * numpy_dtype(decl.name, decl.dtype).itemsize, STAGING_ALIGNMENT)
    transport = plan_transport(execution.transport, sparse=sparse, copy_limit=copy_limit)
    completion = plan_completion(decls, shapes)
    return total + frames * (transport.copied.nbytes + completion.nbytes)


def _view(buffer: HostBuffer, slot: Slot) -> AnyArray:
    """A numpy array of the slot's dtype and shape over ``buffer``'s bytes (no copy)."""
    if slot.nbytes == 0:
        return np.zeros(slot.shape, dtype=slot.dtype)
    raw = buffer.array()[slot.offset : slot.end]
    return raw.view(slot.dtype).reshape(slot.shape)


# ----------------------------------------------------------------------------------------------
# the backend
# ----------------------------------------------------------------------------------------------


@dataclass
class _Frame:
    """One execution frame's staging, completion and fence."""

    host: HostBuffer
    device: int
    mapped: HostBuffer | None
    completion_host: HostBuffer
    completion_device: int
    event: Any
    staging: dict[str, AnyArray]
    records: dict[int, AnyArray]
    addresses: dict[str, int]
    record_view: Mapping[int, AnyArray]
    """``records``, read-only: what :meth:`CudaBackend.completion` hands out."""
    in_flight: bool = False


@dataclass(frozen=True)
class _Shared:
    """A frame-independent device buffer."""

    address: int
    dtype: np.dtype[Any]
    shape: tuple[int, ...]


class CudaBackend:
    """Buffers, staging, graphs and fences of one core on one GPU.

    ``context``, when given, is an open context the backend takes over (it is closed with the
    backend); otherwise the primary context of ``device`` is opened. ``communicator``, when given, is
    the NCCL communicator its collective nodes run on, taken over likewise; otherwise a core with
    collective nodes gets a one-rank communicator at load. ``rank`` is the tensor-parallel rank it holds
    (:func:`check_rank`). ``staging``, when given, is each frame's host staging shared with the other ranks
    of the process (:func:`allocate_staging`; not freed here), else the backend allocates its own.
    Construction that fails half-way releases everything it made before the error propagates.
    """

    def __init__(
        self,
        contract: PreparedContract,
        core: CoreFile,
        *,
        cache_pages: int,
        state_rows: int,
        frames: int = 2,
        snapshot_rows: int = 0,
        device: int = 0,
        programmatic: bool = True,
        context: Context | None = None,
        copy_limit: int = TRANSPORT_COPY_LIMIT,
        communicator: NcclCommunicator | None = None,
        rank: int = 0,
        staging: Sequence[FrameStaging] | None = None,
    ) -> None:
        if cache_pages <= 0 or state_rows <= 0 or frames <= 0:
            raise ValueError(
                f"cache_pages, state_rows and frames must be positive, got {cache_pages}, {state_rows}, {frames}"
            )
        if snapshot_rows < 0:
            raise ValueError(f"snapshot_rows must not be negative, got {snapshot_rows}")
        self._rank = rank
        self._given_staging = tuple(staging) if staging is not None else None
        """Each frame's host staging blocks when the ranks of a process share them (not freed here)."""
        self._decls: tuple[mf.BufferDecl, ...] = ()
        """The buffer declarations this rank allocates (a per-rank buffer's own, the replicated ones)."""
        self._closed = False
        self._frames_count = frames
        self._programmatic = programmatic
        self._context: Context | None = context
        self._communicator: NcclCommunicator | None = communicator
        self._collectives: dict[str, int] = {}
        """Collective nodes captured into each program's graph."""
        self._buffer_dtypes: dict[str, int] = {}
        """Wire dtype of each device buffer (what a collective's NCCL element type comes from)."""
        self._shared: dict[str, _Shared] = {}
        self._frames: list[_Frame] = []
        self._builders: list[GraphBuilder] = []
        self._executables: list[Any] = []
        self._events: list[Any] = []
        self._programs: dict[str, list[Any]] = {}
        self._transport_spans: dict[str, list[tuple[int, int]]] = {}
        self._completion_spans: dict[str, tuple[int, int] | None] = {}
        self._paged: list[str] = []
        self._host_pages: HostBuffer | None = None
        """The host tier's page slots (:meth:`reserve_host_pages`)."""
        self._host_page_count = 0
        self._host_slot_bytes = 0
        self._page_planes: list[tuple[int, int, int]] = []
        """Per paged buffer: (device address, bytes per page, offset within a host slot)."""
        self._cache_pages = cache_pages
        self._snapshot_buffers: list[str] = []
        self._host_snapshots: HostBuffer | None = None
        """The checkpoint host tier's slots (:meth:`reserve_host_snapshots`)."""
        self._host_snapshot_count = 0
        self._host_snapshot_bytes = 0
        self._snapshot_planes: list[tuple[int, int, int]] = []
        """Per snapshot buffer: (device address, bytes per snapshot row, offset within a host slot)."""
        self._snapshot_row_count = 0
        try:
            check_rank(contract, rank, communicator)
            self._decls = tuple(rank_declarations(contract.execution, rank).values())
            self._paged = paged_buffers(self._decls)
            self._snapshot_buffers = [
                d.name for d in self._decls if d.shape and d.shape[0].symbol == mf.DIM_SYMBOL_SNAPSHOT_ROWS
            ]
            if self._context is None:
                self._context = open_context(device)
            self._start(contract, core, cache_pages, state_rows, snapshot_rows, copy_limit)
        except BaseException:
            with contextlib.suppress(HeliosError):  # the startup failure is what the caller needs to see
                self.close()
            raise

    # -- public surface ---------------------------------------------------------------------------
    @property
    def frames(self) -> int:
        """Execution frames (each has its own transport staging, completion record and fence)."""
        return self._frames_count

    @property
    def rank(self) -> int:
        """The tensor-parallel rank whose buffers this backend holds (0 for a one-rank core)."""
        return self._rank

    def abort_collectives(self) -> None:
        """A rank of the group failed: abort this rank's NCCL communicator, so collectives waiting on the device
        for the failed rank end instead of spinning. Programs with collectives cannot run afterwards."""
        if self._communicator is not None and self._context is not None:
            self._context.bind()
            self._communicator.abort()

    @property
    def programs(self) -> tuple[str, ...]:
        """Names of the runnable programs (serving and tuning)."""
        return tuple(self._programs)

    @property
    def architecture(self) -> str:
        """The device's target name (``sm_90a``)."""
        return self._ctx.architecture

    @property
    def collectives(self) -> Mapping[str, int]:
        """How many collective nodes each program's graph holds as captured child graphs."""
        return MappingProxyType(self._collectives)

    @property
    def transport_layout(self) -> TransportLayout:
        return self._transport_layout

    @property
    def completion_layout(self) -> BlockLayout:
        return self._completion_layout

    def transport(self, frame: int) -> dict[str, AnyArray]:
        """The frame's staging arrays by entry name, once the GPU no longer reads them."""
        state = self._frames[self._frame(frame)]
        self._fence(state)
        return state.staging

    def completion(self, frame: int) -> Mapping[int, AnyArray]:
        """The frame's completion record keyed by ``CompletionField`` value, after the frame's fence (the
        same read-only mapping every time, so a reader may keep views of it)."""
        state = self._frames[self._frame(frame)]
        self._fence(state)
        return state.record_view

    def run(self, program: str, frame: int) -> None:
        """Launch ``program``'s graph of ``frame`` and record the frame's fence; returns at once."""
        if self._closed:
            raise CudaError("the CUDA backend is closed")
        variants = self._programs.get(program)
        if variants is None:
            raise ValueError(f"unknown program {program!r}; known: {', '.join(self._programs)}")
        index = self._frame(frame)
        state = self._frames[index]
        context = self._ctx
        context.bind()
        state.in_flight = True
        context.launch_graph(variants[index])
        context.record(state.event)

    def download(self, name: str, *, frame: int = 0) -> AnyArray:
        """A copy of a buffer's device contents (after draining every frame); transport and completion
        names read ``frame``'s copy."""
        address, dtype, shape, host = self._locate(name, frame)
        self.drain()
        if address is None:
            return np.array(host, copy=True)
        out = np.empty(shape, dtype=dtype)
        self._ctx.download(address, out)
        return out

    def upload(self, name: str, array: AnyArray, *, frame: int = 0) -> None:
        """Set a buffer's contents (after draining every frame); a transport entry's staging too."""
        address, dtype, shape, host = self._locate(name, frame)
        values = np.ascontiguousarray(array, dtype=dtype)
        if values.size != math.prod(shape):
            raise ValueError(f"{name!r} holds {math.prod(shape)} elements of shape {shape}, got {values.shape}")
        values = values.reshape(shape)
        self.drain()
        if host is not None:
            host[...] = values
        if address is not None:
            self._ctx.upload(address, values)  # returns once the bytes are on the device

    # -- the host tier of cache pages -------------------------------------------------------------
    def reserve_host_pages(self, count: int) -> None:
        """Page-locked host slots for ``count`` pages of every buffer with a ``CACHE_PAGES`` leading
        dimension, once, at load."""
        if count <= 0 or self._host_page_count:
            raise ValueError(f"host pages are reserved once, a positive count; got {count}")
        planes: list[tuple[int, int, int]] = []
        offset = 0
        for name in self._paged:
            shared = self._shared[name]
            nbytes = math.prod(shared.shape[1:]) * shared.dtype.itemsize
            planes.append((shared.address, nbytes, offset))
            offset = _align(offset + nbytes, STAGING_ALIGNMENT)
        context = self._ctx
        context.bind()
        self._host_pages = context.host_alloc(count * offset)
        self._page_planes = planes
        self._host_slot_bytes = offset
        self._host_page_count = count

    def copy_page_to_host(self, page: int, slot: int) -> None:
        """Enqueue the copy of device page ``page`` of every paged buffer into host slot ``slot``."""
        host = self._check_page_copy(page, slot)
        context = self._ctx
        context.bind()
        base = host.pointer + slot * self._host_slot_bytes
        for address, nbytes, offset in self._page_planes:
            context.copy_to_host_async(base + offset, address + page * nbytes, nbytes)

    def copy_page_to_device(self, slot: int, page: int) -> None:
        """Enqueue the copy of host slot ``slot`` into device page ``page`` of every paged buffer."""
        host = self._check_page_copy(page, slot)
        context = self._ctx
        context.bind()
        base = host.pointer + slot * self._host_slot_bytes
        for address, nbytes, offset in self._page_planes:
            context.copy_to_device_async(address + page * nbytes, base + offset, nbytes)

    def _check_page_copy(self, page: int, slot: int) -> HostBuffer:
        if self._closed:
            raise CudaError("the CUDA backend is closed")
        if self._host_pages is None:
            raise ValueError("no host pages are reserved")
        if not (0 <= page < self._cache_pages and 0 <= slot < self._host_page_count):
            raise ValueError(
                f"page {page} or host slot {slot} is outside [0, {self._cache_pages}) or [0, {self._host_page_count})"
            )
        return self._host_pages

    # -- the host tier of checkpoints --------------------------------------------------------------
    def reserve_host_snapshots(self, count: int, rows: int) -> None:
        """Page-locked host slots for ``count`` checkpoints of ``rows`` rows of every buffer with a
        ``SNAPSHOT_ROWS`` leading dimension, once, at load (laid out as the page slots are)."""
        if count <= 0 or rows <= 0 or self._host_snapshot_count:
            raise ValueError(f"host checkpoint slots are reserved once, a positive count and rows; got {count}, {rows}")
        planes: list[tuple[int, int, int]] = []
        offset = 0
        snapshot_rows = 0
        for name in self._snapshot_buffers:
            shared = self._shared[name]
            snapshot_rows = shared.shape[0] // rows
            nbytes = rows * math.prod(shared.shape[1:]) * shared.dtype.itemsize
            planes.append((shared.address, nbytes, offset))
            offset = _align(offset + nbytes, STAGING_ALIGNMENT)
        if not snapshot_rows:
            raise ValueError("the core has no snapshot rows to copy (its prefix reuse keeps no checkpoints)")
        context = self._ctx
        context.bind()
        self._host_snapshots = context.host_alloc(count * offset)
        self._snapshot_planes = planes
        self._host_snapshot_bytes = offset
        self._host_snapshot_count = count
        self._snapshot_row_count = snapshot_rows

    def copy_snapshot_to_host(self, row: int, slot: int) -> None:
        """Enqueue the copy of snapshot row ``row`` of every snapshot buffer into host slot ``slot``."""
        host = self._check_snapshot_copy(row, slot)
        context = self._ctx
        context.bind()
        base = host.pointer + slot * self._host_snapshot_bytes
        for address, nbytes, offset in self._snapshot_planes:
            context.copy_to_host_async(base + offset, address + row * nbytes, nbytes)

    def copy_snapshot_to_device(self, slot: int, row: int) -> None:
        """Enqueue the copy of host slot ``slot`` into snapshot row ``row`` of every snapshot buffer."""
        host = self._check_snapshot_copy(row, slot)
        context = self._ctx
        context.bind()
        base = host.pointer + slot * self._host_snapshot_bytes
        for address, nbytes, offset in self._snapshot_planes:
            context.copy_to_device_async(address + row * nbytes, base + offset, nbytes)

    def _check_snapshot_copy(self, row: int, slot: int) -> HostBuffer:
        if self._closed:
            raise CudaError("the CUDA backend is closed")
        if self._host_snapshots is None:
            raise ValueError("no host checkpoint slots are reserved")
        if not (0 <= row < self._snapshot_row_count and 0 <= slot < self._host_snapshot_count):
            raise ValueError(
                f"snapshot row {row} or host slot {slot} is outside [0, {self._snapshot_row_count}) or "
                f"[0, {self._host_snapshot_count})"
            )
        return self._host_snapshots

    def drain(self) -> None:
        """Wait for every frame's fence and the stream (nothing of this backend runs afterwards)."""
        context = self._ctx
        context.bind()
        for state in self._frames:
            self._fence(state)
        context.synchronize()

    def close(self) -> None:
        """Drain (wait every frame's fence, synchronize the stream), then destroy graphs and events, unload
        modules, free device and pinned memory and release the context. Idempotent; every step is
        attempted, and the first failure is raised at the end."""
        if self._closed:
            return
        self._closed = True
        context = self._context
        self._context = None
        if context is None:
            return
        errors: list[HeliosError] = []

        def attempt(step: Any, *args: Any) -> None:
            try:
                step(*args)
            except HeliosError as exc:
                errors.append(exc)

        attempt(context.make_current)
        for event in self._events:
            attempt(context.wait_event, event)
        attempt(context.synchronize)
        for executable in self._executables:
            attempt(context.destroy_graph, executable)
        for builder in self._builders:
            attempt(builder.destroy)
        if self._communicator is not None:  # after every graph holding its collectives
            attempt(self._communicator.close)
            self._communicator = None
        for event in self._events:
            attempt(context.destroy_event, event)
        for state in self._frames:
            staged = (state.host, state.mapped) if self._given_staging is None else ()  # shared: not this one's
            for host in (*staged, state.completion_host):
                if host is not None:
                    attempt(context.host_free, host)
            attempt(context.free, state.device)
            attempt(context.free, state.completion_device)
        if self._host_pages is not None:
            attempt(context.host_free, self._host_pages)
            self._host_pages = None
        if self._host_snapshots is not None:
            attempt(context.host_free, self._host_snapshots)
            self._host_snapshots = None
        for shared in self._shared.values():
            attempt(context.free, shared.address)
        attempt(context.close)  # unloads the modules, frees anything left, releases the context
        self._executables.clear()
        self._builders.clear()
        self._events.clear()
        self._frames.clear()
        self._shared.clear()
        self._programs.clear()
        if errors:
            raise errors[0]

    # -- serving helpers --------------------------------------------------------------------------
    @property
    def _ctx(self) -> Context:
        if self._context is None:
            raise CudaError("the CUDA backend is closed")
        return self._context

    def _frame(self, frame: int) -> int:
        if self._closed:
            raise CudaError("the CUDA backend is closed")
        if not 0 <= frame < self._frames_count:
            raise ValueError(f"frame {frame} is outside [0, {self._frames_count})")
        return frame

    def _fence(self, state: _Frame) -> None:
        if state.in_flight:
            context = self._ctx
            context.bind()
            context.wait_event(state.event)
            state.in_flight = False

    def _locate(self, name: str, frame: int) -> tuple[int | None, np.dtype[Any], tuple[int, ...], AnyArray | None]:
        """(device address or None, dtype, shape, host array or None) of a buffer or entry."""
        shared = self._shared.get(name)
        if shared is not None:
            return shared.address, shared.dtype, shared.shape, None
        state = self._frames[self._frame(frame)]
        slot = self._completion_layout.slots.get(name)
        if slot is not None:
            return state.completion_device + slot.offset, slot.dtype, slot.shape, None
        placed = self._transport_layout.slot(name)
        if placed is not None:
            slot, mapped = placed
            host = state.staging[name]
            return (None if mapped else state.device + slot.offset), slot.dtype, slot.shape, host
        raise ValueError(f"unknown buffer {name!r}")

    # -- construction -----------------------------------------------------------------------------
    def _start(
        self,
        contract: PreparedContract,
        core: CoreFile,
        cache_pages: int,
        state_rows: int,
        snapshot_rows: int,
        copy_limit: int,
    ) -> None:
        context = self._ctx
        context.bind()
        execution = contract.execution
        architecture = context.architecture
        self._target = architecture
        check_targets(execution, architecture)
        entries = {e.name for e in execution.transport.entries}
        for decl in self._decls:
            if decl.name in entries:
                raise ContractError(f"buffer {decl.name!r} is declared both as a buffer and as a transport entry")
        shapes = {
            d.name: runtime_shape(d, cache_pages=cache_pages, state_rows=state_rows, snapshot_rows=snapshot_rows)
            for d in self._decls
        }
        functions = self._load_code(execution, core, architecture)
        self._allocate_buffers(core, shapes)
        self._buffer_dtypes = {d.name: int(d.dtype) for d in self._decls if d.name in self._shared}
        self._transport_layout = plan_transport(
            execution.transport, sparse=sparse_entries(contract), copy_limit=copy_limit
        )
        if self._given_staging is not None:
            if len(self._given_staging) != self._frames_count:
                raise ValueError(
                    f"{len(self._given_staging)} frames of shared staging for a backend of {self._frames_count}"
                )
            for given in self._given_staging:
                check_staging(given, self._transport_layout)
        self._completion_layout = plan_completion(self._decls, shapes)
        fields: dict[int, str] = {}
        for record in execution.completion:
            if record.buffer not in self._completion_layout.slots:
                raise ContractError(
                    f"completion field {mf.CompletionField.Name(record.field)} names {record.buffer!r}, "
                    "which is not a COMPLETION buffer"
                )
            fields[int(record.field)] = record.buffer
        for frame in range(self._frames_count):
            self._frames.append(self._allocate_frame(frame, execution.transport, fields))
        programs = list(execution.programs) + list(execution.tuning_programs)
        for program in programs:
            self._transport_spans[program.name] = copy_spans(
                program, architecture, self._transport_layout.copied, gap=copy_limit
            )
            self._completion_spans[program.name] = launch_span(program, architecture, self._completion_layout)
        if self._communicator is None and any(
            node.op.name in COLLECTIVE_OPERATORS for program in programs for node in program.nodes
        ):
            self._communicator = _one_rank_communicator()
        for program in programs:
            self._programs[program.name] = [
                self._build_graph(program, frame, functions) for frame in range(self._frames_count)
            ]
        context.synchronize_context()  # nothing of the load left in flight on any stream
        self._run_tuning(execution)

    def _load_code(
        self, execution: mf.ExecutionManifest, core: CoreFile, architecture: str
    ) -> dict[tuple[str, str], Any]:
        """Load each module of the target once and resolve each (module, symbol) once."""
        context = self._ctx
        modules: dict[str, Any] = {}
        for decl in execution.modules:
            if decl.target != architecture:
                continue
            image = bytes(core.read_resource(decl.resource_id, cb.RESOURCE_KIND_MODULE))
            if decl.format == mf.MODULE_FORMAT_PTX and not image.endswith(b"\0"):
                image += b"\0"  # the driver reads PTX as a NUL-terminated string
            elif decl.format not in (mf.MODULE_FORMAT_CUBIN, mf.MODULE_FORMAT_PTX):
                raise UnsupportedFeatureError(
                    f"module {decl.name!r} has format {int(decl.format)}, which the CUDA backend cannot load"
                )
            try:
                modules[decl.name] = context.load_module(image)
            except CudaError as exc:
                raise CudaError(f"module {decl.name!r} ({architecture}): {exc}") from exc
        shared_bytes: dict[tuple[str, str], int] = {}
        where: dict[tuple[str, str], str] = {}
        for program in list(execution.programs) + list(execution.tuning_programs):
            for node, launch in target_launches(program, architecture):
                key = (launch.module, launch.symbol)
                if launch.module not in modules:
                    raise ContractError(
                        f"program {program.name!r} node {node.name!r}: launch names module {launch.module!r}, "
                        f"which is not an {architecture} module of the core"
                    )
                _check_geometry(f"program {program.name!r} node {node.name!r}", launch)
                shared_bytes[key] = max(shared_bytes.get(key, 0), int(launch.shared_bytes))
                where.setdefault(key, f"program {program.name!r} node {node.name!r}")
        functions: dict[tuple[str, str], Any] = {}
        for key, needed in shared_bytes.items():
            module, symbol = key
            try:
                functions[key] = context.function(modules[module], symbol, needed)
            except CudaError as exc:
                raise CudaError(
                    f"{where[key]}: kernel {symbol!r} of module {module!r} ({needed} shared bytes): {exc}"
                ) from exc
        return functions

    def _allocate_buffers(self, core: CoreFile, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Every non-completion buffer of this rank once: weights uploaded from this rank's resources (each
        read once), the rest zeroed."""
        context = self._ctx
        weights: dict[str, list[mf.BufferDecl]] = {}
        for decl in self._decls:
            if decl.role == mf.BUFFER_ROLE_COMPLETION:
                continue
            dtype = numpy_dtype(decl.name, decl.dtype)
            shape = shapes[decl.name]
            nbytes = math.prod(shape) * dtype.itemsize
            if decl.role == mf.BUFFER_ROLE_WEIGHTS and any(d.symbol in SYMBOLIC for d in decl.shape):
                raise ContractError(f"weights buffer {decl.name!r} has a symbolic dimension")
            address = context.alloc(nbytes)
            self._shared[decl.name] = _Shared(address, dtype, shape)
            if decl.role == mf.BUFFER_ROLE_WEIGHTS:
                weights.setdefault(decl.resource_id, []).append(decl)
            else:
                context.memset(address, nbytes)

        def upload(resource_id: str, data: DecodedResource) -> None:
            for decl in weights[resource_id]:
                shared = self._shared[decl.name]
                offset = int(decl.resource_offset)
                end = offset + math.prod(shared.shape) * shared.dtype.itemsize
                if end > len(data):
                    raise ContractError(
                        f"weights buffer {decl.name!r} needs bytes [{offset}, {end}) of resource "
                        f"{resource_id!r}, which holds {len(data)}"
                    )
                context.upload(shared.address, data[offset:end])

        # decoded a few at once on host threads; uploaded here, where the context is current, and the
        # host bytes of each are dropped once they are on the device
        decode_resources(core, list(weights), cb.RESOURCE_KIND_WEIGHTS, upload)

    def _allocate_frame(self, frame: int, transport: mf.Transport, fields: Mapping[int, str]) -> _Frame:
        context = self._ctx
        layout = self._transport_layout
        given = self._given_staging
        shared = given is not None
        staging_blocks = given[frame] if given is not None else allocate_staging(context, layout, 1)[0]
        host, mapped = staging_blocks.host, staging_blocks.mapped
        device = context.alloc(layout.copied.nbytes)
        completion_host = context.host_alloc(self._completion_layout.nbytes)
        completion_device = context.alloc(self._completion_layout.nbytes)
        context.memset(completion_device, self._completion_layout.nbytes)
        event = context.event()
        self._events.append(event)
        staging = {name: _view(host, slot) for name, slot in layout.copied.slots.items()}
        if mapped is not None:
            staging.update({name: _view(mapped, slot) for name, slot in layout.mapped.slots.items()})
        ordered = {e.name: staging[e.name] for e in transport.entries}  # declaration order, like the reference
        if transport.frame_index_entry and transport.frame_index_entry in ordered:
            ordered[transport.frame_index_entry][...] = frame
        context.upload(device, host.array())  # the device copy starts equal to the staging
        mirror = {name: _view(completion_host, slot) for name, slot in self._completion_layout.slots.items()}
        records = {field: mirror[name] for field, name in fields.items()}
        if mapped is None:
            mapped_device = 0
        elif shared:  # this context's own address of the shared mapped block
            mapped_device = context.mapped_pointer(mapped)
        else:
            mapped_device = mapped.device_pointer
        addresses = frame_addresses(
            {name: shared.address for name, shared in self._shared.items()},
            layout,
            device,
            mapped_device,
            self._completion_layout,
            completion_device,
        )
        return _Frame(
            host, device, mapped, completion_host, completion_device, event, ordered, records, addresses,
            MappingProxyType(records),
        )  # fmt: skip

    def _build_graph(self, program: mf.ProgramDecl, frame: int, functions: Mapping[tuple[str, str], Any]) -> Any:
        """Build and instantiate the graph of ``program`` on ``frame``: copy in, launches, copy out."""
        context = self._ctx
        state = self._frames[frame]
        builder = context.graph()
        self._builders.append(builder)
        previous: Any = None
        previous_is_kernel = False
        for start, end in self._transport_spans[program.name]:
            previous = builder.copy(
                state.device + start, state.host.pointer + start, end - start, previous, to_device=True
            )
        collectives = 0
        for step in graph_steps(program, self._target):
            node, launch = step.node, step.launch
            where = f"program {program.name!r} node {node.name!r} frame {frame}"
            if launch is None:
                child = self._add_collective(builder, node, state.addresses, previous, where)
                collectives += 1
                if child is not None:
                    previous = child
                    previous_is_kernel = False  # the next kernel waits for the collective by a plain edge
                continue  # a call that enqueues nothing (one rank, in place) leaves the kernel chain as it was
            try:
                params = pack_params(launch.params, state.addresses)
            except CudaError as exc:
                raise ContractError(f"{where}: {exc}") from exc
            programmatic = self._programmatic and launch.programmatic_wait and previous_is_kernel
            try:
                previous = builder.kernel(
                    functions[(launch.module, launch.symbol)],
                    launch.grid,
                    launch.block,
                    int(launch.shared_bytes),
                    params,
                    previous,
                    programmatic=programmatic,
                )
            except CudaError as exc:
                raise CudaError(f"{where}: {exc}") from exc
            previous_is_kernel = True
        span = self._completion_spans[program.name]
        if span is not None:
            start, end = span
            builder.copy(
                state.completion_host.pointer + start,
                state.completion_device + start,
                end - start,
                previous,
                to_device=False,
            )
        try:
            executable = builder.instantiate()
        except CudaError as exc:
            raise CudaError(f"program {program.name!r} frame {frame}: {exc}") from exc
        self._executables.append(executable)
        self._collectives[program.name] = collectives
        return executable

    def _add_collective(
        self, builder: GraphBuilder, node: mf.Node, addresses: Mapping[str, int], previous: Any, where: str
    ) -> Any | None:
        """Capture the node's NCCL call into a graph and add it as a child graph node after ``previous``;
        None, and no node, when the call enqueued no work (an in-place collective of a one-rank
        communicator, which NCCL completes on the host): the graph then stays as it was without it."""
        communicator = self._communicator
        if communicator is None:
            raise CudaError(f"{where}: no NCCL communicator was made for the core's collective nodes")
        elements = {name: math.prod(shared.shape) for name, shared in self._shared.items()}
        call = plan_collective(node, self._buffer_dtypes, elements, communicator.size)
        itemsize = self._shared[call.source].dtype.itemsize
        source = addresses[call.source] + call.source_offset * itemsize
        destination = addresses[call.destination] + call.destination_offset * itemsize
        try:
            dtype = nccl_dtype(call.dtype)
        except NcclError as exc:
            raise ContractError(f"{where}: {exc}") from exc

        def issue(stream: int) -> None:
            if call.operator == "all_reduce":
                communicator.all_reduce(source, destination, call.count, dtype, stream)
            elif call.operator == "all_gather":
                communicator.all_gather(source, destination, call.count, dtype, stream)
            else:
                communicator.broadcast(source, destination, call.count, dtype, call.root, stream)

        context = self._ctx
        try:
            captured = context.capture(issue)
        except (CudaError, NcclError) as exc:
            raise CudaError(f"{where}: capturing {call.operator}: {exc}") from exc
        try:
            if context.captured_nodes(captured) == 0:
                return None
            return builder.child(captured, previous)
        except CudaError as exc:
            raise CudaError(f"{where}: {exc}") from exc
        finally:
            context.destroy_captured(captured)

    def _run_tuning(self, execution: mf.ExecutionManifest) -> None:
        """Run each tuning producer once, then drain: tuned buffers are filled before serving starts."""
        tuning = {p.name for p in execution.tuning_programs}
        buffers = {b.name for b in self._decls}
        for producer in execution.tuning:
            if producer.program not in tuning:
                raise ContractError(f"tuning producer {producer.program!r} has no program in the tuning catalog")
            missing = [name for name in producer.outputs if name not in buffers]
            if missing:
                raise ContractError(f"tuning producer {producer.program!r} fills unknown buffers {missing}")
            try:
                self.run(producer.program, 0)
                self.drain()
            except CudaError as exc:
                raise CudaError(f"tuning producer {producer.program!r}: {exc}") from exc


@dataclass(frozen=True)
class FrameStaging:
    """One frame's host staging blocks: the copied block and the mapped one (None without mapped entries)."""

    host: HostBuffer
    mapped: HostBuffer | None


def allocate_staging(context: Context, layout: TransportLayout, frames: int) -> list[FrameStaging]:
    """Page-locked staging blocks of ``frames`` frames in ``context`` (portable, so every context of the
    process may copy from them; the mapped blocks mapped): a backend's own, or those the ranks of one process
    share (the packer writes a round's values once and every rank's graph reads them; freed with
    ``context``)."""
    return [
        FrameStaging(
            context.host_alloc(layout.copied.nbytes),
            context.host_alloc(layout.mapped.nbytes, mapped=True) if layout.mapped.slots else None,
        )
        for _ in range(frames)
    ]


def check_staging(staging: FrameStaging, layout: TransportLayout) -> None:
    """Shared staging holds ``layout``'s copied and mapped blocks."""
    mapped = staging.mapped.nbytes if staging.mapped is not None else 0
    if staging.host.nbytes < layout.copied.nbytes or mapped < layout.mapped.nbytes:
        raise ValueError(
            f"shared staging of {staging.host.nbytes} and {mapped} bytes cannot hold the transport's "
            f"{layout.copied.nbytes} copied and {layout.mapped.nbytes} mapped bytes"
        )


def check_rank(contract: PreparedContract, rank: int, communicator: NcclCommunicator | None) -> None:
    """A backend of ``rank`` over ``communicator`` fits the core: the rank is one of the core's, and a core of
    several ranks comes with the NCCL communicator of that rank in a group of the core's size (a one-rank
    core may come without one: it gets a group of one when it has collective nodes)."""
    ranks = max(contract.ranks, 1)
    if not 0 <= rank < ranks:
        raise StartupError(f"rank {rank} is not one of the core's {ranks} tensor-parallel ranks")
    if communicator is None:
        if ranks > 1:
            raise StartupError(
                f"the core is built for {ranks} tensor-parallel ranks: the CUDA backend of rank {rank} needs that "
                f"rank's NCCL communicator in a group of {ranks}"
            )
        return
    if (communicator.rank, communicator.size) != (rank, ranks):
        raise StartupError(
            f"the NCCL communicator is rank {communicator.rank} of {communicator.size}; this backend is rank {rank} "
            f"of the core's {ranks}"
        )


def _one_rank_communicator() -> NcclCommunicator:
    """A one-rank NCCL communicator on the current device, or a StartupError saying what is missing."""
    try:
        return NcclCommunicator.one_rank(load_library())
    except NcclUnavailableError as exc:
        raise StartupError(f"the core has collective nodes, which the CUDA backend runs through NCCL: {exc}") from exc
    except NcclError as exc:
        raise StartupError(
            f"cannot create the one-rank NCCL communicator for the core's collective nodes: {exc}"
        ) from exc


def _check_geometry(where: str, launch: mf.KernelLaunch) -> None:
    if len(launch.grid) != 3 or len(launch.block) != 3:
        raise ContractError(f"{where}: a launch needs three grid and three block dimensions")
    if any(int(g) < 1 for g in launch.grid) or any(int(b) < 1 for b in launch.block):
        raise ContractError(f"{where}: launch grid {list(launch.grid)} and block {list(launch.block)} must be positive")
