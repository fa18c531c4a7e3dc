"""Decode beside a long prompt: what a prompt's prefill costs the requests already decoding, by prefill chunk.

A demanding server computes a new long prompt in chunks that ride along with the running requests' decode
steps (mixed rounds), so no decoding request waits for a whole prompt. This benchmark measures that on
one synthetic Llama shape: for each prefill chunk of ``--chunks`` (``none``: the core's largest prefill
program; N: ``--prefill-chunk N``, only the programs of at most N tokens) it starts the core through the
real engine, lets ``--batch`` requests (32-token prompts, greedy, ``ignore_eos``) decode steadily, submits
one ``--long``-token prompt, and reads every token's timestamp from the engine's per-token observation:

| column | meaning |
| --- | --- |
| chunk | ``--prefill-chunk`` (``none``: every captured program) |
| prompt rounds | rounds that computed the long prompt, and the programs they ran on |
| TTFT ms | the long prompt's submission to its first token, beside the decoders |
| alone ms | the same prompt's time to first token with nothing else running (median of three) |
| step ms | the decoders' median gap between tokens while all of them decode, before the prompt arrived |
| longest gap ms | the longest gap between two tokens of any decoder while the prompt was computed |
| gap / step | the longest gap over the step: how long the prompt stalled a decoder, in steps |
| decoder tokens | tokens each decoder received while the prompt was computed (mean) |

The core is built like ``gpu_decode.py``'s (bf16, targets ``reference,sm_90a``, context 1024), with decode
rows 1, ``--batch`` and one more (a mixed round's decoders and prompt) and prefill programs of 32 tokens,
each chunk and ``--long`` tokens; ``--cores DIR`` reuses it. ``--device cpu`` runs the same on the reference
backend with the ``tiny`` shape:

    tools/gpu_run.sh python3 benchmarks/mixed_prefill.py --shape 1b --batch 64 --long 512 --chunks none,256,128
    python benchmarks/mixed_prefill.py --device cpu
    python benchmarks/mixed_prefill.py --device cpu --backend null --batch 64 --long 512 --context 1024 \
        --chunks none,256,128

The null backend (``--backend null``) writes completion records without computing, so its figures are
the host's part of each round alone: planning, packing, validating and publishing.

Every figure goes to ``--out`` as JSON (default ``$OUT/mixed_prefill.json``, else ``./mixed_prefill.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import itertools

import gpu_decode
from gpu_decode import log


@dataclass(frozen=True)
class Setup:
    """What one run measures."""

    shape: str
    device: str
    backend: str
    targets: tuple[str, ...]
    batch: int
    prompt: int
    long: int
    chunks: tuple[int | None, ...]
    context: int
    page_tokens: int
    settle_tokens: int
    """Tokens every decoder has before the steady step is measured; then each decodes as many again (the steady
    step) before the long prompt is submitted."""
    timeout_s: float
    seed: int

    @property
    def prefill_variants(self) -> tuple[int, ...]:
        return tuple(sorted({self.prompt, self.long, *(c for c in self.chunks if c is not None)}))

    def prompt_rounds(self, chunk: int | None) -> int:
        """Rounds that compute the long prompt beside every decoder with prefill chunk ``chunk``."""
        tokens = (self.long if chunk is None else chunk) - self.batch
        return -(-self.long // tokens)

    @property
    def decode_tokens(self) -> int:
        """New tokens of each decoder: as many as the context holds, to outlast the prompt's rounds whatever the
        time the benchmark's own thread takes to submit it."""
        return self.context - self.prompt - 1


def core_spec(setup: Setup, directory: Path, signing_key: Path) -> gpu_decode.CoreSpec:
    arguments = (
        "build", "llama-synthetic", "--shape", setup.shape, "--dtype", "bf16" if setup.device == "cuda" else "f32",
        "--targets", ",".join(setup.targets), "--max-rows", str(setup.batch + 1),
        "--decode-rows", ",".join(map(str, sorted({1, setup.batch, setup.batch + 1}))),
        "--prefill-tokens", ",".join(map(str, setup.prefill_variants)), "--context", str(setup.context),
        "--page-tokens", str(setup.page_tokens), "--namespace", gpu_decode.NAMESPACE, "--seed", str(setup.seed),
    )  # fmt: skip
    variants = "-".join(map(str, setup.prefill_variants))
    path = directory / f"{setup.shape}-mixed-b{setup.batch + 1}-p{variants}-c{setup.context}.core"
    return gpu_decode.CoreSpec(setup.shape, str(path), (*arguments, "--sign-key", str(signing_key)))


Stream = gpu_decode.StreamResult
"""One request's recorded tokens and stamps (``gpu_decode.record_streams``)."""


def submit(engine: Any, requests: Sequence[Any]) -> list[Stream]:
    """Submit ``requests``; one thread records every stream's token timestamps as they are published."""
    streams, _ = gpu_decode.record_streams(engine, requests)
    return streams


def wait(streams: Sequence[Stream], timeout_s: float, *, tokens: int | None = None, after_ns: int = -1) -> None:
    """Until every stream finished (or, with ``tokens``, holds that many tokens stamped after ``after_ns``);
    raises on a failure or a timeout. (Counting stamps, not tokens read: the thread that reads the events
    may lag behind the rounds that stamped them.)"""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        failed = [s.error for s in streams if s.error]
        if failed:
            raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
        if all(
            s.done.is_set() or (tokens is not None and len(s.stamps_ns) >= tokens and s.stamps_ns[-tokens] > after_ns)
            for s in streams
        ):
            return
        time.sleep(0.0005)
    raise TimeoutError(f"{len(streams)} requests did not get there within {timeout_s:.0f} s")


def stall(decoders: Sequence[Stream], settled_ns: int, submitted_ns: int, first_ns: int) -> dict[str, float]:
    """The decoders' steady step between ``settled_ns`` (every one of them decoding) and ``submitted_ns``, and
    their gaps while the prompt was computed (from its submission to its first token at ``first_ns``)."""
    before = [
        later - earlier
        for s in decoders
        for earlier, later in itertools.pairwise(s.stamps_ns)
        if settled_ns <= earlier and later <= submitted_ns
    ]
    during: list[int] = []
    received = 0
    for s in decoders:
        stamps = s.stamps_ns
        received += sum(1 for t in stamps if submitted_ns < t <= first_ns)
        for earlier, later in itertools.pairwise(stamps):
            if later > submitted_ns and earlier < first_ns:  # a gap that overlaps the prompt's computation
                during.append(later - earlier)
    if not before or not during:
        raise RuntimeError("no decode gaps before or during the prompt (raise --batch tokens or --long)")
    step = statistics.median(before) / 1e6
    longest = max(during) / 1e6
    return {
        "step_ms": step,
        "longest_gap_ms": longest,
        "gap_over_step": longest / step,
        "decoder_tokens": received / len(decoders),
    }


def measure_chunk(spec: gpu_decode.CoreSpec, public_key: Path, setup: Setup, chunk: int | None) -> dict[str, Any]:
    """One chunk setting: the prompt alone, then the prompt beside ``setup.batch`` decoding requests."""
    from helios_core.contract import LoadOptions
    from helios_core.loading import TrustSettings
    from helios_core.runtime.startup import start

    pages = (setup.batch * -(-(setup.prompt + setup.decode_tokens) // setup.page_tokens)) + 2 * -(
        -setup.context // setup.page_tokens
    )
    options = LoadOptions(
        max_active=setup.batch + 1, queue_capacity=setup.batch + 1, cache_pages=pages, prefill_chunk=chunk
    )
    trust = TrustSettings((public_key,), gpu_decode.NAMESPACE, None)
    running = start(Path(spec.path), trust, options, backend=setup.backend)
    try:
        engine, clock = running.engine, gpu_decode.RoundClock(running)
        vocab = gpu_decode.model_facts(running.verified.contract).input_vocab
        rng = np.random.default_rng(setup.seed + 5)
        warm = gpu_decode._requests("warm", 1, setup.long, 2, vocab, rng)
        wait(submit(engine, warm), setup.timeout_s)
        alone = []
        for index in range(3):
            (request,) = gpu_decode._requests(f"alone{index}", 1, setup.long, 2, vocab, rng)
            submitted = clock.now_ns()
            (stream,) = submit(engine, [request])
            wait([stream], setup.timeout_s)
            alone.append((stream.stamps_ns[0] - submitted) / 1e6)
        decoders = submit(
            engine, gpu_decode._requests("decode", setup.batch, setup.prompt, setup.decode_tokens, vocab, rng)
        )
        # every decoder decoding (all prompts computed), then as many steady tokens again before the prompt
        wait(decoders, setup.timeout_s, tokens=setup.settle_tokens)
        settled = clock.now_ns()
        wait(decoders, setup.timeout_s, tokens=setup.settle_tokens, after_ns=settled)
        (request,) = gpu_decode._requests("long", 1, setup.long, 2, vocab, rng)
        seen = len(clock.records)
        submitted = clock.now_ns()
        (long_stream,) = submit(engine, [request])
        wait([long_stream], setup.timeout_s)
        first = long_stream.stamps_ns[0]
        wait(decoders, setup.timeout_s)
        if any(first >= s.stamps_ns[-1] for s in decoders):
            raise RuntimeError("a decoder finished before the long prompt's first token (raise the decode tokens)")
        rounds = [r for r in clock.records[seen:] if submitted <= r.launch_ns <= first]
        prompt_rounds = [r.program for r in rounds if "decode" not in r.program]
        return {
            "chunk": chunk,
            "ttft_ms": (first - submitted) / 1e6,
            "alone_ms": statistics.median(alone),
            "prompt_rounds": prompt_rounds,
            "rounds": [  # every round launched while the prompt was computed: ms after its submission
                {
                    "program": r.program,
                    "launch_ms": (r.launch_ns - submitted) / 1e6,
                    "done_ms": (r.wait_end_ns - submitted) / 1e6,
                }
                for r in rounds
            ],
            **stall(decoders, settled, submitted, first),
        }
    finally:
        running.close()


HEADERS = ("chunk", "prompt rounds", "TTFT ms", "alone ms", "step ms", "longest gap ms", "gap / step", "decoder tokens")


def table_rows(results: Sequence[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for result in results:
        chunk = "none" if result["chunk"] is None else str(result["chunk"])
        if "error" in result:
            rows.append([chunk, f"failed: {result['error']}", *["-"] * (len(HEADERS) - 2)])
            continue
        programs: dict[str, int] = {}
        for program in result["prompt_rounds"]:
            programs[program] = programs.get(program, 0) + 1
        rounds = ", ".join(f"{count} {name}" for name, count in programs.items()) or "-"
        rows.append(
            [
                chunk,
                rounds,
                f"{result['ttft_ms']:.2f}",
                f"{result['alone_ms']:.2f}",
                f"{result['step_ms']:.3f}",
                f"{result['longest_gap_ms']:.3f}",
                f"{result['gap_over_step']:.2f}",
                f"{result['decoder_tokens']:.1f}",
            ]
        )
    return rows


def print_table(setup: Setup, results: Sequence[dict[str, Any]]) -> None:
    print(
        f"\n{setup.shape} on {setup.backend}: {setup.batch} decoding requests ({setup.prompt}-token prompts), "
        f"one {setup.long}-token prompt submitted after {2 * setup.settle_tokens} decode tokens"
    )
    print("| " + " | ".join(HEADERS) + " |")
    print("| " + " | ".join(["---", "---", *["---:"] * (len(HEADERS) - 2)]) + " |")
    for row in table_rows(results):
        print("| " + " | ".join(row) + " |")


def parse_chunks(text: str) -> tuple[int | None, ...]:
    chunks: list[int | None] = []
    for item in text.split(","):
        item = item.strip()
        if item == "none":
            chunks.append(None)
        elif item.isdigit() and int(item) > 0:
            chunks.append(int(item))
        else:
            raise SystemExit(f"--chunks takes 'none' and positive token counts, not {item!r}")
    return tuple(chunks)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the reference backend")
    parser.add_argument(
        "--backend",
        choices=("cuda", "reference", "null"),
        help="Helios backend (default cuda; cpu: reference); null computes nothing: the rounds' host time alone",
    )
    parser.add_argument("--shape", help="synthetic shape (default 1b; cpu: tiny)")
    parser.add_argument("--batch", type=int, help="decoding requests (default 64; cpu: 4)")
    parser.add_argument("--long", type=int, help="tokens of the long prompt (default 512; cpu: 64)")
    parser.add_argument(
        "--chunks", help="prefill chunks, 'none' for every program (default none,256,128; cpu: none,16)"
    )
    parser.add_argument("--context", type=int, help="core context tokens (default 1024; cpu: 256)")
    parser.add_argument("--cores", type=Path, help="folder to reuse the core from and build it into")
    parser.add_argument("--out", type=Path, help="JSON of every figure (default $OUT/mixed_prefill.json or ./)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds for one wave of requests")
    parser.add_argument("--seed", type=int, default=0, help="weight seed of the core")
    return parser.parse_args(argv)


def make_setup(args: argparse.Namespace) -> Setup:
    cpu = args.device == "cpu"
    setup = Setup(
        shape=args.shape or ("tiny" if cpu else "1b"),
        device=args.device,
        backend=args.backend or ("reference" if cpu else "cuda"),
        targets=("reference",) if cpu else ("reference", "sm_90a"),
        batch=args.batch or (4 if cpu else 64),
        prompt=16 if cpu else 32,
        long=args.long or (64 if cpu else 512),
        chunks=parse_chunks(args.chunks or ("none,16" if cpu else "none,256,128")),
        context=args.context or (256 if cpu else 1024),
        page_tokens=16,
        settle_tokens=8,
        timeout_s=args.timeout,
        seed=args.seed,
    )
    if setup.batch <= 0 or setup.long + 2 > setup.context or setup.long <= setup.batch:
        raise SystemExit(f"--batch must be positive and below --long, and --long fit the context of {setup.context}")
    too_small = [c for c in setup.chunks if c is not None and c <= setup.batch]
    if too_small:
        raise SystemExit(f"chunks {too_small} leave no room for prompt tokens beside {setup.batch} decoders")
    return setup


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    setup = make_setup(args)
    os.environ.setdefault("IGNITION_KERNEL_CACHE", str(gpu_decode.KERNEL_CACHE))
    out = args.out or Path(os.environ.get("OUT", ".")) / "mixed_prefill.json"
    data: dict[str, Any] = {"date": str(date.today()), "setup": {**setup.__dict__}, "results": []}
    with contextlib.ExitStack() as stack:
        cores = args.cores or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="mixed-prefill-")))
        cores.mkdir(parents=True, exist_ok=True)
        signing, public = gpu_decode.keys_in(cores)
        spec = core_spec(setup, cores, signing)
        builds = gpu_decode.Report(cores / "build.json", gpu_decode.Plan(
            shapes=(setup.shape,), device=setup.device, backend=setup.backend, targets=setup.targets,
            batches=(setup.batch,), prompt=setup.prompt, tokens=setup.decode_tokens, prefill=setup.long,
            context=setup.context, page_tokens=setup.page_tokens, baseline_steps=0, baseline_warmup=0,
            prefill_repeats=0, agreement_tokens=0, timeout_s=setup.timeout_s, budget_s=0, seed=setup.seed,
        ))  # fmt: skip
        gpu_decode.build_cores([spec], builds)
        gpu_decode.pack_kernel_cache(Path(os.environ["IGNITION_KERNEL_CACHE"]))
        if builds.data["errors"]:
            print(json.dumps(builds.data["errors"], indent=1))
            return 1
        for chunk in setup.chunks:
            try:
                result = measure_chunk(spec, public, setup, chunk)
            except Exception as exc:  # the other chunks' figures stand without it
                result = {"chunk": chunk, "error": f"{type(exc).__name__}: {exc}"}
            data["results"].append(result)
            figures = {k: v for k, v in result.items() if k not in ("prompt_rounds", "rounds")}
            log(f"chunk {chunk}: {json.dumps(figures)}")
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(data, indent=1, default=str))
    print_table(setup, data["results"])
    return 1 if any("error" in r for r in data["results"]) else 0


if __name__ == "__main__":
    sys.exit(main())
