"""NativeModel: a loaded core's programs, buffers and execution geometry.

Owns the step from a verified core and a load-time selection to an executing
backend: it chooses physical capacities after the programs are known (cache
pages and state rows replace preparation's working-set counts), builds every
selected program once, and exposes the resulting geometry through
:meth:`NativeModel.manifests`. The backend owns the buffers; this object owns
the backend and the packers.

Cache pages by default: enough for every active request to reach its full
context twice over (room for prefix reuse), capped by the memory the cache may
take (a quarter of the host memory available for a host backend; 90% of the
device memory left free after every other buffer for the CUDA backend) and by
the operator's ``cache_pages`` option.

Host pages (``offload_pages``, default 0: none): the backend reserves that many host slots of one page
each at load (:mod:`helios_core.runtime.offload`), so a shortage of host memory is a startup error.
Host checkpoint slots (``offload_checkpoints``, default 0: none) likewise: each holds one snapshot row
(a request's rows of every ``SNAPSHOT_ROWS`` buffer) of a published checkpoint evicted from its row.

Engram tables (a core that declares them): read once at load into host memory by
:func:`~helios_core.runtime.engram.load_engram`; :attr:`NativeModel.engram` owns them and their two staging
frames, which the engine fills each round.

State rows are partitioned by request: ``Selection.state_rows_per_request`` (the largest any selected
graph declares) rows per slot, and as many per snapshot.

Backends: ``reference`` (numpy), ``cuda`` (NVIDIA GPUs, one a rank), ``null`` (host
overhead measurement) and ``auto``, which is ``cuda`` when there is a GPU for each rank and
the core has kernels for their architecture, else ``reference``.

Tensor-parallel ranks: a core of N > 1 ranks runs as N thread ranks (one reference backend per rank
over one thread communicator group, behind a ``RankedBackend``; :mod:`helios_core.backends.ranks`), or on
the CUDA backend as one backend on each of GPUs 0..N-1 of this process, joined by one NCCL group whose
collectives are captured in every rank's graphs; ``ranks`` other than the core's count is a StartupError. With
``Selection.rank_peers`` (``helios run --rank-listen``) rank 0 runs here and ranks 1..N-1 in rank
processes that join over TCP (:mod:`helios_core.backends.rank_processes`).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

from helios_core.container.reader import CoreFile
from helios_core.contract import PreparedContract, PreparedGraph, RuntimeCapabilities, Selection, check_runtime_support
from helios_core.dtypes import NUMPY_DTYPES
from helios_core.errors import HeliosError, StartupError
from helios_core.runtime.engram import EngramStaging, load_engram
from helios_core.runtime.packing import GraphPacker, PageTableMemory
from helios_core.wire import contract_pb2 as ct
from helios_core.wire import manifest_pb2 as mf

if TYPE_CHECKING:
    from helios_core.backends.cuda_driver import Context


class Backend(Protocol):
    """What the runtime needs from an executing backend."""

    def transport(self, frame: int) -> Mapping[str, npt.NDArray[np.generic]]: ...

    def run(self, program: str, frame: int) -> None: ...

    def completion(self, frame: int) -> Mapping[int, npt.NDArray[np.generic]]: ...

    def reserve_host_pages(self, count: int) -> None: ...

    def copy_page_to_host(self, page: int, slot: int) -> None: ...

    def copy_page_to_device(self, slot: int, page: int) -> None: ...

    def reserve_host_snapshots(self, count: int, rows: int) -> None: ...

    def copy_snapshot_to_host(self, row: int, slot: int) -> None: ...

    def copy_snapshot_to_device(self, slot: int, row: int) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class ProgramGeometry:
    """One selected program's extents."""

    name: str
    operation: str
    batch_capacity: int
    token_capacity: int
    packed_token_capacity: int
    draft_tokens: int


@dataclass(frozen=True)
class ExecutionGeometry:
    """What ``NativeModel.manifests()`` reports."""

    backend: str
    frames: int
    cache_pages: int
    page_tokens: int
    pages_per_request: int
    state_rows: int
    snapshot_rows: int
    max_active: int
    programs: tuple[ProgramGeometry, ...]
    ranks: int = 1
    """Tensor-parallel ranks the programs run on (thread ranks on this host)."""


def _memory_available() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def bytes_per_page(contract: PreparedContract) -> int:
    """Bytes one cache page occupies across every cache plane."""
    total = 0
    for buffer in contract.buffers.values():
        if buffer.role == mf.BUFFER_ROLE_CACHE_PLANE:
            per_page = math.prod(d.size for d in buffer.shape[1:]) * NUMPY_DTYPES[buffer.dtype].itemsize
            total += per_page
    return total


def pages_per_request(contract: PreparedContract) -> int:
    """Pages one request at full context needs."""
    return -(-contract.serving.context_tokens // contract.model.cache.page_tokens)


@dataclass(frozen=True)
class DeviceMemory:
    """The device memory figure cache pages are chosen from (a GPU backend)."""

    free: int
    """Free device bytes once the backend's context exists."""
    reserved: int
    """Device bytes the backend allocates besides its cache planes."""


DEVICE_CACHE_FRACTION = 0.9
"""Share of the device memory left after every non-cache buffer that the cache may take."""


def cache_budget(device: DeviceMemory | None) -> int:
    """Bytes the cache planes may take: a quarter of the host memory available, or for a device
    backend 90% of its free memory after every non-cache buffer."""
    if device is None:
        return _memory_available() // 4
    return int(max(device.free - device.reserved, 0) * DEVICE_CACHE_FRACTION)


def choose_cache_pages(
    contract: PreparedContract, selection: Selection, cap: int | None, device: DeviceMemory | None = None
) -> int:
    """Physical cache pages (see the module docstring); ``device`` is given for a GPU backend."""
    per_request = pages_per_request(contract)
    wanted = 2 * selection.max_active * per_request
    page_bytes = bytes_per_page(contract)
    if page_bytes:
        budget = cache_budget(device)
        if page_bytes > budget:
            share = "a quarter of the host memory available" if device is None else "the device memory left"
            raise StartupError(
                f"one cache page takes {page_bytes} bytes ({contract.model.cache.page_tokens} tokens), more than "
                f"the {budget} bytes the cache may take ({share})"
            )
        wanted = min(wanted, budget // page_bytes)
    if cap is not None:
        if cap <= 0:
            raise StartupError(f"--cache-pages must be positive, not {cap}")
        wanted = min(wanted, cap)
    if wanted < per_request:
        raise StartupError(
            f"{wanted} cache pages cannot hold one request at full context ({per_request} pages of "
            f"{contract.model.cache.page_tokens} tokens); raise --cache-pages or free memory"
        )
    return wanted


def resolve_backend(name: str, contract: PreparedContract, device: int = 0) -> str:
    """``auto``: ``cuda`` when there is a GPU for each of the core's ranks (devices ``device`` onward) and the
    core has kernels for every one's architecture, else ``reference``; any other name is returned as it is."""
    if name != "auto":
        return name
    from helios_core.backends.cuda_driver import device_architecture, device_count

    ranks = max(contract.ranks, 1)
    if device_count() < device + ranks:
        return "reference"
    try:
        architectures = {device_architecture(device + rank) for rank in range(ranks)}
    except HeliosError:
        return "reference"
    return "cuda" if architectures <= set(contract.execution.targets) else "reference"


@dataclass(frozen=True)
class LoadSizes:
    """What a backend is built with besides its cache pages."""

    state_rows: int
    frames: int
    snapshot_rows: int


def _open_gpu(device: int) -> Context:
    """The primary context of GPU ``device``, or a StartupError saying a GPU and its driver are needed."""
    from helios_core.backends.cuda_driver import CudaUnavailableError, open_context

    try:
        return open_context(device)
    except CudaUnavailableError as exc:
        raise StartupError(f"backend 'cuda' needs an NVIDIA GPU and its driver ({exc})") from exc


def _device_memory(contract: PreparedContract, context: Context, sizes: LoadSizes, rank: int = 0) -> DeviceMemory:
    """The free memory of ``context``'s GPU and what rank ``rank``'s backend allocates there besides its cache,
    once the core is known to have kernels for that GPU."""
    from helios_core.backends.cuda import check_targets, reserved_device_nbytes, sparse_entries

    check_targets(contract.execution, context.architecture)
    reserved = reserved_device_nbytes(
        contract.execution, state_rows=sizes.state_rows, snapshot_rows=sizes.snapshot_rows, frames=sizes.frames,
        sparse=sparse_entries(contract), rank=rank,
    )  # fmt: skip
    return DeviceMemory(context.free_memory(), reserved)


def _open_gpu_zero(
    contract: PreparedContract, selection: Selection, cap: int | None, sizes: LoadSizes
) -> tuple[Context, int]:
    """GPU 0's context and the cache pages chosen from its free memory (the context is closed on a failure)."""
    context = _open_gpu(0)
    try:
        return context, choose_cache_pages(contract, selection, cap, _device_memory(contract, context, sizes))
    except BaseException:
        with contextlib.suppress(HeliosError):  # the startup failure is what the caller needs to see
            context.close()
        raise


def _load_cuda(
    contract: PreparedContract, core: CoreFile, selection: Selection, cap: int | None, sizes: LoadSizes
) -> tuple[int, Backend]:
    """Open the GPU, choose cache pages from its free memory, build the CUDA backend on that context (which
    makes a one-rank NCCL communicator when the core has collective nodes)."""
    from helios_core.backends.cuda import CudaBackend

    context, pages = _open_gpu_zero(contract, selection, cap, sizes)
    try:
        backend = CudaBackend(
            contract, core, cache_pages=pages, state_rows=sizes.state_rows, frames=sizes.frames,
            snapshot_rows=sizes.snapshot_rows, context=context,
        )  # fmt: skip
    except BaseException:
        with contextlib.suppress(HeliosError):  # the startup failure is what the caller needs to see
            context.close()
        raise
    return pages, backend


def _load_cuda_ranks(
    contract: PreparedContract, core: CoreFile, selection: Selection, cap: int | None, sizes: LoadSizes
) -> tuple[int, Backend]:
    """The N ranks of a tensor-parallel core on GPUs 0..N-1 of this process: one context a GPU, one NCCL
    group over them, cache pages chosen from the GPU with the least room, one page-locked staging every rank
    reads (the packer writes a round once; nothing is copied between ranks), the N CUDA backends built at
    once (a tuning producer's collectives meet across them), behind a RankedBackend that launches every rank
    in rank order and aborts the NCCL group when a rank fails."""
    from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

    from helios_core.backends.cuda import CudaBackend, allocate_staging, plan_transport, sparse_entries
    from helios_core.backends.cuda_driver import device_count
    from helios_core.backends.nccl import NcclCommunicator, NcclError, NcclUnavailableError, load_library
    from helios_core.backends.ranks import RankedBackend

    ranks = contract.ranks
    visible = device_count()
    if visible < ranks:
        raise StartupError(f"the core is built for {ranks} tensor-parallel ranks; {cuda_rank_limit(visible)}")
    contexts: list[Context] = []
    communicators: list[NcclCommunicator] = []
    built: list[CudaBackend] = []
    staging_context: Context | None = None
    try:
        for rank in range(ranks):
            contexts.append(_open_gpu(rank))
        memories = [_device_memory(contract, context, sizes, rank) for rank, context in enumerate(contexts)]
        least = min(memories, key=lambda memory: memory.free - memory.reserved)
        pages = choose_cache_pages(contract, selection, cap, least)
        layout = plan_transport(contract.execution.transport, sparse=sparse_entries(contract))
        # the staging every rank reads is held by a reference of its own to GPU 0's context, so it outlives
        # each rank's backend (a rank that fails to load releases its context at once)
        staging_context = _open_gpu(0)
        staging = allocate_staging(staging_context, layout, sizes.frames)
        try:
            communicators = NcclCommunicator.group(load_library(), contexts)
        except NcclUnavailableError as exc:
            raise StartupError(f"the ranks of a core on the CUDA backend meet through NCCL: {exc}") from exc
        except NcclError as exc:
            raise StartupError(f"cannot create the NCCL group of the core's {ranks} ranks: {exc}") from exc

        def build(rank: int) -> CudaBackend:
            return CudaBackend(
                contract, core, cache_pages=pages, state_rows=sizes.state_rows, frames=sizes.frames,
                snapshot_rows=sizes.snapshot_rows, context=contexts[rank], communicator=communicators[rank], rank=rank,
                staging=staging,
            )  # fmt: skip

        with ThreadPoolExecutor(max_workers=ranks, thread_name_prefix="helios-rank-load") as pool:
            futures = [pool.submit(build, rank) for rank in range(ranks)]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            if any(future.exception() is not None for future in done):
                for communicator in communicators:  # its peers may wait on the device at a tuning collective
                    with contextlib.suppress(NcclError):
                        communicator.abort()
        failures = [(rank, future.exception()) for rank, future in enumerate(futures) if future.exception() is not None]
        built = [future.result() for future in futures if future.exception() is None]
        if failures:
            rank, failure = failures[0]
            if isinstance(failure, HeliosError):
                raise failure
            raise StartupError(f"rank {rank} failed to load: {type(failure).__name__}: {failure}") from failure
    except BaseException:
        with contextlib.suppress(HeliosError):  # the startup failure is what the caller needs to see
            for backend in built:
                backend.abort_collectives()
                backend.close()
            for communicator in communicators:
                communicator.close()
            for context in contexts:
                context.close()
            if staging_context is not None:
                staging_context.close()
        raise

    def abort_group(reason: str) -> None:
        for backend in built:
            with contextlib.suppress(HeliosError):  # abort every rank whatever one of them says
                backend.abort_collectives()

    return pages, RankedBackend(built, in_order=True, abort_group=abort_group, shared=(staging_context,))


def cuda_rank_limit(visible: int) -> str:
    """Why the CUDA backend runs at most ``visible`` ranks (said in the startup error of a larger core)."""
    gpus = f"{visible} GPU{'' if visible == 1 else 's'} {'is' if visible == 1 else 'are'} visible"
    return f"the CUDA backend runs one rank on each GPU and {gpus}; --backend reference runs the ranks as threads"


def backend_capabilities(backend: str, *, rank_processes: bool = False) -> RuntimeCapabilities:
    """What the named (resolved) backend implements: any rank count as thread ranks or rank processes, one rank
    a visible GPU on CUDA in one process."""
    if backend == "cuda" and not rank_processes:
        from helios_core.backends.cuda_driver import device_count

        visible = device_count()
        return RuntimeCapabilities(ranks=max(visible, 1), ranks_limit=cuda_rank_limit(visible))
    return RuntimeCapabilities()


def choose_ranks(contract: PreparedContract, ranks: int | None) -> int:
    """The ranks to run: the core's count (``ranks`` None), or ``ranks`` when it equals it."""
    if ranks is None:
        return contract.ranks
    if ranks < 1:
        raise StartupError(f"--ranks must be at least 1, not {ranks}")
    if ranks != contract.ranks:
        raise StartupError(
            f"--ranks {ranks} does not match the core, which is built for {contract.ranks} tensor-parallel "
            f"rank{'s' if contract.ranks != 1 else ''}; pass --ranks {contract.ranks} or leave it out"
        )
    return ranks


def _load_thread_ranks(
    contract: PreparedContract,
    core: CoreFile,
    ranks: int,
    *,
    cache_pages: int,
    state_rows: int,
    frames: int,
    snapshot_rows: int,
) -> Backend:
    """``ranks`` reference backends, one per rank, built at once (a tuning producer's collectives meet
    across them) over one thread communicator group, behind a RankedBackend."""
    from concurrent.futures import ThreadPoolExecutor

    from helios_core.backends.ranks import RankedBackend, RankError, ThreadCommunicator
    from helios_core.backends.reference import ReferenceBackend

    communicators = ThreadCommunicator.group(ranks)
    resources: dict[str, npt.NDArray[np.uint8]] = {}  # replicated weights decoded once for every rank

    def build(rank: int) -> ReferenceBackend:
        try:
            return ReferenceBackend(
                contract, core, cache_pages=cache_pages, state_rows=state_rows, frames=frames,
                snapshot_rows=snapshot_rows, rank=rank, communicator=communicators[rank], resources=resources,
            )  # fmt: skip
        except BaseException as exc:
            communicators[rank].abort(f"rank {rank} failed to load: {type(exc).__name__}: {exc}")
            raise

    with ThreadPoolExecutor(max_workers=ranks, thread_name_prefix="helios-rank-load") as pool:
        futures = [pool.submit(build, rank) for rank in range(ranks)]
    built = [future.result() for future in futures if future.exception() is None]
    failures = [(rank, future.exception()) for rank, future in enumerate(futures) if future.exception() is not None]
    if failures:
        for backend in built:
            backend.close()
        rank, failure = next(((r, e) for r, e in failures if not isinstance(e, RankError)), failures[0])
        if isinstance(failure, HeliosError):
            raise failure
        raise StartupError(f"rank {rank} failed to load: {type(failure).__name__}: {failure}") from failure
    return RankedBackend(built, communicators=communicators)


def _load_process_ranks(
    contract: PreparedContract,
    core: CoreFile,
    selection: Selection,
    ranks: int,
    *,
    cache_pages: int,
    state_rows: int,
    frames: int,
    snapshot_rows: int,
) -> Backend:
    """Rank 0 here and ranks 1..N-1 in rank processes that join over TCP (``selection.rank_peers``)."""
    from helios_core.backends.rank_processes import load_process_ranks

    settings = selection.rank_peers
    if settings is None or ranks < 2:
        raise StartupError(f"--rank-listen serves a core of more than one tensor-parallel rank; this core has {ranks}")
    return load_process_ranks(
        contract, core, ranks, settings, cache_pages=cache_pages, state_rows=state_rows, frames=frames,
        snapshot_rows=snapshot_rows,
    )  # fmt: skip


def _load_cuda_process_ranks(
    contract: PreparedContract, core: CoreFile, selection: Selection, ranks: int, cap: int | None, sizes: LoadSizes
) -> tuple[int, Backend]:
    """Rank 0 on GPU 0 here, its cache pages chosen from that GPU's free memory (every rank takes the same count),
    and ranks 1..N-1 in rank processes on GPUs of their own, joined by one NCCL group."""
    from helios_core.backends.rank_processes import load_process_ranks

    settings = selection.rank_peers
    if settings is None or ranks < 2:
        raise StartupError(f"--rank-listen serves a core of more than one tensor-parallel rank; this core has {ranks}")
    context, pages = _open_gpu_zero(contract, selection, cap, sizes)
    executor = load_process_ranks(
        contract, core, ranks, settings, cache_pages=pages, state_rows=sizes.state_rows, frames=sizes.frames,
        snapshot_rows=sizes.snapshot_rows, cuda_context=context,
    )  # fmt: skip
    return pages, executor


def _reserve_host_pages(executor: Backend, count: int, page_bytes: int) -> None:
    """The host tier's slots, or a StartupError naming what could not be had."""
    try:
        executor.reserve_host_pages(count)
    except (HeliosError, MemoryError, ValueError) as exc:
        raise StartupError(
            f"cannot reserve {count} host pages of {page_bytes} bytes for --offload-pages: {_reservation_failure(exc)}"
        ) from exc


def _reserve_host_snapshots(executor: Backend, count: int, rows: int) -> None:
    """The checkpoint host tier's slots, or a StartupError naming what could not be had."""
    try:
        executor.reserve_host_snapshots(count, rows)
    except (HeliosError, MemoryError, ValueError) as exc:
        raise StartupError(
            f"cannot reserve {count} host checkpoint slots for --offload-checkpoints: {_reservation_failure(exc)}"
        ) from exc


def _check_offload_use(contract: PreparedContract, offload_checkpoints: int) -> None:
    """A StartupError for host checkpoint slots the core can never use: only a core with a recurrent
    history reuses prefixes through checkpoints."""
    recurrent = any(region.kind == ct.HISTORY_KIND_RECURRENT for region in contract.model.cache.regions)
    if offload_checkpoints and not recurrent:
        raise StartupError(
            f"--offload-checkpoints {offload_checkpoints}: the core keeps no prefix checkpoints (it has no recurrent "
            "history; its prefixes are reused through cache pages, which --offload-pages moves to host memory)"
        )


def _reservation_failure(exc: BaseException) -> str:
    """Why a host reservation failed: the backend's reason, or the allocation failure by its name."""
    return f"{type(exc).__name__}: {exc}" if isinstance(exc, MemoryError) else str(exc)


class NativeModel:
    """A loaded core ready to execute its selected programs."""

    def __init__(
        self,
        contract: PreparedContract,
        selection: Selection,
        backend: Backend,
        backend_name: str,
        *,
        cache_pages: int,
        state_rows: int,
        frames: int,
        offload_pages: int = 0,
        engram: EngramStaging | None = None,
        ranks: int = 1,
        offload_checkpoints: int = 0,
    ) -> None:
        self.contract = contract
        self.selection = selection
        self.backend = backend
        self.backend_name = backend_name
        self.cache_pages = cache_pages
        self.offload_pages = offload_pages
        """Host slots of the prefix cache's host tier (0: evicted pages are dropped)."""
        self.offload_checkpoints = offload_checkpoints
        """Host slots of the checkpoint host tier (0: evicted checkpoints are dropped)."""
        self.state_rows = state_rows
        self.frames = frames
        self.engram = engram
        self.ranks = ranks
        """Tensor-parallel ranks the backend runs (a RankedBackend's, or 1)."""
        """The core's Engram tables and their staging frames (None: it declares none)."""
        self.clock_origin_ns = time.monotonic_ns()
        """The process-local origin of token and timing observations (runtime startup)."""
        staging = backend.transport(0)
        self.page_table_memory = PageTableMemory()
        self.packers: Mapping[str, GraphPacker] = MappingProxyType(
            {
                name: GraphPacker(graph, staging, self.page_table_memory, eos_ids=contract.eos_token_ids)
                for name, graph in selection.graphs.items()
            }
        )

    @classmethod
    def load(
        cls,
        core: CoreFile,
        contract: PreparedContract,
        selection: Selection,
        *,
        backend: str = "reference",
        cache_pages: int | None = None,
        capabilities: RuntimeCapabilities | None = None,
        offload_pages: int = 0,
        ranks: int | None = None,
        offload_checkpoints: int = 0,
    ) -> NativeModel:
        """Check runtime support, choose capacities, build the backend and every program once.

        ``ranks`` (None: the core's rank count) must equal the core's ``ExecutionManifest.ranks``; a core
        of N > 1 ranks runs as N thread ranks of the reference backend (one ``ReferenceBackend`` per rank
        over one :class:`~helios_core.backends.ranks.ThreadCommunicator` group, behind a
        :class:`~helios_core.backends.ranks.RankedBackend`)."""
        if offload_pages < 0:
            raise StartupError(f"--offload-pages must not be negative, not {offload_pages}")
        if offload_checkpoints < 0:
            raise StartupError(f"--offload-checkpoints must not be negative, not {offload_checkpoints}")
        _check_offload_use(contract, offload_checkpoints)
        rank_count = choose_ranks(contract, ranks)
        backend = resolve_backend(backend, contract)
        check_runtime_support(
            contract, capabilities or backend_capabilities(backend, rank_processes=selection.rank_peers is not None)
        )
        state_rows = selection.max_active * selection.state_rows_per_request
        frames = max(contract.execution.transport.frames, 1)
        snapshot_rows = contract.serving.snapshot_capacity * selection.state_rows_per_request
        executor: Backend
        if selection.rank_peers is not None and backend not in ("reference", "cuda"):
            raise StartupError(
                f"rank processes (--rank-listen) run the reference or the CUDA backend; backend {backend!r} cannot "
                "serve them"
            )
        sizes = LoadSizes(state_rows, frames, snapshot_rows)
        if backend == "cuda" and selection.rank_peers is not None:
            pages, executor = _load_cuda_process_ranks(contract, core, selection, rank_count, cache_pages, sizes)
        elif backend == "cuda" and contract.ranks > 1:
            pages, executor = _load_cuda_ranks(contract, core, selection, cache_pages, sizes)
        elif backend == "cuda":
            pages, executor = _load_cuda(contract, core, selection, cache_pages, sizes)
        elif backend == "reference":
            from helios_core.backends.reference import ReferenceBackend

            pages = choose_cache_pages(contract, selection, cache_pages)
            if selection.rank_peers is not None:
                executor = _load_process_ranks(
                    contract, core, selection, rank_count, cache_pages=pages, state_rows=state_rows, frames=frames,
                    snapshot_rows=snapshot_rows,
                )  # fmt: skip
            elif rank_count == 1:
                executor = ReferenceBackend(
                    contract,
                    core,
                    cache_pages=pages,
                    state_rows=state_rows,
                    frames=frames,
                    snapshot_rows=snapshot_rows,
                )
            else:
                executor = _load_thread_ranks(
                    contract, core, rank_count, cache_pages=pages, state_rows=state_rows, frames=frames,
                    snapshot_rows=snapshot_rows,
                )  # fmt: skip
        elif backend == "null":
            from helios_core.backends.null import NullBackend

            pages = choose_cache_pages(contract, selection, cache_pages)
            executor = NullBackend(contract, frames=frames, ranks=rank_count)
        else:
            raise StartupError(f"backend {backend!r} is not available; use auto, reference or cuda")
        try:
            if offload_pages:
                _reserve_host_pages(executor, offload_pages, bytes_per_page(contract))
            if offload_checkpoints:
                _reserve_host_snapshots(executor, offload_checkpoints, selection.state_rows_per_request)
            engram = load_engram(contract, core, participants=contract.ranks)
            return cls(
                contract, selection, executor, backend, cache_pages=pages, state_rows=state_rows, frames=frames,
                offload_pages=offload_pages, engram=engram, ranks=rank_count, offload_checkpoints=offload_checkpoints,
            )  # fmt: skip
        except BaseException:
            with contextlib.suppress(HeliosError):  # the startup failure is what the caller needs to see
                executor.close()
            raise

    def graph(self, name: str) -> PreparedGraph:
        return self.selection.graphs[name]

    def manifests(self) -> ExecutionGeometry:
        """The execution geometry this model runs with."""
        programs = tuple(
            ProgramGeometry(
                name=g.name,
                operation=g.operation_name,
                batch_capacity=g.extents.batch_capacity,
                token_capacity=g.extents.token_capacity,
                packed_token_capacity=g.extents.packed_token_capacity,
                draft_tokens=g.extents.draft_tokens,
            )
            for g in sorted(
                self.selection.graphs.values(), key=lambda g: (g.operation, g.extents.batch_capacity, g.name)
            )
        )
        return ExecutionGeometry(
            backend=self.backend_name,
            frames=self.frames,
            cache_pages=self.cache_pages,
            page_tokens=self.contract.model.cache.page_tokens,
            pages_per_request=pages_per_request(self.contract),
            state_rows=self.state_rows,
            snapshot_rows=self.contract.serving.snapshot_capacity * self.selection.state_rows_per_request,
            max_active=self.selection.max_active,
            programs=programs,
            ranks=self.ranks,
        )

    def close(self) -> None:
        self.backend.close()
