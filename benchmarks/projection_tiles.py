"""Projection kernel tiles on the GPU: each candidate tile shape beside cuBLAS and the HBM limit.

For the projections of the 1B- and 8B-class Llama shapes (``[q|k|v]``, output, ``[gate|up]``, down,
LM head) at 1, 8, 64 and 256 rows, times Ignition's projection kernel with each candidate tile
(``choose_tiles``' choice marked ``*``) and PyTorch's ``F.linear`` (cuBLAS) on the same bf16
weights, rotating over enough weight copies that the L2 cache holds none of them, and prints
microseconds (launches one after another on a stream, and inside a CUDA graph joined by
programmatic edges as a program runs them), the in-graph weight bandwidth and the bandwidth floor
(weight bytes over the device copy bandwidth, measured as ``gpu_decode.py`` measures it). Each
projection is the launch the Llama graph writes: ``[q|k|v]``, ``[gate|up]`` and the LM head
normalise their input first (``rmsnorm_linear``), the output projection reads bf16 rows (attention's
output in a bf16 kernel graph), the output and down projections add the
residual, down over the SwiGLU of its packed input; ``swiglu`` is the ``[gate|up]`` projection
ending in SwiGLU, the first launch of ``rmsnorm_swiglu_mlp_add`` (a candidate's columns are those
of each half: two accumulators of that width); ``rotary`` is the ``[q|k|v]`` projection as
``rmsnorm_linear_rope_kv_cache_write`` launches it on matrix tiles (each tile's columns taken as
rotation pairs of the half layout, rotated and written to the query rows and the bf16 cache planes),
``rotary_adjacent`` the same over pairs of adjacent rows (the interleaved layout). Needs an NVIDIA GPU,
Triton and PyTorch;
``--compile-only`` only compiles every candidate into the kernel cache (no GPU):

    python benchmarks/projection_tiles.py [--shapes 1b,8b] [--rows 1,8,64,256] [--projections gate_up,lm_head]
        [--compile-only]
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "contrib" / "ignition")]

import numpy as np  # noqa: E402
from gpu_decode import copy_bandwidth  # noqa: E402
from ignition.kernels import load_kernel_modules  # noqa: E402
from ignition.kernels.attention import (  # noqa: E402
    MATRIX_PAIRS,
    MIN_DOT_COLUMNS,
    rotary_projection,
    whole_heads_a_tile,
)
from ignition.kernels.compiler import planning, precompile  # noqa: E402
from ignition.kernels.linear import (  # noqa: E402
    POINTER_TILE_COLUMNS,
    Tiles,
    choose_tiles,
    project,
    rotary_tiles,
    swiglu_tiles,
)
from ignition.kernels.lowering import LoweringContext, cdiv  # noqa: E402
from ignition.recipes.synthetic import SHAPES  # noqa: E402

from helios_core.backends.cuda_driver import Context, pack_params  # noqa: E402
from helios_core.backends.reference_kernels import float32_to_bf16_bits  # noqa: E402
from helios_core.wire import manifest_pb2 as mf  # noqa: E402


def _each_split(
    shapes: Sequence[tuple[int, int, int, int, int]], splits: Sequence[int], *, descriptors: bool = False
) -> list[Tiles]:
    """Tiles of every ``(block_m, block_n, block_k, warps, stages)`` shape at every split."""
    return [Tiles(*shape, split=split, descriptors=descriptors) for shape in shapes for split in splits]


CANDIDATES = (
    Tiles(1, 4, 512, 4, 1),
    Tiles(1, 8, 512, 4, 1),
    Tiles(1, 8, 256, 4, 1),
    Tiles(1, 16, 256, 4, 1),
    Tiles(1, 8, 1024, 8, 1),
    Tiles(1, 16, 512, 8, 1),
    Tiles(1, 4, 1024, 4, 1),
    Tiles(1, 16, 1024, 8, 1),
    Tiles(1, 8, 2048, 8, 1),
    Tiles(1, 32, 512, 8, 1),
    Tiles(1, 16, 256, 8, 1),
    Tiles(1, 4, 0, 4, 1, per_sm=4),
    Tiles(1, 4, 0, 4, 1, per_sm=2),
    Tiles(1, 2, 0, 4, 1, per_sm=8),
    Tiles(1, 2, 0, 2, 1, per_sm=16),
    Tiles(1, 8, 0, 8, 1, per_sm=2),
    Tiles(1, 4, 0, 8, 1, per_sm=4),
    Tiles(1, 1, 0, 4, 1, per_sm=8),
    Tiles(16, 16, 256, 4, 4),
    Tiles(16, 32, 256, 4, 4),
    Tiles(16, 64, 128, 4, 3),
    Tiles(16, 64, 128, 4, 4),
    Tiles(16, 128, 128, 4, 3),
    Tiles(16, 32, 512, 4, 3),
    Tiles(64, 64, 64, 4, 4),
    Tiles(64, 128, 64, 4, 4),
    Tiles(128, 64, 64, 4, 3),
    Tiles(128, 128, 64, 8, 3),
    Tiles(128, 256, 64, 8, 3),
    *_each_split(
        ((16, 64, 128, 4, 4), (16, 128, 128, 4, 4), (16, 64, 256, 4, 3), (64, 64, 64, 4, 4), (64, 128, 64, 4, 4)),
        (2, 4, 8),
    ),
    *_each_split(((64, 64, 128, 4, 3), (128, 64, 64, 8, 3), (128, 128, 64, 8, 3)), (2, 4, 8)),
    Tiles(64, 128, 64, 8, 3),
    Tiles(64, 256, 64, 8, 3),
    Tiles(64, 128, 128, 8, 3),
    *(Tiles(64, 256, 64, 8, 3, split=split) for split in (2, 4)),
    *(Tiles(128, 256, 64, 8, 3, split=split) for split in (2, 4)),
    *_each_split(
        ((64, 128, 64, 4, 4), (64, 128, 128, 4, 4), (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 128, 8, 3)),
        (1, 2, 4),
        descriptors=True,
    ),
    *_each_split(((128, 256, 64, 8, 3),), (1, 2, 4), descriptors=True),
    # wide outputs of 64 rows (the LM head of a decode batch): two warpgroups over 256 columns
    Tiles(64, 256, 64, 8, 3, descriptors=True),
    Tiles(64, 256, 64, 8, 4, descriptors=True),
    # for the SwiGLU projection (two accumulators a tile): narrower column blocks, four stages
    Tiles(128, 64, 64, 8, 3, descriptors=True),
    Tiles(128, 64, 64, 8, 4, descriptors=True),
    Tiles(128, 64, 64, 8, 4, descriptors=True, persistent=1),
    Tiles(128, 64, 64, 8, 3, descriptors=True, persistent=1),
    *(
        Tiles(*shape, descriptors=True, persistent=programs)
        for shape, programs in (
            ((128, 128, 64, 8, 3), 1),
            ((128, 128, 64, 8, 4), 1),
            ((128, 256, 64, 8, 3), 1),
            ((128, 128, 128, 8, 3), 1),
            ((128, 128, 64, 8, 2), 2),
            ((128, 64, 64, 4, 3), 2),
        )
    ),
)


class Projection(NamedTuple):
    """One projection of a shape: its weight's (N, K), whether its input is the gated pair of halves
    (down), whether it normalises its input, what its epilogue does (``""``, ``"swiglu"`` or
    ``"rotary"``) and, for ``"rotary"``, the (heads, kv heads, head dim) of the packed rows."""

    n: int
    k: int
    gated: bool
    normed: bool
    ending: str = ""
    heads: tuple[int, int, int] = (0, 0, 0)
    bf16_input: bool = False
    """Inputs in bf16 rather than float32: the output projection of a bf16 kernel graph reads attention's
    bf16 rows."""
    rope_style: str = "half"
    """The rotating projection's pair layout (``"half"`` or ``"interleaved"``)."""


ROTARY_PAGE_TOKENS = 16


def _manifest(rows: int, proj: Projection) -> tuple[mf.ExecutionManifest, mf.Node]:
    n, k = proj.n, proj.k
    manifest = mf.ExecutionManifest()
    program = manifest.programs.add(name="bench")
    node = program.nodes.add(name="proj")
    node.op.name = "rmsnorm_linear" if proj.normed else "linear_add"
    node.op.version = 1
    node.attributes.add(name="eps", float_value=1e-5)
    buffers = [
        (
            "x",
            mf.DTYPE_BF16 if proj.bf16_input else mf.DTYPE_F32,
            (rows, 2 * k if proj.gated else k),
            mf.BUFFER_ROLE_SCRATCH,
        ),
        ("weight", mf.DTYPE_BF16, (n, k), mf.BUFFER_ROLE_WEIGHTS),
    ]
    if proj.ending == "rotary":
        heads, kv_heads, head_dim = proj.heads
        node.op.name = "rmsnorm_linear_rope_kv_cache_write"
        node.attributes.add(name="theta", float_value=500000.0)
        node.attributes.add(name="style", string_value=proj.rope_style)
        pages = cdiv(rows, ROTARY_PAGE_TOKENS)
        plane = (pages, ROTARY_PAGE_TOKENS, kv_heads, head_dim)
        buffers += [
            ("norm_weight", mf.DTYPE_F32, (k,), mf.BUFFER_ROLE_WEIGHTS),
            ("positions", mf.DTYPE_I32, (rows,), mf.BUFFER_ROLE_SCRATCH),
            ("slots", mf.DTYPE_I64, (rows,), mf.BUFFER_ROLE_SCRATCH),
            ("q", mf.DTYPE_F32, (rows, heads, head_dim), mf.BUFFER_ROLE_SCRATCH),
            ("k_plane", mf.DTYPE_BF16, plane, mf.BUFFER_ROLE_SCRATCH),
            ("v_plane", mf.DTYPE_BF16, plane, mf.BUFFER_ROLE_SCRATCH),
        ]
    elif proj.ending == "swiglu":
        # a SwiGLU projection stores the bf16 activation of its n / 2 columns, as the MLP's first launch does
        buffers.append(("out", mf.DTYPE_BF16, (rows, n // 2), mf.BUFFER_ROLE_SCRATCH))
    else:
        buffers.append(("out", mf.DTYPE_F32, (rows, n), mf.BUFFER_ROLE_SCRATCH))
    if proj.normed and proj.ending != "rotary":
        buffers.append(("norm", mf.DTYPE_F32, (k,), mf.BUFFER_ROLE_WEIGHTS))
    declare(manifest, node, buffers)
    return manifest, node


def declare(
    manifest: mf.ExecutionManifest, node: mf.Node, buffers: Sequence[tuple[str, Any, Sequence[int], Any]]
) -> None:
    """Declares each ``(name, dtype, shape, role)`` buffer and passes it whole as ``node``'s argument of that name."""
    for name, dtype, shape, role in buffers:
        decl = manifest.buffers.add(name=name, role=role, dtype=dtype)  # type: ignore[arg-type]
        for size in shape:
            decl.shape.add(size=size)
        node.args.add(name=name, view=mf.BufferView(buffer=name, shape=list(shape)))


def _projections(shape_name: str) -> dict[str, Projection]:
    """Each projection of a shape: ``swiglu`` is the ``[gate | up]`` projection as ``rmsnorm_swiglu_mlp_add``
    launches it (each tile's columns taken from the gate and the up rows, ``silu(gate) * up`` stored in
    bf16), ``gate_up`` the same weight as one plain projection; ``rotary`` is ``qkv`` rotated and written to
    the cache in its epilogue."""
    s = SHAPES[shape_name]
    qkv = (s.heads + 2 * s.kv_heads) * s.head_dim
    return {
        "qkv": Projection(qkv, s.hidden, False, True),
        "rotary": Projection(qkv, s.hidden, False, True, "rotary", (s.heads, s.kv_heads, s.head_dim)),
        "rotary_adjacent": Projection(
            qkv, s.hidden, False, True, "rotary", (s.heads, s.kv_heads, s.head_dim), rope_style="interleaved"
        ),
        "o": Projection(s.hidden, s.heads * s.head_dim, False, False, bf16_input=True),
        "gate_up": Projection(2 * s.ffn, s.hidden, False, True),
        "swiglu": Projection(2 * s.ffn, s.hidden, False, True, "swiglu"),
        "down": Projection(s.hidden, s.ffn, True, False),
        "lm_head": Projection(s.vocab, s.hidden, False, True),
    }


def _chosen(rows: int, proj: Projection) -> Tiles:
    """``choose_tiles``' choice as the lowering applies it (a SwiGLU projection's through
    :func:`swiglu_tiles`, a rotating one's through :func:`rotary_tiles`)."""
    chosen = choose_tiles(rows, proj.n, proj.k, unstaged=proj.bf16_input, specialised=not proj.ending)
    if proj.ending == "rotary":
        whole = whole_heads_a_tile(MATRIX_PAIRS, proj.heads[2], half=proj.rope_style == "half")
        rotary = rotary_tiles(chosen, rows, proj.n, proj.k, describable=whole)
        return rotary or chosen  # (None: the plain projection, then the rotation in a launch of its own)
    return swiglu_tiles(chosen, rows, proj.n) if proj.ending == "swiglu" else chosen


_TILE_SPEC = re.compile(r"(\d+)x(\d+)x(\d+)w(\d+)s(\d+)(?:/(\d+))?(tma)?(?:p(\d+))?(ws)?")


def parse_tiles(spec: str) -> Tiles:
    """A tile named as :func:`_label` prints it, spaces and the mark left out: ``256x128x64w8s3/2tma``
    (``pN``: N persistent programs a multiprocessor; ``ws``: warp-specialised, as ``256x128x64w8s4tmap1ws``)."""
    match = _TILE_SPEC.fullmatch(spec.replace(" ", "").lstrip("*"))
    if match is None:
        raise argparse.ArgumentTypeError(f"{spec!r} is not a tile such as 128x128x64w8s3/2tma")
    m, n, k, warps, stages, split, tma, persistent, specialised = match.groups()
    return Tiles(
        int(m), int(n), int(k), int(warps), int(stages), split=int(split or 1), descriptors=tma is not None,
        persistent=int(persistent or 0), specialised=specialised is not None,
    )  # fmt: skip


def _candidates(
    rows: int,
    proj: Projection,
    *,
    descriptors_only: bool = False,
    persistent_only: bool = False,
    only: Sequence[Tiles] = (),
) -> list[Tiles]:
    """``choose_tiles``' choice first, then the candidates of the same row family (only those fed by
    tensor descriptors with ``descriptors_only``, only the persistent ones with ``persistent_only``); no
    tile of more rows than 64 and ``rows`` (half its products would be of rows past the last)."""
    chosen = _chosen(rows, proj)
    if only:  # the chosen tile and the named ones the projection takes
        return [t for t in dict.fromkeys((chosen, *only)) if t == chosen or _takes(proj, t)]
    family = 1 if rows <= 2 else 16 if rows <= 16 else 64
    return [
        t
        for t in dict.fromkeys((chosen, *CANDIDATES))
        if _takes(proj, t)
        and (
            t == chosen
            or (
                min(t.block_m, 64) == family
                and t.block_m <= max(rows, 64)
                and _fits(t, proj.k)
                and (t.descriptors or not descriptors_only)
                and (t.persistent or not persistent_only)
            )
        )
    ]


def _takes(proj: Projection, tiles: Tiles) -> bool:
    """Whether the lowering of ``proj`` takes ``tiles``: a SwiGLU projection no blocks of 256 columns a half
    (two such accumulators leave no room), the rotating projection only matrix tiles of one program a tile
    and at least ``MIN_DOT_COLUMNS`` column pairs (through tensor descriptors in the half layout: whole heads
    a tile)."""
    if proj.ending == "swiglu":
        return tiles.block_n <= POINTER_TILE_COLUMNS
    if proj.ending == "rotary":
        half = proj.rope_style == "half"
        whole_heads = not tiles.descriptors or whole_heads_a_tile(tiles.block_n // 2, proj.heads[2], half=half)
        matrix = tiles.block_m > 1 and not (tiles.persistent or tiles.per_sm or tiles.specialised)
        return matrix and whole_heads and tiles.block_n // 2 >= MIN_DOT_COLUMNS
    return True


def _fits(tiles: Tiles, k: int) -> bool:
    """A streaming tile holds its weight rows in registers twice over: at most 64 values a thread."""
    if not tiles.per_sm:
        return True
    values = tiles.block_n * (1 << (k - 1).bit_length()) // (32 * tiles.num_warps)
    return values <= 64


def _label(tiles: Tiles, chosen: Tiles) -> str:
    mark = "*" if tiles == chosen else " "
    if tiles.per_sm:
        return f"{mark}{tiles.block_m}x{tiles.block_n}xrow w{tiles.num_warps} {tiles.per_sm}/SM"
    split = f" /{tiles.split}" if tiles.split > 1 else ""
    copy = " tma" if tiles.descriptors else ""
    copy += f" p{tiles.persistent}" if tiles.persistent else ""
    copy += " ws" if tiles.specialised else ""
    return f"{mark}{tiles.block_m}x{tiles.block_n}x{tiles.block_k} w{tiles.num_warps} s{tiles.num_stages}{split}{copy}"


def _lowered(rows: int, proj: Projection, tiles: Tiles) -> tuple[Any, mf.KernelLaunch, dict[str, int]]:
    """The compiled module and the launch of one projection as the Llama graph writes it, and the
    elements of each workspace it uses."""
    load_kernel_modules()  # the staged prologue's lowerings
    manifest, node = _manifest(rows, proj)
    ctx = LoweringContext(manifest, "sm_90a", program="bench", node="proj")
    views = {arg.name: arg.view for arg in node.args}
    if proj.ending == "rotary":
        launches = rotary_projection(ctx, node, tiles, (rows, proj.n, proj.k), proj.heads)
    else:
        launches = project(
            ctx, node, views["x"], views["weight"], views["out"], residual=None if proj.normed else views["out"],
            norm=views["norm"] if proj.normed else None, gated=proj.gated, swiglu=proj.ending == "swiglu",
            tiles=tiles,
        )  # fmt: skip
    # matrix tiles stage the norm or SwiGLU in a launch before: only the projection's launch is timed
    workspaces = {
        d.name: int(np.prod([int(s.size) for s in d.shape]))
        for d in manifest.buffers
        if d.name.startswith("workspace.")
    }
    return ctx.modules[launches[-1].module], launches[-1], workspaces


def _compile_all(shapes: list[str], rows_list: list[int], projections: list[str], only: Mapping[str, Any]) -> None:
    """Compile every candidate of the selection (``only``: :func:`_candidates`' filters), in parallel
    processes (into the kernel cache)."""
    with planning() as requests:
        for shape_name in shapes:
            for rows in rows_list:
                for name, proj in _projections(shape_name).items():
                    if name not in projections:
                        continue
                    for tiles in _candidates(rows, proj, **only):
                        try:
                            _lowered(rows, proj, tiles)
                        except Exception as exc:  # reported like a tile that fails on the GPU
                            print(f"{shape_name} {name} {rows} {tiles}: {exc}")
    try:
        precompile(requests)
    except Exception as exc:  # a candidate the compiler refuses is reported again when timed
        print(f"precompile: {exc}")
    print(f"compiled {len(set(requests))} kernels", flush=True)


def _rotary_buffers(cuda: Context, rows: int, proj: Projection) -> dict[str, int]:
    """Device buffers of the rotating projection's other arguments: positions 0 to rows - 1, each row's
    cache slot its own, the query rows and the two bf16 cache planes."""
    heads, kv_heads, head_dim = proj.heads
    plane_bytes = cdiv(rows, ROTARY_PAGE_TOKENS) * ROTARY_PAGE_TOKENS * kv_heads * head_dim * 2
    buffers = {
        "positions": cuda.alloc(rows * 4),
        "slots": cuda.alloc(rows * 8),
        "q": cuda.alloc(rows * heads * head_dim * 4),
        "k_plane": cuda.alloc(plane_bytes),
        "v_plane": cuda.alloc(plane_bytes),
    }
    cuda.upload(buffers["positions"], np.arange(rows, dtype=np.int32))
    cuda.upload(buffers["slots"], np.arange(rows, dtype=np.int64))
    return buffers


def _time_ours(cuda: Context, rows: int, proj: Projection, tiles: Tiles, copies: int) -> tuple[float, float]:
    """Microseconds of one launch of the projection (see :func:`_lowered`), weights rotated: launched one
    after another on the stream, and as a CUDA graph of such launches joined by programmatic edges
    (how a program's graph runs them)."""
    n, k, gated = proj.n, proj.k, proj.gated
    module_data, launch, workspaces = _lowered(rows, proj, tiles)
    module = cuda.load_module(module_data.data)
    scratch = {name: cuda.alloc(max(count * 4, 4)) for name, count in workspaces.items()}
    for name, count in workspaces.items():
        cuda.memset(scratch[name], max(count * 4, 4))
    # the staged prologue's output (float32, or the bf16 weights' type) is the projection's input
    if "workspace.projection_input" in scratch:
        cuda.upload(scratch["workspace.projection_input"], np.ones(rows * k, dtype=np.float32))
    if "workspace.projection_input_bf16" in scratch:
        cuda.upload(scratch["workspace.projection_input_bf16"], np.full(rows * k, 0x3F80, dtype=np.uint16))
    function = cuda.function(module, launch.symbol, launch.shared_bytes)
    x = cuda.alloc(rows * (2 * k if gated else k) * 4)
    out = cuda.alloc(rows * n * 4)
    weights = [cuda.alloc(n * k * 2) for _ in range(copies)]
    rng = np.random.default_rng(0)
    inputs = rng.standard_normal(rows * (2 * k if gated else k)).astype(np.float32)
    cuda.upload(x, float32_to_bf16_bits(inputs) if proj.bf16_input else inputs)
    # one block of random bf16 values repeated over every copy: the copies only keep the weights out of L2
    block = float32_to_bf16_bits(rng.standard_normal(min(n * k, 1 << 20)))
    bits = np.resize(block, n * k)
    for w in weights:
        cuda.upload(w, bits)
    norm = cuda.alloc(k * 4)
    cuda.upload(norm, np.ones(k, dtype=np.float32))
    others = _rotary_buffers(cuda, rows, proj) if proj.ending == "rotary" else {}
    addresses = {"x": x, "out": out, "norm": norm, "norm_weight": norm, **others, **scratch}
    packs = [pack_params(launch.params, {**addresses, "weight": w}) for w in weights]
    start, end = cuda.timing_event(), cuda.timing_event()
    for pack in packs:
        cuda.launch(function, launch.grid, launch.block, launch.shared_bytes, pack)
    cuda.synchronize()
    repeats = 20
    cuda.record(start)
    for _ in range(repeats):
        for pack in packs:
            cuda.launch(function, launch.grid, launch.block, launch.shared_bytes, pack)
    cuda.record(end)
    cuda.wait_event(end)
    elapsed = cuda.elapsed_ms(start, end) * 1000.0 / (repeats * copies)
    in_graph = chain_us(cuda, [(function, launch, packs[index % copies]) for index in range(max(16, copies))], repeats)
    for pointer in (x, out, norm, *weights, *scratch.values(), *others.values()):
        cuda.free(pointer)
    return elapsed, in_graph


def chain_us(cuda: Context, links: Sequence[tuple[Any, mf.KernelLaunch, Any]], repeats: int) -> float:
    """Microseconds a link of a CUDA graph of ``links`` (function, launch, packed parameters), each after the
    one before through a programmatic edge as a program's graph chains them: replayed once untimed, then
    ``repeats`` times between two events."""
    builder = cuda.graph()
    previous = None
    for function, launch, pack in links:
        previous = builder.kernel(
            function, launch.grid, launch.block, launch.shared_bytes, pack, previous, programmatic=previous is not None
        )
    executable = builder.instantiate()
    try:
        cuda.launch_graph(executable)
        cuda.synchronize()
        start, end = cuda.timing_event(), cuda.timing_event()
        cuda.record(start)
        for _ in range(repeats):
            cuda.launch_graph(executable)
        cuda.record(end)
        cuda.wait_event(end)
        return cuda.elapsed_ms(start, end) * 1000.0 / (repeats * len(links))
    finally:
        cuda.destroy_graph(executable)
        builder.destroy()


def _time_torch(rows: int, n: int, k: int, copies: int) -> float:
    import torch

    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]

    def step() -> None:
        for w in weights:
            torch.nn.functional.linear(x, w)

    return torch_us(step, copies)


def torch_us(step: Callable[[], None], calls: int, repeats: int = 20) -> float:
    """Microseconds a call of ``step``'s ``calls`` PyTorch calls: once untimed, then ``repeats`` times
    between two CUDA events."""
    import torch

    step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        step()
    end.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end)) * 1000.0 / (repeats * calls)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1b,8b")
    parser.add_argument("--rows", default="1,8,64,256")
    parser.add_argument(
        "--projections", default="qkv,rotary,o,gate_up,swiglu,down,lm_head", help="which projections to time"
    )
    parser.add_argument("--compile-only", action="store_true", help="compile the candidates, measure nothing")
    parser.add_argument(
        "--descriptors-only", action="store_true", help="time the chosen tile and the tensor-descriptor candidates"
    )
    parser.add_argument(
        "--persistent-only", action="store_true", help="time the chosen tile and the persistent candidates"
    )
    parser.add_argument(
        "--tiles", type=lambda text: [parse_tiles(s) for s in text.split(",")], default=[],
        help="time only the chosen tile and these (e.g. 256x128x64w8s3/2tma,128x128x64w8s4tma)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    only = {
        "descriptors_only": args.descriptors_only,
        "persistent_only": args.persistent_only,
        "only": args.tiles,
    }
    _compile_all(args.shapes.split(","), [int(r) for r in args.rows.split(",")], args.projections.split(","), only)
    if args.compile_only:
        return 0
    bandwidth = copy_bandwidth("cuda")
    cuda = Context(0)
    print(f"device copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
    columns = (("shape", "<5"), ("proj", "<8"), ("rows", ">4"), ("N", ">6"), ("K", ">6"), ("tile", "<22"), ("us", ">8"))
    columns += (("graph us", ">8"), ("TB/s", ">6"), ("cuBLAS us", ">9"), ("floor us", ">8"))
    print(" ".join(f"{name:{spec}}" for name, spec in columns))
    for shape_name in args.shapes.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            for name, proj in _projections(shape_name).items():
                if name not in args.projections.split(","):
                    continue
                n, k = proj.n, proj.k
                copies = max(2, int(np.ceil(200e6 / (n * k * 2))))
                chosen = _chosen(rows, proj)
                cublas = _time_torch(rows, n, k, copies)
                floor = n * k * 2 / bandwidth * 1e6
                for tiles in _candidates(rows, proj, **only):
                    label = _label(tiles, chosen)
                    try:
                        us, graph_us = _time_ours(cuda, rows, proj, tiles, copies)
                    except Exception as exc:  # a tile that does not fit the chip is reported, not fatal
                        print(f"{shape_name:<5} {name:<8} {rows:>4} {n:>6} {k:>6} {label:<22} failed: {exc}")
                        continue
                    print(
                        f"{shape_name:<5} {name:<8} {rows:>4} {n:>6} {k:>6} {label:<22} {us:>8.1f} {graph_us:>8.1f} "
                        f"{n * k * 2 / graph_us / 1e6:>6.2f} {cublas:>9.1f} {floor:>8.1f}",
                        flush=True,
                    )
    cuda.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
