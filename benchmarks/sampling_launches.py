"""The ``sample`` operator's launches on the GPU: each candidate layout beside PyTorch and the HBM limit.

For greedy rows with default settings (the decode step of a batch of plain requests) over float32
logits, lowers ``sample`` with each candidate :class:`~ignition.kernels.sampling.SampleLayout` (the
choice of ``choose_sample_layout`` marked ``*``), and prints the microseconds of each of its launches
(a chain of launches joined by programmatic edges inside a CUDA graph, as a program runs them) and of
the whole operator, beside PyTorch doing the same work (argmax, ``log_softmax`` and the top-N
alternatives) and the floor of reading the logits once at the device's copy bandwidth (measured as
``gpu_decode.py`` measures it). Needs an NVIDIA GPU, Triton and PyTorch; ``--compile-only`` only
compiles every candidate into the kernel cache (no GPU):

    python benchmarks/sampling_launches.py [--rows 1,64,256] [--vocab 128256] [--top-n 5,0] [--compile-only]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(ROOT.parent), str(ROOT.parent / "contrib" / "ignition")]

import numpy as np  # noqa: E402
from gpu_decode import copy_bandwidth  # noqa: E402
from ignition.kernels import load_kernel_modules  # noqa: E402
from ignition.kernels.compiler import planning, precompile  # noqa: E402
from ignition.kernels.lowering import LoweringContext, cdiv, next_power_of_two  # noqa: E402
from ignition.kernels.sampling import SampleLayout, choose_sample_layout, lower_sample  # noqa: E402
from ignition.preparation.program import set_attribute  # noqa: E402
from projection_tiles import chain_us, declare, torch_us  # noqa: E402

from helios_core.backends.cuda_driver import Context, pack_params  # noqa: E402
from helios_core.wire import manifest_pb2 as mf  # noqa: E402

_PER_ROW = (
    ("active", mf.DTYPE_U8),
    ("rows", mf.DTYPE_I32),
    ("temperature", mf.DTYPE_F32),
    ("top_k", mf.DTYPE_I32),
    ("top_p", mf.DTYPE_F32),
    ("min_p", mf.DTYPE_F32),
    ("repetition_penalty", mf.DTYPE_F32),
    ("frequency_penalty", mf.DTYPE_F32),
    ("presence_penalty", mf.DTYPE_F32),
    ("seed", mf.DTYPE_U64),
    ("step", mf.DTYPE_I64),
)
_DEFAULTS = {"active": 1, "top_p": 1.0, "repetition_penalty": 1.0}
_NUMPY = {
    mf.DTYPE_U8: np.uint8,
    mf.DTYPE_I32: np.int32,
    mf.DTYPE_F32: np.float32,
    mf.DTYPE_U64: np.uint64,
    mf.DTYPE_I64: np.int64,
}


def _manifest(rows: int, vocab: int, top_n: int) -> tuple[mf.ExecutionManifest, mf.Node]:
    manifest = mf.ExecutionManifest()
    program = manifest.programs.add(name="bench")
    node = program.nodes.add(name="sample")
    node.op.name = "sample"
    node.op.version = 1
    scratch = mf.BUFFER_ROLE_SCRATCH
    buffers: list[tuple[str, Any, tuple[int, ...], Any]] = [("logits", mf.DTYPE_F32, (rows, vocab), scratch)]
    buffers += [(name, dtype, (rows,), scratch) for name, dtype in _PER_ROW]
    buffers += [
        ("prompt_presence", mf.DTYPE_U8, (rows, vocab), scratch),
        ("output_counts", mf.DTYPE_I32, (rows, vocab), scratch),
        ("ids", mf.DTYPE_I32, (rows, 1), scratch),
        ("logprob", mf.DTYPE_F32, (rows, 1), scratch),
        ("top_ids", mf.DTYPE_I32, (rows, max(top_n, 1)), scratch),
        ("top_logprobs", mf.DTYPE_F32, (rows, max(top_n, 1)), scratch),
    ]
    declare(manifest, node, buffers)
    set_attribute(node, "vocab_limit", vocab)
    set_attribute(node, "top_n", top_n)
    return manifest, node


def _lowered(rows: int, vocab: int, top_n: int, layout: SampleLayout) -> tuple[LoweringContext, list[mf.KernelLaunch]]:
    load_kernel_modules()
    manifest, node = _manifest(rows, vocab, top_n)
    ctx = LoweringContext(manifest, "sm_90a", program="bench", node="sample")
    return ctx, lower_sample(ctx, node, layout)


def candidates(rows: int, vocab: int) -> list[SampleLayout]:
    """``choose_sample_layout``'s choice first, then chunks of 2048 and 4096 ids, each program of a row
    taking 1 to 16 of them."""
    chosen = choose_sample_layout(rows, vocab)
    layouts = [chosen]
    for chunk, warps, shares in ((2048, 4, (1, 2, 4, 8, 16)), (4096, 8, (1, 4, 8))):
        chunk = min(chunk, next_power_of_two(vocab))
        chunks = cdiv(vocab, chunk)
        for share in shares:
            layouts.append(SampleLayout(chunk=chunk, programs=cdiv(chunks, share), warps=warps))
    return list(dict.fromkeys(layouts))


def _compile_all(rows_list: list[int], vocabs: list[int], top_ns: list[int]) -> None:
    """Compile every candidate (a layout's programs are only its grid), in parallel processes."""
    with planning() as requests:
        for rows in rows_list:
            for vocab in vocabs:
                for top_n in top_ns:
                    for layout in candidates(rows, vocab):
                        _lowered(rows, vocab, top_n, layout)
    precompile(requests)
    print(f"compiled {len(set(requests))} kernels", flush=True)


def _time_ours(cuda: Context, rows: int, vocab: int, top_n: int, layout: SampleLayout) -> list[float]:
    """In-graph microseconds of each launch, then of all of them in order (chains of 16)."""
    ctx, launches = _lowered(rows, vocab, top_n, layout)
    addresses: dict[str, int] = {}
    rng = np.random.default_rng(0)
    for decl in ctx.manifest.buffers:
        count = int(np.prod([int(d.size) for d in decl.shape]))
        addresses[decl.name] = cuda.alloc(max(count * 8, 8))
        cuda.memset(addresses[decl.name], max(count * 8, 8))
    cuda.upload(addresses["logits"], (rng.standard_normal(rows * vocab) * 3).astype(np.float32))
    for name, dtype in _PER_ROW:
        value = np.arange(rows) if name in ("rows", "seed") else np.full(rows, _DEFAULTS.get(name, 0))
        cuda.upload(addresses[name], value.astype(_NUMPY[dtype]))
    modules = {name: cuda.load_module(module.data) for name, module in ctx.modules.items()}
    functions = [cuda.function(modules[launch.module], launch.symbol, launch.shared_bytes) for launch in launches]
    packs = [pack_params(launch.params, addresses) for launch in launches]
    links = list(zip(functions, launches, packs, strict=True))
    selections = [[index] for index in range(len(launches))] + [list(range(len(launches)))]
    results = [chain_us(cuda, [links[index] for _ in range(16) for index in selection], 20) for selection in selections]
    results[-1] *= len(launches)  # the whole operator, not one of its launches
    for pointer in addresses.values():
        cuda.free(pointer)
    return results


def _time_torch(rows: int, vocab: int, top_n: int) -> float:
    import torch

    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.float32) * 3

    def step() -> None:
        logprobs = torch.log_softmax(logits, dim=-1)
        logits.argmax(dim=-1)
        if top_n:
            logprobs.topk(top_n, dim=-1)

    return torch_us(step, 1)


def _label(layout: SampleLayout, chosen: SampleLayout, vocab: int) -> str:
    mark = "*" if layout == chosen else " "
    return f"{mark}{layout.chunk} x{cdiv(cdiv(vocab, layout.chunk), layout.programs)}/prog w{layout.warps}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,64,256")
    parser.add_argument("--vocab", default="128256")
    parser.add_argument("--top-n", default="5,0", help="top alternatives the operator reports")
    parser.add_argument("--compile-only", action="store_true", help="compile the candidates, measure nothing")
    args = parser.parse_args(argv)
    rows_list = [int(r) for r in args.rows.split(",")]
    vocabs = [int(v) for v in args.vocab.split(",")]
    top_ns = [int(n) for n in args.top_n.split(",")]
    _compile_all(rows_list, vocabs, top_ns)
    if args.compile_only:
        return 0
    bandwidth = copy_bandwidth("cuda")
    cuda = Context(0)
    print(f"device copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
    columns = (("rows", ">4"), ("vocab", ">6"), ("top", ">3"), ("layout", "<20"), ("chunks us", ">9"), ("top us", ">6"))
    columns += (("weights us", ">10"), ("finish us", ">9"), ("sample us", ">9"), ("torch us", ">8"), ("floor us", ">8"))
    print(" ".join(f"{name:{spec}}" for name, spec in columns))
    for rows in rows_list:
        for vocab in vocabs:
            for top_n in top_ns:
                torch_time = _time_torch(rows, vocab, top_n)
                floor = rows * vocab * 4 / bandwidth * 1e6
                chosen = choose_sample_layout(rows, vocab)
                for layout in candidates(rows, vocab):
                    label = _label(layout, chosen, vocab)
                    times = _time_ours(cuda, rows, vocab, top_n, layout)
                    chunks, top = times[0], (f"{times[1]:>6.1f}" if top_n else f"{'-':>6}")
                    weights, finish, whole = times[-3:]
                    print(
                        f"{rows:>4} {vocab:>6} {top_n:>3} {label:<20} {chunks:>9.1f} {top} {weights:>10.1f} "
                        f"{finish:>9.1f} {whole:>9.1f} {torch_time:>8.1f} {floor:>8.1f}",
                        flush=True,
                    )
    cuda.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
