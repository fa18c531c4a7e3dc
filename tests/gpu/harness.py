"""Shared GPU test helpers: one op-catalogue node on the GPU and on the reference backend, and tiny
cores built with GPU kernels.

``run_node`` declares one buffer per tensor argument (numpy arrays in, numpy arrays out), lowers
the node with the operator's registered lowering function, loads the modules, launches every
launch in order on the context's stream and downloads every array back. ``reference_node`` runs
the same node through the reference backend's adapter. Arrays are bound as whole buffers, so
shapes and dtypes come from the arrays: float32 -> F32, uint16 -> BF16 bit patterns, float16 -> F16, int32 -> I32,
int64 -> I64, uint8 -> U8, uint64 -> U64.

``build_gpu_core`` builds a signed tiny synthetic core (``llama-synthetic`` with bf16 weights by default)
for the ``reference,sm_90a`` targets (skipping the test on another GPU); the ``verified`` fixture of
``tests/gpu/conftest.py`` opens a module's ``gpu_core``. ``start_core`` serves such a core on a backend
and ``assert_cuda_matches_reference`` compares greedy requests on the CUDA backend with the reference.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ignition.kernels import load_kernel_modules
from ignition.kernels.lowering import LOWERINGS, LoweringContext
from ignition.preparation.program import set_attribute

from helios_core.backends import reference, reference_kernels
from helios_core.backends.cuda_driver import Context, pack_params
from helios_core.container.keys import generate_keys
from helios_core.contract import LoadOptions
from helios_core.loading import TrustSettings
from helios_core.runtime.messages import Finished, PreparedRequest, SamplingParams, TokenEvent
from helios_core.runtime.startup import RunningModel, start
from helios_core.wire import manifest_pb2 as mf

GREEDY = SamplingParams(temperature=0.0)

COMPILE_ONLY = os.environ.get("HELIOS_GPU_TESTS_COMPILE_ONLY") == "1"
"""Compile the tests' kernels without a GPU; a test reaching the device is reported skipped
(``tests/gpu/conftest.py``)."""


def skip_when_compiling_only(what: str) -> None:
    """Skip the test here in a compile-only run: ``what`` needs the GPU in a way the stand-in context cannot
    see (a backend chosen automatically, a server in a child process)."""
    if COMPILE_ONLY:
        pytest.skip(f"compile only: {what} needs the GPU")


WIRE_DTYPES = {
    np.dtype(np.float32): mf.DTYPE_F32,
    np.dtype(np.uint16): mf.DTYPE_BF16,
    np.dtype(np.float16): mf.DTYPE_F16,
    np.dtype(np.int32): mf.DTYPE_I32,
    np.dtype(np.int64): mf.DTYPE_I64,
    np.dtype(np.uint8): mf.DTYPE_U8,
    np.dtype(np.uint64): mf.DTYPE_U64,
}


def one_node_manifest(
    op: str,
    arrays: Mapping[str, np.ndarray],
    attributes: Mapping[str, Any],
    weights: Sequence[str] = (),
    *,
    symbolic: Mapping[str, int] | None = None,
    alias: Mapping[str, str] | None = None,
) -> tuple[mf.ExecutionManifest, mf.Node]:
    """A manifest of one node over one whole buffer per array.

    ``symbolic`` gives an array's leading dimension a symbol; ``alias`` points an argument at another
    argument's buffer (``{"out": "x"}``: an in-place update).
    """
    manifest = mf.ExecutionManifest(abi_label="test", ranks=1, op_catalogue=1)
    program = manifest.programs.add(name="test")
    node = program.nodes.add(name=op)
    node.op.name = op
    node.op.version = 1
    for name, array in arrays.items():
        role = mf.BUFFER_ROLE_WEIGHTS if name in weights else mf.BUFFER_ROLE_SCRATCH
        decl = manifest.buffers.add(name=name, role=role, dtype=WIRE_DTYPES[array.dtype])
        for axis, size in enumerate(array.shape):
            symbol = (symbolic or {}).get(name, mf.DIM_SYMBOL_UNSPECIFIED) if axis == 0 else 0
            decl.shape.add(size=int(size), symbol=symbol)  # type: ignore[arg-type]
        buffer = (alias or {}).get(name, name)
        node.args.add(name=name, view=mf.BufferView(buffer=buffer, shape=[int(s) for s in array.shape]))
    for name, value in attributes.items():
        set_attribute(node, name, value)
    return manifest, node


def lower(
    op: str,
    arrays: Mapping[str, np.ndarray],
    attributes: Mapping[str, Any] | None = None,
    *,
    weights: Sequence[str] = (),
    alias: Mapping[str, str] | None = None,
    written: Sequence[str] = (),
    operation: int = 0,
) -> tuple[LoweringContext, list[mf.KernelLaunch]]:
    """The launches the operator's lowering makes for this node.

    ``alias`` binds an argument to another argument's buffer (``{"out": "x"}``: an in-place update);
    ``written`` names buffers an earlier node of the program would write (not settled for this one);
    ``operation`` is the program's (``contract_pb2.Operation``).
    """
    load_kernel_modules()
    manifest, node = one_node_manifest(op, arrays, attributes or {}, weights, alias=alias)
    manifest.programs[0].operation = operation  # type: ignore[assignment]
    context = LoweringContext(manifest, "sm_90a", program="test", node=op, written=set(written), operation=operation)
    return context, LOWERINGS[(op, 1)](context, node)


def run_node(
    cuda: Context,
    op: str,
    arrays: Mapping[str, np.ndarray],
    attributes: Mapping[str, Any] | None = None,
    *,
    weights: Sequence[str] = (),
    alias: Mapping[str, str] | None = None,
    repeat: int = 1,
    reset: Sequence[str] = (),
    written: Sequence[str] = (),
    operation: int = 0,
) -> dict[str, np.ndarray]:
    """Run the node on the GPU ``repeat`` times (uploading the ``reset`` arrays again before each
    time); returns every array as the device left it.

    Buffers the lowering adds (workspaces) are allocated too, zeroed as the backend allocates them;
    ``alias``, ``written`` and ``operation`` as for :func:`lower`.
    """
    context, launches = lower(
        op, arrays, attributes, weights=weights, alias=alias, written=written, operation=operation
    )
    addresses: dict[str, int] = {}
    try:
        for decl in context.manifest.buffers:
            if decl.name in arrays:
                array = np.ascontiguousarray(arrays[decl.name])
                addresses[decl.name] = cuda.alloc(max(array.nbytes, 1))
                cuda.upload(addresses[decl.name], array)
            else:
                count = int(np.prod([int(d.size) for d in decl.shape]))
                addresses[decl.name] = cuda.alloc(max(count * 8, 1))
                cuda.memset(addresses[decl.name], max(count * 8, 1))
        functions = {name: cuda.load_module(module.data) for name, module in context.modules.items()}
        for _ in range(repeat):
            for name in reset:
                cuda.upload(addresses[name], np.ascontiguousarray(arrays[name]))
            for launch in launches:
                function = cuda.function(functions[launch.module], launch.symbol, launch.shared_bytes)
                params = pack_params(launch.params, addresses)
                cuda.launch(function, launch.grid, launch.block, launch.shared_bytes, params)
        cuda.synchronize()
        out = {}
        for name, array in arrays.items():
            result = np.empty_like(np.ascontiguousarray(array))
            cuda.download(addresses[name], result)
            out[name] = result
        return out
    finally:
        for pointer in addresses.values():
            cuda.free(pointer)


def reference_node(
    op: str, arrays: Mapping[str, np.ndarray], attributes: Mapping[str, Any] | None = None
) -> dict[str, np.ndarray]:
    """Run the node through the reference backend's adapter on copies of ``arrays``."""
    _manifest, node = one_node_manifest(op, arrays, attributes or {})
    copies = {name: np.array(array, copy=True) for name, array in arrays.items()}
    bound = {arg.name: reference._Bound(copies[arg.name], WIRE_DTYPES[copies[arg.name].dtype]) for arg in node.args}
    attrs = {attr.name: reference._attribute_value(attr) for attr in node.attributes}
    step = reference._ADAPTERS[(op, 1)](reference._Node(f"node {op}", bound, attrs))
    step()
    return copies


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    got64, want64 = got.astype(np.float64), want.astype(np.float64)
    scale = float(np.linalg.norm(want64))
    return float(np.linalg.norm(got64 - want64)) / (scale if scale else 1.0)


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (round to nearest even), as the reference backend rounds."""
    return reference_kernels.float32_to_bf16_bits(values)


def bf16_values(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def build_gpu_core(
    tmp_path_factory: pytest.TempPathFactory,
    cuda_context: Context,
    directory: str,
    namespace: str,
    *options: str,
    core_name: str = "tiny.core",
    recipe: str = "llama-synthetic",
    dtype: str | None = "bf16",
) -> tuple[Path, TrustSettings]:
    """A signed tiny ``recipe`` core (``llama-synthetic`` with bf16 weights unless told otherwise; ``dtype``
    ``None`` keeps the recipe's default) and ``reference,sm_90a`` kernels, built by the Ignition command
    line with the extra ``options`` (capacities, speculation) into a new temporary ``directory``; the test
    is skipped on a GPU other than sm_90a."""
    if cuda_context.architecture != "sm_90a":
        pytest.skip(f"the kernels are built for sm_90a; this GPU is {cuda_context.architecture}")
    from ignition.cli import main as ignition_main

    folder = tmp_path_factory.mktemp(directory)
    keys = generate_keys(folder / "keys")
    core = folder / core_name
    weights = ("--dtype", dtype) if dtype is not None else ()
    code = ignition_main(
        [
            "build", recipe, "--shape", "tiny", "--targets", "reference,sm_90a", *weights,
            "--out", str(core), "--sign-key", str(keys["signing"]), "--namespace", namespace, *options, "--quiet",
        ]
    )  # fmt: skip
    assert code == 0
    return core, TrustSettings((keys["public"],), namespace, None)


NEAR_TIE = 0.05
"""Top-2 log-probability gap below which GPU arithmetic may legitimately pick the other token."""


def start_core(gpu_core: tuple[Path, TrustSettings], backend: str, max_active: int = 4) -> RunningModel:
    """The core served on ``backend`` (``reference`` or ``cuda``)."""
    return start(gpu_core[0], gpu_core[1], LoadOptions(max_active=max_active), backend=backend)


def question_prompts(running: RunningModel, prefill_tokens: int = 16) -> list[list[int]]:
    """Four chat prompts, each spanning several ``prefill_tokens``-token prefill chunks."""
    prompts = [
        running.bootstrap.encode_prompt([{"role": "user", "content": f"Question {i}: " + "what comes next? " * 3}])
        for i in range(4)
    ]
    assert all(len(p) > 2 * prefill_tokens for p in prompts)
    return prompts


def greedy_token_events(running: RunningModel, prompts: list[list[int]], max_tokens: int) -> list[list[TokenEvent]]:
    """The token events of one greedy request a prompt (EOS ignored, top-2 log-probabilities), all finished."""
    streams = [
        running.engine.submit(PreparedRequest(f"r{i}", p, max_tokens, GREEDY, ignore_eos=True, top_logprobs=2))
        for i, p in enumerate(prompts)
    ]
    outcomes = [list(stream) for stream in streams]
    assert all(isinstance(events[-1], Finished) for events in outcomes), [o[-1] for o in outcomes]
    return [[e for e in events if isinstance(e, TokenEvent)] for events in outcomes]


def assert_cuda_matches_reference(
    gpu_core: tuple[Path, TrustSettings], reference_running: RunningModel, max_tokens: int = 10
) -> None:
    """The core on the CUDA backend gives the reference's greedy tokens for :func:`question_prompts` (up to
    a step the reference itself decided by less than :data:`NEAR_TIE`) and its log-probabilities within 2e-2."""
    prompts = question_prompts(reference_running)
    expected = greedy_token_events(reference_running, prompts, max_tokens)
    running = start_core(gpu_core, "cuda")
    try:
        assert running.model.backend_name == "cuda"
        got = greedy_token_events(running, prompts, max_tokens)
    finally:
        running.close()
    for mine, theirs in zip(got, expected, strict=True):
        assert len(mine) == len(theirs) == max_tokens
        for step, (token, want) in enumerate(zip(mine, theirs, strict=True)):
            if token.token_id != want.token_id:
                assert want.top[0][1] - want.top[1][1] < NEAR_TIE, (step, token, want)
                break
            assert relative_error(np.array([token.logprob]), np.array([want.logprob])) < 2e-2 or (
                abs(token.logprob - want.logprob) < 1e-3
            ), (step, token.logprob, want.logprob)
