"""The NCCL binding and the CUDA backend's collective plumbing, without a GPU or NCCL.

Pins where the library is found (``HELIOS_NCCL_LIBRARY``, the ``nvidia.nccl`` wheel) and the errors when
it is not; the wire-dtype to ``ncclDataType_t`` mapping; the argument order of every NCCL call and its
typed errors (over fake library functions); what a collective node asks of NCCL and the errors of a bad
one; ``check_targets`` accepting collective nodes without launches; the order in which a program's
graph is built around a collective (copy in, kernel, captured child graph, kernel joined by a plain
edge, copy out) over a fake driver. Several ranks on CUDA: ``test_cuda_ranks.py``.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from helios_core.backends import cuda as cuda_backend
from helios_core.backends import nccl
from helios_core.backends.cuda import CollectiveCall, CudaBackend, check_targets, graph_steps, plan_collective
from helios_core.backends.nccl import NcclCommunicator, NcclError, NcclLibrary, NcclUnavailableError
from helios_core.errors import ContractError, StartupError, UnsupportedFeatureError
from helios_core.wire import manifest_pb2 as mf

# ----------------------------------------------------------------------------------------------
# finding and loading the library
# ----------------------------------------------------------------------------------------------


def test_the_environment_variable_names_the_library(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    library = tmp_path / "libnccl-custom.so"
    library.write_bytes(b"not really a library")
    monkeypatch.setenv("HELIOS_NCCL_LIBRARY", str(library))
    assert nccl.find_library() == library
    monkeypatch.setenv("HELIOS_NCCL_LIBRARY", str(tmp_path / "absent.so"))
    with pytest.raises(NcclUnavailableError) as caught:
        nccl.find_library()
    assert str(caught.value) == f"HELIOS_NCCL_LIBRARY={tmp_path / 'absent.so'} names no file"


def test_without_the_wheel_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HELIOS_NCCL_LIBRARY", raising=False)
    asked: list[str] = []

    def no_package(name: str) -> None:
        asked.append(name)
        raise ModuleNotFoundError(f"No module named {name.split('.')[0]!r}")

    monkeypatch.setattr(importlib.util, "find_spec", no_package)
    with pytest.raises(NcclUnavailableError) as caught:
        nccl.find_library()
    assert asked == ["nvidia.nccl"]
    assert str(caught.value) == (
        "the nvidia.nccl package is not installed; install the nvidia-nccl-cu12 or nvidia-nccl-cu13 wheel or set "
        "HELIOS_NCCL_LIBRARY"
    )


def _package_at(folder: Path) -> Callable[[str], importlib.machinery.ModuleSpec]:
    def spec(name: str) -> importlib.machinery.ModuleSpec:
        found = importlib.machinery.ModuleSpec(name, None, is_package=True)
        found.submodule_search_locations = [str(folder)]
        return found

    return spec


def test_the_wheel_s_library_is_found_in_its_lib_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("HELIOS_NCCL_LIBRARY", raising=False)
    package = tmp_path / "nvidia" / "nccl"
    (package / "lib").mkdir(parents=True)
    monkeypatch.setattr(importlib.util, "find_spec", _package_at(package))
    with pytest.raises(NcclUnavailableError) as caught:
        nccl.find_library()
    assert str(caught.value) == (
        f"the nvidia.nccl package has no libnccl.so.2 (searched {package / 'lib'}); install the nvidia-nccl-cu12 "
        "or nvidia-nccl-cu13 wheel or set HELIOS_NCCL_LIBRARY"
    )
    (package / "lib" / "libnccl.so.2").write_bytes(b"\x7fELF")
    assert nccl.find_library() == package / "lib" / "libnccl.so.2"


def test_a_file_that_is_no_library_is_refused_with_the_loader_s_reason(tmp_path: Path) -> None:
    bogus = tmp_path / "libnccl.so.2"
    bogus.write_bytes(b"plain text")
    with pytest.raises(NcclUnavailableError) as caught:
        nccl.load_library(bogus)
    assert str(caught.value).startswith(f"cannot load the NCCL library {bogus}: ")


def test_wire_dtypes_map_to_nccl_element_types() -> None:
    assert {mf.DType.Name(d): nccl.nccl_dtype(d) for d in nccl.NCCL_DTYPES} == {
        "DTYPE_U8": 1,
        "DTYPE_I32": 2,
        "DTYPE_U32": 3,
        "DTYPE_I64": 4,
        "DTYPE_U64": 5,
        "DTYPE_F16": 6,
        "DTYPE_F32": 7,
        "DTYPE_F64": 8,
        "DTYPE_BF16": 9,
    }
    with pytest.raises(NcclError) as caught:
        nccl.nccl_dtype(mf.DTYPE_UNSPECIFIED)
    assert str(caught.value) == "NCCL has no element type for dtype unspecified"


# ----------------------------------------------------------------------------------------------
# calls over fake library functions
# ----------------------------------------------------------------------------------------------


class FakeFunctions:
    """NCCL's functions as Python callables recording their arguments as plain values."""

    def __init__(self, results: dict[str, int] | None = None) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.results = results or {}
        self.unique = bytes(range(128))

    def _done(self, name: str, *arguments: Any) -> int:
        self.calls.append((name, arguments))
        return self.results.get(name, 0)

    def ncclGetVersion(self, version: Any) -> int:
        version._obj.value = 22809
        return self._done("ncclGetVersion")

    def ncclGetErrorString(self, code: int) -> bytes:
        return b"invalid usage (run with NCCL_DEBUG=WARN for details)" if code == 5 else b""

    def ncclGetUniqueId(self, unique: Any) -> int:
        ctypes.memmove(ctypes.addressof(unique._obj), self.unique, 128)
        return self._done("ncclGetUniqueId")

    def ncclCommInitRank(self, handle: Any, ranks: int, unique: nccl.UniqueId, rank: int) -> int:
        handle._obj.value = 0xC0
        return self._done("ncclCommInitRank", ranks, unique.to_bytes(), rank)

    def ncclCommDestroy(self, handle: ctypes.c_void_p) -> int:
        return self._done("ncclCommDestroy", handle.value)

    def ncclCommAbort(self, handle: ctypes.c_void_p) -> int:
        return self._done("ncclCommAbort", handle.value)

    def ncclAllReduce(self, *arguments: Any) -> int:
        return self._done("ncclAllReduce", *(_plain(a) for a in arguments))

    def ncclAllGather(self, *arguments: Any) -> int:
        return self._done("ncclAllGather", *(_plain(a) for a in arguments))

    def ncclBroadcast(self, *arguments: Any) -> int:
        return self._done("ncclBroadcast", *(_plain(a) for a in arguments))

    def ncclGroupStart(self) -> int:
        return self._done("ncclGroupStart")

    def ncclGroupEnd(self) -> int:
        return self._done("ncclGroupEnd")


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, ctypes.c_void_p | ctypes.c_size_t) else value


def test_a_library_without_nccl_s_functions_is_refused() -> None:
    with pytest.raises(NcclUnavailableError) as caught:
        NcclLibrary(SimpleNamespace(ncclGetVersion=None), path="/opt/libfake.so")
    assert str(caught.value) == (
        "/opt/libfake.so lacks ncclGetErrorString, ncclGetUniqueId, ncclCommInitRank, ncclCommDestroy, ncclCommAbort, "
        "ncclAllReduce, ncclAllGather, ncclBroadcast, ncclGroupStart, ncclGroupEnd; it is not a usable NCCL library"
    )


def test_collectives_pass_their_arguments_in_nccl_s_order() -> None:
    functions = FakeFunctions()
    library = NcclLibrary(functions)
    assert library.version() == 22809
    communicator = NcclCommunicator.one_rank(library)
    assert (communicator.rank, communicator.size, communicator.handle) == (0, 1, 0xC0)
    communicator.all_reduce(0x1000, 0x2000, 32, 9, stream=0x77)
    communicator.all_gather(0x1000, 0x3000, 8, 7, stream=0x77)
    communicator.broadcast(0x1000, 0x1000, 4, 2, 0, stream=0x77)
    communicator.close()
    communicator.close()  # once only
    assert functions.calls == [
        ("ncclGetVersion", ()),
        ("ncclGetUniqueId", ()),
        ("ncclCommInitRank", (1, functions.unique, 0)),
        ("ncclAllReduce", (0x1000, 0x2000, 32, 9, 0, 0xC0, 0x77)),  # 0: ncclSum
        ("ncclAllGather", (0x1000, 0x3000, 8, 7, 0xC0, 0x77)),
        ("ncclBroadcast", (0x1000, 0x1000, 4, 2, 0, 0xC0, 0x77)),
        ("ncclCommDestroy", (0xC0,)),
    ]
    with pytest.raises(NcclError) as caught:
        communicator.all_reduce(0x1000, 0x2000, 32, 9, stream=0x77)
    assert str(caught.value) == "the NCCL communicator is destroyed"


def test_a_failing_call_raises_a_typed_error_naming_it() -> None:
    library = NcclLibrary(FakeFunctions({"ncclAllReduce": 5, "ncclAllGather": 42}))
    with pytest.raises(NcclError) as caught:
        library.all_reduce(0x1000, 0x1000, 4, 7, 0xC0, 0)
    assert (caught.value.call, caught.value.code) == ("ncclAllReduce", 5)
    assert str(caught.value) == (
        "ncclAllReduce failed: ncclInvalidUsage (5): invalid usage (run with NCCL_DEBUG=WARN for details)"
    )
    with pytest.raises(NcclError) as unknown:
        library.all_gather(0x1000, 0x2000, 4, 7, 0xC0, 0)
    assert str(unknown.value) == "ncclAllGather failed: unknown result (42)"


def test_bad_arguments_are_refused_before_nccl_is_called() -> None:
    functions = FakeFunctions()
    library = NcclLibrary(functions)
    with pytest.raises(NcclError) as short:
        nccl.UniqueId.from_bytes(b"\0" * 127)
    assert str(short.value) == "an NCCL unique id is 128 bytes, got 127"
    with pytest.raises(NcclError) as outside:
        library.init_rank(2, bytes(128), 2)
    assert str(outside.value) == "rank 2 of 2 ranks is no rank of an NCCL group"
    with pytest.raises(NcclError) as null:
        library.all_reduce(0, 0x1000, 4, 7, 0xC0, 0)
    assert str(null.value) == "a collective needs a device address, got 0x0"
    communicator = NcclCommunicator(library, 0xC0, rank=0, size=1)
    with pytest.raises(NcclError) as root:
        communicator.broadcast(0x1000, 0x1000, 4, 7, 1, stream=0)
    assert str(root.value) == "broadcast root 1 is outside the ranks [0, 1)"
    assert nccl.UniqueId.from_bytes(bytes(range(128))).to_bytes() == bytes(range(128))
    assert functions.calls == []


# ----------------------------------------------------------------------------------------------
# collective nodes in a program
# ----------------------------------------------------------------------------------------------


def _node(program: mf.ProgramDecl, name: str, op: str, args: dict[str, tuple[str, list[int], int]]) -> mf.Node:
    node = program.nodes.add(name=name)
    node.op.name, node.op.version = op, 1
    for arg, (buffer, shape, offset) in args.items():
        node.args.add(name=arg, view=mf.BufferView(buffer=buffer, shape=shape, element_offset=offset))
    return node


def _launch(node: mf.Node, symbol: str, *, programmatic_wait: bool = False, target: str = "sm_90a") -> None:
    node.launches.add(
        target=target, module="m", symbol=symbol, grid=[1, 1, 1], block=[32, 1, 1], programmatic_wait=programmatic_wait
    )


def _program() -> mf.ProgramDecl:
    """norm -> o projection -> all_reduce (in place) -> residual add (programmatic) -> head (programmatic)."""
    program = mf.ProgramDecl(name="decode_b1")
    _launch(_node(program, "norm", "rms_norm", {"x": ("h", [1, 8], 0), "out": ("n", [1, 8], 0)}), "norm_k")
    _launch(_node(program, "o", "linear", {"x": ("n", [1, 8], 0), "out": ("o", [1, 8], 0)}), "linear_k")
    _node(program, "o_all_reduce", "all_reduce", {"x": ("o", [1, 8], 0), "out": ("o", [1, 8], 0)})
    add = _node(program, "residual", "add", {"a": ("h", [1, 8], 0), "b": ("o", [1, 8], 0), "out": ("h", [1, 8], 0)})
    _launch(add, "add_k", programmatic_wait=True)
    _launch(add, "add_reference", target="reference")
    _launch(_node(program, "head", "linear", {"x": ("h", [1, 8], 0), "out": ("n", [1, 8], 0)}), "head_k",
            programmatic_wait=True)  # fmt: skip
    return program


def test_graph_steps_keep_each_collective_at_its_place() -> None:
    steps = graph_steps(_program(), "sm_90a")
    assert [(s.node.name, None if s.launch is None else s.launch.symbol) for s in steps] == [
        ("norm", "norm_k"),
        ("o", "linear_k"),
        ("o_all_reduce", None),
        ("residual", "add_k"),
        ("head", "head_k"),
    ]


def test_check_targets_accepts_collective_nodes_without_launches() -> None:
    execution = mf.ExecutionManifest(targets=["reference", "sm_90a"])
    execution.programs.append(_program())
    check_targets(execution, "sm_90a")
    _node(execution.programs[0], "bare", "add", {"a": ("h", [1, 8], 0), "b": ("o", [1, 8], 0), "out": ("h", [1, 8], 0)})
    with pytest.raises(StartupError) as caught:
        check_targets(execution, "sm_90a")
    assert str(caught.value) == (
        "program 'decode_b1' node 'bare' has no sm_90a launch; rebuild it with "
        "`ignition build --targets reference,sm_90a`"
    )


BF16, F32 = int(mf.DTYPE_BF16), int(mf.DTYPE_F32)


def test_plan_collective_says_what_nccl_is_asked() -> None:
    program = mf.ProgramDecl(name="p")
    dtypes, elements = {"a": BF16, "b": BF16, "f": F32}, {"a": 64, "b": 128, "f": 64}
    reduce = _node(program, "r", "all_reduce", {"x": ("a", [2, 8], 16), "out": ("a", [2, 8], 16)})
    assert plan_collective(reduce, dtypes, elements, 1) == CollectiveCall("all_reduce", "a", 16, "a", 16, 16, BF16)
    gather = _node(program, "g", "all_gather", {"x": ("a", [4, 8], 0), "out": ("b", [8, 8], 0)})
    gather.attributes.add(name="axis", int_value=0)
    assert plan_collective(gather, dtypes, elements, 2) == CollectiveCall("all_gather", "a", 0, "b", 0, 32, BF16)
    broadcast = _node(program, "b", "broadcast", {"x": ("a", [8], 0), "out": ("b", [8], 8)})
    broadcast.attributes.add(name="root", int_value=1)
    assert plan_collective(broadcast, dtypes, elements, 2) == CollectiveCall("broadcast", "a", 0, "b", 8, 8, BF16, 1)


@pytest.mark.parametrize(
    ("op", "args", "attributes", "ranks", "error", "message"),
    [
        ("all_reduce", {"x": ("a", [8], 0)}, {}, 1, ContractError, "node 'n' (all_reduce) lacks its out argument"),
        (
            "all_reduce", {"x": ("tokens", [8], 0), "out": ("a", [8], 0)}, {}, 1, ContractError,
            "node 'n' (all_reduce): x names 'tokens', which is no device buffer (a collective reads and writes "
            "buffers, never transport entries or completion buffers)",
        ),
        (
            "all_reduce", {"x": ("a", [8], 60), "out": ("a", [8], 60)}, {}, 1, ContractError,
            "node 'n' (all_reduce): x ends at element 68 of 'a', which holds 64",
        ),
        (
            "all_reduce", {"x": ("a", [8], 0), "out": ("f", [8], 0)}, {}, 1, ContractError,
            "node 'n' (all_reduce): x ('a') and out ('f') have different dtypes",
        ),
        (
            "all_reduce", {"x": ("a", [8], 0), "out": ("b", [16], 0)}, {}, 1, ContractError,
            "node 'n' (all_reduce): out holds 16 elements and x 8; they must be equal",
        ),
        (
            "all_gather", {"x": ("a", [8], 0), "out": ("b", [8], 0)}, {"axis": 0}, 2, ContractError,
            "node 'n' (all_gather): out holds 8 elements, not 2 ranks x 8",
        ),
        (
            "all_gather", {"x": ("a", [2, 4], 0), "out": ("b", [2, 8], 0)}, {"axis": 1}, 2, UnsupportedFeatureError,
            "node 'n' (all_gather): gathering along axis 1 of x of shape [2, 4] interleaves the ranks' rows, which "
            "the CUDA backend does not do; gather along the leading axis",
        ),
        (
            "broadcast", {"x": ("a", [8], 0), "out": ("a", [8], 0)}, {"root": 1}, 1, ContractError,
            "node 'n' (broadcast): root 1 is outside the ranks [0, 1)",
        ),
    ],
)  # fmt: skip
def test_plan_collective_refuses_a_bad_node(
    op: str,
    args: dict[str, tuple[str, list[int], int]],
    attributes: dict[str, int],
    ranks: int,
    error: type[Exception],
    message: str,
) -> None:
    node = _node(mf.ProgramDecl(name="p"), "n", op, args)
    for name, value in attributes.items():
        node.attributes.add(name=name, int_value=value)
    with pytest.raises(error) as caught:
        plan_collective(node, {"a": BF16, "b": BF16, "f": F32}, {"a": 64, "b": 128, "f": 64}, ranks)
    assert type(caught.value) is error
    assert str(caught.value) == message


def test_one_rank_gathers_along_any_axis() -> None:
    node = _node(mf.ProgramDecl(name="p"), "g", "all_gather", {"x": ("a", [2, 4], 0), "out": ("b", [2, 4], 0)})
    node.attributes.add(name="axis", int_value=1)
    assert plan_collective(node, {"a": BF16, "b": BF16}, {"a": 8, "b": 8}, 1).count == 8


# ----------------------------------------------------------------------------------------------
# the graph around a collective, over a fake driver
# ----------------------------------------------------------------------------------------------


class FakeBuilder:
    def __init__(self, log: list[tuple[Any, ...]]) -> None:
        self.log = log
        self.count = 0

    def _node(self, *entry: Any) -> str:
        self.count += 1
        name = f"n{self.count}"
        self.log.append((name, *entry))
        return name

    def copy(self, dst: int, src: int, nbytes: int, after: Any, *, to_device: bool) -> str:
        return self._node("copy_in" if to_device else "copy_out", after)

    def kernel(self, function: Any, grid: Any, block: Any, shared: int, params: Any, after: Any, *,
               programmatic: bool = False) -> str:  # fmt: skip
        return self._node("kernel", function, after, programmatic)

    def child(self, graph: Any, after: Any) -> str:
        return self._node("child", graph, after)

    def instantiate(self) -> str:
        return "executable"


class FakeContext:
    def __init__(self, captured_nodes: int = 1) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.nodes = captured_nodes
        """The nodes every capture records (0: the NCCL call enqueued nothing, as a one-rank in-place one)."""

    def graph(self) -> FakeBuilder:
        return FakeBuilder(self.log)

    def capture(self, issue: Callable[[int], None]) -> str:
        self.log.append(("begin_capture",))
        issue(0x5EED)
        self.log.append(("end_capture",))
        return "captured"

    def captured_nodes(self, graph: Any) -> int:
        return self.nodes

    def destroy_captured(self, graph: Any) -> None:
        self.log.append(("destroy_captured", graph))


class RecordingCommunicator:
    size = 1

    def __init__(self, log: list[tuple[Any, ...]]) -> None:
        self.log = log

    def all_reduce(self, send: int, recv: int, count: int, dtype: int, stream: int) -> None:
        self.log.append(("ncclAllReduce", send, recv, count, dtype, stream))


def _fake_backend(programmatic: bool = True, captured_nodes: int = 1) -> tuple[CudaBackend, FakeContext]:
    context = FakeContext(captured_nodes)
    backend = CudaBackend.__new__(CudaBackend)
    shared = {
        name: cuda_backend._Shared(address, np.dtype(np.uint16), (1, 8))
        for name, address in (("h", 0x1000), ("n", 0x2000), ("o", 0x3000))
    }
    frame = SimpleNamespace(
        device=0xD000, host=SimpleNamespace(pointer=0xA000), completion_host=SimpleNamespace(pointer=0xB000),
        completion_device=0xE000, addresses={name: s.address for name, s in shared.items()},
    )  # fmt: skip
    backend.__dict__.update(
        _closed=False, _context=context, _frames=[frame], _builders=[], _executables=[], _collectives={},
        _shared=shared, _buffer_dtypes=dict.fromkeys(shared, BF16), _communicator=RecordingCommunicator(context.log),
        _target="sm_90a", _programmatic=programmatic, _transport_spans={"decode_b1": [(0, 64)]},
        _completion_spans={"decode_b1": (0, 16)},
    )  # fmt: skip
    return backend, context


def test_a_collective_is_a_captured_child_graph_between_its_neighbours() -> None:
    backend, context = _fake_backend()
    functions = {("m", symbol): symbol for symbol in ("norm_k", "linear_k", "add_k", "head_k")}
    assert backend._build_graph(_program(), 0, functions) == "executable"
    assert context.log == [
        ("n1", "copy_in", None),
        ("n2", "kernel", "norm_k", "n1", False),
        ("n3", "kernel", "linear_k", "n2", False),
        ("begin_capture",),
        ("ncclAllReduce", 0x3000, 0x3000, 8, 9, 0x5EED),  # in place, 8 bf16 elements, on the capture stream
        ("end_capture",),
        ("n4", "child", "captured", "n3"),
        ("destroy_captured", "captured"),
        ("n5", "kernel", "add_k", "n4", False),  # marked programmatic_wait, yet a plain edge after the collective
        ("n6", "kernel", "head_k", "n5", True),
        ("n7", "copy_out", "n6"),
    ]
    assert dict(backend.collectives) == {"decode_b1": 1}


def test_a_collective_that_enqueues_nothing_leaves_the_kernel_chain_whole() -> None:
    """An in-place all_reduce of a one-rank communicator captures no work: no child node is added, and the
    kernel after it keeps its programmatic edge to the kernel before it (the graph of a core without the
    collective)."""
    backend, context = _fake_backend(captured_nodes=0)
    functions = {("m", symbol): symbol for symbol in ("norm_k", "linear_k", "add_k", "head_k")}
    assert backend._build_graph(_program(), 0, functions) == "executable"
    assert context.log == [
        ("n1", "copy_in", None),
        ("n2", "kernel", "norm_k", "n1", False),
        ("n3", "kernel", "linear_k", "n2", False),
        ("begin_capture",),
        ("ncclAllReduce", 0x3000, 0x3000, 8, 9, 0x5EED),
        ("end_capture",),
        ("destroy_captured", "captured"),
        ("n4", "kernel", "add_k", "n3", True),  # programmatic_wait on the linear kernel, as without the node
        ("n5", "kernel", "head_k", "n4", True),
        ("n6", "copy_out", "n5"),
    ]
    assert dict(backend.collectives) == {"decode_b1": 1}
