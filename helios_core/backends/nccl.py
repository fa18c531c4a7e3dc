"""NCCL through ctypes: the collective library the CUDA backend runs a core's collective nodes with.

Owns every call Helios makes into ``libnccl.so.2``: finding the library, the 128-byte unique id that
names a communicator group, creating communicators (one rank; the ranks of one process, one a device;
one rank of a group spread over processes), destroying and aborting them, and enqueueing
``ncclAllReduce``, ``ncclAllGather`` and ``ncclBroadcast`` on a CUDA stream (the CUDA backend enqueues
them on a stream under capture, so each lands in the program's CUDA graph). Every result code is
checked; a failure raises :class:`NcclError` naming the call, the result and NCCL's own description.

Where the library comes from (:func:`find_library`): the file named by ``HELIOS_NCCL_LIBRARY`` when it
is set, else ``lib/libnccl.so.2`` of the ``nvidia.nccl`` package that the ``nvidia-nccl-cu12`` and
``nvidia-nccl-cu13`` wheels install (located with ``importlib.util.find_spec``, never imported), else
:class:`NcclUnavailableError` saying what to install. Nothing here imports a deep-learning framework.

Element types (:func:`nccl_dtype`): every wire dtype with an NCCL equivalent (bfloat16 included); the
reduction is always a sum (the ``all_reduce`` operator of ``docs/ops.md``).

:class:`NcclLibrary` takes any object with NCCL's functions as attributes, so the argument handling
is testable without the library; on a real ``ctypes.CDLL`` it declares every function's argument and
result types first.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

from helios_core.dtypes import dtype_name
from helios_core.errors import HeliosError
from helios_core.wire import manifest_pb2 as mf

__all__ = [
    "LIBRARY_ENVIRONMENT",
    "NCCL_DTYPES",
    "UNIQUE_ID_BYTES",
    "NcclCommunicator",
    "NcclError",
    "NcclLibrary",
    "NcclUnavailableError",
    "UniqueId",
    "find_library",
    "load_library",
    "nccl_dtype",
]

LIBRARY_ENVIRONMENT: Final = "HELIOS_NCCL_LIBRARY"
"""The environment variable naming the NCCL shared library to load instead of the wheel's."""

LIBRARY_NAME: Final = "libnccl.so.2"

UNIQUE_ID_BYTES: Final = 128
"""Size of ``ncclUniqueId`` (``NCCL_UNIQUE_ID_BYTES``)."""

NCCL_SUCCESS: Final = 0
NCCL_SUM: Final = 0
"""``ncclRedOp_t`` of a sum."""

RESULT_NAMES: Final[Mapping[int, str]] = MappingProxyType(
    {
        0: "ncclSuccess",
        1: "ncclUnhandledCudaError",
        2: "ncclSystemError",
        3: "ncclInternalError",
        4: "ncclInvalidArgument",
        5: "ncclInvalidUsage",
        6: "ncclRemoteError",
        7: "ncclInProgress",
    }
)
"""``ncclResult_t`` values by number."""

NCCL_DTYPES: Final[Mapping[int, int]] = MappingProxyType(
    {
        mf.DTYPE_U8: 1,  # ncclUint8
        mf.DTYPE_I32: 2,  # ncclInt32
        mf.DTYPE_U32: 3,  # ncclUint32
        mf.DTYPE_I64: 4,  # ncclInt64
        mf.DTYPE_U64: 5,  # ncclUint64
        mf.DTYPE_F16: 6,  # ncclFloat16
        mf.DTYPE_F32: 7,  # ncclFloat32
        mf.DTYPE_F64: 8,  # ncclFloat64
        mf.DTYPE_BF16: 9,  # ncclBfloat16
    }
)
"""``ncclDataType_t`` of each wire dtype."""


class NcclError(HeliosError):
    """An NCCL call failed; ``call`` names it and ``code`` is its ``ncclResult_t`` (None: no call was made)."""

    def __init__(self, message: str, *, call: str = "", code: int | None = None) -> None:
        super().__init__(message)
        self.call = call
        self.code = code


class NcclUnavailableError(NcclError):
    """The NCCL library cannot be found or loaded."""


def nccl_dtype(dtype: int) -> int:
    """The ``ncclDataType_t`` of a wire dtype (:class:`NcclError` for one NCCL cannot reduce)."""
    found = NCCL_DTYPES.get(int(dtype))
    if found is None:
        raise NcclError(f"NCCL has no element type for dtype {dtype_name(dtype)}")
    return found


def find_library() -> Path:
    """The NCCL shared library to load: ``$HELIOS_NCCL_LIBRARY``, else the ``nvidia.nccl`` wheel's."""
    override = os.environ.get(LIBRARY_ENVIRONMENT)
    if override:
        path = Path(override)
        if not path.is_file():
            raise NcclUnavailableError(f"{LIBRARY_ENVIRONMENT}={override} names no file")
        return path
    install = "install the nvidia-nccl-cu12 or nvidia-nccl-cu13 wheel or set " + LIBRARY_ENVIRONMENT
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):  # no ``nvidia`` package at all
        spec = None
    if spec is None:
        raise NcclUnavailableError(f"the nvidia.nccl package is not installed; {install}")
    folders = [Path(folder) for folder in (spec.submodule_search_locations or ())]
    if not folders and spec.origin:
        folders = [Path(spec.origin).parent]
    for folder in folders:
        candidate = folder / "lib" / LIBRARY_NAME
        if candidate.is_file():
            return candidate
    searched = ", ".join(str(folder / "lib") for folder in folders) or "no folder"
    raise NcclUnavailableError(f"the nvidia.nccl package has no {LIBRARY_NAME} (searched {searched}); {install}")


class UniqueId(ctypes.Structure):
    """``ncclUniqueId``: 128 opaque bytes naming one communicator group (passed by value)."""

    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]

    @classmethod
    def from_bytes(cls, raw: bytes) -> UniqueId:
        if len(raw) != UNIQUE_ID_BYTES:
            raise NcclError(f"an NCCL unique id is {UNIQUE_ID_BYTES} bytes, got {len(raw)}")
        made = cls()
        ctypes.memmove(ctypes.addressof(made), raw, UNIQUE_ID_BYTES)
        return made

    def to_bytes(self) -> bytes:
        return ctypes.string_at(ctypes.addressof(self), UNIQUE_ID_BYTES)


_Comm = ctypes.c_void_p
_Stream = ctypes.c_void_p
_SIGNATURES: Final[Mapping[str, tuple[Any, list[Any]]]] = MappingProxyType(
    {
        "ncclGetVersion": (ctypes.c_int, [ctypes.POINTER(ctypes.c_int)]),
        "ncclGetErrorString": (ctypes.c_char_p, [ctypes.c_int]),
        "ncclGetUniqueId": (ctypes.c_int, [ctypes.POINTER(UniqueId)]),
        "ncclCommInitRank": (ctypes.c_int, [ctypes.POINTER(_Comm), ctypes.c_int, UniqueId, ctypes.c_int]),
        "ncclCommDestroy": (ctypes.c_int, [_Comm]),
        "ncclCommAbort": (ctypes.c_int, [_Comm]),
        "ncclAllReduce": (
            ctypes.c_int,
            [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _Comm, _Stream],
        ),
        "ncclAllGather": (
            ctypes.c_int,
            [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, _Comm, _Stream],
        ),
        "ncclBroadcast": (
            ctypes.c_int,
            [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _Comm, _Stream],
        ),
        "ncclGroupStart": (ctypes.c_int, []),
        "ncclGroupEnd": (ctypes.c_int, []),
    }
)
"""Result and argument types of every NCCL function used (``nccl.h``)."""


class NcclLibrary:
    """NCCL's functions, each call checked.

    ``functions`` is a loaded ``ctypes.CDLL`` (its functions get their declared types here) or any
    object with the same attributes (tests).
    """

    def __init__(self, functions: Any, *, path: str = LIBRARY_NAME) -> None:
        self.path = path
        self._functions = functions
        missing = [name for name in _SIGNATURES if not hasattr(functions, name)]
        if missing:
            raise NcclUnavailableError(f"{path} lacks {', '.join(missing)}; it is not a usable NCCL library")
        if isinstance(functions, ctypes.CDLL):  # a real library: declare every function's types
            for name, (result, arguments) in _SIGNATURES.items():
                function = getattr(functions, name)
                function.restype = result
                function.argtypes = arguments

    def _call(self, name: str, *arguments: Any) -> None:
        code = int(getattr(self._functions, name)(*arguments))
        if code != NCCL_SUCCESS:
            raise NcclError(f"{name} failed: {self.describe(code)}", call=name, code=code)

    def describe(self, code: int) -> str:
        """``ncclResult_t`` ``code`` as its name, number and NCCL's error string."""
        label = f"{RESULT_NAMES.get(code, 'unknown result')} ({code})"
        try:
            text = self._functions.ncclGetErrorString(code)
        except Exception:  # the description is a courtesy; the code is what matters
            return label
        if isinstance(text, bytes):
            text = text.decode(errors="replace")
        return f"{label}: {text}" if text else label

    def version(self) -> int:
        """``ncclGetVersion`` (e.g. 22809 for 2.28.9)."""
        value = ctypes.c_int(0)
        self._call("ncclGetVersion", ctypes.byref(value))
        return int(value.value)

    def unique_id(self) -> bytes:
        """A new group's ``ncclUniqueId``, as the 128 bytes every rank passes to :meth:`init_rank`."""
        made = UniqueId()
        self._call("ncclGetUniqueId", ctypes.byref(made))
        return made.to_bytes()

    def init_rank(self, ranks: int, unique_id: bytes, rank: int) -> int:
        """``ncclCommInitRank`` on the current CUDA device: the communicator handle of ``rank`` of ``ranks``
        (blocks until every rank of the group has called it)."""
        if ranks < 1 or not 0 <= rank < ranks:
            raise NcclError(f"rank {rank} of {ranks} ranks is no rank of an NCCL group", call="ncclCommInitRank")
        handle = _Comm()
        self._call("ncclCommInitRank", ctypes.byref(handle), int(ranks), UniqueId.from_bytes(unique_id), int(rank))
        if not handle.value:
            raise NcclError("ncclCommInitRank returned no communicator", call="ncclCommInitRank")
        return int(handle.value)

    def destroy(self, communicator: int) -> None:
        self._call("ncclCommDestroy", _Comm(communicator))

    def abort(self, communicator: int) -> None:
        """``ncclCommAbort``: stop the communicator's operations still on the device and free it."""
        self._call("ncclCommAbort", _Comm(communicator))

    def all_reduce(self, send: int, recv: int, count: int, dtype: int, communicator: int, stream: int) -> None:
        """Enqueue a sum ``ncclAllReduce`` of ``count`` elements of ``ncclDataType_t`` ``dtype``."""
        self._call(
            "ncclAllReduce", _pointer(send), _pointer(recv), _count(count), int(dtype), NCCL_SUM,
            _Comm(communicator), _Stream(stream),
        )  # fmt: skip

    def all_gather(self, send: int, recv: int, count: int, dtype: int, communicator: int, stream: int) -> None:
        """Enqueue ``ncclAllGather``: ``count`` elements from each rank, rank-major into ``recv``."""
        self._call(
            "ncclAllGather", _pointer(send), _pointer(recv), _count(count), int(dtype), _Comm(communicator),
            _Stream(stream),
        )  # fmt: skip

    def broadcast(
        self, send: int, recv: int, count: int, dtype: int, root: int, communicator: int, stream: int
    ) -> None:
        """Enqueue ``ncclBroadcast`` of ``count`` elements from rank ``root``."""
        self._call(
            "ncclBroadcast", _pointer(send), _pointer(recv), _count(count), int(dtype), int(root),
            _Comm(communicator), _Stream(stream),
        )  # fmt: skip

    def group_start(self) -> None:
        self._call("ncclGroupStart")

    def group_end(self) -> None:
        self._call("ncclGroupEnd")


def _pointer(address: int) -> ctypes.c_void_p:
    if address <= 0:
        raise NcclError(f"a collective needs a device address, got {address:#x}")
    return ctypes.c_void_p(address)


def _count(count: int) -> ctypes.c_size_t:
    if count < 0:
        raise NcclError(f"a collective's element count must not be negative, got {count}")
    return ctypes.c_size_t(count)


_LOADED: dict[str, NcclLibrary] = {}
_LOAD_LOCK = threading.Lock()


def load_library(path: Path | None = None) -> NcclLibrary:
    """The NCCL library at ``path`` (default :func:`find_library`), loaded once per process."""
    chosen = path if path is not None else find_library()
    key = str(chosen)
    with _LOAD_LOCK:
        loaded = _LOADED.get(key)
        if loaded is None:
            try:
                functions = ctypes.CDLL(key)
            except OSError as exc:
                raise NcclUnavailableError(f"cannot load the NCCL library {key}: {exc}") from exc
            loaded = _LOADED[key] = NcclLibrary(functions, path=key)
        return loaded


class NcclCommunicator:
    """One rank's NCCL communicator on the current CUDA device, and the collectives the CUDA backend
    enqueues with it (device addresses, element counts, NCCL element types, a stream handle)."""

    def __init__(self, library: NcclLibrary, handle: int, *, rank: int, size: int) -> None:
        self.library = library
        self.rank = rank
        self.size = size
        self._handle: int | None = handle

    @classmethod
    def one_rank(cls, library: NcclLibrary) -> NcclCommunicator:
        """A group of one: this process's only rank (a collective is then a copy)."""
        handle = library.init_rank(1, library.unique_id(), 0)
        return cls(library, handle, rank=0, size=1)

    @classmethod
    def group(cls, library: NcclLibrary, contexts: Sequence[Any]) -> list[NcclCommunicator]:
        """The communicators of this process's ranks, rank ``i`` on the device of ``contexts[i]`` (objects
        with ``make_current()``): one unique id, and every rank's ``ncclCommInitRank`` with its device's
        context current, between ``ncclGroupStart`` and ``ncclGroupEnd`` (how one thread creates the ranks
        of several devices; each would otherwise wait for the others)."""
        size = len(contexts)
        if size < 1:
            raise NcclError("an NCCL group needs at least one rank", call="ncclCommInitRank")
        unique_id = library.unique_id()
        handles: list[int] = []
        library.group_start()
        try:
            for rank, context in enumerate(contexts):
                context.make_current()
                handles.append(library.init_rank(size, unique_id, rank))
        finally:
            library.group_end()
        return [cls(library, handle, rank=rank, size=size) for rank, handle in enumerate(handles)]

    @classmethod
    def joined(cls, library: NcclLibrary, size: int, unique_id: bytes, rank: int) -> NcclCommunicator:
        """Rank ``rank`` of a group of ``size`` ranks spread over processes, on the current device; returns
        once every rank has joined with the same ``unique_id`` (made by one of them, sent to the others)."""
        return cls(library, library.init_rank(size, unique_id, rank), rank=rank, size=size)

    @property
    def handle(self) -> int:
        if self._handle is None:
            raise NcclError("the NCCL communicator is destroyed")
        return self._handle

    def all_reduce(self, send: int, recv: int, count: int, dtype: int, stream: int) -> None:
        self.library.all_reduce(send, recv, count, dtype, self.handle, stream)

    def all_gather(self, send: int, recv: int, count: int, dtype: int, stream: int) -> None:
        self.library.all_gather(send, recv, count, dtype, self.handle, stream)

    def broadcast(self, send: int, recv: int, count: int, dtype: int, root: int, stream: int) -> None:
        if not 0 <= root < self.size:
            raise NcclError(f"broadcast root {root} is outside the ranks [0, {self.size})", call="ncclBroadcast")
        self.library.broadcast(send, recv, count, dtype, root, self.handle, stream)

    def close(self) -> None:
        """``ncclCommDestroy`` once (after every graph that holds its collectives is done). Idempotent."""
        handle, self._handle = self._handle, None
        if handle is not None:
            self.library.destroy(handle)

    def abort(self) -> None:
        """``ncclCommAbort`` once: a rank of the group failed, so collectives waiting on the device for it
        end instead of spinning, and the communicator is gone (a later :meth:`close` does nothing)."""
        handle, self._handle = self._handle, None
        if handle is not None:
            self.library.abort(handle)
