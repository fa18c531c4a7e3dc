"""Ahead-of-time Triton compilation: one cubin per kernel specialization.

Owns turning a ``@triton.jit`` function, its parameter types and its compile-time constants into a
:class:`CompiledKernel` (cubin bytes, symbol, threads, shared memory, trailing scratch parameters)
for a named GPU target, and the bytes of global scratch memory each program of a launch needs (Triton's
device-side tensor descriptors live there). Compilation needs no GPU: Triton's own ``ptxas`` runs on the build machine.
Results are cached in memory and, when ``IGNITION_KERNEL_CACHE`` names a folder, on disk, keyed by
the kernel source, the signature, the constants and the target, so a rebuild compiles nothing new. The
disk cache keeps each Triton version's cubins in a folder of their own (``triton-<version>``), so a
build never reuses what another version of the compiler made, and publishes each entry by renaming a whole
file onto its name, so processes sharing the folder never read one half written.
A planning pass (:func:`planning`) records what a lowering would compile without compiling, so
:func:`precompile` can compile every distinct kernel in parallel processes first.

The key holds the source of the kernel's whole module and of every module holding a ``triton.jit``
helper the kernel calls (directly or through other helpers), so editing a helper re-keys every kernel
that uses it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.metadata
import inspect
import json
import multiprocessing
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_TARGETS = {"sm_90a": 90}
"""GPU targets Ignition compiles for, and their compute capability."""


class KernelCompileError(ValueError):
    """A kernel could not be compiled (Triton missing, an unsupported target, a compiler error)."""


@dataclass(frozen=True)
class CompiledKernel:
    """One compiled kernel specialization."""

    symbol: str
    cubin: bytes
    num_warps: int
    shared_bytes: int
    scratch_params: int
    """Trailing pointer parameters the compiler appends (Triton's global and profile scratch, in that
    order); the launch passes null for each whose size is zero."""
    global_scratch_bytes: int = 0
    """Bytes of global scratch each program of a launch needs (0: none); the launch passes the address of
    ``programs x global_scratch_bytes`` bytes aligned to :attr:`global_scratch_align` as the first
    scratch parameter."""
    global_scratch_align: int = 1

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.cubin).hexdigest()


_MEMORY: dict[str, CompiledKernel] = {}


@functools.cache
def compiler_version() -> str:
    """The installed Triton's version (``none`` without Triton)."""
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def _cache_dir() -> Path | None:
    """This compiler version's folder of the disk cache (``$IGNITION_KERNEL_CACHE/triton-<version>``), or None
    without the variable."""
    folder = os.environ.get("IGNITION_KERNEL_CACHE")
    return Path(folder) / f"triton-{compiler_version()}" if folder else None


def _key(
    source: str, signature: Mapping[str, str], constants: Mapping[str, Any], attrs: Mapping[str, Any], target: str
) -> str:
    blob = json.dumps(
        {"source": source, "signature": dict(signature), "constants": constants, "attrs": attrs, "target": target},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


@functools.cache
def _module_source(module: str) -> str:
    """A kernel module's source, read once per process (every launch of a build asks for its key)."""
    return inspect.getsource(sys.modules[module])


def _helper_modules(python: Any, seen: set[Any]) -> set[str]:
    """The modules of the ``triton.jit`` functions ``python`` calls, transitively."""
    modules: set[str] = set()
    for name in python.__code__.co_names:
        value = python.__globals__.get(name)
        helper = getattr(value, "fn", None)
        if helper is None or not hasattr(value, "run") or helper in seen:
            continue  # not a jit function, or one already visited
        seen.add(helper)
        modules.add(helper.__module__)
        modules |= _helper_modules(helper, seen)
    return modules


@functools.cache
def _kernel_source(python: Any) -> str:
    """The source a kernel's key holds: its module, then the other modules of the helpers it calls."""
    others = sorted(_helper_modules(python, {python}) - {python.__module__})
    return "".join(_module_source(module) for module in [python.__module__, *others])


def _is_gluon(fn: Any) -> bool:
    """Whether ``fn`` is a Gluon kernel (compiled from its own source type, its warp count a parameter)."""
    is_gluon = getattr(fn, "is_gluon", None)
    return bool(is_gluon()) if callable(is_gluon) else False


def _request_key(
    fn: Any,
    signature: Mapping[str, str],
    constants: Mapping[str, int | float | bool],
    *,
    aligned: frozenset[str],
    target: str,
    num_warps: int,
    num_stages: int,
) -> tuple[str, dict[str, str], dict[tuple[int], list[list[Any]]], dict[str, int]]:
    if target not in SUPPORTED_TARGETS:
        raise KernelCompileError(f"unknown GPU target {target!r}; known: {', '.join(SUPPORTED_TARGETS)}")
    python = fn.fn if hasattr(fn, "fn") else fn
    source = _kernel_source(python) + f"\n# kernel: {python.__name__}\n"  # a module holds several
    names = list(inspect.signature(python).parameters)
    full_signature: dict[str, str] = {}
    for name in names:
        if name == "num_warps" and _is_gluon(fn):
            continue  # set from the option below
        if name in constants:
            full_signature[name] = "constexpr"
        elif name in signature:
            full_signature[name] = signature[name]
        else:
            raise KernelCompileError(f"kernel {fn.__name__}: parameter {name!r} has neither a type nor a constant")
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    options = {"num_warps": num_warps, "num_stages": num_stages}
    key = _key(source, full_signature, dict(constants), {str(k): v for k, v in attrs.items()} | options, target)
    return key, full_signature, attrs, options


def compile_triton(
    fn: Any,
    signature: Mapping[str, str],
    constants: Mapping[str, int | float | bool],
    *,
    aligned: frozenset[str] = frozenset(),
    target: str = "sm_90a",
    num_warps: int = 4,
    num_stages: int = 2,
) -> CompiledKernel:
    """Compile ``fn`` for ``target``.

    Args:
        fn: a ``triton.jit`` function.
        signature: every runtime parameter's Triton type in order (``"*fp32"``, ``"*bf16"``, ``"i32"``,
            ...); parameters named in ``constants`` must not appear.
        constants: compile-time (``tl.constexpr``) parameters.
        aligned: pointer parameters whose addresses are 16-byte aligned (vectorized access).
        target: a key of :data:`SUPPORTED_TARGETS`.
    """
    key, full_signature, attrs, options = _request_key(
        fn, signature, constants, aligned=aligned, target=target, num_warps=num_warps, num_stages=num_stages
    )
    found = _MEMORY.get(key)
    if found is not None:
        return found
    if _RECORDING is not None:
        # A planning pass: note what to compile, answer with a stand-in of the same launch shape.
        _RECORDING.append(
            CompileRequest(
                fn.__module__,
                fn.__name__,
                tuple(signature.items()),
                tuple(constants.items()),
                tuple(sorted(aligned)),
                target,
                num_warps,
                num_stages,
            )
        )
        return CompiledKernel(symbol=fn.__name__, cubin=b"", num_warps=num_warps, shared_bytes=0, scratch_params=0)
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:  # pragma: no cover - depends on the build machine
        raise KernelCompileError(
            "GPU targets need Triton on the build machine (pip install 'helios-ignition[gpu]')"
        ) from exc
    folder = _cache_dir()
    if folder is not None and (folder / f"{key}.json").exists():
        meta = json.loads((folder / f"{key}.json").read_text())
        kernel = CompiledKernel(
            symbol=meta["symbol"],
            cubin=(folder / f"{key}.cubin").read_bytes(),
            num_warps=meta["num_warps"],
            shared_bytes=meta["shared_bytes"],
            scratch_params=meta["scratch_params"],
            global_scratch_bytes=meta.get("global_scratch_bytes", 0),
            global_scratch_align=meta.get("global_scratch_align", 1),
        )
        _MEMORY[key] = kernel
        return kernel
    if _is_gluon(fn):
        # A Gluon kernel declares its warp count as a compile-time parameter.
        from triton.experimental.gluon._runtime import GluonASTSource

        gluon_constants = {**constants, "num_warps": num_warps}
        full_signature["num_warps"] = "constexpr"
        src = GluonASTSource(fn=fn, signature=full_signature, constexprs=gluon_constants, attrs=attrs)
    else:
        src = ASTSource(fn=fn, signature=full_signature, constexprs=dict(constants), attrs=attrs)
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", SUPPORTED_TARGETS[target], 32), options=options)
    except Exception as exc:  # the compiler raises many types; name the kernel
        raise KernelCompileError(f"kernel {fn.__name__} ({dict(constants)}) failed to compile: {exc}") from exc
    meta = compiled.metadata
    if getattr(meta, "profile_scratch_size", 0):
        raise KernelCompileError(f"kernel {fn.__name__} needs profiling scratch memory, which launches do not provide")
    ptx = compiled.asm["ptx"]
    entry = ptx[ptx.index(".entry") :]
    declared = entry[: entry.index(")")].count(".param")
    kernel = CompiledKernel(
        symbol=str(meta.name),
        cubin=bytes(compiled.asm["cubin"]),
        num_warps=int(meta.num_warps),
        shared_bytes=int(meta.shared),
        scratch_params=declared - len(signature),
        global_scratch_bytes=int(getattr(meta, "global_scratch_size", 0) or 0),
        global_scratch_align=int(getattr(meta, "global_scratch_align", 1) or 1),
    )
    _MEMORY[key] = kernel
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        _publish(folder / f"{key}.cubin", kernel.cubin)
        meta_text = json.dumps(
            {
                "symbol": kernel.symbol,
                "num_warps": kernel.num_warps,
                "shared_bytes": kernel.shared_bytes,
                "scratch_params": kernel.scratch_params,
                "global_scratch_bytes": kernel.global_scratch_bytes,
                "global_scratch_align": kernel.global_scratch_align,
            }
        )
        _publish(folder / f"{key}.json", meta_text.encode())  # last: a reader takes the entry once it exists
    return kernel


def _publish(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all: the bytes go to a file of this process's own and are renamed onto
    ``path``, so builds sharing one cache folder never read an entry another is still writing."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        partial.write_bytes(data)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


@dataclass(frozen=True)
class CompileRequest:
    """One compilation noted by a planning pass (picklable: the kernel is named by module and name)."""

    module: str
    name: str
    signature: tuple[tuple[str, str], ...]
    constants: tuple[tuple[str, int | float | bool], ...]
    aligned: tuple[str, ...]
    target: str
    num_warps: int
    num_stages: int

    def compile(self) -> tuple[str, CompiledKernel]:
        fn = getattr(importlib.import_module(self.module), self.name)
        signature, constants = dict(self.signature), dict(self.constants)
        aligned = frozenset(self.aligned)
        key = _request_key(
            fn, signature, constants, aligned=aligned, target=self.target, num_warps=self.num_warps,
            num_stages=self.num_stages,
        )[0]  # fmt: skip
        kernel = compile_triton(
            fn, signature, constants, aligned=aligned, target=self.target, num_warps=self.num_warps,
            num_stages=self.num_stages,
        )  # fmt: skip
        return key, kernel


_RECORDING: list[CompileRequest] | None = None


@contextmanager
def planning() -> Iterator[list[CompileRequest]]:
    """Within the block, compile_triton compiles nothing: it records requests and returns stand-ins."""
    global _RECORDING
    previous, _RECORDING = _RECORDING, []
    try:
        yield _RECORDING
    finally:
        _RECORDING = previous


def _compile_one(request: CompileRequest) -> tuple[str, CompiledKernel]:
    return request.compile()


def precompile(requests: Sequence[CompileRequest], *, workers: int | None = None) -> None:
    """Compile ``requests`` in parallel processes; later compile_triton calls find them in memory."""
    unique = list(dict.fromkeys(requests))
    if not unique:
        return
    count = min(len(unique), workers or os.cpu_count() or 1)
    if count <= 1:
        for request in unique:
            request.compile()
        return
    context = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    with ProcessPoolExecutor(max_workers=count, mp_context=context) as pool:
        for key, kernel in pool.map(_compile_one, unique):
            _MEMORY[key] = kernel
