"""Lowering program nodes to kernel launches for a GPU target.

Owns the step from a finished execution manifest (programs of op-catalogue nodes over buffer views)
to the same manifest with, on every node, the launches of prepared kernels for a target, and the
MODULE resources holding their code. Each operator has one lowering function, registered in
:data:`LOWERINGS` by the kernel module that implements it; the function reads the node's views,
shapes and attributes through a :class:`LoweringContext` and returns the node's launches (one or
more, run in list order). Kernels are specialized on shapes known at build time; extents the
runtime fixes (cache pages, state rows) are never compiled in.

Launch conventions every kernel follows:

* one ``ADDRESS`` parameter per buffer view (its byte offset within the buffer), integer and float
  scalars as ``I32``/``I64``/``F32``, then the compiler's scratch parameters: the address of the
  ``workspace.kernel_scratch`` buffer for a kernel that needs global scratch (Triton keeps device-side
  tensor descriptors there, ``programs x bytes`` of it), null for the rest. One buffer serves every
  such launch: a kernel writes its scratch only after ``gdc_wait``, when every earlier launch of the
  program has finished;
* ``block = (32 * num_warps, 1, 1)``, the compiled shared memory as dynamic shared bytes;
* a kernel compiled with ``USE_PDL`` calls ``gdc_wait()`` before its first access to any buffer but
  weights and *settled* buffers, so its launch is marked ``programmatic_wait`` (unless the lowering
  chose an ordinary wait for it: see ``ORDINARY_WAIT_ROWS`` in :mod:`ignition.kernels.linear`). A buffer is settled
  for a node when no earlier node of its program writes it (:meth:`LoweringContext.settled`): its
  bytes were final before the program's first launch began (host inputs copied in by the graph's
  first node, cache pages of earlier rounds), so reading it early cannot see a stale value.

Collective operators (the catalogue's ``COLLECTIVE_OPERATORS``: ``all_reduce``, ``all_gather``, ``broadcast``) have
no kernel: their nodes keep no launch for the target, and the runtime runs them between the launches of
the nodes around them (on a GPU through its collective library, captured into the program's graph). A
collective's output is written by an earlier node for what follows, like any other output, so the next
kernel reading it waits (``gdc_wait``) as it would after a kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from helios_core.ops.catalogue import COLLECTIVE_OPERATORS, lookup
from helios_core.wire import manifest_pb2 as mf
from ignition.kernels.compiler import CompiledKernel, compile_triton, planning, precompile

TRITON_POINTER: dict[int, str] = {
    mf.DTYPE_F32: "*fp32",
    mf.DTYPE_F16: "*fp16",
    mf.DTYPE_BF16: "*bf16",
    mf.DTYPE_I32: "*i32",
    mf.DTYPE_I64: "*i64",
    mf.DTYPE_U8: "*u8",
    mf.DTYPE_U32: "*u32",
    mf.DTYPE_U64: "*u64",
    mf.DTYPE_F64: "*fp64",
}
ITEMSIZE: dict[int, int] = {
    mf.DTYPE_F32: 4,
    mf.DTYPE_F16: 2,
    mf.DTYPE_BF16: 2,
    mf.DTYPE_I32: 4,
    mf.DTYPE_I64: 8,
    mf.DTYPE_U8: 1,
    mf.DTYPE_U32: 4,
    mf.DTYPE_U64: 8,
    mf.DTYPE_F64: 8,
}


class LoweringError(ValueError):
    """A node cannot be lowered for the target (unsupported operator, dtype or shape)."""


@dataclass(frozen=True)
class KernelArg:
    """One runtime kernel parameter: its Triton type, its launch parameter, its alignment."""

    triton_type: str
    param: mf.LaunchParam
    aligned: bool = False


@dataclass
class ModuleResource:
    """A compiled module and the resource holding its code."""

    decl: mf.ModuleDecl
    data: bytes


@dataclass
class LoweringContext:
    """What a lowering function may ask about the manifest, and how it makes launches."""

    manifest: mf.ExecutionManifest
    target: str
    modules: dict[str, ModuleResource] = field(default_factory=dict)
    program: str = ""
    node: str = ""
    operation: int = 0
    """The current program's operation (``contract_pb2.Operation``; 0 where it declares none)."""
    written: set[str] = field(default_factory=set)
    """Buffers the nodes of the current program lowered so far may write."""

    def __post_init__(self) -> None:
        self._dtypes: dict[str, int] = {b.name: int(b.dtype) for b in self.manifest.buffers}
        self._dtypes.update({e.name: int(e.dtype) for e in self.manifest.transport.entries})
        self._roles: dict[str, int] = {b.name: int(b.role) for b in self.manifest.buffers}
        self._shapes: dict[str, tuple[int, ...]] = {
            b.name: tuple(int(d.size) for d in b.shape) for b in self.manifest.buffers
        }
        self._shapes.update({e.name: tuple(int(s) for s in e.shape) for e in self.manifest.transport.entries})

    # -- questions -----------------------------------------------------------------------------
    def fail(self, message: str) -> LoweringError:
        return LoweringError(f"program {self.program!r} node {self.node!r}: {message}")

    def dtype(self, view: mf.BufferView) -> int:
        found = self._dtypes.get(view.buffer)
        if found is None:
            raise self.fail(f"unknown buffer {view.buffer!r}")
        return found

    def is_weights(self, view: mf.BufferView) -> bool:
        return self._roles.get(view.buffer) == mf.BUFFER_ROLE_WEIGHTS

    def shape(self, view: mf.BufferView) -> tuple[int, ...]:
        """The view's shape (a whole-buffer view has the buffer's declared shape)."""
        if view.shape:
            return tuple(int(s) for s in view.shape)
        return self._shapes[view.buffer]

    def settled(self, *views: mf.BufferView) -> bool:
        """No earlier node of the program writes any of ``views``' buffers, so a kernel may read them
        before ``gdc_wait`` (module docstring)."""
        return not any(view.buffer in self.written for view in views)

    def buffer_shape(self, view: mf.BufferView) -> tuple[int, ...]:
        """The declared shape of the buffer behind ``view`` (symbolic extents at their working size)."""
        return self._shapes[view.buffer]

    @staticmethod
    def arg(node: mf.Node, name: str) -> mf.BufferView | None:
        for arg in node.args:
            if arg.name == name:
                return arg.view
        return None

    def need(self, node: mf.Node, name: str) -> mf.BufferView:
        view = self.arg(node, name)
        if view is None:
            raise self.fail(f"argument {name!r} is missing")
        return view

    @staticmethod
    def attribute(node: mf.Node, name: str, default: Any = None) -> Any:
        for attr in node.attributes:
            if attr.name == name:
                kind = attr.WhichOneof("value")
                if kind == "ints":
                    return tuple(int(v) for v in attr.ints.values)
                if kind == "floats":
                    return tuple(float(v) for v in attr.floats.values)
                return getattr(attr, kind) if kind else default
        return default

    def workspace(self, key: str, dtype: int, elements: int) -> mf.BufferView:
        """A SCRATCH buffer ``workspace.<key>`` of at least ``elements`` for a kernel's own use.

        One buffer per key serves every node (launches run one after another, so a workspace holds
        nothing from one node to the next); a later, larger request grows it.
        """
        name = f"workspace.{key}"
        for decl in self.manifest.buffers:
            if decl.name == name:
                if int(decl.dtype) != dtype:
                    raise self.fail(f"workspace {key!r} is used with two dtypes")
                if int(decl.shape[0].size) < elements:
                    decl.shape[0].size = int(elements)
                    self._shapes[name] = (int(elements),)
                break
        else:
            decl = self.manifest.buffers.add(name=name, role=mf.BUFFER_ROLE_SCRATCH, dtype=dtype)  # type: ignore[arg-type]
            decl.shape.add(size=int(elements))
            self._dtypes[name] = dtype
            self._roles[name] = mf.BUFFER_ROLE_SCRATCH
            self._shapes[name] = (int(elements),)
        return mf.BufferView(buffer=name, element_offset=0, shape=[int(elements)])

    # -- parameters ----------------------------------------------------------------------------
    def pointer(self, view: mf.BufferView, *, as_dtype: int | None = None) -> KernelArg:
        """The address of ``view``; typed by its buffer's dtype (or ``as_dtype``)."""
        dtype = self.dtype(view)
        byte_offset = int(view.element_offset) * ITEMSIZE[dtype]
        typed = as_dtype if as_dtype is not None else dtype
        param = mf.LaunchParam(kind=mf.PARAM_KIND_ADDRESS, buffer=view.buffer, byte_offset=byte_offset)
        return KernelArg(TRITON_POINTER[typed], param, aligned=byte_offset % 16 == 0)

    @staticmethod
    def i32(value: int) -> KernelArg:
        if not -(2**31) <= value < 2**31:
            raise LoweringError(f"{value} does not fit an i32 kernel parameter")
        return KernelArg("i32", mf.LaunchParam(kind=mf.PARAM_KIND_I32, int_value=int(value)))

    @staticmethod
    def i64(value: int) -> KernelArg:
        return KernelArg("i64", mf.LaunchParam(kind=mf.PARAM_KIND_I64, int_value=int(value)))

    @staticmethod
    def f32(value: float) -> KernelArg:
        return KernelArg("fp32", mf.LaunchParam(kind=mf.PARAM_KIND_F32, float_value=float(value)))

    # -- launches ------------------------------------------------------------------------------
    def launch(
        self,
        fn: Any,
        args: Mapping[str, KernelArg],
        constants: Mapping[str, int | float | bool],
        grid: Sequence[int],
        *,
        num_warps: int = 4,
        num_stages: int = 2,
        programmatic: bool = True,
    ) -> mf.KernelLaunch:
        """Compile ``fn`` (with ``USE_PDL`` set for the target) and describe one launch of it.

        ``args`` lists the kernel's runtime parameters in declaration order; ``grid`` has 1 to 3
        dimensions, each at least 1. ``programmatic=False`` marks the launch as waiting the ordinary way
        (not ``programmatic_wait``): it starts once the launch before has finished, and its ``gdc_wait``
        returns at once.
        """
        if not 1 <= len(grid) <= 3 or any(int(g) < 1 for g in grid) or any(int(g) >= 2**31 for g in grid):
            raise self.fail(f"grid {list(grid)} must have 1 to 3 positive dimensions")
        full_constants = {**constants, "USE_PDL": True}
        kernel = compile_triton(
            fn,
            {name: a.triton_type for name, a in args.items()},
            full_constants,
            aligned=frozenset(name for name, a in args.items() if a.aligned),
            target=self.target,
            num_warps=num_warps,
            num_stages=num_stages,
        )
        module = self._module(kernel)
        launch = mf.KernelLaunch(
            target=self.target,
            module=module,
            symbol=kernel.symbol,
            grid=[int(g) for g in grid] + [1] * (3 - len(grid)),
            block=[32 * kernel.num_warps, 1, 1],
            shared_bytes=kernel.shared_bytes,
            programmatic_wait=programmatic,
        )
        launch.params.extend(a.param for a in args.values())
        scratch = [mf.LaunchParam(kind=mf.PARAM_KIND_ADDRESS) for _ in range(kernel.scratch_params)]
        if kernel.global_scratch_bytes:
            if not scratch or kernel.global_scratch_align > KERNEL_SCRATCH_ALIGNMENT:
                raise self.fail(f"kernel {kernel.symbol} needs global scratch this launch convention cannot pass")
            programs = math.prod(int(g) for g in grid)
            view = self.workspace("kernel_scratch", mf.DTYPE_U8, programs * kernel.global_scratch_bytes)
            scratch[0] = self.pointer(view).param
        launch.params.extend(scratch)
        return launch

    def _module(self, kernel: CompiledKernel) -> str:
        digest = kernel.digest[:16]
        name = f"kernel.{kernel.symbol}.{digest}"
        if name not in self.modules:
            decl = mf.ModuleDecl(
                name=name,
                target=self.target,
                resource_id=f"module.{kernel.symbol}.{digest}",
                format=mf.MODULE_FORMAT_CUBIN,
            )
            self.modules[name] = ModuleResource(decl, kernel.cubin)
        return name


KERNEL_SCRATCH_ALIGNMENT = 256
"""Byte alignment the runtime gives every buffer, so the most a kernel's global scratch may ask for."""

Lowering = Callable[[LoweringContext, mf.Node], list[mf.KernelLaunch]]

COLLECTIVE_OUTPUTS = ("out",)
"""The argument a collective writes."""

LOWERINGS: dict[tuple[str, int], Lowering] = {}
"""Lowering functions by ``(operator, version)``; filled by the kernel modules on import."""


def lowering(name: str, version: int = 1) -> Callable[[Lowering], Lowering]:
    """Register a lowering function for ``name`` at ``version``."""

    def register(fn: Lowering) -> Lowering:
        LOWERINGS[(name, version)] = fn
        return fn

    return register


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_two(n: int) -> int:
    return 1 if n <= 1 else 2 ** math.ceil(math.log2(n))


def lower_manifest(manifest: mf.ExecutionManifest, target: str) -> list[ModuleResource]:
    """Add ``target`` launches to every node of every program; returns the modules to store."""
    from ignition.kernels import load_kernel_modules

    load_kernel_modules()
    # Plan on a copy (stand-in kernels), compile every distinct kernel in parallel, then lower for real.
    draft = mf.ExecutionManifest()
    draft.CopyFrom(manifest)
    with planning() as requests:
        _lower_programs(LoweringContext(draft, target), draft, target)
    precompile(requests)
    context = LoweringContext(manifest, target)
    _lower_programs(context, manifest, target)
    if target not in manifest.targets:
        manifest.targets.append(target)
    ordered = sorted(context.modules.values(), key=lambda m: m.decl.name)
    manifest.modules.extend(m.decl for m in ordered)
    return ordered


def _lower_programs(context: LoweringContext, manifest: mf.ExecutionManifest, target: str) -> None:
    for program in list(manifest.programs) + list(manifest.tuning_programs):
        context.program = program.name
        context.operation = int(program.operation)
        context.written = set()
        for node in program.nodes:
            context.node = node.name
            if node.op.name in COLLECTIVE_OPERATORS:
                context.written.update(arg.view.buffer for arg in node.args if arg.name in COLLECTIVE_OUTPUTS)
                continue
            fn = LOWERINGS.get((node.op.name, int(node.op.version)))
            spec = lookup(node.op.name, int(node.op.version))
            if fn is None or spec is None:
                raise context.fail(f"no {target} kernel for operator {node.op.name} v{node.op.version}")
            launches = fn(context, node)
            if not launches:
                raise context.fail("lowering produced no launch")
            node.launches.extend(launches)
            context.written.update(arg.view.buffer for arg in node.args if arg.name in spec.written_args)
