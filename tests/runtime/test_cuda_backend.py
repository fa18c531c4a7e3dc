"""The CUDA backend on the CPU.

Without a GPU this covers: the backend choice (``auto`` falls back to the reference backend, ``cuda``
fails startup with one clear line), the pure planning (transport layout, copy spans, parameter
addresses, kernel parameter packing, target checks, the device cache budget), and the whole
:class:`CudaBackend` over an *emulated* driver context: device memory is a fake address space
backed by host memory (an address outside every allocation is an illegal address), graphs run
their copy and kernel nodes only when the stream is waited on (as a GPU runs them later), and each
kernel node runs its operator's reference implementation on the memory its packed parameters
point at. A wrong address, span, frame or fence therefore shows up as a wrong token. The last tests
check that the engine fails only the round whose completion wait raised.
"""

from __future__ import annotations

import bisect
import ctypes
import dataclasses
import itertools
import json
import math
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from helios_core.backends import cuda_driver, reference
from helios_core.backends import reference_kernels as rk
from helios_core.backends.cuda import (
    SPARSE_SOURCES,
    STAGING_ALIGNMENT,
    TRANSPORT_COPY_LIMIT,
    CudaBackend,
    check_targets,
    copy_spans,
    frame_addresses,
    launch_span,
    plan_completion,
    plan_transport,
    reserved_device_nbytes,
    runtime_shape,
    sparse_entries,
)
from helios_core.backends.cuda_driver import CudaError, HostBuffer, ParamPack, cuda_available, pack_params
from helios_core.backends.reference import ReferenceBackend
from helios_core.cli import main
from helios_core.contract import LoadOptions, PreparedContract, select
from helios_core.dtypes import NUMPY_DTYPES
from helios_core.errors import HeliosError, StartupError
from helios_core.frontend.bootstrap import Bootstrap
from helios_core.frontend.structured import GrammarCompiler
from helios_core.loading import VerifiedCore, open_core
from helios_core.runtime.engine import Engine
from helios_core.runtime.messages import ExecutionFailed, Finished, PreparedRequest, SamplingParams, TokenEvent
from helios_core.runtime.native_model import (
    DeviceMemory,
    NativeModel,
    bytes_per_page,
    choose_cache_pages,
    resolve_backend,
)
from helios_core.runtime.startup import RunningModel, start
from helios_core.wire import container_pb2 as cb
from helios_core.wire import contract_pb2 as ct
from helios_core.wire import manifest_pb2 as mf

from .conftest import FIXTURES, KEYS, NAMESPACE, fixture_settings

TARGET = "sm_90a"
MODULE = "kernel.emulated"
GREEDY = SamplingParams(temperature=0.0)
CORE = FIXTURES / "payload-v3.core"
needs_no_gpu = pytest.mark.skipif(cuda_available(), reason="checks the behaviour of a machine without a GPU")


@pytest.fixture(scope="module")
def verified() -> Iterator[VerifiedCore]:
    core = open_core(CORE, fixture_settings(), check_resources=False)
    yield core
    core.close()


def _messages(tmp_path: Path) -> Path:
    path = tmp_path / "messages.json"
    path.write_text(json.dumps([{"role": "user", "content": "Hello there"}]))
    return path


# ----------------------------------------------------------------------------------------------
# backend choice and the startup error without a GPU
# ----------------------------------------------------------------------------------------------


@needs_no_gpu
def test_auto_is_the_reference_backend_without_a_gpu() -> None:
    running = start(CORE, fixture_settings(), LoadOptions(max_active=1), backend="auto")
    try:
        assert running.model.backend_name == "reference"
        assert isinstance(running.model.backend, ReferenceBackend)
        assert running.model.manifests().backend == "reference"
    finally:
        running.close()


def test_auto_needs_a_gpu_and_kernels_for_its_architecture(
    verified: VerifiedCore, monkeypatch: pytest.MonkeyPatch
) -> None:
    with_target = dataclasses.replace(verified.contract, execution=with_launches(verified.contract.execution))
    monkeypatch.setattr(cuda_driver, "device_count", lambda: 0)
    assert resolve_backend("auto", with_target) == "reference"
    monkeypatch.setattr(cuda_driver, "device_count", lambda: 1)
    monkeypatch.setattr(cuda_driver, "device_architecture", lambda device=0: TARGET)
    assert resolve_backend("auto", with_target) == "cuda"
    assert resolve_backend("auto", verified.contract) == "reference"  # no sm_90a kernels in the core
    monkeypatch.setattr(cuda_driver, "device_architecture", lambda device=0: "sm_89")
    assert resolve_backend("auto", with_target) == "reference"
    assert resolve_backend("reference", with_target) == "reference"
    assert resolve_backend("cuda", verified.contract) == "cuda"


@needs_no_gpu
def test_cuda_without_a_gpu_fails_startup_clearly() -> None:
    with pytest.raises(StartupError) as caught:
        start(CORE, fixture_settings(), LoadOptions(max_active=1), backend="cuda")
    message = str(caught.value)
    assert message.startswith("backend 'cuda' needs an NVIDIA GPU and its driver (")
    assert message.endswith(")") and "\n" not in message


@needs_no_gpu
def test_cuda_without_a_gpu_is_one_error_line_at_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trust = ["--trust-key", str(KEYS / "signing.pub.pem"), "--accept", NAMESPACE]
    generate = ["generate", "--core", str(CORE), "--messages", str(_messages(tmp_path)), *trust, "--backend", "cuda"]
    serve = ["run", "--core", str(CORE), *trust, "--port", "0", "--backend", "cuda"]
    for argv, command in ((generate, "generate"), (serve, "run")):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert err.startswith(f"helios {command}: error: backend 'cuda' needs an NVIDIA GPU and its driver (")


# ----------------------------------------------------------------------------------------------
# pure planning
# ----------------------------------------------------------------------------------------------


def with_launches(
    execution: mf.ExecutionManifest, *, shared_bytes: Mapping[str, int] | None = None
) -> mf.ExecutionManifest:
    """The manifest with one emulated sm_90a launch per node, following Ignition's conventions: one
    address per tensor argument (its byte offset within the buffer), an i32 scalar, a null scratch
    address; every launch waits programmatically. ``shared_bytes`` sets a node's dynamic shared memory."""
    manifest = mf.ExecutionManifest()
    manifest.CopyFrom(execution)
    dtypes = {b.name: int(b.dtype) for b in manifest.buffers}
    dtypes.update({e.name: int(e.dtype) for e in manifest.transport.entries})
    for program in list(manifest.programs) + list(manifest.tuning_programs):
        for node in program.nodes:
            launch = node.launches.add(
                target=TARGET,
                module=MODULE,
                symbol=f"{program.name}/{node.name}",
                grid=[1, 1, 1],
                block=[32, 1, 1],
                shared_bytes=(shared_bytes or {}).get(node.name, 0),
                programmatic_wait=True,
            )
            for arg in node.args:
                itemsize = NUMPY_DTYPES[dtypes[arg.view.buffer]].itemsize
                launch.params.add(
                    kind=mf.PARAM_KIND_ADDRESS, buffer=arg.view.buffer, byte_offset=arg.view.element_offset * itemsize
                )
            launch.params.add(kind=mf.PARAM_KIND_I32, int_value=7)
            launch.params.add(kind=mf.PARAM_KIND_ADDRESS)
    manifest.targets.append(TARGET)
    manifest.modules.add(name=MODULE, target=TARGET, resource_id="module.emulated", format=mf.MODULE_FORMAT_CUBIN)
    return manifest


def test_transport_layout_of_a_tiny_core(verified: VerifiedCore) -> None:
    transport = verified.contract.execution.transport
    layout = plan_transport(transport)
    assert TRANSPORT_COPY_LIMIT == 64 * 1024 and STAGING_ALIGNMENT == 256
    assert not layout.mapped.slots and layout.mapped.nbytes == 0  # every entry of the tiny core is small
    offsets = {name: slot.offset for name, slot in layout.copied.slots.items()}
    assert list(offsets) == [e.name for e in transport.entries]  # declaration order
    assert offsets["input_ids"] == 0 and offsets["positions"] == 256 and offsets["cache_slots"] == 768
    assert offsets["page_table"] == 1536 and offsets["state_rows"] == 1792 and offsets["sample_active"] == 2048
    assert offsets["grammar_mask"] == 4864 and offsets["prompt_histogram"] == 5376
    assert offsets["submission_sequence"] == 6656 and offsets["frame_index"] == 6912
    assert layout.copied.nbytes == 7168
    previous_end = 0
    for entry in transport.entries:
        slot = layout.copied.slots[entry.name]
        assert slot.offset % STAGING_ALIGNMENT == 0 and slot.offset >= previous_end
        assert slot.nbytes == math.prod(entry.shape) * NUMPY_DTYPES[entry.dtype].itemsize
        assert slot.shape == tuple(entry.shape) and slot.dtype == NUMPY_DTYPES[entry.dtype]
        previous_end = slot.end


def test_sparse_entries_are_those_bound_only_to_sources_read_for_a_few_rows(verified: VerifiedCore) -> None:
    assert sparse_entries(verified.contract) == {"grammar_mask", "prompt_histogram"}
    expected = {ct.VALUE_SOURCE_GRAMMAR_MASK, ct.VALUE_SOURCE_CANDIDATE_GRAMMAR_MASKS, ct.VALUE_SOURCE_PROMPT_HISTOGRAM}
    assert expected == SPARSE_SOURCES


def test_only_sparse_entries_above_the_threshold_are_mapped(verified: VerifiedCore) -> None:
    transport = verified.contract.execution.transport
    sparse = sparse_entries(verified.contract)
    sizes = {e.name: math.prod(e.shape) * NUMPY_DTYPES[e.dtype].itemsize for e in transport.entries}
    assert sizes["page_table"] == 256 and sizes["grammar_mask"] == 160 and sizes["prompt_histogram"] == 1280
    dense = plan_transport(transport, sparse=sparse, copy_limit=128)  # the page table is read whole: copied
    assert list(dense.mapped.slots) == ["grammar_mask", "prompt_histogram"] and "page_table" in dense.copied.slots
    assert not plan_transport(transport, copy_limit=128).mapped.slots  # nothing named sparse: all copied
    layout = plan_transport(transport, sparse=sparse, copy_limit=1024)  # prompt_histogram holds 4 x 320 bytes
    assert list(layout.mapped.slots) == ["prompt_histogram"]
    assert layout.mapped.slots["prompt_histogram"].offset == 0 and layout.mapped.nbytes == 1280
    assert "prompt_histogram" not in layout.copied.slots
    assert layout.copied.slots["submission_sequence"].offset == 5376
    assert layout.copied.slots["frame_index"].offset == 5632 and layout.copied.nbytes == 5888
    assert layout.slot("prompt_histogram") == (layout.mapped.slots["prompt_histogram"], True)
    assert layout.slot("frame_index") == (layout.copied.slots["frame_index"], False)
    assert layout.slot("nothing") is None
    at_limit = plan_transport(transport, sparse=sparse, copy_limit=1280)  # the limit itself is still copied
    assert not at_limit.mapped.slots


def test_the_real_model_s_large_entries_are_mapped() -> None:
    """A SmolLM2-sized transport (49152 ids, 8 rows): the histogram is mapped, the mask is copied."""
    transport = mf.Transport(frames=2)
    transport.entries.add(name="positions", dtype=mf.DTYPE_I32, shape=[64])
    transport.entries.add(name="grammar_mask", dtype=mf.DTYPE_I32, shape=[8, 1536])
    transport.entries.add(name="prompt_histogram", dtype=mf.DTYPE_U8, shape=[8, 49152])
    transport.entries.add(name="frame_index", dtype=mf.DTYPE_I32, shape=[1])
    layout = plan_transport(transport, sparse={"grammar_mask", "prompt_histogram"})
    assert list(layout.copied.slots) == ["positions", "grammar_mask", "frame_index"]
    assert [s.offset for s in layout.copied.slots.values()] == [0, 256, 256 + 49152]
    assert list(layout.mapped.slots) == ["prompt_histogram"] and layout.mapped.nbytes == 393216


def test_completion_layout_and_runtime_shapes(verified: VerifiedCore) -> None:
    execution = verified.contract.execution
    shapes = {d.name: runtime_shape(d, cache_pages=40, state_rows=2, snapshot_rows=0) for d in execution.buffers}
    ref = ReferenceBackend(verified.contract, verified.core, cache_pages=40, state_rows=2)
    try:
        for decl in execution.buffers:
            if decl.role != mf.BUFFER_ROLE_COMPLETION:
                assert shapes[decl.name] == ref.buffers[decl.name].shape, decl.name
    finally:
        ref.close()
    layout = plan_completion(execution.buffers, shapes)
    names = [d.name for d in execution.buffers if d.role == mf.BUFFER_ROLE_COMPLETION]
    assert list(layout.slots) == names
    assert [s.offset for s in layout.slots.values()] == [256 * i for i in range(len(names))]
    assert layout.slots["out_top_ids"].nbytes == 4 * 5 * 4 and layout.nbytes == 256 * len(names)


def test_copy_spans_cover_exactly_the_referenced_entries(verified: VerifiedCore) -> None:
    execution = with_launches(verified.contract.execution)
    layout = plan_transport(execution.transport)
    shapes = {d.name: runtime_shape(d, cache_pages=40, state_rows=2, snapshot_rows=0) for d in execution.buffers}
    completion = plan_completion(execution.buffers, shapes)
    programs = {p.name: p for p in execution.programs}
    for name, program in programs.items():
        for block in (layout.copied, completion):
            named = {arg.view.buffer for node in program.nodes for arg in node.args} & set(block.slots)
            span = launch_span(program, TARGET, block)
            if not named:
                assert span is None
            else:
                slots = [block.slots[n] for n in named]
                assert span == (min(s.offset for s in slots), max(s.end for s in slots)), name
    # The state initialization reads the histogram and the rows, and writes no completion record.
    assert launch_span(programs["initialize"], TARGET, completion) is None
    start, end = launch_span(programs["initialize"], TARGET, layout.copied) or (0, 0)
    assert (start, end) == (layout.copied.slots["state_rows"].offset, layout.copied.slots["frame_index"].end) or (
        start <= layout.copied.slots["state_rows"].offset and end >= layout.copied.slots["prompt_histogram"].end
    )
    # Decode writes the record but not the prompt scores (the last completion buffer); scored prefill does.
    decode = launch_span(programs["decode_b1"], TARGET, completion)
    scored = launch_span(programs["scored_prefill_p16"], TARGET, completion)
    assert decode is not None and decode[1] <= completion.slots["out_prompt_scores"].offset
    assert scored is not None and scored[1] == completion.slots["out_prompt_scores"].end
    # Launches of another target do not count.
    assert launch_span(programs["decode_b1"], "sm_100a", layout.copied) is None


def test_copy_spans_split_where_an_unreferenced_stretch_exceeds_the_gap(verified: VerifiedCore) -> None:
    execution = with_launches(verified.contract.execution)
    layout = plan_transport(execution.transport).copied
    for program in execution.programs:
        whole = launch_span(program, TARGET, layout)
        named = {arg.view.buffer for node in program.nodes for arg in node.args} & set(layout.slots)
        assert copy_spans(program, TARGET, layout) == ([whole] if whole else [])  # the tiny block has no long gap
        spans = copy_spans(program, TARGET, layout, gap=0)
        assert spans == sorted(spans) and all(a[1] < b[0] for a, b in itertools.pairwise(spans))
        covered = {n for n, slot in layout.slots.items() if any(a <= slot.offset < b for a, b in spans)}
        assert covered == named, program.name  # every named entry, no other, once the gap is zero
        for begin, end in spans:
            inside = sorted((s for s in layout.slots.values() if begin <= s.offset < end), key=lambda s: s.offset)
            assert inside[0].offset == begin and inside[-1].end == end
            assert all(a.end + STAGING_ALIGNMENT > b.offset for a, b in itertools.pairwise(inside))
    decode = next(p for p in execution.programs if p.name == "decode_b1")
    assert len(copy_spans(decode, TARGET, layout, gap=0)) > 1


def test_frame_addresses_resolve_each_kind_of_buffer(verified: VerifiedCore) -> None:
    execution = verified.contract.execution
    layout = plan_transport(execution.transport, sparse=sparse_entries(verified.contract), copy_limit=1024)
    shapes = {d.name: runtime_shape(d, cache_pages=8, state_rows=2, snapshot_rows=0) for d in execution.buffers}
    completion = plan_completion(execution.buffers, shapes)
    shared = {"tok_embd": 0x5000_0000, "cache.k0": 0x6000_0000}
    addresses = frame_addresses(shared, layout, 0x1000_0000, 0x2000_0000, completion, 0x3000_0000)
    assert addresses["input_ids"] == 0x1000_0000
    assert addresses["frame_index"] == 0x1000_0000 + layout.copied.slots["frame_index"].offset
    assert addresses["prompt_histogram"] == 0x2000_0000  # mapped: the host block's device address
    assert addresses["out_sequence"] == 0x3000_0000 + completion.slots["out_sequence"].offset
    assert addresses["tok_embd"] == 0x5000_0000 and addresses["cache.k0"] == 0x6000_0000
    assert set(addresses) == set(layout.copied.slots) | set(layout.mapped.slots) | set(completion.slots) | set(shared)


def _read_params(pack: ParamPack, kinds: list[type[Any]]) -> list[Any]:
    """Read packed kernel parameters back the way the driver does: through the void* array."""
    pointers = (ctypes.c_void_p * len(kinds)).from_address(pack.pointer)
    return [kind.from_address(pointers[i]).value for i, kind in enumerate(kinds)]


def test_pack_params_writes_what_the_kernel_reads() -> None:
    params = [
        mf.LaunchParam(kind=mf.PARAM_KIND_ADDRESS, buffer="a", byte_offset=48),
        mf.LaunchParam(kind=mf.PARAM_KIND_ADDRESS),
        mf.LaunchParam(kind=mf.PARAM_KIND_I32, int_value=-5),
        mf.LaunchParam(kind=mf.PARAM_KIND_I64, int_value=2**40 + 3),
        mf.LaunchParam(kind=mf.PARAM_KIND_F32, float_value=1.5),
        mf.LaunchParam(kind=mf.PARAM_KIND_ADDRESS, buffer="b"),
    ]
    pack = pack_params(params, {"a": 0x7F00_0000_1000, "b": 0x10})
    kinds = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_uint64]
    assert _read_params(pack, kinds) == [0x7F00_0000_1030, 0, -5, 2**40 + 3, 1.5, 0x10]
    assert pack.pointer == ctypes.addressof(pack.array)
    with pytest.raises(CudaError, match="names buffer 'c', which has no device address"):
        pack_params([mf.LaunchParam(kind=mf.PARAM_KIND_ADDRESS, buffer="c")], {})
    with pytest.raises(CudaError, match="kind 0 is not supported"):
        pack_params([mf.LaunchParam()], {})
    assert pack_params([], {}).pointer != 0  # a kernel without parameters still gets a valid array


def test_targets_are_checked_by_program_and_node(verified: VerifiedCore) -> None:
    with pytest.raises(StartupError) as caught:
        check_targets(verified.contract.execution, TARGET)
    assert "no GPU target (reference only)" in str(caught.value)
    assert "ignition build --targets reference,sm_90a" in str(caught.value)
    execution = with_launches(verified.contract.execution)
    check_targets(execution, TARGET)
    with pytest.raises(StartupError, match=r"targets sm_90a, not this GPU's sm_100a"):
        check_targets(execution, "sm_100a")
    del execution.programs[2].nodes[3].launches[:]
    program, node = execution.programs[2].name, execution.programs[2].nodes[3].name
    with pytest.raises(StartupError, match=rf"program '{program}' node '{node}' has no sm_90a launch; rebuild"):
        check_targets(execution, TARGET)
    execution = with_launches(verified.contract.execution)
    execution.tuning_programs.add(name="empty")
    with pytest.raises(StartupError, match="program 'empty' has no sm_90a launches"):
        check_targets(execution, TARGET)


def test_device_cache_pages_take_ninety_percent_of_what_other_buffers_leave(verified: VerifiedCore) -> None:
    contract = verified.contract
    selection = select(contract, LoadOptions(max_active=4))
    execution = contract.execution
    reserved = reserved_device_nbytes(execution, state_rows=4, snapshot_rows=0, frames=2)
    shapes = {d.name: runtime_shape(d, cache_pages=0, state_rows=4, snapshot_rows=0) for d in execution.buffers}
    buffers = sum(
        -(-math.prod(shapes[d.name]) * NUMPY_DTYPES[d.dtype].itemsize // 256) * 256
        for d in execution.buffers
        if d.role not in (mf.BUFFER_ROLE_CACHE_PLANE, mf.BUFFER_ROLE_COMPLETION)
    )
    assert reserved == buffers + 2 * (7168 + plan_completion(execution.buffers, shapes).nbytes)
    page = bytes_per_page(contract)
    assert page == 4 * 4 * 2 * 8 * 4
    assert choose_cache_pages(contract, selection, None, DeviceMemory(reserved + 50 * page, reserved)) == 45
    assert choose_cache_pages(contract, selection, 30, DeviceMemory(reserved + 50 * page, reserved)) == 30
    assert choose_cache_pages(contract, selection, None, DeviceMemory(reserved + 10**9, reserved)) == 2 * 4 * 16
    with pytest.raises(StartupError, match="cannot hold one request at full context"):
        choose_cache_pages(contract, selection, None, DeviceMemory(reserved + 10 * page, reserved))
    # a page larger than what the cache may take is refused, whatever --cache-pages asks for
    for cap in (None, 1):
        with pytest.raises(StartupError, match=rf"one cache page takes {page} bytes .* more than the 230 bytes"):
            choose_cache_pages(contract, selection, cap, DeviceMemory(reserved + 256, reserved))


# ----------------------------------------------------------------------------------------------
# the emulated driver context
# ----------------------------------------------------------------------------------------------


class _AddressSpace:
    """Fake device addresses, each allocation backed by host bytes; a guard gap follows each one."""

    def __init__(self) -> None:
        self._next = 0x7A00_0000_0000
        self._bases: list[int] = []
        self._regions: dict[int, np.ndarray] = {}

    def map(self, nbytes: int, backing: np.ndarray | None = None) -> int:
        base = self._next
        self._next += -(-max(nbytes, 1) // 4096) * 4096 + 4096
        bisect.insort(self._bases, base)
        self._regions[base] = backing if backing is not None else np.zeros(max(nbytes, 1), dtype=np.uint8)
        return base

    def unmap(self, base: int) -> None:
        self._bases.remove(base)
        del self._regions[base]

    def bytes(self, address: int, nbytes: int) -> np.ndarray:
        index = bisect.bisect_right(self._bases, address) - 1
        if index >= 0:
            base = self._bases[index]
            region = self._regions[base]
            if address + nbytes <= base + region.size:
                return region[address - base : address - base + nbytes]
        raise CudaError(f"CUDA_ERROR_ILLEGAL_ADDRESS: {nbytes} bytes at {address:#x}")

    @property
    def allocations(self) -> int:
        return len(self._bases)


class _Event:
    pass


@dataclasses.dataclass
class _GraphNode:
    kind: str
    after: Any
    dst: int = 0
    src: int = 0
    nbytes: int = 0
    to_device: bool = False
    symbol: str = ""
    values: list[Any] = dataclasses.field(default_factory=list)
    programmatic: bool = False
    shared_bytes: int = 0


class _Graph:
    def __init__(self, context: EmulatedContext) -> None:
        self.context = context
        self.nodes: list[_GraphNode] = []
        context.graphs.add(self)

    def kernel(
        self,
        function: Any,
        grid: Any,
        block: Any,
        shared_bytes: int,
        params: ParamPack,
        after: Any,
        *,
        programmatic: bool,
    ) -> _GraphNode:
        symbol = function[1]
        launch = self.context.launches_by_symbol[symbol]
        kinds = [_CTYPES[p.kind] for p in launch.params]
        node = _GraphNode(
            "kernel",
            after,
            symbol=symbol,
            values=_read_params(params, kinds),  # the driver copies parameters at node creation
            programmatic=programmatic,
            shared_bytes=shared_bytes,
        )
        if programmatic and (after is None or after.kind != "kernel"):
            raise CudaError("CUDA_ERROR_INVALID_VALUE: a programmatic edge needs a kernel node before it")
        self.nodes.append(node)
        return node

    def copy(self, dst: int, src: int, nbytes: int, after: Any, *, to_device: bool) -> _GraphNode:
        node = _GraphNode("copy", after, dst=dst, src=src, nbytes=nbytes, to_device=to_device)
        self.nodes.append(node)
        return node

    def instantiate(self) -> _Executable:
        if self.context.fail_instantiate is not None:
            self.context.fail_instantiate -= 1
            if self.context.fail_instantiate < 0:
                raise CudaError("cuGraphInstantiate failed: CUDA_ERROR_OUT_OF_MEMORY")
        executable = _Executable(self, list(self.nodes))
        self.context.executables.add(executable)
        return executable

    def destroy(self) -> None:
        self.context.graphs.discard(self)


@dataclasses.dataclass(eq=False)
class _Executable:
    graph: _Graph
    nodes: list[_GraphNode]


_CTYPES = {
    mf.PARAM_KIND_ADDRESS: ctypes.c_uint64,
    mf.PARAM_KIND_I32: ctypes.c_int32,
    mf.PARAM_KIND_I64: ctypes.c_int64,
    mf.PARAM_KIND_F32: ctypes.c_float,
}


class EmulatedContext:
    """The driver context surface the CUDA backend uses, emulated on the CPU (see the module docstring)."""

    architecture = TARGET

    def __init__(self, execution: mf.ExecutionManifest, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.device = _AddressSpace()
        self.host: dict[int, Any] = {}
        self.launches_by_symbol: dict[str, mf.KernelLaunch] = {}
        self.nodes_by_symbol: dict[str, mf.Node] = {}
        for program in list(execution.programs) + list(execution.tuning_programs):
            for node in program.nodes:
                for launch in node.launches:
                    self.launches_by_symbol[launch.symbol] = launch
                    self.nodes_by_symbol[launch.symbol] = node
        self.wire_dtypes = {b.name: int(b.dtype) for b in execution.buffers}
        self.wire_dtypes.update({e.name: int(e.dtype) for e in execution.transport.entries})
        self.declared = {b.name: tuple(int(d.size) for d in b.shape) for b in execution.buffers}
        self.declared.update({e.name: tuple(int(s) for s in e.shape) for e in execution.transport.entries})
        self.shapes = dict(shapes)
        self.shapes.update({e.name: tuple(int(s) for s in e.shape) for e in execution.transport.entries})
        self.queue: list[tuple[str, Any]] = []
        self.log: list[tuple[str, Any]] = []
        self.events: set[_Event] = set()
        self.executables: set[_Executable] = set()
        self.graphs: set[_Graph] = set()
        self.modules: list[bytes] = []
        self.functions: list[tuple[str, int]] = []
        self.fail_instantiate: int | None = None
        self.fail_wait: _Event | None = None
        self.closed = False
        self.lock = threading.Lock()

    # memory
    def bind(self) -> None:
        pass

    make_current = bind

    def free_memory(self) -> int:
        return 1 << 34

    def alloc(self, nbytes: int) -> int:
        return self.device.map(nbytes)

    def free(self, pointer: int) -> None:
        self.device.unmap(pointer)

    def host_alloc(self, nbytes: int, *, mapped: bool = False) -> HostBuffer:
        storage = (ctypes.c_uint8 * max(nbytes, 1))()
        buffer = HostBuffer(ctypes.addressof(storage), nbytes)
        self.host[buffer.pointer] = storage
        if mapped:
            buffer.device_pointer = self.device.map(nbytes, np.ctypeslib.as_array(storage))
        return buffer

    def host_free(self, buffer: HostBuffer) -> None:
        del self.host[buffer.pointer]
        if buffer.device_pointer:
            self.device.unmap(buffer.device_pointer)

    def _host_bytes(self, pointer: int, nbytes: int) -> np.ndarray:
        for base, storage in self.host.items():
            if base <= pointer and pointer + nbytes <= base + ctypes.sizeof(storage):
                return np.ctypeslib.as_array(storage)[pointer - base : pointer - base + nbytes]
        raise CudaError(f"CUDA_ERROR_INVALID_VALUE: {pointer:#x} is not pinned host memory")

    def upload(self, pointer: int, data: Any) -> None:
        raw = (
            np.ascontiguousarray(data).reshape(-1).view(np.uint8)
            if isinstance(data, np.ndarray)
            else np.frombuffer(data, dtype=np.uint8)
        )
        self.device.bytes(pointer, raw.nbytes)[...] = raw

    def download(self, pointer: int, out: np.ndarray) -> None:
        out.reshape(-1).view(np.uint8)[...] = self.device.bytes(pointer, out.nbytes)

    def memset(self, pointer: int, nbytes: int, value: int = 0) -> None:
        self.device.bytes(pointer, nbytes)[...] = value
        self.log.append(("memset", pointer))

    # code
    def load_module(self, image: bytes) -> Any:
        self.modules.append(image)
        return ("module", len(self.modules) - 1)

    def function(self, module: Any, symbol: str, shared_bytes: int = 0) -> Any:
        self.functions.append((symbol, shared_bytes))
        return ("function", symbol)

    # ordering
    def event(self) -> _Event:
        event = _Event()
        self.events.add(event)
        return event

    def record(self, event: _Event) -> None:
        self.queue.append(("event", event))

    def wait_event(self, event: _Event) -> None:
        self.log.append(("wait", event))
        if ("event", event) in self.queue:
            self._execute(until=event)
        if self.fail_wait is event:  # the work ran, and the device reports a failure
            self.fail_wait = None
            raise CudaError("cuEventSynchronize failed: CUDA_ERROR_LAUNCH_FAILED")

    def destroy_event(self, event: _Event) -> None:
        self.events.remove(event)

    def synchronize(self) -> None:
        self.log.append(("synchronize", None))
        self._execute(until=None)

    def synchronize_context(self) -> None:
        self.synchronize()

    def graph(self) -> _Graph:
        return _Graph(self)

    def launch_graph(self, executable: _Executable) -> None:
        if executable not in self.executables:
            raise CudaError("cuGraphLaunch failed: CUDA_ERROR_INVALID_HANDLE")
        self.queue.append(("graph", executable))
        self.log.append(("launch", executable))

    def destroy_graph(self, executable: _Executable) -> None:
        self.executables.remove(executable)
        self.log.append(("destroy", executable))

    def close(self) -> None:
        self.closed = True
        self.log.append(("close", None))

    # execution: what the GPU does, later
    def _execute(self, until: _Event | None) -> None:
        with self.lock:
            while self.queue:
                kind, item = self.queue.pop(0)
                if kind == "event":
                    if item is until:
                        return
                    continue
                for node in item.nodes:
                    if node.kind == "copy":
                        if node.to_device:
                            self.device.bytes(node.dst, node.nbytes)[...] = self._host_bytes(node.src, node.nbytes)
                        else:
                            self._host_bytes(node.dst, node.nbytes)[...] = self.device.bytes(node.src, node.nbytes)
                    else:
                        self._kernel(node)

    def _kernel(self, graph_node: _GraphNode) -> None:
        node = self.nodes_by_symbol[graph_node.symbol]
        values = graph_node.values
        if values[len(node.args)] != 7 or values[len(node.args) + 1] != 0:
            raise CudaError("CUDA_ERROR_INVALID_VALUE: scalar or scratch parameter")
        bound = {}
        for arg, address in zip(node.args, values, strict=False):
            name = arg.view.buffer
            dtype = NUMPY_DTYPES[self.wire_dtypes[name]]
            shape = tuple(int(s) for s in arg.view.shape)
            if not shape or (arg.view.element_offset == 0 and shape == self.declared[name]):
                shape = self.shapes[name]  # the whole buffer at its runtime extent
                if arg.view.element_offset:
                    shape = (math.prod(shape) - int(arg.view.element_offset),)
            raw = self.device.bytes(address, math.prod(shape) * dtype.itemsize)
            bound[arg.name] = reference._Bound(raw.view(dtype).reshape(shape), self.wire_dtypes[name])
        attributes = {a.name: reference._attribute_value(a) for a in node.attributes}
        step = reference._ADAPTERS[(node.op.name, int(node.op.version))](
            reference._Node(f"emulated {node.name}", bound, attributes)
        )
        step()


class EmulatedCore:
    """The core's resources, with the emulated module's code."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self.reads: list[str] = []

    def read_resource(self, resource_id: str, kind: int) -> bytearray:
        self.reads.append(resource_id)
        if kind == cb.RESOURCE_KIND_MODULE:
            return bytearray(b"emulated cubin")
        data: bytearray = self.core.read_resource(resource_id, kind)
        return data

    def read_resource_into(self, resource_id: str, kind: int, allocate: Callable[[int], memoryview]) -> None:
        self.reads.append(resource_id)
        self.core.read_resource_into(resource_id, kind, allocate)


@dataclasses.dataclass
class Emulated:
    backend: CudaBackend
    context: EmulatedContext
    contract: PreparedContract
    core: EmulatedCore


def emulated_backend(
    verified: VerifiedCore,
    *,
    cache_pages: int = 64,
    state_rows: int = 4,
    copy_limit: int = TRANSPORT_COPY_LIMIT,
    programmatic: bool = True,
    execution: mf.ExecutionManifest | None = None,
    prepare: Callable[[EmulatedContext], None] | None = None,
) -> Emulated:
    execution = execution or with_launches(verified.contract.execution, shared_bytes={"lm_head": 96 * 1024})
    contract = dataclasses.replace(verified.contract, execution=execution)
    shapes = {
        d.name: runtime_shape(d, cache_pages=cache_pages, state_rows=state_rows, snapshot_rows=0)
        for d in execution.buffers
    }
    context = EmulatedContext(execution, shapes)
    if prepare is not None:
        prepare(context)
    core = EmulatedCore(verified.core)
    backend = CudaBackend(
        contract,
        core,  # type: ignore[arg-type]
        cache_pages=cache_pages,
        state_rows=state_rows,
        frames=2,
        programmatic=programmatic,
        context=context,  # type: ignore[arg-type]
        copy_limit=copy_limit,
    )
    return Emulated(backend, context, contract, core)


# ----------------------------------------------------------------------------------------------
# the backend over the emulated context
# ----------------------------------------------------------------------------------------------


def test_startup_allocates_uploads_and_loads_once(verified: VerifiedCore) -> None:
    emulated = emulated_backend(verified)
    backend, context = emulated.backend, emulated.context
    try:
        execution = emulated.contract.execution
        assert backend.frames == 2 and backend.architecture == TARGET
        assert set(backend.programs) == {p.name for p in execution.programs}
        assert len(context.modules) == 1  # one module, loaded once
        symbols = [symbol for symbol, _ in context.functions]
        assert len(symbols) == len(set(symbols)) == sum(len(p.nodes) for p in execution.programs)
        assert all(shared == (96 * 1024 if symbol.endswith("/lm_head") else 0) for symbol, shared in context.functions)
        weight_resources = [r for r in emulated.core.reads if r.startswith("weights.")]
        assert sorted(weight_resources) == sorted({b.resource_id for b in execution.buffers if b.resource_id})
        ref = ReferenceBackend(verified.contract, verified.core, cache_pages=64, state_rows=4)
        try:
            for decl in execution.buffers:
                if decl.role == mf.BUFFER_ROLE_COMPLETION:
                    assert not backend.download(decl.name, frame=1).any()
                else:
                    np.testing.assert_array_equal(backend.download(decl.name), ref.buffers[decl.name])
        finally:
            ref.close()
        for frame in (0, 1):
            staging = backend.transport(frame)
            assert list(staging) == [e.name for e in execution.transport.entries]
            assert int(staging["frame_index"][0]) == frame
            assert int(backend.download("frame_index", frame=frame)[0]) == frame
    finally:
        backend.close()


def test_staging_and_records_are_views_of_each_frame_s_pinned_memory(verified: VerifiedCore) -> None:
    emulated = emulated_backend(verified, copy_limit=1024)
    backend, context = emulated.backend, emulated.context
    try:
        layout = backend.transport_layout
        frames = [backend.transport(f) for f in (0, 1)]
        for staging in frames:
            for name, array in staging.items():
                slot, _mapped = layout.slot(name) or (None, False)
                assert slot is not None and array.shape == slot.shape and array.dtype == slot.dtype
                context._host_bytes(array.ctypes.data, array.nbytes)  # pinned host memory of the backend
        assert not np.shares_memory(frames[0]["positions"], frames[1]["positions"])
        assert frames[0]["positions"].ctypes.data - frames[0]["input_ids"].ctypes.data == 256
        records = backend.completion(1)
        assert set(records) == {int(r.field) for r in emulated.contract.execution.completion}
        assert records[mf.COMPLETION_FIELD_SAMPLED_IDS].shape == (4, 1)
    finally:
        backend.close()


def _structure(executable: _Executable) -> list[tuple[str, bool]]:
    return [(node.kind, node.programmatic) for node in executable.nodes]


def test_a_graph_chains_one_copy_in_per_span(verified: VerifiedCore) -> None:
    emulated = emulated_backend(verified, copy_limit=0)  # every sparse entry mapped, spans split at every gap
    backend = emulated.backend
    try:
        program = next(p for p in emulated.contract.execution.programs if p.name == "decode_b4")
        spans = copy_spans(program, TARGET, backend.transport_layout.copied, gap=0)
        assert len(spans) > 1
        for frame, executable in enumerate(backend._programs["decode_b4"]):
            state = backend._frames[frame]
            copies = executable.nodes[: len(spans)]
            assert [(n.kind, n.to_device) for n in copies] == [("copy", True)] * len(spans)
            assert [(n.dst, n.src, n.nbytes) for n in copies] == [
                (state.device + start, state.host.pointer + start, end - start) for start, end in spans
            ]
            assert copies[0].after is None and all(b.after is a for a, b in itertools.pairwise(copies))
            assert executable.nodes[len(spans)].kind == "kernel" and executable.nodes[len(spans)].after is copies[-1]
    finally:
        backend.close()


@pytest.mark.parametrize("programmatic", [True, False])
def test_each_graph_copies_in_launches_in_order_and_copies_out(verified: VerifiedCore, programmatic: bool) -> None:
    emulated = emulated_backend(verified, copy_limit=1024, programmatic=programmatic)
    backend, context = emulated.backend, emulated.context
    try:
        layout, completion = backend.transport_layout, backend.completion_layout
        program = next(p for p in emulated.contract.execution.programs if p.name == "decode_b4")
        graphs = backend._programs["decode_b4"]
        assert len(graphs) == 2 and graphs[0] is not graphs[1]
        for frame, executable in enumerate(graphs):
            nodes = executable.nodes
            kernels = [n for n in nodes if n.kind == "kernel"]
            assert [n.symbol for n in kernels] == [f"decode_b4/{node.name}" for node in program.nodes]
            assert _structure(executable) == [("copy", False), ("kernel", False)] + [("kernel", programmatic)] * (
                len(kernels) - 1
            ) + [("copy", False)]
            for before, after in itertools.pairwise(nodes):
                assert after.after is before  # a chain, in list order
            copy_in, copy_out = nodes[0], nodes[-1]
            start, end = launch_span(program, TARGET, layout.copied) or (0, 0)
            state = backend._frames[frame]
            assert copy_in.to_device and (copy_in.dst, copy_in.src, copy_in.nbytes) == (
                state.device + start,
                state.host.pointer + start,
                end - start,
            )
            start, end = launch_span(program, TARGET, completion) or (0, 0)
            assert not copy_out.to_device and (copy_out.dst, copy_out.src, copy_out.nbytes) == (
                state.completion_host.pointer + start,
                state.completion_device + start,
                end - start,
            )
            # every address parameter points at this frame's transport and completion, shared buffers otherwise
            for node, graph_node in zip(program.nodes, kernels, strict=True):
                for arg, value in zip(node.args, graph_node.values, strict=False):
                    assert (
                        value
                        == state.addresses[arg.view.buffer]
                        + arg.view.element_offset * NUMPY_DTYPES[context.wire_dtypes[arg.view.buffer]].itemsize
                    )
            sample = next(n for n in kernels if n.symbol == "decode_b4/sample")
            sample_node = next(n for n in program.nodes if n.name == "sample")
            presence = [a.name for a in sample_node.args].index("prompt_presence")
            assert sample.values[presence] == backend._shared["prompt_presence"].address
        init = backend._programs["initialize"][1]
        histogram = next(n for n in init.nodes if n.kind == "kernel").values[0]
        assert histogram == backend._frames[1].mapped.device_pointer  # type: ignore[union-attr]
        assert init.nodes[-1].kind == "kernel"  # no completion record: no copy out
    finally:
        backend.close()


def test_run_returns_at_once_and_the_fences_guard_staging_and_records(verified: VerifiedCore) -> None:
    emulated = emulated_backend(verified)
    backend, context = emulated.backend, emulated.context
    try:
        staging = backend.transport(0)
        staging["generation"][:] = [11, 12, 13, 14]
        staging["sample_active"][:] = 0
        staging["cache_slots"][:] = -1  # padding: nothing is written to the cache
        backend.run("decode_b4", 0)
        assert context.queue  # launched, not executed yet
        assert ("launch", backend._programs["decode_b4"][0]) in context.log
        event = backend._frames[0].event
        assert context.queue[-1] == ("event", event)
        # The host writes staging only after the frame's fence: transport() waits for the graph.
        staging = backend.transport(0)
        assert ("wait", event) in context.log and not context.queue
        staging["generation"][:] = 99  # does not reach the finished round
        records = backend.completion(0)
        assert records[mf.COMPLETION_FIELD_GENERATION].tolist() == [11, 12, 13, 14]
        # The other frame was untouched.
        backend.transport(1)["cache_slots"][:] = -1
        backend.run("decode_b4", 1)
        assert backend.completion(1)[mf.COMPLETION_FIELD_GENERATION].tolist() == [0, 0, 0, 0]
        with pytest.raises(ValueError, match="unknown program 'nope'"):
            backend.run("nope", 0)
        with pytest.raises(ValueError, match=r"frame 2 is outside \[0, 2\)"):
            backend.run("decode_b4", 2)
        with pytest.raises(ValueError, match="frame -1"):
            backend.transport(-1)
    finally:
        backend.close()
    with pytest.raises(CudaError, match="closed"):
        backend.run("decode_b4", 0)
    with pytest.raises(CudaError, match="closed"):
        backend.completion(0)


def test_upload_and_download_round_trip(verified: VerifiedCore) -> None:
    emulated = emulated_backend(verified, copy_limit=1024)
    backend = emulated.backend
    try:
        logits = np.arange(4 * 320, dtype=np.float32).reshape(4, 320)
        backend.upload("scratch.logits", logits)
        np.testing.assert_array_equal(backend.download("scratch.logits"), logits)
        backend.upload("positions", np.arange(16), frame=1)
        assert backend.transport(1)["positions"].tolist() == list(range(16))
        assert backend.download("positions", frame=1).tolist() == list(range(16))
        assert not backend.download("positions").any()
        histogram = np.full((4, 320), 3, dtype=np.uint8)
        backend.upload("prompt_histogram", histogram)  # mapped: the host memory is the buffer
        np.testing.assert_array_equal(backend.transport(0)["prompt_histogram"], histogram)
        with pytest.raises(ValueError, match="unknown buffer"):
            backend.download("nope")
        with pytest.raises(ValueError, match="holds 16 elements"):
            backend.upload("positions", np.arange(3))
    finally:
        backend.close()


def test_close_drains_then_releases_everything(verified: VerifiedCore) -> None:
    emulated = emulated_backend(verified, copy_limit=1024)
    backend, context = emulated.backend, emulated.context
    for frame in (0, 1):
        backend.transport(frame)["cache_slots"][:] = -1
    backend.run("decode_b4", 0)
    backend.run("decode_b2", 1)
    backend.close()
    first_destroy = next(i for i, (kind, _) in enumerate(context.log) if kind == "destroy")
    waits = [i for i, (kind, _) in enumerate(context.log) if kind in ("wait", "synchronize")]
    assert not context.queue  # both frames ran to completion
    assert waits and max(waits) < first_destroy  # the drain comes before anything is destroyed
    assert context.closed and context.log[-1] == ("close", None)
    assert not context.executables and not context.graphs and not context.events
    assert context.device.allocations == 0 and not context.host
    backend.close()  # idempotent


def test_a_failed_startup_releases_everything(verified: VerifiedCore) -> None:
    holder: list[EmulatedContext] = []

    def keep(context: EmulatedContext) -> None:
        holder.append(context)
        context.fail_instantiate = 2  # the third graph (initialize on both frames came first)

    with pytest.raises(CudaError, match=r"program 'prefill_p16' frame 0: cuGraphInstantiate failed"):
        emulated_backend(verified, prepare=keep)
    (context,) = holder
    assert context.closed and not context.executables and not context.graphs and not context.events
    assert context.device.allocations == 0 and not context.host

    execution = with_launches(verified.contract.execution)
    del execution.programs[-1].nodes[0].launches[:]
    holder.clear()
    with pytest.raises(StartupError, match="has no sm_90a launch"):
        emulated_backend(verified, execution=execution, prepare=holder.append)
    assert holder[0].closed and holder[0].device.allocations == 0


def test_tuning_producers_run_once_before_serving(verified: VerifiedCore) -> None:
    execution = with_launches(verified.contract.execution)
    tuned = execution.buffers.add(name="tuned.table", role=mf.BUFFER_ROLE_TUNED, dtype=mf.DTYPE_F32)
    tuned.shape.add(size=1)
    tuned.shape.add(size=32)
    program = execution.tuning_programs.add(name="tune_table")
    node = program.nodes.add(name="fill")
    node.op.name, node.op.version = "rmsnorm", 1
    for name, buffer in (("x", "output_norm.weight"), ("weight", "output_norm.weight"), ("out", "tuned.table")):
        node.args.add(name=name, view=mf.BufferView(buffer=buffer, shape=[32] if name == "weight" else [1, 32]))
    node.attributes.add(name="eps", float_value=1e-5)
    launch = node.launches.add(target=TARGET, module=MODULE, symbol="tune_table/fill", grid=[1, 1, 1], block=[32, 1, 1])
    for arg in node.args:
        launch.params.add(kind=mf.PARAM_KIND_ADDRESS, buffer=arg.view.buffer)
    launch.params.add(kind=mf.PARAM_KIND_I32, int_value=7)
    launch.params.add(kind=mf.PARAM_KIND_ADDRESS)
    execution.tuning.add(program="tune_table", outputs=["tuned.table"])
    emulated = emulated_backend(verified, execution=execution)
    backend, context = emulated.backend, emulated.context
    try:
        assert "tune_table" in backend.programs
        launches = [item for kind, item in context.log if kind == "launch"]
        assert launches == [backend._programs["tune_table"][0]]  # once, on frame 0, before serving
        assert not context.queue
        weight = backend.download("output_norm.weight")
        want = rk.rmsnorm(weight.reshape(1, 32), weight, 1e-5)
        np.testing.assert_allclose(backend.download("tuned.table"), want, rtol=1e-6)
        assert np.any(want)
    finally:
        backend.close()


# ----------------------------------------------------------------------------------------------
# the engine over the emulated backend, against the reference backend
# ----------------------------------------------------------------------------------------------


def _emulated_running(
    verified: VerifiedCore, *, max_active: int = 4, copy_limit: int = 1024
) -> tuple[Engine, Emulated]:
    selection = select(verified.contract, LoadOptions(max_active=max_active))
    state_rows = selection.max_active * selection.state_rows_per_request
    emulated = emulated_backend(verified, cache_pages=64, state_rows=state_rows, copy_limit=copy_limit)
    model = NativeModel(
        emulated.contract, selection, emulated.backend, "cuda", cache_pages=64, state_rows=state_rows, frames=2
    )
    bootstrap = Bootstrap.load(verified.core, verified.contract)
    contract = verified.contract
    compiler = GrammarCompiler(
        bootstrap.tokenizer,
        sampled_size=contract.sampled_size,
        logits_width=contract.logits_width,
        eos_token_ids=contract.eos_token_ids,
    )
    return Engine(model, bootstrap.tokenizer, compiler), emulated


def _prompts(running: RunningModel, count: int) -> list[list[int]]:
    return [
        running.bootstrap.encode_prompt([{"role": "user", "content": f"Shared opening, then {i}"}])
        for i in range(count)
    ]


def _tokens(events: list[Any]) -> list[int]:
    return [e.token_id for e in events if isinstance(e, TokenEvent)]


def test_the_engine_on_the_emulated_gpu_gives_the_reference_tokens(
    verified: VerifiedCore, start_fixture: Callable[..., RunningModel]
) -> None:
    reference_running = start_fixture(max_active=4, cache_pages=64)
    prompts = _prompts(reference_running, 6)
    work = [(p, GREEDY if i % 2 else SamplingParams(temperature=0.9, top_p=0.9, seed=i)) for i, p in enumerate(prompts)]
    expected = [
        reference_running.engine.generate(PreparedRequest(f"s{i}", p, 10, s, ignore_eos=True)).token_ids
        for i, (p, s) in enumerate(work)
    ]
    engine, emulated = _emulated_running(verified)
    try:
        streams = [engine.submit(PreparedRequest(f"r{i}", p, 10, s, ignore_eos=True)) for i, (p, s) in enumerate(work)]
        outcomes = [list(stream) for stream in streams]
        assert all(isinstance(events[-1], Finished) for events in outcomes), [o[-1] for o in outcomes]
        assert [_tokens(events) for events in outcomes] == expected
        stats = engine.statistics()
        assert stats.pipelined_rounds > 0 and stats.launches.get("decode_b4", 0) > 0
    finally:
        engine.shutdown()
    assert emulated.context.closed and emulated.context.device.allocations == 0


def test_the_emulated_gpu_leaves_the_reference_backend_s_buffers(
    verified: VerifiedCore, start_fixture: Callable[..., RunningModel]
) -> None:
    reference_running = start_fixture(max_active=4, cache_pages=64)
    engine, emulated = _emulated_running(verified)
    try:
        for engine_ in (reference_running.engine, engine):
            for i, prompt in enumerate(_prompts(reference_running, 2)):
                engine_.generate(PreparedRequest(f"q{i}", prompt, 6, GREEDY, ignore_eos=True))
        ref = reference_running.model.backend
        assert isinstance(ref, ReferenceBackend)
        for name, array in ref.buffers.items():
            np.testing.assert_array_equal(emulated.backend.download(name), array, err_msg=name)
        for frame in (0, 1):
            want = ref.completion(frame)
            got = emulated.backend.completion(frame)
            for field, array in want.items():
                np.testing.assert_array_equal(got[field], array, err_msg=f"frame {frame} field {field}")
    finally:
        engine.shutdown()


def test_a_failed_fence_fails_only_the_requests_of_that_round(
    verified: VerifiedCore, start_fixture: Callable[..., RunningModel]
) -> None:
    reference_running = start_fixture(max_active=1, cache_pages=64)
    prompts = _prompts(reference_running, 3)
    expected = [
        reference_running.engine.generate(PreparedRequest(f"s{i}", p, 8, GREEDY, ignore_eos=True)).token_ids
        for i, p in enumerate(prompts)
    ]
    engine, emulated = _emulated_running(verified, max_active=1)
    backend, context = emulated.backend, emulated.context
    original = backend.run
    armed: list[int] = []

    def fail_first_follow_up(program: str, frame: int) -> None:
        original(program, frame)
        if frame == 1 and not armed:  # the first pipelined round: the device reports a failed launch
            armed.append(frame)
            context.fail_wait = backend._frames[1].event

    backend.run = fail_first_follow_up  # type: ignore[method-assign]
    try:
        streams = [
            engine.submit(PreparedRequest(f"r{i}", p, 8, GREEDY, ignore_eos=True)) for i, p in enumerate(prompts)
        ]
        outcomes = [list(stream) for stream in streams]
        first = outcomes[0][-1]
        assert isinstance(first, ExecutionFailed)
        assert first.message.startswith("execution failed: CudaError: cuEventSynchronize failed")
        published = _tokens(outcomes[0])
        assert published == expected[0][: len(published)] and len(published) < 8
        for events, tokens in zip(outcomes[1:], expected[1:], strict=True):
            assert isinstance(events[-1], Finished) and _tokens(events) == tokens
        assert engine.statistics().failed == 1
    finally:
        engine.shutdown()
    assert context.closed and context.device.allocations == 0


# ----------------------------------------------------------------------------------------------
# the engine: a backend error while waiting for a frame fails only that round
# ----------------------------------------------------------------------------------------------


class RaisingCompletion:
    """The reference backend, except that waiting for one chosen frame raises once, at its ``nth`` wait."""

    def __init__(self, inner: Any, frame: int, nth: int) -> None:
        self.inner = inner
        self.frame = frame
        self.remaining = nth
        self.raised = False

    def transport(self, frame: int) -> Any:
        return self.inner.transport(frame)

    def run(self, program: str, frame: int) -> None:
        self.inner.run(program, frame)

    def completion(self, frame: int) -> Any:
        if frame == self.frame and not self.raised:
            self.remaining -= 1
            if self.remaining == 0:
                self.raised = True
                raise HeliosError(f"device fault while waiting for frame {frame}")
        return self.inner.completion(frame)

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize(
    ("frame", "nth"),
    [
        (0, 2),  # the first request's first prefill chunk (after its state initialization)
        (0, 5),  # its first decode round (after 3 chunks of its 41 prompt tokens), its follow-up in flight
        (1, 2),  # its second follow-up round
    ],
)
def test_a_completion_wait_that_raises_fails_only_its_round(
    frame: int, nth: int, start_fixture: Callable[..., RunningModel]
) -> None:
    solo = start_fixture(max_active=1)
    prompts = _prompts(solo, 3)
    expected = [
        solo.engine.generate(PreparedRequest(f"s{i}", p, 8, GREEDY, ignore_eos=True)).token_ids
        for i, p in enumerate(prompts)
    ]
    running = start_fixture(max_active=1)  # one request at a time: the failing round is the first request's
    wrapper = RaisingCompletion(running.model.backend, frame, nth)
    running.model.backend = wrapper  # type: ignore[assignment]
    streams = [
        running.engine.submit(PreparedRequest(f"r{i}", p, 8, GREEDY, ignore_eos=True)) for i, p in enumerate(prompts)
    ]
    outcomes = [list(stream) for stream in streams]
    assert wrapper.raised
    failed = outcomes[0][-1]
    assert isinstance(failed, ExecutionFailed)
    assert failed.message == f"execution failed: HeliosError: device fault while waiting for frame {frame}"
    published = _tokens(outcomes[0])
    assert (
        published == expected[0][: len(published)] and len(published) == {(0, 2): 0, (0, 5): 1, (1, 2): 4}[(frame, nth)]
    )
    for events, tokens in zip(outcomes[1:], expected[1:], strict=True):
        assert isinstance(events[-1], Finished) and _tokens(events) == tokens
    stats = running.engine.statistics()
    assert stats.failed == 1 and stats.finished == {"length": 2}
    assert stats.pipelined_rounds > 0
    running.model.backend = wrapper.inner


def test_a_transport_wait_that_raises_fails_only_its_round(start_fixture: Callable[..., RunningModel]) -> None:
    running = start_fixture(max_active=1)
    prompts = _prompts(running, 2)
    inner = running.model.backend
    calls = {"count": 0}
    original = inner.transport

    def flaky_transport(frame: int) -> Any:
        calls["count"] += 1
        if calls["count"] == 3:
            raise CudaError("cuEventSynchronize failed: CUDA_ERROR_ILLEGAL_ADDRESS")
        return original(frame)

    inner.transport = flaky_transport  # type: ignore[method-assign]
    outcomes = [
        list(s)
        for s in [
            running.engine.submit(PreparedRequest(f"t{i}", p, 6, GREEDY, ignore_eos=True))
            for i, p in enumerate(prompts)
        ]
    ]
    assert isinstance(outcomes[0][-1], ExecutionFailed)
    assert (
        outcomes[0][-1].message == "execution failed: CudaError: cuEventSynchronize failed: CUDA_ERROR_ILLEGAL_ADDRESS"
    )
    assert isinstance(outcomes[1][-1], Finished) and len(_tokens(outcomes[1])) == 6
    inner.transport = original  # type: ignore[method-assign]


def test_shutdown_is_idempotent_and_closes_the_model_after_the_worker(
    start_fixture: Callable[..., RunningModel],
) -> None:
    running = start_fixture(max_active=1)
    closed: list[bool] = []
    backend = running.model.backend
    original = backend.close

    def close() -> None:
        closed.append(running.engine._worker.is_alive())
        original()

    backend.close = close  # type: ignore[method-assign]
    stream = running.engine.submit(PreparedRequest("x", _prompts(running, 1)[0], 20, GREEDY, ignore_eos=True))
    running.engine.shutdown()
    running.engine.shutdown()
    assert closed == [False]  # once, with the worker stopped
    assert isinstance(list(stream)[-1], Finished)
