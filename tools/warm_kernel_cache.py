"""Compile the GPU kernels of synthetic cores into the kernel cache, without building the cores.

Writes the programs of each named synthetic shape as kernel graphs over weight buffers that hold
no data, lowers them for the target, and leaves every compiled kernel in ``IGNITION_KERNEL_CACHE``
(default ``build/kernel-cache``). A later ``ignition build`` of the same shape and capacities (on
this machine or on a GPU machine the folder is carried to) compiles nothing. No GPU is needed.

    python tools/warm_kernel_cache.py --shapes 135m,1b,8b --max-rows 256 --decode-rows 1,8,64,256 \\
        --prefill-tokens 32,512 --context 1024 --cache-dtype bf16
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "contrib" / "ignition")]

import numpy as np  # noqa: E402
import numpy.typing as npt  # noqa: E402
from ignition.kernels.lowering import lower_manifest  # noqa: E402
from ignition.preparation.program import ManifestBuilder, View  # noqa: E402
from ignition.recipes.llama import CACHE_DTYPES, Capacities, LlamaProgramWriter, LlamaShape, tensor_names  # noqa: E402
from ignition.recipes.synthetic import SHAPES, byte_level_tokenizer  # noqa: E402

from helios_core.wire import manifest_pb2 as mf  # noqa: E402


class _ShapeOnlyBuilder(ManifestBuilder):
    """Declares weight buffers with their shapes and dtypes, and stores no bytes."""

    def weight(self, name: str, array: npt.NDArray[np.generic], resource_id: str, *, bf16: bool = False) -> View:
        dtype = mf.DTYPE_BF16 if bf16 else mf.DTYPE_F32
        view = self.buffer(name, mf.BUFFER_ROLE_WEIGHTS, dtype, array.shape)
        self.manifest.buffers[-1].resource_id = resource_id
        return view


class _ZeroWeights(Mapping[str, npt.NDArray[np.float32]]):
    """Every tensor a Llama shape needs, as a zero-stride view (no memory)."""

    def __init__(self, shape: LlamaShape) -> None:
        s, hd = shape, shape.head_dim
        self._shapes: dict[str, tuple[int, ...]] = {
            "token_embd.weight": (s.vocab, s.hidden),
            "output.weight": (s.vocab, s.hidden),
            "output_norm.weight": (s.hidden,),
        }
        for layer in range(s.layers):
            names = tensor_names(layer)
            self._shapes.update(
                {
                    names["attn_norm"]: (s.hidden,),
                    names["ffn_norm"]: (s.hidden,),
                    names["wq"]: (s.heads * hd, s.hidden),
                    names["wk"]: (s.kv_heads * hd, s.hidden),
                    names["wv"]: (s.kv_heads * hd, s.hidden),
                    names["wo"]: (s.hidden, s.heads * hd),
                    names["w_gate"]: (s.ffn, s.hidden),
                    names["w_up"]: (s.ffn, s.hidden),
                    names["w_down"]: (s.hidden, s.ffn),
                }
            )

    def __getitem__(self, name: str) -> npt.NDArray[np.float32]:
        return np.broadcast_to(np.float32(0.0), self._shapes[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part)


def warm(shape_name: str, caps: Capacities, target: str) -> int:
    shape = SHAPES[shape_name]
    builder = _ShapeOnlyBuilder()
    sampled = byte_level_tokenizer().vocab_size  # what ``ignition build llama-synthetic`` declares
    writer = LlamaProgramWriter(builder, shape, caps, _ZeroWeights(shape), sampled_size=sampled, bf16=True, fused=True)
    writer.write()
    return len(lower_manifest(builder.manifest, target))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="135m,1b,8b")
    parser.add_argument("--target", default="sm_90a")
    parser.add_argument("--max-rows", type=int, default=256)
    parser.add_argument("--decode-rows", default="1,8,64,256")
    parser.add_argument("--prefill-tokens", default="32,512")
    parser.add_argument("--page-tokens", type=int, default=16)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--cache-dtype", choices=tuple(CACHE_DTYPES), default="bf16", help="cache planes' type")
    args = parser.parse_args(argv)
    os.environ.setdefault("IGNITION_KERNEL_CACHE", str(ROOT / "build" / "kernel-cache"))
    caps = Capacities(
        max_rows=args.max_rows,
        prefill_tokens=_ints(args.prefill_tokens),
        decode_rows=_ints(args.decode_rows),
        page_tokens=args.page_tokens,
        context=args.context,
        cache_dtype=args.cache_dtype,
    )
    for shape_name in args.shapes.split(","):
        started = time.monotonic()
        modules = warm(shape_name, caps, args.target)
        print(f"{shape_name}: {modules} kernels in {time.monotonic() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
