"""Inter-token latency of an unconstrained stream while requests with a large JSON schema arrive.

One long unconstrained request (greedy, ``ignore_eos``) streams on the reference backend; its reader
stamps each token as it arrives, and the table gives the gaps between consecutive tokens (p50, p99,
max) in three runs: ``alone`` (no other traffic), ``compile off worker`` (a submitter thread sends
requests with a large schema through ``Engine.submit``, which compiles each on the submitting thread,
as preparation does for the server; the worker only copies the compiled grammar's matcher) and
``compile on worker`` (the same requests, but each grammar is compiled in the request's host gate on
the worker thread, as before the compiled grammar travelled with the request). Each constrained request
has its own schema (property names differ), so nothing is reused between them. ``compile ms`` is the
median time one schema takes to compile (measured once beforehand on the benchmark's thread).

The core is a tiny synthetic one built by Ignition; ``--smollm2`` builds SmolLM2-135M-Instruct instead
(a 49 152-token vocabulary: compiling costs more, and so does every round).

    python benchmarks/grammar_compile.py [--tokens 400] [--constrained 12] [--properties 120] [--smollm2]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "contrib" / "ignition"))


def build(directory: Path, smollm2: bool) -> tuple[Path, Path, str]:
    from ignition.build import build_core
    from ignition.cli import main as ignition_main
    from ignition.recipes.llama import Capacities
    from ignition.recipes.synthetic import synthetic_declaration

    from helios_core.container.keys import generate_keys, load_private_key

    keys = generate_keys(directory / "keys")
    core = directory / "bench.core"
    namespace = "bench/grammar"
    if smollm2:
        code = ignition_main(
            [
                "build", "smollm2-135m-instruct", "--out", str(core), "--sign-key", str(keys["signing"]),
                "--namespace", namespace, "--max-rows", "8", "--prefill-tokens", "16,64", "--context", "1024",
                "--quiet",
            ]
        )  # fmt: skip
        if code != 0:
            raise SystemExit(f"building SmolLM2 failed ({code})")
        return core, keys["public"], namespace
    caps = Capacities(
        max_rows=8, prefill_tokens=(64, 256), decode_rows=(1, 2, 4, 8), page_tokens=16, cache_pages=256,
        context=2048, snapshots=0,
    )  # fmt: skip
    build_core(
        synthetic_declaration("tiny", seed=1), core, caps=caps, signing_key=load_private_key(keys["signing"]),
        namespace=namespace,
    )  # fmt: skip
    return core, keys["public"], namespace


def large_schema(properties: int, tag: str) -> dict[str, Any]:
    """Many properties, each a nested object with enums, patterns, bounds and an array."""
    fields: dict[str, Any] = {}
    for index in range(properties):
        fields[f"{tag}_field_{index}"] = {
            "type": "object",
            "properties": {
                "name": {"type": "string", "pattern": "^[A-Z][a-z]{2,20}(-[A-Z][a-z]{2,20}){0,3}$"},
                "kind": {"enum": [f"{tag}_kind_{index}_{value}" for value in range(12)]},
                "count": {"type": "integer", "minimum": 0, "maximum": 10000},
                "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z0-9_]{1,16}$"}, "maxItems": 8},
                "inner": {
                    "type": "object",
                    "properties": {
                        "x": {"type": "number"},
                        "flag": {"type": "boolean"},
                        "code": {"type": "string", "pattern": "^[A-F0-9]{4}-[A-F0-9]{4}$"},
                    },
                    "required": ["x", "code"],
                },
            },
            "required": ["name", "kind", "count"],
            "additionalProperties": False,
        }
    return {"type": "object", "properties": fields, "required": list(fields)[:2], "additionalProperties": False}


def response_format(properties: int, tag: str) -> str:
    schema = large_schema(properties, tag)
    return json.dumps({"type": "json_schema", "json_schema": {"name": tag, "schema": schema}})


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def run_once(running: Any, mode: str, args: argparse.Namespace, round_: int) -> list[float]:
    """Gaps (ms) between consecutive tokens of the unconstrained stream under ``mode``."""
    import msgspec

    from helios_core.runtime.messages import PreparedRequest, SamplingParams, TokenEvent

    engine, compiler = running.engine, running.grammar_compiler
    prompt = running.bootstrap.encode_prompt([{"role": "user", "content": "Tell me a long story."}])
    greedy = SamplingParams(temperature=0.0)
    real_make_gate = engine.scheduler.make_gate
    placeholder = compiler.compile_prepared(json.dumps({"type": "json_object"}))
    if mode == "compile on worker":

        def compiling_gate(request: Any) -> Any:
            if request.response_format is not None:  # the former path: compile in the gate, on the worker
                request = msgspec.structs.replace(request, grammar=compiler.compile_prepared(request.response_format))
            return real_make_gate(request)

        engine.scheduler.make_gate = compiling_gate
    stamps: list[int] = []
    long = PreparedRequest(f"long{round_}", prompt, args.tokens, greedy, ignore_eos=True)
    stream = engine.submit(long)

    def read() -> None:
        for event in stream:
            if isinstance(event, TokenEvent):
                stamps.append(time.perf_counter_ns())

    reader = threading.Thread(target=read, name="bench-reader")
    reader.start()
    constrained: list[Any] = []
    try:
        while len(stamps) < 20:  # the stream is in steady decoding before constrained traffic starts
            time.sleep(0.001)
        if mode != "alone":
            for index in range(args.constrained):
                text = response_format(args.properties, f"r{round_}x{index}")
                grammar = placeholder if mode == "compile on worker" else None  # None: Engine.submit compiles
                request = PreparedRequest(
                    f"c{round_}x{index}", prompt, 4, greedy, response_format=text, grammar=grammar
                )
                constrained.append(engine.submit(request))
                time.sleep(args.interval_ms / 1000)
        reader.join()
        for other in constrained:
            list(other)
    finally:
        engine.scheduler.make_gate = real_make_gate
    return [(b - a) / 1e6 for a, b in itertools.pairwise(stamps[20:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=400, help="tokens of the unconstrained stream")
    parser.add_argument("--constrained", type=int, default=12, help="constrained requests per run")
    parser.add_argument("--properties", type=int, default=120, help="top-level properties of the schema")
    parser.add_argument("--interval-ms", type=float, default=40.0, help="time between constrained submissions")
    parser.add_argument("--smollm2", action="store_true", help="SmolLM2-135M-Instruct instead of a tiny core")
    args = parser.parse_args()

    from helios_core.contract import LoadOptions
    from helios_core.frontend.formats import parse_response_format
    from helios_core.loading import TrustSettings
    from helios_core.runtime.startup import start

    with tempfile.TemporaryDirectory() as tmp:
        core, key, namespace = build(Path(tmp), args.smollm2)
        running = start(core, TrustSettings((key,), namespace, None), LoadOptions(), backend="reference")
        try:
            compiler = running.grammar_compiler
            costs = []
            for index in range(5):
                fmt = parse_response_format(json.loads(response_format(args.properties, f"warm{index}")))
                began = time.perf_counter()
                compiler.compile(fmt)  # type: ignore[arg-type]
                costs.append((time.perf_counter() - began) * 1e3)
            compile_ms = statistics.median(costs)
            rows = []
            for round_, mode in enumerate(("alone", "compile off worker", "compile on worker")):
                gaps = run_once(running, mode, args, round_)
                rows.append((mode, statistics.median(gaps), percentile(gaps, 0.99), max(gaps)))
        finally:
            running.close()
    model = "SmolLM2-135M-Instruct" if args.smollm2 else "tiny synthetic"
    print(
        f"# grammar compile vs streaming, {model}, reference backend, {date.today()}: {args.tokens} tokens, "
        f"{args.constrained} constrained requests every {args.interval_ms:g} ms, {args.properties} properties, "
        f"compile {compile_ms:.1f} ms"
    )
    print("| traffic | p50 ms | p99 ms | max ms |")
    print("| --- | ---: | ---: | ---: |")
    for mode, p50, p99, worst in rows:
        print(f"| {mode} | {p50:.2f} | {p99:.2f} | {worst:.2f} |")


if __name__ == "__main__":
    main()
