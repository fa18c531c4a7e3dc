"""Decode attention on the GPU: the paged-attention kernel at several contexts and short-context limits.

For the attention of a Llama shape (query and KV heads, head size) at one to a few decode tokens,
times Ignition's ``paged_attention`` launch as a program lowers it, once per candidate
``short_positions`` (contexts up to it are attended by one program per KV head, longer ones split
into 64-position programs whose last one merges them) and way of running the two matrix products
(three TF32 products or float32 FMAs); the lowering's choice is marked ``*``. At each context: a
CUDA graph of one launch per layer, each over its own layer's cache planes, joined by programmatic
edges as a program's graph joins them, with enough layers that the keys and values read come from
HBM, not the L2 cache. Beside it: PyTorch's
``scaled_dot_product_attention`` on float32 keys and values of the same shape in contiguous form
(eager, one call for each of 64 layers), and the bandwidth floor (the keys and values read, over
the measured device copy bandwidth). Needs an NVIDIA GPU, Triton and PyTorch:

    python benchmarks/attention_splits.py [--shapes 1b] [--rows 1] [--contexts 32,100,160,512,1000]
        [--short 64,128,192,256] [--products tf32x3,ieee] [--compile-only]

``--compile-only`` only compiles every candidate into the kernel cache (no GPU).

``--chunk TOKENS`` times a prompt chunk instead: one row's ``TOKENS`` consecutive tokens from position 0
(a prefill program's attention, which lowers to query tiles), for the lowering's tile configuration and
each of ``--tile-configs`` (``tTnNwWsS``: ``BLOCK_T`` tokens a tile, ``BLOCK_N`` positions a block, warps,
stages), in a chain of one launch per layer, beside PyTorch's causal ``scaled_dot_product_attention`` on
bfloat16 queries, keys and values (one call a layer) and the rate of the products a causal chunk needs
(``4 * heads * head_dim * TOKENS * (TOKENS + 1) / 2`` operations; the kernels run each product twice, see
``attention.py``):

    python benchmarks/attention_splits.py --shapes 1b,8b --chunk 512 --cache-dtype bf16 \
        --tile-configs t16n64w8s2,t32n64w8s3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "contrib" / "ignition")]

import numpy as np  # noqa: E402
from gpu_decode import copy_bandwidth  # noqa: E402
from ignition.kernels.attention import (  # noqa: E402
    SHORT_POSITIONS,
    TF32X3_PRODUCTS,
    attention_launches,
    tile_kernel_config,
)
from ignition.kernels.lowering import LoweringContext, cdiv  # noqa: E402
from ignition.recipes.synthetic import SHAPES  # noqa: E402
from projection_tiles import chain_us, declare, torch_us  # noqa: E402

from helios_core.backends.cuda_driver import Context, pack_params  # noqa: E402
from helios_core.wire import manifest_pb2 as mf  # noqa: E402

PAGE_TOKENS = 16
SPAN = 1024
"""Positions a row's page table reaches (the benchmark cores' context)."""
COLD_BYTES = 128 * 1024**2
"""Keys and values one graph replay reads at the least: enough layers that the L2 cache holds none
of them from one replay to the next, as a decode step's weight stream evicts them."""
MAX_LAYERS = 1024


def _manifest(
    rows: int, heads: int, kv_heads: int, head_dim: int, plane_dtype: int = mf.DTYPE_F32, table_rows: int = 0
) -> tuple[mf.ExecutionManifest, mf.Node]:
    """One ``paged_attention`` node of ``rows`` tokens over ``table_rows`` page-table rows (default: one a token)."""
    width = SPAN // PAGE_TOKENS
    table_rows = table_rows or rows
    manifest = mf.ExecutionManifest()
    program = manifest.programs.add(name="bench")
    node = program.nodes.add(name="attention")
    node.op.name, node.op.version = "paged_attention", 1
    planes = (table_rows * width, PAGE_TOKENS, kv_heads, head_dim)
    buffers = [
        ("q", mf.DTYPE_F32, (rows, heads, head_dim), mf.BUFFER_ROLE_SCRATCH),
        ("out", mf.DTYPE_F32, (rows, heads, head_dim), mf.BUFFER_ROLE_SCRATCH),
        ("k_plane", plane_dtype, planes, mf.BUFFER_ROLE_CACHE_PLANE),
        ("v_plane", plane_dtype, planes, mf.BUFFER_ROLE_CACHE_PLANE),
        ("page_table", mf.DTYPE_I32, (table_rows, width), mf.BUFFER_ROLE_TRANSPORT),
        ("token_row", mf.DTYPE_I32, (rows,), mf.BUFFER_ROLE_TRANSPORT),
        ("token_position", mf.DTYPE_I32, (rows,), mf.BUFFER_ROLE_TRANSPORT),
    ]
    declare(manifest, node, buffers)
    return manifest, node


def _lowered(
    rows: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    short: int | None = None,
    tf32x3: bool | None = None,
    plane_dtype: int = mf.DTYPE_F32,
    split_config: tuple[int, int, int] | None = None,
    *,
    table_rows: int = 0,
    tile_config: tuple[int, int, int, int] | None = None,
) -> tuple[mf.ExecutionManifest, bytes, mf.KernelLaunch]:
    """The manifest (with its workspaces), the compiled module and the launch of one attention node of
    ``rows`` tokens over ``table_rows`` page-table rows (default: one a token; one row's prompt chunk lowers to
    query tiles)."""
    manifest, node = _manifest(rows, heads, kv_heads, head_dim, plane_dtype, table_rows)
    ctx = LoweringContext(manifest, "sm_90a", program="bench", node="attention")
    (launch,) = attention_launches(
        ctx, node, short_positions=short, tf32x3=tf32x3, split_config=split_config, tile_config=tile_config
    )
    return manifest, next(iter(ctx.modules.values())).data, launch


def _tile_config(text: str) -> tuple[int, int, int, int]:
    """``tTnNwWsS`` -> ``(T, N, W, S)``."""
    try:
        block_t, rest = text.removeprefix("t").split("n")
        block_n, rest = rest.split("w")
        warps, stages = rest.split("s")
        return int(block_t), int(block_n), int(warps), int(stages)
    except ValueError as error:
        raise SystemExit(f"--tile-configs: {text!r} is not tBLOCK_TnBLOCK_NwWARPSsSTAGES") from error


def _chunk_main(args: argparse.Namespace) -> int:
    """``--chunk``: one prompt chunk's attention for each tile configuration (module docstring)."""
    tokens = int(args.chunk)
    if not 64 <= tokens <= SPAN:
        raise SystemExit(f"--chunk must be 64 to {SPAN} tokens")
    configs: list[tuple[int, int, int, int] | None] = [None]
    configs += [_tile_config(text) for text in args.tile_configs.split(",") if text]
    bf16 = args.cache_dtype == "bf16"
    plane_dtype, itemsize = (mf.DTYPE_BF16, 2) if bf16 else (mf.DTYPE_F32, 4)
    shapes = args.shapes.split(",")
    if args.compile_only:
        for shape_name in shapes:
            s = SHAPES[shape_name]
            for config in configs:
                _lowered(
                    tokens, s.heads, s.kv_heads, s.head_dim, plane_dtype=plane_dtype, table_rows=1, tile_config=config
                )
        return 0
    import torch

    cuda = Context(0)
    width = SPAN // PAGE_TOKENS
    print(f"prompt chunk of {tokens} tokens from position 0; cache planes {args.cache_dtype}")
    print("shape config (T,N,warps,stages)   graph us  TFLOP/s  torch us  torch TFLOP/s")
    for shape_name in shapes:
        s = SHAPES[shape_name]
        operations = 4 * s.heads * s.head_dim * tokens * (tokens + 1) / 2
        plane_bytes = width * PAGE_TOKENS * s.kv_heads * s.head_dim * itemsize
        count = min(64, max(16, cdiv(COLD_BYTES, 2 * plane_bytes)))
        rng = np.random.default_rng(0)
        pointers: dict[str, int] = {}
        q_bytes = tokens * s.heads * s.head_dim * 4
        for name, nbytes in (("q", q_bytes), ("out", q_bytes), ("page_table", width * 4)):
            pointers[name] = cuda.alloc(nbytes)
        pointers["token_row"], pointers["token_position"] = cuda.alloc(tokens * 4), cuda.alloc(tokens * 4)
        cuda.upload(pointers["q"], rng.standard_normal(q_bytes // 4).astype(np.float32))
        cuda.upload(pointers["page_table"], rng.permutation(width).astype(np.int32))
        cuda.upload(pointers["token_row"], np.zeros(tokens, dtype=np.int32))
        cuda.upload(pointers["token_position"], np.arange(tokens, dtype=np.int32))
        planes = []
        for _ in range(count):
            pair = (cuda.alloc(plane_bytes), cuda.alloc(plane_bytes))
            for plane in pair:
                cuda.memset(plane, plane_bytes, 0x3C)  # every value 0.0115 (f32 and bf16): timing only
            planes.append(pair)
        for config in configs:
            _, module_data, launch = _lowered(
                tokens, s.heads, s.kv_heads, s.head_dim, plane_dtype=plane_dtype, table_rows=1, tile_config=config
            )
            function = cuda.function(cuda.load_module(module_data), launch.symbol, launch.shared_bytes)
            packs = [
                pack_params(launch.params, {**pointers, "k_plane": k_plane, "v_plane": v_plane})
                for k_plane, v_plane in planes
            ]
            us = chain_us(cuda, [(function, launch, pack) for pack in packs], repeats=20)
            label = "* " + "t{}n{}w{}s{}".format(*tile_kernel_config(s.heads // s.kv_heads, s.head_dim))
            label = label if config is None else "  t{}n{}w{}s{}".format(*config)
            print(f"{shape_name:<5} {label:<26} {us:>9.2f} {operations / us / 1e6:>8.1f}", flush=True)
        q = torch.randn(1, s.heads, tokens, s.head_dim, device="cuda", dtype=torch.bfloat16)
        kv = [
            (
                torch.randn(1, s.kv_heads, tokens, s.head_dim, device="cuda", dtype=torch.bfloat16),
                torch.randn(1, s.kv_heads, tokens, s.head_dim, device="cuda", dtype=torch.bfloat16),
            )
            for _ in range(count)
        ]

        def step(q: Any = q, kv: Any = kv) -> None:
            for keys, values in kv:
                torch.nn.functional.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=True)

        reference = torch_us(step, count)
        print(f"{shape_name:<5} {'torch sdpa (causal, bf16)':<26} {'':>9} {'':>8} {reference:>9.2f} "
              f"{operations / reference / 1e6:>13.1f}", flush=True)  # fmt: skip
        for pointer in pointers.values():
            cuda.free(pointer)
        for pair in planes:
            for plane in pair:
                cuda.free(plane)
    cuda.close()
    return 0


def _config(text: str) -> tuple[int, int, int]:
    """``wWsSbB`` -> ``(W, S, B)``."""
    try:
        warps, rest = text.removeprefix("w").split("s")
        stages, block = rest.split("b")
        return int(warps), int(stages), int(block)
    except ValueError as error:
        raise SystemExit(f"--configs: {text!r} is not wWARPSsSTAGESbBLOCK_N") from error


class Layers:
    """Device buffers of one benchmark case: a query, an output, and every layer's cache planes."""

    def __init__(
        self, cuda: Context, rows: int, heads: int, kv_heads: int, head_dim: int, layers: int, itemsize: int = 4
    ) -> None:
        self.cuda = cuda
        width = SPAN // PAGE_TOKENS
        rng = np.random.default_rng(0)
        self.plane_bytes = rows * width * PAGE_TOKENS * kv_heads * head_dim * itemsize
        self.pointers: dict[str, int] = {}
        self.layer_planes: list[tuple[int, int]] = []
        for _ in range(layers):
            planes = (cuda.alloc(self.plane_bytes), cuda.alloc(self.plane_bytes))
            for plane in planes:
                cuda.memset(plane, self.plane_bytes, 0x3C)  # every value 0.0115 (f32 and bf16): timing only
            self.layer_planes.append(planes)
        q_bytes = rows * heads * head_dim * 4
        for name, nbytes in (("q", q_bytes), ("out", q_bytes), ("page_table", rows * width * 4)):
            self.pointers[name] = cuda.alloc(nbytes)
        self.pointers["token_row"] = cuda.alloc(rows * 4)
        self.pointers["token_position"] = cuda.alloc(rows * 4)
        cuda.upload(self.pointers["q"], rng.standard_normal(q_bytes // 4).astype(np.float32))
        cuda.upload(self.pointers["page_table"], rng.permutation(rows * width).astype(np.int32))
        cuda.upload(self.pointers["token_row"], np.arange(rows, dtype=np.int32))

    def workspaces(self, manifest: mf.ExecutionManifest) -> None:
        """Zeroed workspaces for every ``workspace.*`` buffer the lowering declared."""
        for decl in manifest.buffers:
            if decl.name.startswith("workspace.") and decl.name not in self.pointers:
                nbytes = int(np.prod([d.size for d in decl.shape])) * 4
                self.pointers[decl.name] = self.cuda.alloc(nbytes)
                self.cuda.memset(self.pointers[decl.name], nbytes)

    def close(self) -> None:
        for pointer in self.pointers.values():
            self.cuda.free(pointer)
        for planes in self.layer_planes:
            for plane in planes:
                self.cuda.free(plane)


def _graph_us(cuda: Context, layers: Layers, launch: mf.KernelLaunch, function: Any, position: int, rows: int) -> float:
    """Microseconds a launch of one layer's attention, in a graph of one launch per layer."""
    cuda.upload(layers.pointers["token_position"], np.full(rows, position, dtype=np.int32))
    packs = [
        pack_params(launch.params, {**layers.pointers, "k_plane": k_plane, "v_plane": v_plane})
        for k_plane, v_plane in layers.layer_planes
    ]
    return chain_us(cuda, [(function, launch, pack) for pack in packs], repeats=50)


def _torch_us(rows: int, heads: int, kv_heads: int, head_dim: int, context: int, layers: int, bf16: bool) -> float:
    import torch

    dtype = torch.bfloat16 if bf16 else torch.float32
    q = torch.randn(rows, heads, 1, head_dim, device="cuda", dtype=dtype)
    caches = [
        (
            torch.randn(rows, kv_heads, context, head_dim, device="cuda", dtype=dtype),
            torch.randn(rows, kv_heads, context, head_dim, device="cuda", dtype=dtype),
        )
        for _ in range(layers)
    ]

    def step() -> None:
        for keys, values in caches:
            torch.nn.functional.scaled_dot_product_attention(q, keys, values, enable_gqa=True)

    return torch_us(step, layers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1b")
    parser.add_argument("--rows", default="1")
    parser.add_argument("--contexts", default="32,100,160,256,512,1000")
    parser.add_argument("--short", default="64,128,192,256", help="short_positions candidates")
    parser.add_argument("--products", default="tf32x3,ieee", help="how the two matrix products run")
    parser.add_argument(
        "--configs",
        default="",
        help="split-kernel candidates wWsSbB (num_warps W, num_stages S, BLOCK_N B), e.g. w4s2b64,w2s1b32",
    )
    parser.add_argument("--cache-dtype", choices=("f32", "bf16"), default="f32", help="the cache planes' type")
    parser.add_argument("--compile-only", action="store_true", help="compile the candidates, measure nothing")
    parser.add_argument("--chunk", type=int, help="time one prompt chunk of this many tokens instead (docstring)")
    parser.add_argument("--tile-configs", default="", help="tile-kernel candidates tTnNwWsS (with --chunk)")
    args = parser.parse_args(argv)
    if args.chunk:
        return _chunk_main(args)
    contexts = [int(c) for c in args.contexts.split(",")]
    if max(contexts) > SPAN:
        raise SystemExit(f"contexts must be at most {SPAN}")
    shorts = dict.fromkeys([SHORT_POSITIONS, *(int(s) for s in args.short.split(","))])
    products = dict.fromkeys(["tf32x3" if TF32X3_PRODUCTS else "ieee", *args.products.split(",")])
    if set(products) - {"tf32x3", "ieee"}:
        raise SystemExit("--products takes tf32x3 and ieee")
    candidates: list[tuple[int, str, tuple[int, int, int] | None]] = [
        (short, product, None) for product in products for short in shorts
    ]
    default_product = "tf32x3" if TF32X3_PRODUCTS else "ieee"
    candidates += [(SHORT_POSITIONS, default_product, _config(text)) for text in args.configs.split(",") if text]
    bf16 = args.cache_dtype == "bf16"
    plane_dtype = mf.DTYPE_BF16 if bf16 else mf.DTYPE_F32
    if args.compile_only:
        for shape_name in args.shapes.split(","):
            shape = SHAPES[shape_name]
            for rows in (int(r) for r in args.rows.split(",")):
                for short, product, config in candidates:
                    _lowered(
                        rows, shape.heads, shape.kv_heads, shape.head_dim, short, product == "tf32x3", plane_dtype,
                        config,
                    )  # fmt: skip
        return 0
    bandwidth = copy_bandwidth("cuda")
    cuda = Context(0)
    print(f"device copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write); span {SPAN}, pages of {PAGE_TOKENS}")
    print(f"cache planes {args.cache_dtype}; config: split kernel wWARPS sSTAGES bBLOCK_N (- the lowering's choice)")
    print("shape rows context short products config      graph us  torch us  floor us")
    for shape_name in args.shapes.split(","):
        shape = SHAPES[shape_name]
        for rows in (int(r) for r in args.rows.split(",")):
            itemsize = 2 if bf16 else 4
            touched = 2 * rows * min(contexts) * shape.kv_heads * shape.head_dim * itemsize
            count = min(MAX_LAYERS, max(16, cdiv(COLD_BYTES, touched)))
            layers = Layers(cuda, rows, shape.heads, shape.kv_heads, shape.head_dim, count, itemsize)
            lowered = []
            for short, product, config in candidates:
                manifest, module_data, launch = _lowered(
                    rows, shape.heads, shape.kv_heads, shape.head_dim, short, product == "tf32x3", plane_dtype, config
                )
                layers.workspaces(manifest)
                module = cuda.load_module(module_data)
                function = cuda.function(module, launch.symbol, launch.shared_bytes)
                lowered.append((short, product, config, launch, function))
            for context in contexts:
                kv_bytes = 2 * rows * context * shape.kv_heads * shape.head_dim * itemsize
                floor = kv_bytes / bandwidth * 1e6  # as gpu_decode's HBM roofline
                torch_us = _torch_us(rows, shape.heads, shape.kv_heads, shape.head_dim, context, 64, bf16)
                for short, product, config, launch, function in lowered:
                    chosen = config is None and short == SHORT_POSITIONS and (product == "tf32x3") == TF32X3_PRODUCTS
                    label = "-" if config is None else "w{}s{}b{}".format(*config)
                    us = _graph_us(cuda, layers, launch, function, context - 1, rows)
                    print(
                        f"{shape_name:<5} {rows:>4} {context:>7} {'*' if chosen else ' '}{short:>4} {product:<8} "
                        f"{label:<9} {us:>10.2f} {torch_us:>9.2f} {floor:>9.3f}",
                        flush=True,
                    )
            layers.close()
    cuda.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
