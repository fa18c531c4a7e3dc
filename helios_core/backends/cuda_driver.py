"""A thin, checked layer over the CUDA driver API (``cuda-python``'s ``cuda.bindings.driver``).

Owns every raw driver call Helios makes: context, device and pinned host memory, modules and
functions, streams and events, kernel parameter packing, CUDA graphs built from node lists, and the
capture of work that a library enqueues on a stream (a collective) into a graph that a node list
then embeds as a child graph node (:meth:`Context.capture`, :meth:`GraphBuilder.child`).
Every call's result code is checked; a failure raises :class:`CudaError` naming the call and the
driver's error name. Nothing here knows about cores or programs: the CUDA backend
(:mod:`helios_core.backends.cuda`) and the GPU tests build on these primitives.

Without a driver (a machine with no NVIDIA GPU), :func:`cuda_available` answers False and
:func:`open_context` raises :class:`CudaUnavailableError` with the reason; importing this module
never fails for lack of a driver.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from helios_core.errors import HeliosError
from helios_core.wire import manifest_pb2 as mf


class CudaError(HeliosError):
    """A CUDA driver call failed."""


class CudaUnavailableError(CudaError):
    """No usable CUDA driver or device on this machine."""


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver  # older cuda-python layout
        except ImportError as exc:
            raise CudaUnavailableError("cuda-python is not installed (pip install 'helios[cuda]')") from exc
    return driver


def check(result: Any, call: str) -> Any:
    """Unpack a driver call's ``(CUresult, *values)`` tuple; raise :class:`CudaError` on failure."""
    cu = _driver()
    if isinstance(result, tuple):
        code, values = result[0], result[1:]
    else:
        code, values = result, ()
    if code != cu.CUresult.CUDA_SUCCESS:
        name_result = cu.cuGetErrorName(code)
        name = name_result[1].decode() if name_result[0] == cu.CUresult.CUDA_SUCCESS else str(int(code))
        raise CudaError(f"{call} failed: {name}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


_INITIALIZED: list[bool] = []


def _init() -> Any:
    cu = _driver()
    if not _INITIALIZED:
        try:
            result = cu.cuInit(0)
        except Exception as exc:  # without libcuda the bindings raise instead of returning a code
            raise CudaUnavailableError(f"no CUDA driver: {exc}") from exc
        try:
            check(result, "cuInit")
        except CudaError as exc:
            raise CudaUnavailableError(str(exc)) from exc
        _INITIALIZED.append(True)
    return cu


def cuda_available() -> bool:
    """True when a CUDA driver and at least one device are present (never raises)."""
    try:
        cu = _init()
        return int(check(cu.cuDeviceGetCount(), "cuDeviceGetCount")) > 0
    except HeliosError:
        return False


def architecture_name(major: int, minor: int) -> str:
    """The Ignition target name of a compute capability (``sm_90a`` for 9.0, ``sm_89`` for 8.9)."""
    suffix = "a" if (major, minor) == (9, 0) else ""
    return f"sm_{major}{minor}{suffix}"


def _device(cu: Any, device: int) -> Any:
    count = int(check(cu.cuDeviceGetCount(), "cuDeviceGetCount"))
    if count == 0:
        raise CudaUnavailableError("no CUDA device is present")
    if not 0 <= device < count:
        raise CudaError(f"CUDA device {device} does not exist ({count} present)")
    return check(cu.cuDeviceGet(device), "cuDeviceGet")


def _compute_capability(cu: Any, handle: Any) -> tuple[int, int]:
    attr = cu.CUdevice_attribute
    major = cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, handle)
    minor = cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, handle)
    return int(check(major, "cuDeviceGetAttribute")), int(check(minor, "cuDeviceGetAttribute"))


def device_architecture(device: int = 0) -> str:
    """The Ignition target name of ``device`` without creating a context (raises CudaUnavailableError)."""
    cu = _init()
    return architecture_name(*_compute_capability(cu, _device(cu, device)))


def device_count() -> int:
    """The CUDA devices this process sees (0 without a driver; never raises)."""
    try:
        cu = _init()
        return int(check(cu.cuDeviceGetCount(), "cuDeviceGetCount"))
    except HeliosError:
        return 0


def open_context(device: int = 0) -> Context:
    """The primary context of ``device`` (raises :class:`CudaUnavailableError` without a driver or device)."""
    return Context(device)


@dataclass
class HostBuffer:
    """Page-locked host memory; ``device_pointer`` is set when it is mapped into the device."""

    pointer: int
    nbytes: int
    device_pointer: int = 0

    def array(self) -> npt.NDArray[np.uint8]:
        """The bytes as a writable numpy array (no copy)."""
        if self.nbytes == 0:
            return np.zeros(0, dtype=np.uint8)
        storage = (ctypes.c_uint8 * self.nbytes).from_address(self.pointer)
        return np.frombuffer(memoryview(storage).cast("B"), dtype=np.uint8)


_CURRENT = threading.local()
"""The :class:`Context` made current on each thread (``context``), so :meth:`Context.bind` calls the driver
only when the thread's current context changes."""


class Context:
    """The primary context of one device, current on the calling thread, and its stream.

    Owns every allocation made through it; :meth:`close` frees what is still allocated (after a
    full synchronization) and releases the primary context.
    """

    def __init__(self, device: int = 0) -> None:
        cu = _init()
        self._cu = cu
        self._closed = False
        self._device_allocations: set[int] = set()
        self._host_allocations: set[int] = set()
        self._modules: list[Any] = []
        self._capture_stream: Any = None
        """The stream :meth:`capture` records on (made on first use)."""
        self.device = _device(cu, device)
        self.context = check(cu.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain")
        self.stream: Any = None
        try:
            self.make_current()
            self.compute_capability = _compute_capability(cu, self.device)
            attr = cu.CUdevice_attribute
            self.multiprocessors = int(
                check(
                    cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, self.device),
                    "cuDeviceGetAttribute",
                )
            )
            name = check(cu.cuDeviceGetName(256, self.device), "cuDeviceGetName")
            self.name = bytes(name).split(b"\0", 1)[0].decode(errors="replace")
            self.total_memory = int(check(cu.cuDeviceTotalMem(self.device), "cuDeviceTotalMem"))
            self.stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        except BaseException:
            self._closed = True
            with contextlib.suppress(CudaError):  # the original failure is what the caller needs to see
                check(cu.cuDevicePrimaryCtxRelease(self.device), "cuDevicePrimaryCtxRelease")
            raise

    @property
    def architecture(self) -> str:
        """The Ignition target name of this device (``sm_90a`` for compute capability 9.0)."""
        return architecture_name(*self.compute_capability)

    @property
    def closed(self) -> bool:
        return self._closed

    def make_current(self) -> None:
        check(self._cu.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        _CURRENT.context = self

    def bind(self) -> None:
        """Make the context current on the calling thread unless it already is (driver calls need it); a
        thread that drives the contexts of several devices (tensor-parallel ranks) switches between them."""
        if getattr(_CURRENT, "context", None) is not self:
            self.make_current()

    def free_memory(self) -> int:
        """Free bytes of this context's device."""
        self.bind()
        free, _total = check(self._cu.cuMemGetInfo(), "cuMemGetInfo")
        return int(free)

    # -- memory -----------------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> int:
        """Device memory of at least ``nbytes`` (256-byte aligned); returns its address."""
        pointer = int(check(self._cu.cuMemAlloc(max(int(nbytes), 1)), f"cuMemAlloc({nbytes})"))
        self._device_allocations.add(pointer)
        return pointer

    def free(self, pointer: int) -> None:
        if pointer in self._device_allocations:
            self._device_allocations.discard(pointer)
            check(self._cu.cuMemFree(pointer), "cuMemFree")

    def host_alloc(self, nbytes: int, *, mapped: bool = False) -> HostBuffer:
        """Page-locked host memory; ``mapped`` also maps it into the device's address space."""
        flags = self._cu.CU_MEMHOSTALLOC_PORTABLE
        if mapped:
            flags |= self._cu.CU_MEMHOSTALLOC_DEVICEMAP
        pointer = int(check(self._cu.cuMemHostAlloc(max(int(nbytes), 1), flags), f"cuMemHostAlloc({nbytes})"))
        self._host_allocations.add(pointer)
        buffer = HostBuffer(pointer, int(nbytes))
        if mapped:
            buffer.device_pointer = int(
                check(self._cu.cuMemHostGetDevicePointer(pointer, 0), "cuMemHostGetDevicePointer")
            )
        ctypes.memset(pointer, 0, max(int(nbytes), 1))
        return buffer

    def mapped_pointer(self, buffer: HostBuffer) -> int:
        """The device address of mapped page-locked host memory in this context (memory another context
        of the process allocated mapped and portable: each context has its own address for it)."""
        self.bind()
        return int(check(self._cu.cuMemHostGetDevicePointer(buffer.pointer, 0), "cuMemHostGetDevicePointer"))

    def host_free(self, buffer: HostBuffer) -> None:
        if buffer.pointer in self._host_allocations:
            self._host_allocations.discard(buffer.pointer)
            check(self._cu.cuMemFreeHost(buffer.pointer), "cuMemFreeHost")

    def upload(self, pointer: int, data: npt.NDArray[Any] | bytes | bytearray | memoryview) -> None:
        """Synchronous host-to-device copy of ``data``'s bytes to ``pointer``: ordered on the context's stream
        after the work enqueued there, and returning once the bytes are on the device. (``cuMemcpyHtoD`` from
        pageable memory returns once the bytes are staged, before they land, on the legacy default stream,
        which work on the context's non-blocking stream does not wait for: a kernel launched right after
        could write its results before the copy's bytes overwrite them.)"""
        if isinstance(data, np.ndarray):
            raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        else:
            raw = np.frombuffer(data, dtype=np.uint8)
        if raw.nbytes:
            check(self._cu.cuMemcpyHtoDAsync(pointer, raw.ctypes.data, raw.nbytes, self.stream), "cuMemcpyHtoDAsync")
            check(self._cu.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def download(self, pointer: int, out: npt.NDArray[Any]) -> None:
        """Synchronous device-to-host copy into the C-contiguous array ``out``: ordered on the context's stream
        after the work enqueued there (a ``cuMemcpyDtoH`` on the legacy default stream would not wait for it),
        returning once the bytes are in ``out``."""
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError("download needs a writable C-contiguous array")
        if out.nbytes:
            check(self._cu.cuMemcpyDtoHAsync(out.ctypes.data, pointer, out.nbytes, self.stream), "cuMemcpyDtoHAsync")
            check(self._cu.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def copy_to_host_async(self, host_pointer: int, device_pointer: int, nbytes: int) -> None:
        """Device-to-host copy of ``nbytes`` into page-locked host memory, enqueued on the context's stream
        (ordered after everything enqueued there before; returns at once)."""
        if nbytes:
            check(
                self._cu.cuMemcpyDtoHAsync(host_pointer, device_pointer, int(nbytes), self.stream), "cuMemcpyDtoHAsync"
            )

    def copy_to_device_async(self, device_pointer: int, host_pointer: int, nbytes: int) -> None:
        """Host-to-device copy of ``nbytes`` from page-locked host memory, enqueued on the context's stream
        (ordered before everything enqueued there after; returns at once)."""
        if nbytes:
            check(
                self._cu.cuMemcpyHtoDAsync(device_pointer, host_pointer, int(nbytes), self.stream), "cuMemcpyHtoDAsync"
            )

    def memset(self, pointer: int, nbytes: int, value: int = 0) -> None:
        """Synchronous: sets ``nbytes`` bytes at ``pointer`` to ``value`` on the context's stream and returns
        once they are set. (``cuMemsetD8`` alone returns before the bytes are set, on the legacy default
        stream, which work on the context's non-blocking stream does not wait for: a graph launched right
        after could run before the memset and have its results overwritten.)"""
        if nbytes:
            check(self._cu.cuMemsetD8Async(pointer, value, nbytes, self.stream), "cuMemsetD8Async")
            check(self._cu.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    # -- code -------------------------------------------------------------------------------------
    def load_module(self, image: bytes) -> Any:
        module = check(self._cu.cuModuleLoadData(image), "cuModuleLoadData")
        self._modules.append(module)
        return module

    def function(self, module: Any, symbol: str, shared_bytes: int = 0) -> Any:
        function = check(self._cu.cuModuleGetFunction(module, symbol.encode()), f"cuModuleGetFunction({symbol})")
        if shared_bytes > 48 * 1024:
            attribute = self._cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            check(self._cu.cuFuncSetAttribute(function, attribute, int(shared_bytes)), "cuFuncSetAttribute")
        return function

    # -- ordering ---------------------------------------------------------------------------------
    def event(self) -> Any:
        flags = self._cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        return check(self._cu.cuEventCreate(flags), "cuEventCreate")

    def timing_event(self) -> Any:
        return check(self._cu.cuEventCreate(self._cu.CUevent_flags.CU_EVENT_DEFAULT), "cuEventCreate")

    def record(self, event: Any) -> None:
        check(self._cu.cuEventRecord(event, self.stream), "cuEventRecord")

    def wait_event(self, event: Any) -> None:
        check(self._cu.cuEventSynchronize(event), "cuEventSynchronize")

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return float(check(self._cu.cuEventElapsedTime(start, end), "cuEventElapsedTime"))

    def destroy_event(self, event: Any) -> None:
        check(self._cu.cuEventDestroy(event), "cuEventDestroy")

    def synchronize(self) -> None:
        """Wait for everything queued on the context's stream."""
        check(self._cu.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def synchronize_context(self) -> None:
        """Wait for all work of the context on every stream, the legacy default stream included (which
        the synchronous copies and memsets use, and which the non-blocking stream does not wait for)."""
        check(self._cu.cuCtxSynchronize(), "cuCtxSynchronize")

    def launch(
        self, function: Any, grid: Sequence[int], block: Sequence[int], shared_bytes: int, params: ParamPack
    ) -> None:
        """Launch one kernel on the context's stream."""
        check(
            self._cu.cuLaunchKernel(function, *grid, *block, int(shared_bytes), self.stream, params.pointer, 0),
            "cuLaunchKernel",
        )

    # -- graphs -----------------------------------------------------------------------------------
    def graph(self) -> GraphBuilder:
        return GraphBuilder(self)

    def capture(self, issue: Callable[[int], None]) -> Any:
        """The CUDA graph of what ``issue(stream)`` enqueues on a capture stream (its handle as an integer).

        Captures in thread-local mode, so other threads' work is neither captured nor disturbed. The
        caller destroys the graph with :meth:`destroy_captured` (:meth:`GraphBuilder.child` clones it).
        When ``issue`` or the capture fails, the capture is ended and its graph destroyed first.
        """
        cu = self._cu
        if self._capture_stream is None:
            self._capture_stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        stream = self._capture_stream
        mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        check(cu.cuStreamBeginCapture(stream, mode), "cuStreamBeginCapture")
        try:
            issue(stream_address(stream))
        except BaseException:
            ended = cu.cuStreamEndCapture(stream)
            if isinstance(ended, tuple) and ended[0] == cu.CUresult.CUDA_SUCCESS and len(ended) > 1 and ended[1]:
                cu.cuGraphDestroy(ended[1])
            raise
        return check(cu.cuStreamEndCapture(stream), "cuStreamEndCapture")

    def captured_nodes(self, graph: Any) -> int:
        """How many nodes a graph made by :meth:`capture` holds (0: the captured call enqueued no work)."""
        _, count = check(self._cu.cuGraphGetNodes(graph, 0), "cuGraphGetNodes")
        return int(count)

    def destroy_captured(self, graph: Any) -> None:
        """Destroy a graph made by :meth:`capture`."""
        check(self._cu.cuGraphDestroy(graph), "cuGraphDestroy")

    def launch_graph(self, executable: Any) -> None:
        check(self._cu.cuGraphLaunch(executable, self.stream), "cuGraphLaunch")

    def destroy_graph(self, executable: Any) -> None:
        check(self._cu.cuGraphExecDestroy(executable), "cuGraphExecDestroy")

    # -- teardown ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Synchronize, free every allocation and module, release the primary context.

        Every step is attempted even when an earlier one fails (a context with a sticky error still
        releases what it can); the first failure is raised at the end. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        cu = self._cu
        errors: list[CudaError] = []

        def attempt(result: Any, call: str) -> None:
            try:
                check(result, call)
            except CudaError as exc:
                errors.append(exc)

        attempt(cu.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        _CURRENT.context = None  # released below: the next bind on this thread sets its context again
        attempt(cu.cuStreamSynchronize(self.stream), "cuStreamSynchronize")
        attempt(cu.cuCtxSynchronize(), "cuCtxSynchronize")
        for module in self._modules:
            attempt(cu.cuModuleUnload(module), "cuModuleUnload")
        self._modules.clear()
        for pointer in sorted(self._device_allocations):
            attempt(cu.cuMemFree(pointer), "cuMemFree")
        self._device_allocations.clear()
        for pointer in sorted(self._host_allocations):
            attempt(cu.cuMemFreeHost(pointer), "cuMemFreeHost")
        self._host_allocations.clear()
        if self._capture_stream is not None:
            attempt(cu.cuStreamDestroy(self._capture_stream), "cuStreamDestroy")
            self._capture_stream = None
        attempt(cu.cuStreamDestroy(self.stream), "cuStreamDestroy")
        attempt(cu.cuDevicePrimaryCtxRelease(self.device), "cuDevicePrimaryCtxRelease")
        if errors:
            raise errors[0]


def stream_address(stream: Any) -> int:
    """A driver stream handle as the integer a C library takes for ``cudaStream_t``."""
    return int(stream)


@dataclass
class ParamPack:
    """Kernel parameters packed for the driver: the ``void*[]`` array and the values it points at."""

    values: list[Any] = field(default_factory=list)
    array: Any = None

    @property
    def pointer(self) -> int:
        return ctypes.addressof(self.array) if self.array is not None else 0


def pack_params(params: Sequence[mf.LaunchParam], addresses: dict[str, int]) -> ParamPack:
    """Pack launch parameters; ``addresses`` maps each buffer name to its device address."""
    values: list[Any] = []
    for param in params:
        if param.kind == mf.PARAM_KIND_ADDRESS:
            if not param.buffer:
                values.append(ctypes.c_uint64(0))
                continue
            base = addresses.get(param.buffer)
            if base is None:
                raise CudaError(f"launch parameter names buffer {param.buffer!r}, which has no device address")
            values.append(ctypes.c_uint64(base + int(param.byte_offset)))
        elif param.kind == mf.PARAM_KIND_I32:
            values.append(ctypes.c_int32(int(param.int_value)))
        elif param.kind == mf.PARAM_KIND_I64:
            values.append(ctypes.c_int64(int(param.int_value)))
        elif param.kind == mf.PARAM_KIND_F32:
            values.append(ctypes.c_float(float(param.float_value)))
        else:
            raise CudaError(f"launch parameter kind {int(param.kind)} is not supported")
    array = (ctypes.c_void_p * max(len(values), 1))(*[ctypes.addressof(v) for v in values])
    return ParamPack(values, array)


class GraphBuilder:
    """A CUDA graph built node by node (no stream capture); :meth:`instantiate` makes it executable.

    Holds the parameter packs of its kernel nodes until the graph is destroyed (the driver copies
    parameters at node creation, but keeping them costs nothing and keeps addresses valid).
    """

    def __init__(self, context: Context) -> None:
        self._context = context
        self._cu = context._cu
        self.graph = check(self._cu.cuGraphCreate(0), "cuGraphCreate")
        self._packs: list[ParamPack] = []
        self.nodes = 0

    def kernel(
        self,
        function: Any,
        grid: Sequence[int],
        block: Sequence[int],
        shared_bytes: int,
        params: ParamPack,
        after: Any | None,
        *,
        programmatic: bool = False,
    ) -> Any:
        """Add a kernel node depending on ``after`` (or none); programmatic edges allow early launch."""
        cu = self._cu
        node_params = cu.CUDA_KERNEL_NODE_PARAMS()
        node_params.func = function
        node_params.gridDimX, node_params.gridDimY, node_params.gridDimZ = (int(g) for g in grid)
        node_params.blockDimX, node_params.blockDimY, node_params.blockDimZ = (int(b) for b in block)
        node_params.sharedMemBytes = int(shared_bytes)
        node_params.kernelParams = params.pointer
        node_params.extra = 0
        self._packs.append(params)
        if after is None or not programmatic:
            deps = [after] if after is not None else []
            node = check(cu.cuGraphAddKernelNode(self.graph, deps, len(deps), node_params), "cuGraphAddKernelNode")
        else:
            node = check(cu.cuGraphAddKernelNode(self.graph, [], 0, node_params), "cuGraphAddKernelNode")
            self._programmatic_edge(after, node)
        self.nodes += 1
        return node

    def _programmatic_edge(self, source: Any, target: Any) -> None:
        cu = self._cu
        edge = cu.CUgraphEdgeData()
        edge.from_port = cu.CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC
        edge.to_port = 0
        edge.type = cu.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
        add = getattr(cu, "cuGraphAddDependencies_v2", None)
        if add is None:
            add = cu.cuGraphAddDependencies  # cuda-python 13: the edge-data form
        check(add(self.graph, [source], [target], [edge], 1), "cuGraphAddDependencies")

    def copy(self, dst: int, src: int, nbytes: int, after: Any | None, *, to_device: bool) -> Any:
        """Add a 1-D copy node (host to device, or device to host)."""
        cu = self._cu
        copy = cu.CUDA_MEMCPY3D()
        host, device = cu.CUmemorytype.CU_MEMORYTYPE_HOST, cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
        if to_device:
            copy.srcMemoryType, copy.srcHost = host, src
            copy.dstMemoryType, copy.dstDevice = device, dst
        else:
            copy.srcMemoryType, copy.srcDevice = device, src
            copy.dstMemoryType, copy.dstHost = host, dst
        copy.WidthInBytes = int(nbytes)
        copy.srcPitch = copy.dstPitch = int(nbytes)
        copy.srcHeight = copy.dstHeight = 1
        copy.Height = 1
        copy.Depth = 1
        deps = [after] if after is not None else []
        node = check(
            cu.cuGraphAddMemcpyNode(self.graph, deps, len(deps), copy, self._context.context), "cuGraphAddMemcpyNode"
        )
        self.nodes += 1
        return node

    def child(self, graph: Any, after: Any | None) -> Any:
        """Add a child graph node running a clone of ``graph`` (a captured graph), depending on ``after``
        by a plain edge (a kernel after it is never its programmatic dependent)."""
        deps = [after] if after is not None else []
        node = check(self._cu.cuGraphAddChildGraphNode(self.graph, deps, len(deps), graph), "cuGraphAddChildGraphNode")
        self.nodes += 1
        return node

    def instantiate(self) -> Any:
        return check(self._cu.cuGraphInstantiate(self.graph, 0), "cuGraphInstantiate")

    def destroy(self) -> None:
        check(self._cu.cuGraphDestroy(self.graph), "cuGraphDestroy")
        self._packs.clear()
