"""Reference-backend decode speed at batch 1 on SmolLM2-135M-Instruct, beside its baseline and limit.

One run prints one table:

* Helios: greedy decode through the engine (worker loop, packing, completion validation) on the
  reference backend, tokens/s after the first token;
* baseline: the independent float32 numpy forward pass of the same weights
  (``tests/oracles/llama_numpy.py``, contiguous KV cache, no engine);
* limit: the memory-bandwidth bound, the bytes one decode step must read (all float32 weights)
  over the measured copy bandwidth of this machine.

    python benchmarks/reference_decode.py [--core smol.core --trust-key PEM --accept NS] [--tokens 64]

Without ``--core`` it builds the core into a temporary directory first.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one short sentence."}]


def copy_bandwidth(nbytes: int = 512 * 1024 * 1024, repeats: int = 5) -> float:
    """Best observed memory traffic of a large copy, bytes/s (each byte is read once and written once)."""
    source = np.ones(nbytes // 4, dtype=np.float32)
    target = np.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def build_core(directory: Path) -> tuple[Path, Path, str]:
    from ignition.cli import main as ignition_main

    from helios_core.container.keys import generate_keys

    keys = generate_keys(directory / "keys")
    core = directory / "smol.core"
    namespace = "bench/smollm2"
    args = ["build", "smollm2-135m-instruct", "--out", str(core), "--sign-key", str(keys["signing"])]
    if ignition_main([*args, "--namespace", namespace, "--max-rows", "1", "--quiet"]) != 0:
        raise SystemExit("ignition build failed")
    return core, keys["public"], namespace


def helios_decode(core: Path, key: Path, namespace: str, tokens: int) -> tuple[float, float, list[int], int]:
    from helios_core.contract import LoadOptions
    from helios_core.loading import TrustSettings
    from helios_core.runtime.messages import PreparedRequest, SamplingParams, TokenEvent
    from helios_core.runtime.startup import start

    running = start(core, TrustSettings((key,), namespace, None), LoadOptions(max_active=1), backend="reference")
    try:
        prompt = running.bootstrap.encode_prompt(QUESTION)
        request = PreparedRequest("bench", prompt, tokens, SamplingParams(temperature=0.0), ignore_eos=True)
        stamps: list[float] = []
        ids: list[int] = []
        start_time = time.perf_counter()
        for event in running.engine.submit(request):
            if isinstance(event, TokenEvent):
                stamps.append(time.perf_counter())
                ids.append(event.token_id)
        first = stamps[0] - start_time
        rate = (len(stamps) - 1) / (stamps[-1] - stamps[0])
        weight_bytes = sum(
            r.decoded_nbytes for r in running.verified.core.resources.values() if r.id.startswith("weights")
        )
        return rate, first, ids, weight_bytes
    finally:
        running.close()


def oracle_decode(tokens: int, prompt: list[int]) -> float:
    from ignition.gguf import locate_smollm2_gguf, read_gguf

    from tests.oracles.llama_numpy import LlamaHParams, LlamaNumpy

    gguf = read_gguf(locate_smollm2_gguf())
    tensors = {name: gguf.tensor(name) for name in gguf.tensors}
    model = LlamaNumpy(tensors, LlamaHParams.from_gguf_metadata(gguf.metadata))
    model.reset(len(prompt) + tokens)
    logits = model.forward(prompt)
    token = int(np.argmax(logits[-1]))
    start = time.perf_counter()
    for _ in range(tokens - 1):
        token = int(np.argmax(model.forward([token])[-1]))
    return (tokens - 1) / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--core", type=Path)
    parser.add_argument("--trust-key", type=Path)
    parser.add_argument("--accept")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, help="also write the figures as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.core is None:
            core, key, namespace = build_core(Path(tmp))
        else:
            core, key, namespace = args.core, args.trust_key, args.accept
        rate, first, ids, weight_bytes = helios_decode(core, key, namespace, args.tokens)
        prompt = json.loads((ROOT / "tests" / "fixtures" / "smollm2_reference_ids.json").read_text())["chat"][
            "prompt_ids"
        ]
        baseline = oracle_decode(args.tokens, prompt)
    bandwidth = copy_bandwidth()
    limit = bandwidth / weight_bytes
    rows = [
        ("Helios engine, reference backend", rate, f"first token {first * 1000:.0f} ms"),
        ("numpy forward pass (baseline)", baseline, "no engine, contiguous KV cache"),
        ("memory-bandwidth limit", limit, f"{weight_bytes / 1e6:.0f} MB weights / {bandwidth / 1e9:.1f} GB/s copy"),
    ]
    print(
        f"reference decode, batch 1, SmolLM2-135M-Instruct float32, {args.tokens} tokens, {date.today()}, "
        f"{platform.machine()} x{__import__('os').cpu_count()}"
    )
    print(f"{'path':<36} {'tokens/s':>9} {'vs limit':>9}  note")
    for name, value, note in rows:
        print(f"{name:<36} {value:>9.1f} {value / limit:>8.0%}  {note}")
    if args.json:
        args.json.write_text(json.dumps({"helios": rate, "baseline": baseline, "limit": limit, "tokens": ids}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
