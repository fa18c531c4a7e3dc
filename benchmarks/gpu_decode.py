"""GPU decode and prefill on synthetic Llama shapes: Helios' CUDA backend beside PyTorch and the HBM roofline.

One run prints one table. For each shape of ``--shapes`` (default 135m, 1b, 8b) it builds a bf16
``reference,sm_90a`` core (decode rows 1, 8, 64 and 256, prefill variants for a 32-token and a
512-token prompt, context 1024, key and value cache planes of ``--cache-dtype``, default bf16 as the
PyTorch baseline's cache; or reuses it from ``--cores DIR``), then measures:

* Helios, through the real engine and its worker loop on backend ``cuda``: decode latency at batch 1
  (one request, 32-token prompt, ``ignore_eos``, 128 new tokens; ms per token after the first),
  decode throughput at batch 8, 64 and 256 (that many concurrent requests; tokens/s over the window
  in which every request is decoding, from the per-token timestamps), prefill throughput (a
  512-token prompt at batch 1, submit to first token) and host time per decode round (the time
  from one decode round's completion to the next, minus the time spent waiting for the GPU inside
  ``backend.completion`` and ``backend.transport``; the backend object is wrapped, the library is
  not changed);
* PyTorch eager on the same weights read from the core (bf16 ``F.linear``, ``F.rms_norm``, the
  same RoPE frequencies, a static contiguous KV cache with matmul attention over it, greedy
  argmax), and the same decode step captured once per batch size with ``torch.cuda.CUDAGraph``
  (static inputs and outputs, the next token and position fed back on the device, one replay per
  token); a greedy-agreement check of the eager model against Helios' batch-1 tokens;
* the limits: the HBM roofline per step, (weight bytes streamed + KV bytes at the window's mean
  context) / the device-to-device copy bandwidth measured in the same run (bytes read + written),
  and the compute floor (matmul FLOPs / measured bf16 matmul rate).

With ``--tensor-parallel-1`` each shape is also built with ``--tensor-parallel 1`` (the same weights and
programs plus an ``all_reduce`` after every output and down projection, run on one GPU through a one-rank
NCCL communicator captured into each program's CUDA graph) and its batch-1 decode is measured the same way
and shown beside the plain core's, in the ``tp1 ms/step`` column.

With ``--ranks N`` (N >= 2) each shape is also built with ``--tensor-parallel N`` and served on N ranks (on
``cuda``: one CUDA backend on each of GPUs 0..N-1 of the process, one NCCL group, the collectives captured in
every rank's graphs; on ``cpu``: N reference thread ranks); its decode at every batch goes to a second table
beside the one-rank figures and the PyTorch graph of the same run, with the cost of one in-place bf16
``all_reduce`` of a decode step's activations (batch x hidden) over the N GPUs, measured alone: 64 calls
captured back to back into one CUDA graph a rank, all ranks launched together, the slowest rank's time over 64
(median of 5 launches), and the share of the N-rank step those calls take (two a layer).

``--kinds llama,recurrent,latent,window`` adds, for each shape, one batch-1 decode row per other history kind
beside the Llama row: ``recurrent`` a ``recurrent-synthetic`` core, ``latent`` a ``latent-synthetic`` core
(their ``small`` shape, ``tiny`` for the ``tiny`` shape; float32 weights, the same capacities and targets),
``window`` the shape's ``llama-synthetic`` core built with ``--window`` :data:`WINDOW_TOKENS`. A kind whose
build fails (a target it has no kernels for) is reported as a failure of that row only.

``--compare-tree DIR`` also builds each shape's core with the Ignition of the source tree at ``DIR`` (another
checkout: a child process with ``DIR`` and ``DIR/contrib/ignition`` first on its path) and serves it with this
tree's runtime, measuring the same decode waves and prefill right after this tree's core and before the PyTorch
baselines, which both share: rows ``<shape> compared`` and, per shape, each figure of this tree over the compared
tree's. That is a kernel change measured before and after on one lease, at the cost of one build and one
Helios phase. A compared core is reused from ``--cores`` only while the tree's Ignition sources are unchanged.

    python benchmarks/gpu_decode.py [--shapes 135m,1b,8b] [--cores DIR] [--out FILE] [--tensor-parallel-1]
    python benchmarks/gpu_decode.py --shapes 8b --ranks 2          # two GPUs: the ranks table
    python benchmarks/gpu_decode.py --shapes 1b --kinds llama,recurrent,latent,window
    python benchmarks/gpu_decode.py --shapes 1b --compare-tree ../before   # this tree's kernels beside another's
    python benchmarks/gpu_decode.py --device cpu --shapes tiny    # checks the script without a GPU

Cores build in parallel child processes before any measurement. Compiled kernels are cached in
``$IGNITION_KERNEL_CACHE`` (default ``build/kernel-cache``, carried between machines as a folder);
with ``$OUT`` set the cache is also packed into ``$OUT/kernel-cache.tar.gz`` after the builds. Every
number goes to ``--out`` as JSON (default ``$OUT/gpu_decode.json``, else ``./gpu_decode.json``),
rewritten after every phase so a run cut short keeps what finished. ``--device cpu`` runs the same
code on the reference backend and float32 PyTorch, without CUDA graphs."""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import gc
import hashlib
import itertools
import json
import math
import os
import platform
import queue
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import date, datetime
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "contrib" / "ignition"))
sys.path.insert(0, str(ROOT))

NAMESPACE = "bench/gpu-decode"
KERNEL_CACHE = ROOT / "build" / "kernel-cache"
RETURN_LIMIT = 16 * 1024 * 1024
"""Largest file the GPU machine hands back from $OUT."""
STARTED = time.monotonic()
KINDS = ("llama", "recurrent", "latent", "window")
"""History kinds ``--kinds`` may name: the Llama core itself and the cores measured beside it."""
KIND_RECIPES = {"recurrent": "recurrent-synthetic", "latent": "latent-synthetic", "window": "llama-synthetic"}
WINDOW_TOKENS = 64
"""The attention window of the ``window`` kind's core."""


def log(message: str) -> None:
    """One progress line: wall clock, seconds since start."""
    now = datetime.now().strftime("%H:%M:%S")
    print(f"[{now} +{time.monotonic() - STARTED:6.1f}s] {message}", flush=True)


class Interrupted(Exception):
    """SIGTERM arrived: stop measuring, print and write what finished."""


# ---------------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Plan:
    """What one run measures."""

    shapes: tuple[str, ...]
    device: str
    backend: str
    targets: tuple[str, ...]
    batches: tuple[int, ...]
    prompt: int
    tokens: int
    prefill: int
    context: int
    page_tokens: int
    baseline_steps: int
    baseline_warmup: int
    prefill_repeats: int
    agreement_tokens: int
    timeout_s: float
    budget_s: float
    seed: int
    tensor_parallel_1: bool = False
    """Also build each shape with ``--tensor-parallel 1`` and measure its batch-1 decode."""
    ranks: int = 1
    """N >= 2: also build each shape with ``--tensor-parallel N`` and measure its decode at every batch on N ranks."""
    kinds: tuple[str, ...] = ("llama",)
    """History kinds measured; each but ``llama`` adds a batch-1 decode row per shape."""
    compare_tree: str = ""
    """Another source tree whose Ignition also builds each shape's core, measured beside this tree's."""
    cache_dtype: str = "bf16"
    """Storage type of the Llama cores' key and value cache planes (``ignition build --cache-dtype``)."""

    @property
    def max_rows(self) -> int:
        return max(self.batches)

    @property
    def prefill_variants(self) -> tuple[int, ...]:
        return tuple(sorted({self.prompt, self.prefill}))

    @property
    def decode_rows(self) -> tuple[int, ...]:
        return tuple(sorted({1, *self.batches}))


def make_plan(args: argparse.Namespace) -> Plan:
    cpu = args.device == "cpu"

    def pick(value: Any, gpu: Any, dev: Any) -> Any:
        return value if value is not None else (dev if cpu else gpu)

    batches = tuple(sorted({int(b) for b in pick(args.batches, "1,8,64,256", "1,8").split(",") if b.strip()}))
    plan = Plan(
        shapes=tuple(s.strip() for s in pick(args.shapes, "135m,1b,8b", "tiny").split(",") if s.strip()),
        device=args.device,
        backend=pick(args.backend, "cuda", "reference"),
        targets=tuple(pick(args.targets, "reference,sm_90a", "reference").split(",")),
        batches=batches,
        prompt=pick(args.prompt, 32, 16),
        tokens=pick(args.tokens, 128, 24),
        prefill=pick(args.prefill, 512, 64),
        context=pick(args.context, 1024, 256),
        page_tokens=16,
        baseline_steps=pick(args.baseline_steps, 64, 8),
        baseline_warmup=pick(args.baseline_warmup, 8, 2),
        prefill_repeats=pick(args.prefill_repeats, 9, 2),
        agreement_tokens=pick(args.agreement_tokens, 32, 16),
        timeout_s=args.timeout,
        budget_s=args.budget,
        seed=args.seed,
        tensor_parallel_1=args.tensor_parallel_1,
        ranks=args.ranks,
        kinds=tuple(k.strip() for k in args.kinds.split(",") if k.strip()),
        cache_dtype=args.cache_dtype,
        compare_tree=str(Path(args.compare_tree).resolve()) if args.compare_tree else "",
    )
    if plan.compare_tree and not (Path(plan.compare_tree) / "contrib" / "ignition" / "ignition" / "cli.py").is_file():
        raise SystemExit(f"--compare-tree {args.compare_tree}: no contrib/ignition/ignition/cli.py there")
    unknown_kinds = [k for k in plan.kinds if k not in KINDS]
    if unknown_kinds or "llama" not in plan.kinds:
        raise SystemExit(f"--kinds must name llama and any of {', '.join(KINDS[1:])}, got {args.kinds}")
    if plan.ranks < 1:
        raise SystemExit(f"--ranks must be at least 1, got {plan.ranks}")
    if not batches or min(batches) <= 0 or plan.prompt <= 0 or plan.tokens < 4:
        raise SystemExit("batches and prompt must be positive and --tokens at least 4")
    if plan.prompt + plan.tokens > plan.context or plan.prefill + 2 > plan.context:
        raise SystemExit(f"prompt + tokens and the prefill prompt must fit the context of {plan.context}")
    return plan


# ------------------------------------------------------------------------------------------- cores


@dataclass(frozen=True)
class CoreSpec:
    """One core to build (or reuse when a core of the same arguments, built by the same Ignition sources, is there)."""

    shape: str
    path: str
    arguments: tuple[str, ...]
    tensor_parallel: int = 0
    """N >= 1: the ``--tensor-parallel N`` twin of the shape's core (its figures go to the shape's ``tpN`` entry)."""
    kind: str = "llama"
    """Another history kind's core of the shape (its figures go to the shape's entry of that kind)."""
    tree: str = ""
    """Another source tree whose Ignition builds the shape's core (its figures go to the shape's ``compared``
    entry); empty: this tree's."""

    @property
    def record(self) -> Path:
        return Path(self.path).with_suffix(".args.json")

    def recorded(self) -> list[str]:
        """What the record beside a built core holds: its build arguments and a digest of the Ignition sources of
        the tree that builds it (this one, or ``tree``), so a core is built again once that tree's lowering,
        kernels or recipes change rather than reused from an earlier build."""
        return [*self.arguments, f"ignition sources {ignition_digest(Path(self.tree) if self.tree else ROOT)}"]

    def reusable(self) -> bool:
        if not Path(self.path).exists() or not self.record.exists():
            return False
        with contextlib.suppress(ValueError, OSError):
            return list(json.loads(self.record.read_text())) == self.recorded()
        return False


def ignition_digest(tree: Path) -> str:
    """SHA-256 over the paths and bytes of every Python source of ``tree``'s Ignition package."""
    digest = hashlib.sha256()
    package = tree / "contrib" / "ignition" / "ignition"
    for source in sorted(package.rglob("*.py")):
        digest.update(str(source.relative_to(package)).encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()


def core_specs(plan: Plan, directory: Path, signing_key: Path) -> list[CoreSpec]:
    specs = []
    for shape in plan.shapes:
        arguments = (
            "build", "llama-synthetic", "--shape", shape, "--dtype", "bf16", "--targets", ",".join(plan.targets),
            "--max-rows", str(plan.max_rows), "--decode-rows", ",".join(map(str, plan.decode_rows)),
            "--prefill-tokens", ",".join(map(str, plan.prefill_variants)), "--context", str(plan.context),
            "--page-tokens", str(plan.page_tokens), "--namespace", NAMESPACE, "--seed", str(plan.seed),
            "--cache-dtype", plan.cache_dtype,
        )  # fmt: skip
        targets = "-".join(t.replace("_", "") for t in plan.targets)
        path = directory / f"{shape}-bf16-{targets}-r{plan.max_rows}-c{plan.context}-kv{plan.cache_dtype}.core"
        specs.append(CoreSpec(shape, str(path), (*arguments, "--sign-key", str(signing_key))))
        if plan.tensor_parallel_1:
            twin = path.with_name(path.stem + "-tp1.core")
            specs.append(
                CoreSpec(shape, str(twin), (*arguments, "--tensor-parallel", "1", "--sign-key", str(signing_key)), 1)
            )
        if plan.ranks > 1:
            ranked = path.with_name(path.stem + f"-tp{plan.ranks}.core")
            options = ("--tensor-parallel", str(plan.ranks), "--sign-key", str(signing_key))
            specs.append(CoreSpec(shape, str(ranked), (*arguments, *options), plan.ranks))
        for kind in plan.kinds:
            if kind != "llama":
                specs.append(kind_spec(plan, kind, shape, arguments, path, signing_key))
        if plan.compare_tree:
            compared = path.with_name(path.stem + "-compared.core")
            specs.append(
                CoreSpec(shape, str(compared), (*arguments, "--sign-key", str(signing_key)), tree=plan.compare_tree)
            )
    return specs


def kind_spec(
    plan: Plan, kind: str, shape: str, llama_arguments: tuple[str, ...], llama_path: Path, signing_key: Path
) -> CoreSpec:
    """The core of history kind ``kind`` measured beside ``shape``'s Llama core."""
    if kind == "window":
        arguments = (*llama_arguments, "--window", str(WINDOW_TOKENS))
        path = llama_path.with_name(llama_path.stem + f"-window{WINDOW_TOKENS}.core")
    else:
        own_shape = "tiny" if shape == "tiny" else "small"
        arguments = (
            "build", KIND_RECIPES[kind], "--shape", own_shape, "--targets", ",".join(plan.targets),
            "--max-rows", str(plan.max_rows), "--decode-rows", ",".join(map(str, plan.decode_rows)),
            "--prefill-tokens", ",".join(map(str, plan.prefill_variants)), "--context", str(plan.context),
            "--page-tokens", str(plan.page_tokens), "--namespace", NAMESPACE, "--seed", str(plan.seed),
        )  # fmt: skip
        path = llama_path.with_name(f"{kind}-{own_shape}-" + llama_path.name.split("-", 2)[2])
    return CoreSpec(shape, str(path), (*arguments, "--sign-key", str(signing_key)), kind=kind)


def spec_entry(report: Report, spec: CoreSpec) -> dict[str, Any]:
    """The report entry of a core: its shape's, or the shape's ``tpN`` entry for a tensor-parallel twin."""
    entry = report.shape(spec.shape)
    if spec.tensor_parallel:
        twin: dict[str, Any] = entry.setdefault(f"tp{spec.tensor_parallel}", {})
        return twin
    if spec.kind != "llama":
        beside: dict[str, Any] = entry.setdefault("kinds", {}).setdefault(spec.kind, {})
        return beside
    if spec.tree:
        compared: dict[str, Any] = entry.setdefault("compared", {"tree": spec.tree})
        return compared
    return entry


def spec_phase(spec: CoreSpec, phase: str) -> str:
    if spec.kind != "llama":
        return f"{spec.kind} {phase}"
    if spec.tree:
        return f"compared {phase}"
    return f"tp{spec.tensor_parallel} {phase}" if spec.tensor_parallel else phase


def build_child(spec_json: str) -> int:
    """The child process that builds one core (``--build-spec``)."""
    fields = json.loads(spec_json)
    from ignition.cli import main as ignition_main

    return int(ignition_main([*fields["arguments"], "--out", fields["path"], "--quiet"]))


def build_command(spec: CoreSpec) -> tuple[list[str], dict[str, str] | None, Path]:
    """The child process that builds ``spec``'s core: (command, environment, working folder). Another tree's
    core is built by that tree's own ``ignition.cli`` (and the ``helios_core`` it imports), first on the path."""
    if not spec.tree:
        return [sys.executable, str(Path(__file__).resolve()), "--build-spec", json.dumps(asdict(spec))], None, ROOT
    tree = Path(spec.tree)
    path = os.pathsep.join([str(tree), str(tree / "contrib" / "ignition"), os.environ.get("PYTHONPATH", "")])
    code = "import sys\nfrom ignition.cli import main\nsys.exit(main(sys.argv[1:]))"
    command = [sys.executable, "-c", code, *spec.arguments, "--out", spec.path, "--quiet"]
    return command, {**os.environ, "PYTHONPATH": path.rstrip(os.pathsep)}, tree


def keys_in(directory: Path) -> tuple[Path, Path]:
    """The signing and public key of ``directory/keys`` (made on first use)."""
    from helios_core.container.keys import generate_keys

    folder = directory / "keys"
    signing, public = folder / "signing.pem", folder / "signing.pub.pem"
    if not signing.exists():
        paths = generate_keys(folder)
        signing, public = paths["signing"], paths["public"]
    return signing, public


def build_cores(specs: Sequence[CoreSpec], report: Report) -> None:
    """Build every missing core at once in child processes; record time, size and failures."""
    running: list[tuple[CoreSpec, subprocess.Popen[str], Path, float]] = []
    for spec in specs:
        entry = spec_entry(report, spec)
        if spec.reusable():
            entry["build"] = {"reused": True, "path": spec.path, "bytes": Path(spec.path).stat().st_size}
            log(f"{spec.shape}: reusing {spec.path}")
            continue
        log_path = Path(spec.path).with_suffix(".build.log")
        command, environment, folder = build_command(spec)
        with log_path.open("w") as sink:
            child = subprocess.Popen(
                command, stdout=sink, stderr=subprocess.STDOUT, text=True, cwd=folder, env=environment
            )
        running.append((spec, child, log_path, time.monotonic()))
        log(f"{spec.shape}: building {Path(spec.path).name} (pid {child.pid})")
    waiting = list(running)
    try:
        while waiting:
            for item in list(waiting):
                spec, child, log_path, began = item
                code = child.poll()
                if code is not None:
                    waiting.remove(item)
                    _finish_build(spec, code, log_path, began, report)
            time.sleep(0.1)
    finally:
        for _, child, _, _ in waiting:
            child.terminate()
    report.save()


def _finish_build(spec: CoreSpec, code: int, log_path: Path, began: float, report: Report) -> None:
    seconds = time.monotonic() - began
    text = log_path.read_text(errors="replace")
    entry = spec_entry(report, spec)
    if code == 0 and Path(spec.path).exists():
        spec.record.write_text(json.dumps(spec.recorded()))
        size = Path(spec.path).stat().st_size
        entry["build"] = {
            "reused": False,
            "path": spec.path,
            "seconds": seconds,
            "bytes": size,
            "log": text[-2000:],
        }
        log(f"{spec.shape}: built {Path(spec.path).name} in {seconds:.1f} s ({size / 1e6:.1f} MB)")
    else:
        entry["build"] = {"reused": False, "seconds": seconds, "exit": code, "log": text[-4000:]}
        report.fail(spec.shape, spec_phase(spec, "build"), f"ignition build exited {code}: {text.strip()[-600:]}")


def cached_kernels(folder: Path) -> int:
    """The cubins in a kernel cache folder: every Triton version's folder of it (``triton-<version>/``)."""
    return sum(1 for _ in folder.rglob("*.cubin")) if folder.is_dir() else 0


def pack_kernel_cache(folder: Path) -> None:
    """``$OUT/kernel-cache.tar.gz`` from the kernel cache, when OUT is set and the archive is small enough."""
    out = os.environ.get("OUT")
    if not out or not folder.is_dir() or not any(folder.iterdir()):
        return
    target = Path(out) / "kernel-cache.tar.gz"
    with tarfile.open(target, "w:gz") as archive:
        archive.add(folder, arcname="kernel-cache")
    size = target.stat().st_size
    if size > RETURN_LIMIT:
        target.unlink()
        log(f"kernel cache archive is {size / 1e6:.1f} MB, over what comes back from $OUT; not kept")
    else:
        log(f"kernel cache ({cached_kernels(folder)} kernels) packed into {target} ({size / 1e6:.1f} MB)")


# ---------------------------------------------------------------------------------- the core's model


@dataclass(frozen=True)
class ModelFacts:
    """What the limits need, read from the core's manifest."""

    weight_bytes: int
    """Every weight buffer."""
    streamed_bytes: int
    """What one decode step reads: every weight except the gathered embedding (unless it is the LM head)."""
    embedding_row_bytes: int
    kv_bytes_per_token: int
    """Cache bytes of one token over every layer and plane."""
    layer_params: int
    """Matrix parameters of the decoder layers (each costs 2 FLOP per token)."""
    head_params: int
    sampled_size: int
    input_vocab: int

    def decode_flops(self, batch: int, context: float, attention_flops_per_ctx: int) -> float:
        return 2.0 * batch * (self.layer_params + self.head_params) + batch * context * attention_flops_per_ctx

    def prefill_flops(self, tokens: int, attention_flops_per_ctx: int) -> float:
        # The LM head runs on the last token only; causal attention sees tokens/2 positions on average.
        return 2.0 * tokens * self.layer_params + 2.0 * self.head_params + tokens * tokens / 2 * attention_flops_per_ctx


def model_facts(contract: Any) -> ModelFacts:
    from helios_core.dtypes import NUMPY_DTYPES
    from helios_core.runtime.native_model import bytes_per_page
    from helios_core.wire import manifest_pb2 as mf

    sizes: dict[str, int] = {}
    params: dict[str, int] = {}
    for decl in contract.execution.buffers:
        if decl.role == mf.BUFFER_ROLE_WEIGHTS:
            count = math.prod(int(d.size) for d in decl.shape)
            params[decl.name] = count
            sizes[decl.name] = count * NUMPY_DTYPES[decl.dtype].itemsize
    tied = "output.weight" not in sizes
    embed = sizes.get("tok_embd", 0)
    vocab_rows = _dims(contract, "tok_embd")[0] if "tok_embd" in sizes else 1
    return ModelFacts(
        weight_bytes=sum(sizes.values()),
        streamed_bytes=sum(sizes.values()) - (0 if tied else embed),
        embedding_row_bytes=embed // vocab_rows,
        kv_bytes_per_token=bytes_per_page(contract) // contract.model.cache.page_tokens,
        layer_params=sum(
            n for name, n in params.items() if name.startswith("blk.") and len(_dims(contract, name)) == 2
        ),
        head_params=params.get("output.weight", params.get("tok_embd", 0)),
        sampled_size=contract.sampled_size,
        input_vocab=int(contract.model.input_vocabulary.size) or contract.sampled_size,
    )


def read_model_facts(spec: CoreSpec, public_key: Path) -> ModelFacts:
    from helios_core.loading import TrustSettings, open_core

    verified = open_core(Path(spec.path), TrustSettings((public_key,), NAMESPACE, None), check_resources=False)
    try:
        return model_facts(verified.contract)
    finally:
        verified.close()


def _dims(contract: Any, name: str) -> list[int]:
    return [int(d.size) for d in contract.buffers[name].shape]


def attention_flops_per_context(shape: Any) -> int:
    """FLOPs of attention per (query token, context token): q.k and p.v over every head and layer."""
    return int(4 * shape.heads * shape.head_dim * shape.layers)


# ------------------------------------------------------------------------------------------ Helios


@dataclass(frozen=True)
class RoundRecord:
    """One launched round whose completion the worker read: its program, its launch and its wait (runtime clock)."""

    program: str
    launch_ns: int
    run_ns: int
    wait_begin_ns: int
    wait_end_ns: int
    staging_wait_ns: int
    """Time inside ``transport`` since the previous completion (a backend may fence a frame there too)."""


class TimedBackend:
    """Forwards to the backend, timing ``run`` (the launch) and ``completion`` (the wait for the GPU).

    Only the worker thread calls it, so the records need no lock. Consecutive completions of a decode
    chain give the round's wall time; the part of it spent inside ``completion`` (and inside
    ``transport``, which waits for the frame's previous round on the CUDA backend) is the GPU wait.
    """

    def __init__(self, inner: Any, origin_ns: int) -> None:
        self._inner = inner
        self._origin_ns = origin_ns
        self._launched: dict[int, tuple[str, int, int]] = {}
        self._staging_wait_ns = 0
        self.records: list[RoundRecord] = []

    def transport(self, frame: int) -> Any:
        begin = time.monotonic_ns()
        try:
            return self._inner.transport(frame)
        finally:
            self._staging_wait_ns += time.monotonic_ns() - begin

    def run(self, program: str, frame: int) -> None:
        begin = time.monotonic_ns()
        try:
            self._inner.run(program, frame)
        finally:
            end = time.monotonic_ns()
            self._launched[frame] = (program, begin - self._origin_ns, end - begin)

    def completion(self, frame: int) -> Any:
        begin = time.monotonic_ns()
        try:
            return self._inner.completion(frame)
        finally:
            end = time.monotonic_ns()
            program, launch, run = self._launched.pop(frame, ("", 0, 0))
            origin, staging = self._origin_ns, self._staging_wait_ns
            self.records.append(RoundRecord(program, launch, run, begin - origin, end - origin, staging))
            self._staging_wait_ns = 0

    def close(self) -> None:
        self._inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def prefill_timeline(records: Sequence[RoundRecord], submitted_ns: int, first_ns: int) -> list[dict[str, Any]]:
    """The rounds a lone request ran from its submission to its first token: each round's program, its
    launch, the time inside ``run`` and its wait for the GPU, in milliseconds after the submission."""
    return [
        {
            "program": record.program,
            "launch_ms": (record.launch_ns - submitted_ns) / 1e6,
            "run_ms": record.run_ns / 1e6,
            "wait_begin_ms": (record.wait_begin_ns - submitted_ns) / 1e6,
            "wait_end_ms": (record.wait_end_ns - submitted_ns) / 1e6,
        }
        for record in records
        if record.launch_ns >= submitted_ns and record.launch_ns <= first_ns
    ]


@dataclass(frozen=True)
class HostSpan:
    """One call of a worker phase (planning, packing, applying a completion, publishing events)."""

    phase: str
    begin_ns: int
    duration_ns: int


_HOST_PHASES = (
    ("scheduler", "next_round", "plan"),
    ("scheduler", "complete", "complete"),
    ("engine", "_publish", "publish"),
)
"""(owner, method, phase): the worker's host phases timed by :class:`RoundClock`, with every packer's ``pack``
and the backend's ``transport``, ``run`` and ``completion``."""


def host_phases(spans: Sequence[HostSpan], submitted_ns: int, first_ns: int) -> list[dict[str, Any]]:
    """The worker's host phases between a request's submission and its first token, in ms after the
    submission (each phase's calls in order; calls that took under a microsecond and did nothing of
    note, such as an empty publish, are kept: they show where the worker was)."""
    return [
        {"phase": span.phase, "begin_ms": (span.begin_ns - submitted_ns) / 1e6, "ms": span.duration_ns / 1e6}
        for span in spans
        if submitted_ns <= span.begin_ns <= first_ns
    ]


class RoundClock:
    """Puts a :class:`TimedBackend` between a running model and its backend, and times the worker's
    host phases (:data:`_HOST_PHASES`) into :attr:`spans`."""

    def __init__(self, running: Any) -> None:
        self.origin_ns = running.model.clock_origin_ns
        self.backend = TimedBackend(running.model.backend, self.origin_ns)
        running.model.backend = self.backend
        self.spans: list[HostSpan] = []
        owners = {"scheduler": running.engine.scheduler, "engine": running.engine}
        for owner, method, phase in _HOST_PHASES:
            self._time(owners[owner], method, phase)
        for packer in running.model.packers.values():
            self._time(packer, "pack", "pack")
        for method in ("transport", "run", "completion"):  # the waits for a frame's fence, and the launch
            self._time(self.backend, method, method)

    def _time(self, owner: Any, method: str, phase: str) -> None:
        """Replace ``owner.method`` by a wrapper recording each call's span (the worker's thread only)."""
        inner = getattr(owner, method)
        spans, origin = self.spans, int(self.origin_ns)

        def timed(*args: Any, **kwargs: Any) -> Any:
            begin = time.monotonic_ns()
            try:
                return inner(*args, **kwargs)
            finally:
                spans.append(HostSpan(phase, begin - origin, time.monotonic_ns() - begin))

        setattr(owner, method, timed)

    @property
    def records(self) -> list[RoundRecord]:
        return self.backend.records

    def now_ns(self) -> int:
        return time.monotonic_ns() - int(self.origin_ns)


@dataclass
class StreamResult:
    tokens: list[int] = field(default_factory=list)
    stamps_ns: list[int] = field(default_factory=list)
    finish: str = ""
    error: str = ""
    done: threading.Event = field(default_factory=threading.Event)
    """Set once the stream's last event (finished, refused or failed) is recorded."""


def record_streams(engine: Any, requests: Sequence[Any]) -> tuple[list[StreamResult], threading.Thread]:
    """Submit ``requests`` to ``engine``; one thread records every stream's tokens and timestamps, in request
    order, as they are published (returned started: it ends once every stream has ended).

    Every stream's events go to one queue that one thread empties as they are published, as a server
    reading all its streams at once would. Reading the streams one after another instead leaves the later
    streams' events queued for the whole run (a hundred thousand at 256 requests of 384 tokens): memory and
    collector passes the engine's own figures should not carry."""
    from helios_core.runtime.messages import (
        AdmissionRejected,
        ExecutionFailed,
        Finished,
        RoundTokens,
        TokenEvent,
    )

    published: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
    streams = [engine.submit(request) for request in requests]
    results = [StreamResult() for _ in streams]
    for index, stream in enumerate(streams):
        engine.redirect(stream, functools.partial(_tagged, published.put, index))

    def drain() -> None:
        left = len(streams)
        while left:
            index, event = published.get()
            result = results[index]
            if isinstance(event, RoundTokens):
                event = event.event(streams[index].request_id)
            if isinstance(event, TokenEvent):
                result.tokens.append(event.token_id)
                result.stamps_ns.append(event.timestamp_ns)
            elif isinstance(event, Finished):
                result.finish = event.reason
                result.done.set()
                left -= 1
            elif isinstance(event, AdmissionRejected | ExecutionFailed):
                result.error = f"{type(event).__name__}: {event.message}"
                result.done.set()
                left -= 1

    worker = threading.Thread(target=drain, name="gpu-decode-collect", daemon=True)
    worker.start()
    return results, worker


def collect(engine: Any, requests: Sequence[Any], timeout_s: float) -> list[StreamResult]:
    """Submit ``requests`` to ``engine`` and read every stream's tokens and timestamps, in request order
    (:func:`record_streams`); raises TimeoutError when they do not all finish in time."""
    results, worker = record_streams(engine, requests)
    deadline = time.monotonic() + timeout_s
    while worker.is_alive() and time.monotonic() < deadline:
        worker.join(0.2)
    if worker.is_alive():
        raise TimeoutError(f"{len(results)} requests did not finish within {timeout_s:.0f} s")
    failed = [r.error for r in results if r.error]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(results)} requests failed: {failed[0]}")
    return results


def _tagged(put: Callable[[tuple[int, Any]], None], index: int, event: Any) -> None:
    put((index, event))


def decode_window(results: Sequence[StreamResult], prompt: int) -> dict[str, Any]:
    """Tokens/s over the window in which every request is decoding (after its first token)."""
    begin = max(r.stamps_ns[0] for r in results)
    end = min(r.stamps_ns[-1] for r in results)
    counted = [(prompt + i) for r in results for i, t in enumerate(r.stamps_ns) if begin < t <= end]
    if end <= begin or not counted:
        raise RuntimeError("no window in which every request decodes (raise --tokens)")
    seconds = (end - begin) / 1e9
    rate = len(counted) / seconds
    return {
        "window_begin_ns": begin,
        "window_end_ns": end,
        "window_tokens": len(counted),
        "tokens_per_s": rate,
        "ms_per_step": len(results) / rate * 1000,
        "mean_context": statistics.fmean(counted),
    }


class CollectorPauses:
    """Every cyclic garbage collection of this process while installed: (generation, start ns, end ns)."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, int, int]] = []
        self._began = 0
        gc.callbacks.append(self._observe)

    def _observe(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.monotonic_ns()
        else:
            self.pauses.append((info["generation"], self._began, time.monotonic_ns()))

    def within(self, begin_ns: int, end_ns: int) -> dict[str, Any]:
        """Collections that ended in (begin, end], by generation: count, total and longest ms."""
        summary: dict[str, Any] = {}
        for generation, start, end in self.pauses:
            if begin_ns < end <= end_ns:
                entry = summary.setdefault(str(generation), {"count": 0, "total_ms": 0.0, "longest_ms": 0.0})
                entry["count"] += 1
                entry["total_ms"] += (end - start) / 1e6
                entry["longest_ms"] = max(entry["longest_ms"], (end - start) / 1e6)
        return summary


COLLECTOR_PAUSES = CollectorPauses()


def host_statistics(records: Sequence[RoundRecord], begin_ns: int, end_ns: int) -> dict[str, Any]:
    """Host time per decode round whose completion was read in (begin, end].

    A round's wall time is the time from the previous round's completion to its own; the host time
    is that minus the waits inside ``completion`` and ``transport`` (what remains is the launch,
    packing, validation and publishing).
    """
    pairs = [
        (previous, current)
        for previous, current in itertools.pairwise(records)
        if previous.program.startswith("decode")
        and current.program.startswith("decode")
        and begin_ns < current.wait_end_ns <= end_ns
    ]
    if not pairs:
        return {"rounds": 0}
    walls = [current.wait_end_ns - previous.wait_end_ns for previous, current in pairs]
    waits = [current.wait_end_ns - current.wait_begin_ns + current.staging_wait_ns for _, current in pairs]
    host = sorted((wall - wait) / 1000 for wall, wait in zip(walls, waits, strict=True))
    ordered_walls = sorted(walls)
    median_wall = statistics.median(walls)
    in_window = [r for r in records if begin_ns < r.wait_end_ns <= end_ns]
    slow = [
        {
            "index": index,
            "program": current.program,
            "wall_us": wall / 1000,
            "wait_us": wait / 1000,
            "launch_us": current.run_ns / 1000,
            "previous_program": previous.program,
        }
        for index, ((previous, current), wall, wait) in enumerate(zip(pairs, walls, waits, strict=True))
        if wall > 1.5 * median_wall
    ]
    return {
        "round_us_p90": ordered_walls[min(len(walls) - 1, int(0.9 * len(walls)))] / 1000,
        "round_us_max": ordered_walls[-1] / 1000,
        "round_us_sum": sum(walls) / 1000,
        "window_programs": dict(collections.Counter(r.program for r in in_window)),
        "slow_rounds": slow[:64],
        "slow_round_count": len(slow),
        "slow_round_us_sum": sum(item["wall_us"] for item in slow),
        "rounds": len(pairs),
        "host_us_median": statistics.median(host),
        "host_us_p90": host[min(len(host) - 1, int(0.9 * len(host)))],
        "host_us_mean": statistics.fmean(host),
        "round_us_median": statistics.median(walls) / 1000,
        "launch_us_median": statistics.median(current.run_ns for _, current in pairs) / 1000,
        "wait_us_median": statistics.median(waits) / 1000,
        "staging_wait_us_median": statistics.median(current.staging_wait_ns for _, current in pairs) / 1000,
        "wait_share": sum(waits) / sum(walls) if sum(walls) else 0.0,
        "programs": sorted({current.program for _, current in pairs}),
    }


def _window_rounds(
    records: Sequence[RoundRecord], begin_ns: int, end_ns: int
) -> Iterator[tuple[RoundRecord, int, int]]:
    """The rounds whose completion was read in (begin, end], in order: each record, its wall time (from the
    previous completion) and its GPU wait (inside ``completion`` and ``transport``), in ns."""
    for previous, current in itertools.pairwise(records):
        if begin_ns < current.wait_end_ns <= end_ns:
            wait = current.wait_end_ns - current.wait_begin_ns + current.staging_wait_ns
            yield current, current.wait_end_ns - previous.wait_end_ns, wait


def round_trace(records: Sequence[RoundRecord], begin_ns: int, end_ns: int) -> list[tuple[str, float, float]]:
    """The rounds whose completion was read in (begin, end], in order: program, wall and GPU wait in µs."""
    return [
        (record.program, wall / 1000, wait / 1000) for record, wall, wait in _window_rounds(records, begin_ns, end_ns)
    ]


def rounds_by_program(records: Sequence[RoundRecord], begin_ns: int, end_ns: int) -> dict[str, dict[str, float]]:
    """Each program's rounds whose completion was read in (begin, end]: count and medians of the wall time
    (from the previous completion; its mean and maximum too), the GPU wait (inside ``completion`` and
    ``transport``), the host time (wall less wait: planning, packing, launch, validation, publishing) and
    the launch, in µs."""
    grouped: dict[str, list[tuple[int, int, int]]] = collections.defaultdict(list)
    for record, wall, wait in _window_rounds(records, begin_ns, end_ns):
        grouped[record.program].append((wall, wait, record.run_ns))
    return {
        program: {
            "rounds": len(rounds),
            "wall_us_median": statistics.median(wall for wall, _, _ in rounds) / 1000,
            "wall_us_mean": statistics.fmean(wall for wall, _, _ in rounds) / 1000,
            "wall_us_max": max(wall for wall, _, _ in rounds) / 1000,
            "wait_us_median": statistics.median(wait for _, wait, _ in rounds) / 1000,
            "host_us_median": statistics.median(wall - wait for wall, wait, _ in rounds) / 1000,
            "launch_us_median": statistics.median(launch for _, _, launch in rounds) / 1000,
        }
        for program, rounds in sorted(grouped.items())
    }


def _requests(prefix: str, count: int, length: int, max_tokens: int, vocab: int, rng: np.random.Generator) -> list[Any]:
    from helios_core.runtime.messages import PreparedRequest, SamplingParams

    greedy = SamplingParams(temperature=0.0)
    return [
        PreparedRequest(
            f"{prefix}-{i}",
            [int(t) for t in rng.integers(0, vocab, length)],
            max_tokens,
            greedy,
            ignore_eos=True,
            observe_timestamps=True,
        )
        for i in range(count)
    ]


def wave_cache_pages(plan: Plan) -> int:
    """Cache pages for the largest decode wave with a tenth to spare, and at least one request's full context."""
    pages_per_request = -(-plan.context // plan.page_tokens)
    per_request = -(-(plan.prompt + plan.tokens) // plan.page_tokens) + 1
    return max(pages_per_request, int(plan.max_rows * per_request * 1.1) + pages_per_request)


def measure_helios(
    spec: CoreSpec, public_key: Path, plan: Plan, entry: dict[str, Any], save: Callable[[], None]
) -> None:
    """Every Helios figure of one shape into ``entry['helios']``."""
    from helios_core.contract import LoadOptions
    from helios_core.loading import TrustSettings
    from helios_core.runtime.startup import start

    label = f"{spec.shape} compared" if spec.tree else spec.shape
    pages = wave_cache_pages(plan)
    options = LoadOptions(max_active=plan.max_rows, queue_capacity=plan.max_rows, cache_pages=pages)
    helios: dict[str, Any] = {"backend": plan.backend, "cache_pages": pages, "decode": {}}
    entry["helios"] = helios
    began = time.monotonic()
    running = start(Path(spec.path), TrustSettings((public_key,), NAMESPACE, None), options, backend=plan.backend)
    helios["load_s"] = time.monotonic() - began
    log(f"{label}: Helios started on {plan.backend} in {helios['load_s']:.1f} s")
    wedged = False
    try:
        facts = model_facts(running.verified.contract)
        clock = RoundClock(running)
        engine = running.engine
        rng = np.random.default_rng(plan.seed + 11)
        vocab = facts.input_vocab
        warm = _requests("warm", 1, plan.prompt, 8, vocab, rng) + _requests("warm-p", 1, plan.prefill, 2, vocab, rng)
        collect(engine, warm, plan.timeout_s)
        for batch in plan.batches:
            with _wave_errors(helios, f"batch {batch}", label):
                helios["decode"][str(batch)] = _decode_wave(engine, clock, batch, plan, vocab, rng)
                window = helios["decode"][str(batch)]
                rounds = window["host"]
                log(
                    f"{label}: Helios batch {batch}: {window['ms_per_step']:.3f} ms/step, "
                    f"{window['tokens_per_s']:.0f} tok/s, host {rounds.get('host_us_median', -1):.0f} us/round, "
                    f"median round {rounds.get('round_us_median', -1):.0f} us, "
                    f"{rounds.get('slow_round_count', 0)} rounds over 1.5x the median "
                    f"({rounds.get('slow_round_us_sum', 0) / 1000:.1f} ms of "
                    f"{rounds.get('round_us_sum', 0) / 1000:.1f}), "
                    f"programs {rounds.get('window_programs')}, collections {rounds.get('collections')}"
                )
            save()
        with _wave_errors(helios, "prefill", label):
            ttfts, timelines, phases = [], [], []
            for index in range(plan.prefill_repeats):
                (request,) = _requests(f"prefill{index}", 1, plan.prefill, 2, vocab, rng)
                seen, seen_spans = len(clock.records), len(clock.spans)
                submitted = clock.now_ns()
                (result,) = collect(engine, [request], plan.timeout_s)
                ttfts.append((result.stamps_ns[0] - submitted) / 1e9)
                timelines.append(prefill_timeline(clock.records[seen:], submitted, result.stamps_ns[0]))
                phases.append(host_phases(clock.spans[seen_spans:], submitted, result.stamps_ns[0]))
            ttft = statistics.median(ttfts)
            helios["prefill"] = {
                "tokens": plan.prefill,
                "ttft_s": ttfts,
                "ms": ttft * 1000,
                "tokens_per_s": plan.prefill / ttft,
                "rounds": timelines,
                "host_phases": phases,
            }
            log(f"{label}: Helios prefill {plan.prefill}: {ttft * 1000:.2f} ms, {plan.prefill / ttft:.0f} tok/s")
            middle = statistics.median_low(ttfts)
            rounds = "; ".join(
                f"{r['program']} launched {r['launch_ms']:.2f} ({r['run_ms']:.2f} in run), "
                f"waited {r['wait_begin_ms']:.2f}-{r['wait_end_ms']:.2f}"
                for r in timelines[ttfts.index(middle)]
            )
            log(f"{label}: its rounds, ms after the submission: {rounds}; first token {middle * 1000:.2f}")
            worker = ", ".join(
                f"{p['phase']} {p['begin_ms']:.2f}+{p['ms']:.2f}"
                for p in phases[ttfts.index(middle)]
                if p["ms"] >= 0.005
            )
            log(f"{label}: its host phases (ms after the submission + ms taken): {worker}")
        stats = engine.statistics()
        helios["launches"] = dict(stats.launches)
        helios["pipelined_rounds"] = stats.pipelined_rounds
    except BaseException:
        wedged = True
        raise
    finally:
        save()
        _close(running, wedged)


def measure_tp1_decode(spec: CoreSpec, public_key: Path, plan: Plan, entry: dict[str, Any]) -> None:
    """Batch-1 decode of the ``--tensor-parallel 1`` core, or of another history kind's core, into ``entry``
    (the shape's ``tp1`` entry or its entry of that kind)."""
    from helios_core.contract import LoadOptions
    from helios_core.loading import TrustSettings
    from helios_core.ops.catalogue import COLLECTIVE_OPERATORS
    from helios_core.runtime.startup import start

    options = LoadOptions(max_active=plan.max_rows, queue_capacity=plan.max_rows)
    began = time.monotonic()
    running = start(Path(spec.path), TrustSettings((public_key,), NAMESPACE, None), options, backend=plan.backend)
    entry["load_s"] = time.monotonic() - began
    wedged = False
    try:
        decode = next(p for p in running.verified.contract.execution.programs if p.name == "decode_b1")
        entry["collectives_per_decode"] = sum(node.op.name in COLLECTIVE_OPERATORS for node in decode.nodes)
        clock = RoundClock(running)
        rng = np.random.default_rng(plan.seed + 11)
        vocab = model_facts(running.verified.contract).input_vocab
        collect(running.engine, _requests("warm", 1, plan.prompt, 8, vocab, rng), plan.timeout_s)
        window = _decode_wave(running.engine, clock, 1, plan, vocab, rng)
        entry["decode_b1"] = window
        what = f"{spec.kind} core" if spec.kind != "llama" else "--tensor-parallel 1"
        collectives = f" ({entry['collectives_per_decode']} collectives a step)" if spec.tensor_parallel else ""
        log(f"{spec.shape}: {what} batch 1: {window['ms_per_step']:.3f} ms/step{collectives}")
    except BaseException:
        wedged = True
        raise
    finally:
        _close(running, wedged)


def measure_ranked_decode(spec: CoreSpec, public_key: Path, plan: Plan, entry: dict[str, Any]) -> None:
    """Decode at every batch of the ``--tensor-parallel N`` core served on N ranks into ``entry`` (the shape's
    ``tpN`` entry), and on CUDA the cost of one all_reduce of each batch's activations over the N GPUs."""
    from helios_core.contract import LoadOptions
    from helios_core.loading import TrustSettings
    from helios_core.ops.catalogue import COLLECTIVE_OPERATORS
    from helios_core.runtime.startup import start

    pages = wave_cache_pages(plan)
    options = LoadOptions(max_active=plan.max_rows, queue_capacity=plan.max_rows, cache_pages=pages)
    began = time.monotonic()
    running = start(Path(spec.path), TrustSettings((public_key,), NAMESPACE, None), options, backend=plan.backend)
    entry["load_s"] = time.monotonic() - began
    entry["ranks"] = running.model.ranks
    entry["decode"] = {}
    log(f"{spec.shape}: {spec.tensor_parallel} ranks started on {plan.backend} in {entry['load_s']:.1f} s")
    wedged = False
    try:
        contract = running.verified.contract
        decode = next(p for p in contract.execution.programs if p.name == "decode_b1")
        entry["collectives_per_decode"] = sum(node.op.name in COLLECTIVE_OPERATORS for node in decode.nodes)
        clock = RoundClock(running)
        rng = np.random.default_rng(plan.seed + 11)
        vocab = model_facts(contract).input_vocab
        collect(running.engine, _requests("warm", 1, plan.prompt, 8, vocab, rng), plan.timeout_s)
        for batch in plan.batches:
            with _wave_errors(entry, f"batch {batch}", spec.shape):
                window = _decode_wave(running.engine, clock, batch, plan, vocab, rng)
                entry["decode"][str(batch)] = window
                log(
                    f"{spec.shape}: {spec.tensor_parallel} ranks batch {batch}: {window['ms_per_step']:.3f} ms/step, "
                    f"{window['tokens_per_s']:.0f} tok/s ({entry['collectives_per_decode']} collectives a step)"
                )
    except BaseException:
        wedged = True
        raise
    finally:
        _close(running, wedged)
    if plan.device == "cuda":
        hidden = _dims(contract, "tok_embd")[-1]  # the token embedding's columns
        with _wave_errors(entry, "all_reduce", spec.shape):
            entry["all_reduce_us"] = all_reduce_costs(spec.tensor_parallel, hidden, plan.batches)
            log(f"{spec.shape}: one all_reduce over {spec.tensor_parallel} GPUs, µs by batch: {entry['all_reduce_us']}")


def all_reduce_costs(
    ranks: int, hidden: int, batches: Sequence[int], calls: int = 64, repeats: int = 5
) -> dict[str, float]:
    """Microseconds of one in-place bf16 all_reduce of batch x hidden elements over GPUs 0..ranks-1, by batch:
    ``calls`` of them captured back to back into one CUDA graph a rank (as a decode step's collectives are), all
    ranks launched together, the slowest rank's graph time over ``calls`` (median of ``repeats`` launches after
    one untimed)."""
    from concurrent.futures import ThreadPoolExecutor

    from helios_core.backends.cuda_driver import open_context
    from helios_core.backends.nccl import NcclCommunicator, load_library, nccl_dtype
    from helios_core.wire import manifest_pb2 as mf

    bf16 = nccl_dtype(mf.DTYPE_BF16)
    contexts = [open_context(rank) for rank in range(ranks)]
    communicators: list[Any] = []
    costs: dict[str, float] = {}
    try:
        communicators = NcclCommunicator.group(load_library(), contexts)
        for batch in batches:
            count = batch * hidden

            def captured_on(rank: int, count: int = count) -> tuple[Any, int, Any, Any, Any]:
                # one thread a rank: an NCCL call of one rank may wait on the host for its peers' calls
                context, communicator = contexts[rank], communicators[rank]
                context.make_current()
                buffer = context.alloc(count * 2)
                context.memset(buffer, count * 2)

                def issue(stream: int) -> None:
                    for _ in range(calls):
                        communicator.all_reduce(buffer, buffer, count, bf16, stream)

                captured = context.capture(issue)
                builder = context.graph()
                builder.child(captured, None)
                return context, buffer, captured, builder, builder.instantiate()

            with ThreadPoolExecutor(max_workers=ranks) as pool:
                graphs = list(pool.map(captured_on, range(ranks)))
            _slowest_launch_ms([(context, executable) for context, _, _, _, executable in graphs])  # untimed
            times = [
                _slowest_launch_ms([(context, executable) for context, _, _, _, executable in graphs])
                for _ in range(repeats)
            ]
            costs[str(batch)] = statistics.median(times) * 1000 / calls
            for context, buffer, captured, builder, executable in graphs:
                context.make_current()
                context.destroy_graph(executable)
                builder.destroy()
                context.destroy_captured(captured)
                context.free(buffer)
    finally:
        for communicator in communicators:
            communicator.close()
        for context in contexts:
            context.close()
    return costs


def _slowest_launch_ms(graphs: Sequence[tuple[Any, Any]]) -> float:
    """Launch each rank's graph (``(context, executable)``) on its GPU, all before any is waited for: the
    milliseconds the slowest took, timed by events on its own stream."""
    events = []
    for context, executable in graphs:
        context.make_current()
        start, end = context.timing_event(), context.timing_event()
        context.record(start)
        context.launch_graph(executable)
        context.record(end)
        events.append((context, start, end))
    slowest = 0.0
    for context, start, end in events:
        context.make_current()
        context.synchronize()
        slowest = max(slowest, context.elapsed_ms(start, end))
        context.destroy_event(start)
        context.destroy_event(end)
    return slowest


def _decode_wave(
    engine: Any, clock: RoundClock, batch: int, plan: Plan, vocab: int, rng: np.random.Generator
) -> dict[str, Any]:
    """``batch`` concurrent requests of ``plan.prompt`` prompt and ``plan.tokens`` new tokens, measured."""
    requests = _requests(f"b{batch}", batch, plan.prompt, plan.tokens, vocab, rng)
    clock.records.clear()
    with ClockSamples(plan.device) as clocks:
        results = collect(engine, requests, plan.timeout_s)
    window = decode_window(results, plan.prompt)
    if (sampled := clocks.summary()) is not None:
        window["clock"] = sampled
    window["host"] = host_statistics(clock.records, window["window_begin_ns"], window["window_end_ns"])
    origin = int(clock.origin_ns)  # the window is on the runtime clock, the collections on time.monotonic_ns
    window["host"]["collections"] = COLLECTOR_PAUSES.within(
        window["window_begin_ns"] + origin, window["window_end_ns"] + origin
    )
    window["finish"] = sorted({r.finish for r in results})
    if batch == 1:
        window["prompt_ids"] = list(requests[0].prompt_ids)
        window["token_ids"] = results[0].tokens
    return window


@contextlib.contextmanager
def _wave_errors(helios: dict[str, Any], what: str, shape: str) -> Iterator[None]:
    """Record a failed wave and go on with the next; a timeout (a worker that stopped answering) ends the phase."""
    try:
        yield
    except TimeoutError:
        raise
    except Exception as exc:
        helios.setdefault("errors", {})[what] = f"{type(exc).__name__}: {exc}"
        log(f"{shape}: Helios {what} failed: {exc}")


def _close(running: Any, wedged: bool) -> None:
    """Close the model; a worker that stopped answering gets cancellations and 30 s, then is left behind."""
    if wedged:
        for request_id in list(running.engine._streams):
            running.engine.cancel(request_id)
    closer = threading.Thread(target=running.close, name="gpu-decode-close", daemon=True)
    closer.start()
    closer.join(30 if wedged else 300)
    if closer.is_alive():
        log("the Helios worker did not stop; its memory stays allocated")


# ----------------------------------------------------------------------------------- PyTorch baseline


@dataclass
class LayerWeights:
    attn_norm: Any
    qkv: Any
    wo: Any
    ffn_norm: Any
    gate_up: Any
    down: Any


@dataclass
class TorchWeights:
    embed: Any
    head: Any
    out_norm: Any
    layers: list[LayerWeights]


def load_torch_weights(spec: CoreSpec, public_key: Path, shape: Any, device: str, dtype: Any) -> TorchWeights:
    """The core's weight buffers as torch tensors on ``device`` (matrices in ``dtype``, norm gains float32).

    Packed ``attn_qkv`` / ``ffn_gate_up`` buffers are used as they are; cores without them (reference
    targets only) have their q, k, v and gate, up matrices concatenated the same way.
    """
    import torch

    from helios_core.dtypes import NUMPY_DTYPES
    from helios_core.loading import TrustSettings, open_core
    from helios_core.wire import container_pb2 as cb
    from helios_core.wire import manifest_pb2 as mf

    verified = open_core(Path(spec.path), TrustSettings((public_key,), NAMESPACE, None), check_resources=False)
    tensors: dict[str, Any] = {}
    try:
        by_resource: dict[str, list[Any]] = {}
        for decl in verified.contract.execution.buffers:
            if decl.role == mf.BUFFER_ROLE_WEIGHTS:
                by_resource.setdefault(decl.resource_id, []).append(decl)
        for resource_id, decls in by_resource.items():
            data = verified.core.read_resource(resource_id, cb.RESOURCE_KIND_WEIGHTS)
            for decl in decls:
                dims = [int(d.size) for d in decl.shape]
                stored = NUMPY_DTYPES[decl.dtype]
                array = np.frombuffer(data, dtype=stored, count=math.prod(dims), offset=int(decl.resource_offset))
                if decl.dtype == mf.DTYPE_BF16:
                    tensor = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
                else:
                    tensor = torch.from_numpy(array)
                matrix = len(dims) == 2
                tensor = tensor.reshape(dims).to(device=device, dtype=dtype if matrix else torch.float32)
                tensors[decl.name] = tensor if tensor.data_ptr() != array.ctypes.data else tensor.clone()
            del data
    finally:
        verified.close()

    def packed(fused: str, *parts: str) -> Any:
        if fused in tensors:
            return tensors.pop(fused)
        return torch.cat([tensors.pop(p) for p in parts])

    layers = []
    for layer in range(shape.layers):
        b = f"blk.{layer}."
        layers.append(
            LayerWeights(
                attn_norm=tensors.pop(b + "attn_norm.weight"),
                qkv=packed(b + "attn_qkv.weight", b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"),
                wo=tensors.pop(b + "attn_output.weight"),
                ffn_norm=tensors.pop(b + "ffn_norm.weight"),
                gate_up=packed(b + "ffn_gate_up.weight", b + "ffn_gate.weight", b + "ffn_up.weight"),
                down=tensors.pop(b + "ffn_down.weight"),
            )
        )
        expected = ((shape.heads + 2 * shape.kv_heads) * shape.head_dim, shape.hidden)
        if tuple(layers[-1].qkv.shape) != expected or tuple(layers[-1].gate_up.shape) != (2 * shape.ffn, shape.hidden):
            raise ValueError(f"layer {layer}: weights {tuple(layers[-1].qkv.shape)} do not match the shape {shape}")
    embed = tensors.pop("tok_embd")
    return TorchWeights(
        embed=embed, head=tensors.pop("output.weight", embed), out_norm=tensors.pop("output_norm.weight"), layers=layers
    )


class TorchLlama:
    """A Llama decoder in plain PyTorch over a static contiguous KV cache ``[layers, rows, kv_heads, context, hd]``.

    The residual stream is float32 (as in Helios' programs), matrix products take ``dtype`` inputs;
    RoPE uses the reference backend's frequencies ("half" pairs); decode attention is two batched
    matmuls over the whole static cache with positions past each row's masked; greedy argmax over
    the sampled vocabulary.
    """

    def __init__(self, weights: TorchWeights, shape: Any, *, rows: int, context: int, sampled: int, dtype: Any) -> None:
        import torch

        from helios_core.backends.reference_kernels import FrequencyBandScaling, rope_inv_freq

        self.w, self.s, self.dtype, self.sampled = weights, shape, dtype, sampled
        self.last_logits: Any = None  # the sampled logits of the last prefill or decode step
        device = weights.embed.device
        cache = (shape.layers, rows, shape.kv_heads, context, shape.head_dim)
        self.k_cache = torch.zeros(cache, dtype=dtype, device=device)
        self.v_cache = torch.zeros(cache, dtype=dtype, device=device)
        scaling = FrequencyBandScaling(*shape.frequency_band_scaling) if shape.frequency_band_scaling else None
        if shape.rope_style != "half":
            raise ValueError(f"the baseline implements the 'half' rope style, not {shape.rope_style!r}")
        inv_freq = rope_inv_freq(shape.head_dim, shape.rope_theta, scaling)  # [hd/2] float64
        angles = np.arange(context, dtype=np.float64)[:, None] * inv_freq[None, :]  # [context, hd/2]
        self.cos = torch.tensor(np.cos(angles).astype(np.float32), device=device)
        self.sin = torch.tensor(np.sin(angles).astype(np.float32), device=device)
        self.positions = torch.arange(context, device=device)
        self.rows = torch.arange(rows, device=device)
        self.group = shape.heads // shape.kv_heads
        self.widths = (shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.kv_heads * shape.head_dim)
        self.scale = shape.head_dim**-0.5

    @staticmethod
    def _rope(x: Any, cos: Any, sin: Any) -> Any:
        import torch

        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)

    def _norm(self, h: Any, weight: Any) -> Any:
        import torch.nn.functional as F

        return F.rms_norm(h, (self.s.hidden,), weight, self.s.rms_eps).to(self.dtype)

    def _mlp(self, h: Any, lw: LayerWeights) -> Any:
        import torch.nn.functional as F

        gate, up = F.linear(self._norm(h, lw.ffn_norm), lw.gate_up).chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, lw.down).float()

    def _head(self, h: Any) -> Any:
        import torch.nn.functional as F

        logits = F.linear(self._norm(h, self.w.out_norm), self.w.head)[..., : self.sampled]
        self.last_logits = logits
        return logits.argmax(dim=-1)

    def prefill(self, tokens: Any) -> Any:
        """``tokens`` [B, T] from position 0: fills cache positions [0, T) of rows [0, B); the next token [B]."""
        import torch.nn.functional as F

        s, rows, count = self.s, tokens.shape[0], tokens.shape[1]
        hd = s.head_dim
        h = F.embedding(tokens, self.w.embed).float()  # [B, T, hidden]
        cos, sin = self.cos[:count][None, :, None, :], self.sin[:count][None, :, None, :]  # [1, T, 1, hd/2]
        for layer, lw in enumerate(self.w.layers):
            q, k, v = F.linear(self._norm(h, lw.attn_norm), lw.qkv).split(self.widths, dim=-1)
            q = self._rope(q.float().view(rows, count, s.heads, hd), cos, sin).to(self.dtype).transpose(1, 2)
            k = self._rope(k.float().view(rows, count, s.kv_heads, hd), cos, sin).to(self.dtype).transpose(1, 2)
            v = v.reshape(rows, count, s.kv_heads, hd).transpose(1, 2)  # [B, G, T, hd]
            self.k_cache[layer, :rows, :, :count] = k
            self.v_cache[layer, :rows, :, :count] = v
            attn = F.scaled_dot_product_attention(
                q, k.repeat_interleave(self.group, dim=1), v.repeat_interleave(self.group, dim=1), is_causal=True
            )  # [B, H, T, hd]
            h = h + F.linear(attn.transpose(1, 2).reshape(rows, count, s.heads * hd), lw.wo).float()
            h = self._mlp(h, lw)
        return self._head(h[:, -1])

    def decode(self, tokens: Any, positions: Any) -> Any:
        """One token per row: ``tokens`` [B] at ``positions`` [B]; writes the cache there; the next token [B]."""
        import torch
        import torch.nn.functional as F

        s, rows = self.s, tokens.shape[0]
        hd = s.head_dim
        h = F.embedding(tokens, self.w.embed).float()  # [B, hidden]
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]  # [B, 1, hd/2]
        masked = (self.positions[None, :] > positions[:, None])[:, None, None, :]  # [B, 1, 1, context]
        index = self.rows[:rows]
        for layer, lw in enumerate(self.w.layers):
            q, k, v = F.linear(self._norm(h, lw.attn_norm), lw.qkv).split(self.widths, dim=-1)
            q = self._rope(q.float().view(rows, s.heads, hd), cos, sin).to(self.dtype)
            k = self._rope(k.float().view(rows, s.kv_heads, hd), cos, sin).to(self.dtype)
            keys, values = self.k_cache[layer, :rows], self.v_cache[layer, :rows]  # [B, G, context, hd]
            keys[index, :, positions] = k
            values[index, :, positions] = v.reshape(rows, s.kv_heads, hd)
            scores = torch.matmul(q.view(rows, s.kv_heads, self.group, hd), keys.transpose(-1, -2)).float()
            scores = (scores * self.scale).masked_fill(masked, float("-inf"))  # [B, G, group, context]
            attn = torch.matmul(torch.softmax(scores, dim=-1).to(self.dtype), values)  # [B, G, group, hd]
            h = h + F.linear(attn.reshape(rows, s.heads * hd), lw.wo).float()
            h = self._mlp(h, lw)
        return self._head(h)


def _synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def time_decode(model: TorchLlama, batch: int, plan: Plan, vocab: int, *, graph: bool) -> dict[str, Any]:
    """ms per decode step of ``batch`` rows after a prefill of ``plan.prompt`` tokens, eager or replayed."""
    import torch

    device = plan.device
    generator = torch.Generator(device="cpu").manual_seed(plan.seed + batch)
    prompt = torch.randint(0, vocab, (batch, plan.prompt), generator=generator).to(device)
    with torch.inference_mode():
        tokens = model.prefill(prompt)
        positions = torch.full((batch,), plan.prompt, dtype=torch.int64, device=device)
        step: Callable[[], None]
        if graph:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up at the same position: the replays overwrite what it writes
                    model.decode(tokens, positions)
            torch.cuda.current_stream().wait_stream(side)
            captured = torch.cuda.CUDAGraph()
            with torch.cuda.graph(captured, capture_error_mode="thread_local"):
                tokens.copy_(model.decode(tokens, positions))
                positions.add_(1)
            step = captured.replay
        else:

            def step() -> None:
                tokens.copy_(model.decode(tokens, positions))
                positions.add_(1)

        for _ in range(plan.baseline_warmup):
            step()
        _synchronize(device)
        with ClockSamples(device) as clocks:
            begin = time.perf_counter()
            for _ in range(plan.baseline_steps):
                step()
            _synchronize(device)
            seconds = time.perf_counter() - begin
    ms = seconds / plan.baseline_steps * 1000
    figures: dict[str, Any] = {
        "ms_per_step": ms,
        "tokens_per_s": batch / ms * 1000,
        "steps": plan.baseline_steps,
        "mean_context": plan.prompt + plan.baseline_warmup + (plan.baseline_steps - 1) / 2,
        "cache_context": int(model.k_cache.shape[3]),
    }
    if (sampled := clocks.summary()) is not None:
        figures["clock"] = sampled
    return figures


def time_prefill(model: TorchLlama, plan: Plan, vocab: int) -> dict[str, Any]:
    import torch

    generator = torch.Generator(device="cpu").manual_seed(plan.seed + 7)
    seconds = []
    with torch.inference_mode():
        for index in range(plan.prefill_repeats + 1):
            prompt = torch.randint(0, vocab, (1, plan.prefill), generator=generator).to(plan.device)
            _synchronize(plan.device)
            begin = time.perf_counter()
            model.prefill(prompt).cpu()
            if index:  # the first is a warm-up
                seconds.append(time.perf_counter() - begin)
    median = statistics.median(seconds)
    return {"tokens": plan.prefill, "seconds": seconds, "ms": median * 1000, "tokens_per_s": plan.prefill / median}


def greedy_agreement(model: TorchLlama, prompt: Sequence[int], expected: Sequence[int], plan: Plan) -> dict[str, Any]:
    """Eager greedy tokens for Helios' batch-1 prompt; how many leading tokens agree with Helios'.

    Besides the free-running comparison, the eager model is fed Helios' own tokens (teacher forcing):
    at every position where its argmax differs from Helios' token, the gap between the two tokens'
    eager logits says whether the difference is a near tie that rounding decides or a real one.
    """
    import torch

    count = min(plan.agreement_tokens, len(expected))
    with torch.inference_mode():
        token = model.prefill(torch.tensor([list(prompt)], device=plan.device))
        produced = [int(token.item())]
        position = torch.tensor([len(prompt)], device=plan.device)
        while len(produced) < count:
            token = model.decode(token, position)
            position += 1
            produced.append(int(token.item()))
        model.prefill(torch.tensor([list(prompt)], device=plan.device))
        gaps: list[float] = []
        forced_agreement = 0
        for index in range(count):
            logits = model.last_logits.reshape(-1).float()
            helios_token = int(expected[index])
            eager_token = int(logits.argmax().item())
            if eager_token == helios_token:
                forced_agreement += 1
            else:
                gaps.append(float((logits[eager_token] - logits[helios_token]).item()))
            if index + 1 < count:
                model.decode(
                    torch.tensor([helios_token], device=plan.device),
                    torch.tensor([len(prompt) + index], device=plan.device),
                )
        scale = float(model.last_logits.float().std().item())
    leading = next((i for i, (a, b) in enumerate(zip(produced, expected, strict=False)) if a != b), count)
    return {
        "compared": count,
        "leading_agreement": leading,
        "baseline_tokens": produced,
        "forced_agreement": forced_agreement,
        "forced_logit_gaps": gaps,
        "logit_std": scale,
    }


def agreement_summary(agreement: Mapping[str, Any]) -> str:
    """``leading/compared``, and under teacher forcing the agreeing positions and the largest logit gap."""
    text = f"{agreement['leading_agreement']}/{agreement['compared']}"
    if "forced_agreement" in agreement:
        gaps = agreement["forced_logit_gaps"]
        text += f" (fed Helios' tokens: {agreement['forced_agreement']}/{agreement['compared']}"
        if gaps:
            text += f", largest eager logit gap {max(gaps):.4f} against a logit spread of {agreement['logit_std']:.3f}"
        text += ")"
    return text


def measure_baseline(
    spec: CoreSpec, public_key: Path, plan: Plan, entry: dict[str, Any], save: Callable[[], None]
) -> None:
    """PyTorch eager and CUDA-graph figures of one shape into ``entry['baseline']``."""
    import torch
    from ignition.recipes.synthetic import SHAPES

    shape = SHAPES[spec.shape]
    dtype = torch.bfloat16 if plan.device == "cuda" else torch.float32
    baseline: dict[str, Any] = {"dtype": str(dtype), "eager": {}, "graph": {}, "errors": {}}
    entry["baseline"] = baseline
    began = time.monotonic()
    weights = load_torch_weights(spec, public_key, shape, plan.device, dtype)
    baseline["load_s"] = time.monotonic() - began
    log(f"{spec.shape}: PyTorch weights loaded in {baseline['load_s']:.1f} s")
    model_info = entry.get("model", {})
    sampled = int(model_info.get("sampled_size") or weights.embed.shape[0])
    vocab = int(model_info.get("input_vocab") or sampled)
    try:
        context = plan.prompt + plan.baseline_warmup + plan.baseline_steps + 2
        context = -(-context // 16) * 16
        model = TorchLlama(weights, shape, rows=plan.max_rows, context=context, sampled=sampled, dtype=dtype)
        for batch in plan.batches:
            for mode in ("eager", "graph"):
                if mode == "graph" and plan.device != "cuda":
                    continue
                try:
                    figures = time_decode(model, batch, plan, vocab, graph=mode == "graph")
                except Exception as exc:  # one failed configuration must not hide the others
                    baseline["errors"][f"{mode}/{batch}"] = f"{type(exc).__name__}: {exc}"
                    log(f"{spec.shape}: PyTorch {mode} batch {batch} failed: {exc}")
                    continue
                finally:
                    gc.collect()
                    if plan.device == "cuda":
                        torch.cuda.empty_cache()
                baseline[mode][str(batch)] = figures
                log(f"{spec.shape}: PyTorch {mode} batch {batch}: {figures['ms_per_step']:.3f} ms/step")
            save()
        del model
        single = TorchLlama(
            weights, shape, rows=1, context=max(plan.prefill, plan.prompt + plan.agreement_tokens) + 16,
            sampled=sampled, dtype=dtype,
        )  # fmt: skip
        baseline["prefill"] = time_prefill(single, plan, vocab)
        log(f"{spec.shape}: PyTorch eager prefill {plan.prefill}: {baseline['prefill']['ms']:.2f} ms")
        first = entry.get("helios", {}).get("decode", {}).get("1", {})
        if first.get("token_ids"):
            baseline["agreement"] = greedy_agreement(single, first["prompt_ids"], first["token_ids"], plan)
            agreement = baseline["agreement"]
            log(f"{spec.shape}: greedy agreement with Helios: {agreement_summary(agreement)}")
        del single
    finally:
        del weights
        gc.collect()
        if plan.device == "cuda":
            torch.cuda.empty_cache()
        save()


# --------------------------------------------------------------------------------------- the machine


def copy_bandwidth(device: str) -> float:
    """Median bytes/s of a large device-to-device copy, counting bytes read and written."""
    import torch

    nbytes = (1 << 30) if device == "cuda" else (1 << 27)
    source = torch.ones(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    times = []
    for _ in range(20 if device == "cuda" else 5):
        _synchronize(device)
        begin = time.perf_counter()
        target.copy_(source)
        _synchronize(device)
        times.append(time.perf_counter() - begin)
    del source, target
    return 2 * nbytes / statistics.median(times)


def matmul_rate(device: str) -> float:
    """Median FLOP/s of a large bf16 (float32 on the CPU) matrix product on random data."""
    import torch

    size = 8192 if device == "cuda" else 1024
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10 if device == "cuda" else 3):
        _synchronize(device)
        begin = time.perf_counter()
        a @ b
        _synchronize(device)
        times.append(time.perf_counter() - begin)
    return 2 * size**3 / statistics.median(times)


class ClockSamples:
    """The GPU's SM clock and board power, sampled by ``nvidia-smi`` every ``interval_ms`` while the context is
    open: a served step and a baseline are comparable only at like clocks, and sustained work may run at a lower
    clock than work with idle gaps. Without ``nvidia-smi`` (or off the GPU) it samples nothing and
    :meth:`summary` is ``None``; it never fails the measurement it surrounds."""

    def __init__(self, device: str, *, interval_ms: int = 50, gpu: int = 0) -> None:
        self.device, self.interval_ms, self.gpu = device, interval_ms, gpu
        self._process: subprocess.Popen[str] | None = None
        self._output = ""

    def __enter__(self) -> ClockSamples:
        if self.device == "cuda":
            query = ["--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"]
            command = ["nvidia-smi", "-i", str(self.gpu), *query, "-lms", str(self.interval_ms)]
            with contextlib.suppress(OSError):
                self._process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc: object) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        process.terminate()
        try:
            self._output, _ = process.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            self._output, _ = process.communicate()

    def summary(self) -> dict[str, Any] | None:
        """Samples taken, the median and lowest SM clock (MHz) and the median power (W) where reported."""
        clocks, powers = [], []
        for line in self._output.splitlines():
            fields = [part.strip() for part in line.split(",")]
            if len(fields) != 2:
                continue
            with contextlib.suppress(ValueError):
                clock = float(fields[0])
                clocks.append(clock)
                with contextlib.suppress(ValueError):
                    powers.append(float(fields[1]))
        if not clocks:
            return None
        figures: dict[str, Any] = {
            "samples": len(clocks),
            "sm_clock_mhz_median": statistics.median(clocks),
            "sm_clock_mhz_min": min(clocks),
        }
        if powers:
            figures["power_w_median"] = statistics.median(powers)
        return figures


def machine_facts(device: str) -> dict[str, Any]:
    facts: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count(), "machine": platform.machine()}
    for module in ("torch", "triton", "numpy"):
        with contextlib.suppress(Exception):
            facts[module] = __import__(module).__version__
    with contextlib.suppress(Exception):
        from importlib.metadata import version

        facts["cuda-bindings"] = version("cuda-bindings")
    if device == "cuda":
        try:
            import torch

            properties = torch.cuda.get_device_properties(0)
        except Exception as exc:  # reported again, and fatally, by the phases that need the GPU
            facts["device"] = f"unavailable: {type(exc).__name__}: {exc}"
            return facts
        facts["device"] = properties.name
        facts["multiprocessors"] = properties.multi_processor_count
        facts["device_memory"] = properties.total_memory
        facts["torch_cuda"] = torch.version.cuda
        with contextlib.suppress(Exception):
            smi = ["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem", "--format=csv,noheader"]
            facts["nvidia_smi"] = subprocess.run(smi, capture_output=True, text=True, timeout=10).stdout.strip()
    else:
        facts["device"] = platform.processor() or platform.machine()
    return facts


# ------------------------------------------------------------------------------------------- report


class Report:
    """Every number of the run, saved as JSON after every phase."""

    def __init__(self, path: Path, plan: Plan) -> None:
        self.path = path
        self.data: dict[str, Any] = {"date": str(date.today()), "plan": asdict(plan), "shapes": {}, "errors": []}

    def shape(self, name: str) -> dict[str, Any]:
        entry: dict[str, Any] = self.data["shapes"].setdefault(name, {})
        return entry

    def fail(self, shape: str, phase: str, message: str) -> None:
        self.data["errors"].append({"shape": shape, "phase": phase, "error": message})
        if shape in self.data["plan"]["shapes"]:
            self.shape(shape).setdefault("errors", {})[phase] = message
        log(f"{shape}: {phase} failed: {message.splitlines()[0] if message else ''}")
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps(self.data, indent=1, default=str))
        temporary.replace(self.path)


def limits(
    name: str, entry: Mapping[str, Any], hardware: Mapping[str, Any], batch: int, context: float
) -> dict[str, float]:
    """HBM roofline and compute floor (ms) of one decode step of ``batch`` rows at a mean ``context``."""
    from ignition.recipes.synthetic import SHAPES

    model = entry.get("model")
    if not model or name not in SHAPES or not hardware.get("copy_bytes_per_s"):
        return {}
    facts = ModelFacts(**model)
    moved = facts.streamed_bytes + batch * facts.embedding_row_bytes + batch * context * facts.kv_bytes_per_token
    flops = facts.decode_flops(batch, context, attention_flops_per_context(SHAPES[name]))
    return {
        "context": context,
        "bytes": moved,
        "hbm_ms": moved / hardware["copy_bytes_per_s"] * 1000,
        "flops": flops,
        "compute_ms": flops / hardware["matmul_flops_per_s"] * 1000,
    }


def prefill_limits(name: str, entry: Mapping[str, Any], hardware: Mapping[str, Any], tokens: int) -> dict[str, float]:
    """HBM roofline and compute floor (ms) of a ``tokens``-token prefill at batch 1."""
    from ignition.recipes.synthetic import SHAPES

    model = entry.get("model")
    if not model or name not in SHAPES or not hardware.get("copy_bytes_per_s"):
        return {}
    facts = ModelFacts(**model)
    moved = facts.streamed_bytes + tokens * (facts.embedding_row_bytes + facts.kv_bytes_per_token)
    flops = facts.prefill_flops(tokens, attention_flops_per_context(SHAPES[name]))
    return {
        "bytes": moved,
        "hbm_ms": moved / hardware["copy_bytes_per_s"] * 1000,
        "flops": flops,
        "compute_ms": flops / hardware["matmul_flops_per_s"] * 1000,
    }


HEADERS = (
    "shape", "batch", "Helios ms/step", "Helios tok/s", "tp1 ms/step", "eager ms/step", "graph ms/step",
    "HBM roofline ms", "compute floor ms", "Helios vs graph", "% of roofline", "host µs/round",
)  # fmt: skip


def _cell(value: float | None, digits: int = 3) -> str:
    if value is None or value != value:
        return "-"
    return f"{value:.{digits}f}"


def table_rows(report: Report) -> list[list[str]]:
    """One row per (shape, batch) and one prefill row per shape (then the same rows of the compared tree's core,
    if any); limits are stored back into the report."""
    hardware = report.data.get("hardware", {})
    plan = report.data["plan"]
    rows: list[list[str]] = []
    for name, entry in report.data["shapes"].items():
        baseline = entry.get("baseline", {})
        entry["limits"] = {}
        served = [(name, entry.get("helios", {}))]
        if "helios" in entry.get("compared", {}):
            served.append((f"{name} compared", entry["compared"]["helios"]))
        for label, helios in served:
            for batch in plan["batches"]:
                key = str(batch)
                ours = helios.get("decode", {}).get(key, {})
                eager = baseline.get("eager", {}).get(key, {})
                graph = baseline.get("graph", {}).get(key, {})
                context = ours.get("mean_context") or eager.get("mean_context") or plan["prompt"] + plan["tokens"] / 2
                bound = limits(name, entry, hardware, batch, context)
                if label == name:
                    entry["limits"][key] = bound
                ms = ours.get("ms_per_step")
                roof = max(bound.get("hbm_ms", 0.0), bound.get("compute_ms", 0.0)) or None
                twin = entry.get("tp1", {}).get("decode_b1", {}) if batch == 1 and label == name else {}
                rows.append(
                    [
                        label, str(batch), _cell(ms), _cell(ours.get("tokens_per_s"), 0),
                        _cell(twin.get("ms_per_step")), _cell(eager.get("ms_per_step")),
                        _cell(graph.get("ms_per_step")), _cell(bound.get("hbm_ms")), _cell(bound.get("compute_ms")),
                        f"{graph['ms_per_step'] / ms:.2f}x" if ms and graph.get("ms_per_step") else "-",
                        f"{roof / ms:.0%}" if ms and roof else "-",
                        _cell(ours.get("host", {}).get("host_us_median"), 0),
                    ]
                )  # fmt: skip
            ours, eager = helios.get("prefill", {}), baseline.get("prefill", {})
            bound = prefill_limits(name, entry, hardware, plan["prefill"])
            if label == name:
                entry["limits"]["prefill"] = bound
            roof = max(bound.get("hbm_ms", 0.0), bound.get("compute_ms", 0.0)) or None
            ms = ours.get("ms")
            rows.append(
                [
                    label, f"prefill {plan['prefill']}", _cell(ms), _cell(ours.get("tokens_per_s"), 0), "-",
                    _cell(eager.get("ms")), "-", _cell(bound.get("hbm_ms")), _cell(bound.get("compute_ms")),
                    f"{eager['ms'] / ms:.2f}x vs eager" if ms and eager.get("ms") else "-",
                    f"{roof / ms:.0%}" if ms and roof else "-", "-",
                ]
            )  # fmt: skip
        for kind, beside in entry.get("kinds", {}).items():
            window = beside.get("decode_b1", {})
            rows.append(
                [
                    f"{name} {kind}", "1", _cell(window.get("ms_per_step")), _cell(window.get("tokens_per_s"), 0),
                    "-", "-", "-", "-", "-", "-", "-", _cell(window.get("host", {}).get("host_us_median"), 0),
                ]
            )  # fmt: skip
    return rows


def compared_note(entry: Mapping[str, Any], plan: Mapping[str, Any]) -> str:
    """This tree's figures over the compared tree's, where both were measured: ``this tree / compared (DIR): b8
    0.97, b64 0.95, prefill 1.00`` (below 1: this tree is faster)."""
    compared = entry.get("compared", {})
    ours, theirs = entry.get("helios", {}), compared.get("helios", {})
    parts = []
    for batch in plan["batches"]:
        mine = ours.get("decode", {}).get(str(batch), {}).get("ms_per_step")
        other = theirs.get("decode", {}).get(str(batch), {}).get("ms_per_step")
        if mine and other:
            parts.append(f"b{batch} {mine / other:.3f}")
    mine, other = ours.get("prefill", {}).get("ms"), theirs.get("prefill", {}).get("ms")
    if mine and other:
        parts.append(f"prefill {mine / other:.3f}")
    return f"ms of this tree / the compared tree's ({compared.get('tree')}): " + ", ".join(parts) if parts else ""


def clock_note(entry: Mapping[str, Any], batches: Sequence[int]) -> str:
    """The median SM clock (and power) of each batch's Helios wave and graph baseline, where both were sampled:
    ``SM MHz (W) b256 Helios 1755 (690), graph 1980 (600)``."""
    parts = []
    for batch in batches:
        ours = entry.get("helios", {}).get("decode", {}).get(str(batch), {}).get("clock")
        graph = entry.get("baseline", {}).get("graph", {}).get(str(batch), {}).get("clock")
        if ours and graph:
            parts.append(f"b{batch} Helios {_clock_cell(ours)}, graph {_clock_cell(graph)}")
    return "SM MHz (W) " + "; ".join(parts) if parts else ""


def _clock_cell(clock: Mapping[str, Any]) -> str:
    power = clock.get("power_w_median")
    return f"{clock['sm_clock_mhz_median']:.0f}" + (f" ({power:.0f})" if power is not None else "")


def print_table(report: Report) -> None:
    data, plan = report.data, report.data["plan"]
    machine, hardware = data.get("machine", {}), data.get("hardware", {})
    copy = hardware.get("copy_bytes_per_s", 0) / 1e12
    flops = hardware.get("matmul_flops_per_s", 0) / 1e12
    print()
    print(
        f"gpu decode, {machine.get('device', '?')}, torch {machine.get('torch', '?')}, triton "
        f"{machine.get('triton', '?')}, {data['date']}; copy {copy:.2f} TB/s (read + write), matmul "
        f"{flops:.1f} TFLOP/s; prompt {plan['prompt']}, {plan['tokens']} new tokens per request, backend "
        f"{plan['backend']}, KV cache {plan.get('cache_dtype', 'f32')}"
    )
    rows = table_rows(report)
    shown = [i for i, header in enumerate(HEADERS) if header != "tp1 ms/step" or plan.get("tensor_parallel_1")]
    print("| " + " | ".join(HEADERS[i] for i in shown) + " |")
    print("| --- | --- | " + " | ".join("---:" for _ in shown[2:]) + " |")
    for row in rows:
        print("| " + " | ".join(row[i] for i in shown) + " |")
    print(
        "ms/step: Helios from per-token timestamps over the window in which every request decodes (batch 1: ms "
        "per token after the first); eager and graph: PyTorch on the same weights, static KV cache of "
        f"{plan['prompt'] + plan['baseline_warmup'] + plan['baseline_steps']}+ tokens, "
        f"{plan['baseline_steps']} timed steps. roofline = max(HBM, compute): HBM = (weights streamed + KV at "
        "the mean context) / copy bandwidth; compute = matmul FLOPs / matmul rate. host µs/round = time between "
        "consecutive decode completions minus the waits inside backend.completion and transport (median). "
        "Prefill rows: submit to first token, batch 1."
        + (
            " Rows '<shape> <kind>': batch-1 decode of a core of another history kind (recurrent-synthetic and "
            "latent-synthetic at their small shape, tiny for tiny; window: the shape with --window "
            f"{WINDOW_TOKENS})."
            if len(plan.get("kinds", ())) > 1
            else ""
        )
        + (
            " Rows '<shape> compared': the same shape built by the Ignition of "
            f"{plan['compare_tree']} and served by this tree, measured right after this tree's core (its eager "
            "and graph figures are the shared baselines)."
            if plan.get("compare_tree")
            else ""
        )
        + (
            " tp1 ms/step: the same shape built with --tensor-parallel 1 (an all_reduce after every output and down "
            "projection, each a one-rank NCCL call captured at load; one that enqueues no work adds no graph node), "
            "batch 1."
            if plan.get("tensor_parallel_1")
            else ""
        )
    )
    for name, entry in data["shapes"].items():
        notes = []
        agreement = entry.get("baseline", {}).get("agreement")
        if agreement:
            notes.append(f"greedy agreement {agreement_summary(agreement)}")
        build = entry.get("build", {})
        if build.get("seconds") is not None:
            notes.append(f"build {build['seconds']:.0f} s, {build.get('bytes', 0) / 1e6:.0f} MB")
        if entry.get("helios", {}).get("load_s") is not None:
            notes.append(f"Helios start {entry['helios']['load_s']:.1f} s")
        if entry.get("tp1", {}).get("collectives_per_decode") is not None:
            notes.append(f"tp1: {entry['tp1']['collectives_per_decode']} collectives per decode step")
        if clocks := clock_note(entry, plan["batches"]):
            notes.append(clocks)
        if against := compared_note(entry, plan):
            notes.append(against)
        for phase, error in entry.get("errors", {}).items():
            notes.append(f"{phase} FAILED: {error.splitlines()[0][:160]}")
        for key, error in entry.get("helios", {}).get("errors", {}).items():
            notes.append(f"Helios {key} FAILED: {error[:160]}")
        for key, error in entry.get("compared", {}).get("helios", {}).get("errors", {}).items():
            notes.append(f"compared Helios {key} FAILED: {error[:160]}")
        for key, error in entry.get("baseline", {}).get("errors", {}).items():
            notes.append(f"PyTorch {key} FAILED: {error[:160]}")
        if notes:
            print(f"{name}: " + "; ".join(notes))
    if plan.get("ranks", 1) > 1:
        print_ranks_table(report)
    print(f"JSON: {report.path}")


RANK_HEADERS = (
    "shape", "batch", "1 rank ms/step", "N ranks ms/step", "N ranks / 1 rank", "graph ms/step", "N ranks vs graph",
    "all_reduce µs", "all_reduces a step", "all_reduce share",
)  # fmt: skip


def rank_rows(report: Report) -> list[list[str]]:
    """One row per (shape, batch) of the ``--ranks N`` twin beside the shape's one-rank and graph figures."""
    plan = report.data["plan"]
    rows: list[list[str]] = []
    for name, entry in report.data["shapes"].items():
        ranked = entry.get(f"tp{plan['ranks']}", {})
        for batch in plan["batches"]:
            key = str(batch)
            one = entry.get("helios", {}).get("decode", {}).get(key, {}).get("ms_per_step")
            many = ranked.get("decode", {}).get(key, {}).get("ms_per_step")
            graph = entry.get("baseline", {}).get("graph", {}).get(key, {}).get("ms_per_step")
            each = ranked.get("all_reduce_us", {}).get(key)
            calls = ranked.get("collectives_per_decode")
            share = each * calls / 1000 / many if each is not None and calls and many else None
            rows.append(
                [
                    name, key, _cell(one), _cell(many), f"{many / one:.2f}" if one and many else "-", _cell(graph),
                    f"{graph / many:.2f}x" if graph and many else "-", _cell(each, 1),
                    str(calls) if calls is not None else "-", f"{share:.0%}" if share is not None else "-",
                ]
            )  # fmt: skip
    return rows


def print_ranks_table(report: Report) -> None:
    ranks = report.data["plan"]["ranks"]
    print()
    print(f"tensor-parallel ranks: each shape built with --tensor-parallel {ranks} and served on {ranks} ranks")
    print("| " + " | ".join(h.replace("N ranks", f"{ranks} ranks") for h in RANK_HEADERS) + " |")
    print("| --- | --- | " + " | ".join("---:" for _ in RANK_HEADERS[2:]) + " |")
    for row in rank_rows(report):
        print("| " + " | ".join(row) + " |")
    print(
        f"1 rank and graph: the table above (the same weights on one GPU); {ranks} ranks: the same decode waves on "
        f"the --tensor-parallel {ranks} core. all_reduce µs: one in-place bf16 all_reduce of batch x hidden over "
        f"{ranks} GPUs, 64 captured back to back in one graph a rank, slowest rank, median of 5; share: all_reduces "
        f"a step x its cost / the {ranks}-rank step."
    )
    for name, entry in report.data["shapes"].items():
        for key, error in entry.get(f"tp{ranks}", {}).get("errors", {}).items():
            print(f"{name}: {ranks} ranks {key} FAILED: {error[:160]}")


# --------------------------------------------------------------------------------------------- main


def default_out() -> Path:
    out = os.environ.get("OUT")
    return Path(out) / "gpu_decode.json" if out else Path("gpu_decode.json")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--shapes", help="comma-separated synthetic shapes (default 135m,1b,8b; cpu: tiny)")
    parser.add_argument("--cores", type=Path, help="folder to reuse cores from and build missing ones into")
    parser.add_argument("--out", type=Path, help="JSON of every number (default $OUT/gpu_decode.json or ./)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: check the script")
    parser.add_argument("--backend", help="Helios backend (default cuda; cpu: reference)")
    parser.add_argument("--targets", help="core targets (default reference,sm_90a; cpu: reference)")
    parser.add_argument("--batches", help="decode batch sizes (default 1,8,64,256; cpu: 1,8)")
    parser.add_argument("--prompt", type=int, help="decode prompt tokens (default 32)")
    parser.add_argument("--tokens", type=int, help="new tokens per decode request (default 128)")
    parser.add_argument("--prefill", type=int, help="prefill prompt tokens (default 512)")
    parser.add_argument("--context", type=int, help="core context tokens (default 1024)")
    parser.add_argument("--baseline-steps", type=int, help="timed PyTorch decode steps (default 64)")
    parser.add_argument("--baseline-warmup", type=int, help="untimed PyTorch decode steps first (default 8)")
    parser.add_argument("--prefill-repeats", type=int, help="prefill measurements, median taken (default 9)")
    parser.add_argument("--agreement-tokens", type=int, help="greedy tokens compared with Helios (default 32)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds for one wave of requests")
    parser.add_argument("--budget", type=float, default=540.0, help="start no new phase after this many seconds")
    parser.add_argument("--seed", type=int, default=0, help="weight seed of the cores")
    parser.add_argument(
        "--tensor-parallel-1",
        action="store_true",
        help="also build each shape with --tensor-parallel 1 and report its batch-1 decode beside the plain core",
    )
    parser.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="N >= 2: also build each shape with --tensor-parallel N and report its decode on N ranks (N GPUs)",
    )
    parser.add_argument(
        "--kinds",
        default="llama",
        help="history kinds: llama plus any of recurrent,latent,window, each a batch-1 decode row per shape",
    )
    parser.add_argument(
        "--cache-dtype",
        choices=("f32", "bf16"),
        default="bf16",
        help="storage type of the Llama cores' key and value cache planes (default bf16, as the baseline's)",
    )
    parser.add_argument(
        "--compare-tree",
        help="another checkout whose Ignition also builds each shape's core, measured beside this tree's core",
    )
    parser.add_argument("--build-spec", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.build_spec:
        return build_child(args.build_spec)
    plan = make_plan(args)
    from ignition.recipes.synthetic import SHAPES

    unknown = [s for s in plan.shapes if s not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown shapes {unknown}; known: {', '.join(SHAPES)}")
    os.environ.setdefault("IGNITION_KERNEL_CACHE", str(KERNEL_CACHE))
    kernel_cache = Path(os.environ["IGNITION_KERNEL_CACHE"])
    report = Report(args.out or default_out(), plan)

    def on_sigterm(signum: int, frame: Any) -> None:
        raise Interrupted()

    signal.signal(signal.SIGTERM, on_sigterm)
    with contextlib.ExitStack() as stack:
        # absolute: another tree's build (--compare-tree) runs in that tree
        cores = (args.cores or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gpu-decode-")))).resolve()
        cores.mkdir(parents=True, exist_ok=True)
        try:
            run(plan, cores, kernel_cache, report)
        except (Interrupted, KeyboardInterrupt):
            report.data["errors"].append({"shape": "-", "phase": "run", "error": "interrupted"})
            log("interrupted: printing what finished")
        finally:
            report.save()
            print_table(report)
            report.save()
    failed = report.data["errors"] or any(
        entry.get(phase, {}).get("errors")
        for entry in report.data["shapes"].values()
        for phase in ("helios", "baseline")
    )
    return 1 if failed else 0


def run(plan: Plan, cores: Path, kernel_cache: Path, report: Report) -> None:
    log(f"plan: shapes {','.join(plan.shapes)}, batches {plan.batches}, device {plan.device}, cores in {cores}")
    log(f"kernel cache {kernel_cache}: {cached_kernels(kernel_cache)} kernels")
    signing, public = keys_in(cores)
    specs = core_specs(plan, cores, signing)
    report.data["machine"] = machine_facts(plan.device)
    build_cores(specs, report)
    pack_kernel_cache(kernel_cache)
    try:
        bandwidth, rate = copy_bandwidth(plan.device), matmul_rate(plan.device)
    except Exception as exc:  # without the limits the measurements still stand
        report.fail("-", "hardware", f"{type(exc).__name__}: {exc}")
    else:
        report.data["hardware"] = {"copy_bytes_per_s": bandwidth, "matmul_flops_per_s": rate}
        log(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s (read + write), matmul {rate / 1e12:.1f} TFLOP/s")
    report.save()
    compared = {spec.shape: spec for spec in specs if spec.tree}
    for spec in specs:
        entry = report.shape(spec.shape)
        if spec.tree:
            continue  # measured beside its shape's core, below
        if spec.tensor_parallel or spec.kind != "llama":
            if spec_phase(spec, "build") in entry.get("errors", {}):
                continue
            if time.monotonic() - STARTED > plan.budget_s:
                report.fail(spec.shape, spec_phase(spec, "decode"), f"skipped: past the {plan.budget_s:.0f} s budget")
                continue
            try:
                measure = measure_ranked_decode if spec.tensor_parallel > 1 else measure_tp1_decode
                measure(spec, public, plan, spec_entry(report, spec))
            except (Interrupted, KeyboardInterrupt):
                raise
            except Exception as exc:  # the plain core's figures stand without it
                report.fail(spec.shape, spec_phase(spec, "decode"), f"{type(exc).__name__}: {exc}")
            finally:
                gc.collect()
            table_rows(report)
            report.save()
            continue
        if "build" in entry.get("errors", {}):
            continue
        try:
            entry["model"] = asdict(read_model_facts(spec, public))
        except Exception as exc:  # the phases below report the same failure in their own words
            report.fail(spec.shape, "manifest", f"{type(exc).__name__}: {exc}")
        # the compared tree's core right after this tree's, both before the baselines they share
        phases: list[tuple[str, CoreSpec, dict[str, Any], Callable[..., None]]] = [
            ("helios", spec, entry, measure_helios)
        ]
        twin = compared.get(spec.shape)
        if twin is not None and spec_phase(twin, "build") not in entry.get("errors", {}):
            phases.append((spec_phase(twin, "helios"), twin, spec_entry(report, twin), measure_helios))
        phases.append(("baseline", spec, entry, measure_baseline))
        for phase, measured, into, measure in phases:
            if time.monotonic() - STARTED > plan.budget_s:
                report.fail(spec.shape, phase, f"skipped: past the {plan.budget_s:.0f} s budget")
                continue
            try:
                measure(measured, public, plan, into, report.save)
            except (Interrupted, KeyboardInterrupt):
                raise
            except Exception as exc:  # one failed phase must not hide the others
                report.fail(spec.shape, phase, f"{type(exc).__name__}: {exc}")
            finally:
                gc.collect()
        table_rows(report)
        report.save()


if __name__ == "__main__":
    sys.exit(main())
