"""History drafting against plain decode on synthetic Llama shapes: tokens per round, acceptance, speed.

For each shape of ``--shapes`` (default 1b) it builds one bf16 ``reference,sm_90a`` core (bf16 key and value
cache planes) with ``--speculative history --draft-tokens 7`` (speculative widths 1, 2, 4 and 8; decode rows 1, 8, 64
and 256; or reuses it from ``--cores DIR``) and measures, in one run, Helios on that core twice:
without history drafting (plain decode) and with it. The workload repeats earlier text so that
copied proposals can hold: each request's prompt is ``p + c + p``, where ``p`` is a random prompt
and ``c`` the model's own greedy continuation of ``p`` (generated first, without drafting), and it
asks for ``len(c)`` new tokens. For each batch (that many concurrent requests, greedy,
``ignore_eos``) it reports tokens/s over the window in which every request decodes, milliseconds
per emitted token of one request, and with drafting the emitted tokens per lane per speculative
round, the acceptance rate (accepted / offered proposals) and whether the tokens equal plain
decode's. With ``--payoff`` it starts the core a third time, drafting with ``--speculation-payoff`` (it
speculates only while speculative rounds measure faster than decode rounds), and adds its tokens per second
and speedup over plain decode to the table. Each wave's log line gives, for each program, its rounds in the
window and the medians of their wall time (from the previous completion), GPU wait and host time.

    tools/gpu_run.sh python3 benchmarks/speculative.py --shapes 1b --batches 1,8,64,256 --budget 240
    python benchmarks/speculative.py --backend reference --shapes tiny    # checks the script on the CPU

It prints progress lines, one markdown table at the end, and writes every number as JSON to
``--out`` (default ``$OUT/speculative.json`` when ``OUT`` is set, else ``./speculative.json``),
rewritten after every phase. Cores build in child processes with the kernel cache of
``$IGNITION_KERNEL_CACHE`` (default ``build/kernel-cache``; packed into ``$OUT`` like
``gpu_decode.py`` does). ``--budget`` bounds the run: no new phase starts after that many seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "contrib" / "ignition"))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_decode  # noqa: E402  (the builds, stream collection and report of the decode benchmark)
from gpu_decode import CoreSpec, Interrupted, Report, log  # noqa: E402

NAMESPACE = gpu_decode.NAMESPACE
KERNEL_CACHE = gpu_decode.KERNEL_CACHE
DRAFT_TOKENS = 7
"""Proposals the widest round verifies (widths 1, 2, 4 and 8)."""


@dataclass(frozen=True)
class Plan:
    """What one run measures."""

    shapes: tuple[str, ...]
    backend: str
    targets: tuple[str, ...]
    batches: tuple[int, ...]
    prompt: int
    tokens: int
    context: int
    page_tokens: int
    draft_tokens: int
    timeout_s: float
    budget_s: float
    seed: int
    kind: str = "history"
    """``history`` (copied proposals, served with --history-drafting) or ``self-draft`` (in-graph drafts)."""
    workload_passes: int = 3
    """Generation passes that make the repeat workload (:func:`make_workload`)."""
    payoff: bool = False
    """Also measure drafting with ``--speculation-payoff`` (speculate only while it measures faster)."""

    @property
    def modes(self) -> tuple[str, ...]:
        """The models started, in order: plain decode, drafting, and drafting with the payoff measure."""
        return ("plain", "drafting", "payoff") if self.payoff else ("plain", "drafting")

    @property
    def max_rows(self) -> int:
        return max(self.batches)

    @property
    def decode_rows(self) -> tuple[int, ...]:
        return tuple(sorted({1, *self.batches}))

    @property
    def workload_prompt(self) -> int:
        """Tokens of a measured request's prompt: prompt, continuation, prompt."""
        return 2 * self.prompt + self.tokens

    @property
    def prefill_variants(self) -> tuple[int, ...]:
        return tuple(sorted({self.prompt, self.workload_prompt}))


def make_plan(args: argparse.Namespace) -> Plan:
    cpu = args.backend == "reference"

    def pick(value: Any, gpu: Any, reference: Any) -> Any:
        return value if value is not None else (reference if cpu else gpu)

    batches = tuple(sorted({int(b) for b in pick(args.batches, "1,8,64,256", "1,2").split(",") if b.strip()}))
    plan = Plan(
        shapes=tuple(s.strip() for s in pick(args.shapes, "1b", "tiny").split(",") if s.strip()),
        backend=args.backend,
        targets=tuple(pick(args.targets, "reference,sm_90a", "reference").split(",")),
        batches=batches,
        prompt=pick(args.prompt, 32, 12),
        tokens=pick(args.tokens, 128, 16),
        context=pick(args.context, 1024, 128),
        page_tokens=16,
        draft_tokens=args.draft_tokens,
        timeout_s=args.timeout,
        budget_s=args.budget,
        seed=args.seed,
        kind=args.kind,
        workload_passes=args.workload_passes,
        payoff=args.payoff,
    )
    if plan.workload_passes < 1:
        raise SystemExit("--workload-passes must be at least 1")
    if not batches or min(batches) <= 0 or plan.prompt <= 0 or plan.tokens < 4 or plan.draft_tokens < 1:
        raise SystemExit("batches, prompt and --draft-tokens must be positive and --tokens at least 4")
    if plan.workload_prompt + plan.tokens + plan.draft_tokens + 1 > plan.context:
        raise SystemExit(
            f"2 x prompt + 2 x tokens + draft tokens ({plan.workload_prompt + plan.tokens + plan.draft_tokens}) "
            f"must fit the context of {plan.context}"
        )
    return plan


def core_specs(plan: Plan, directory: Path, signing_key: Path) -> list[CoreSpec]:
    specs = []
    for shape in plan.shapes:
        arguments = (
            "build", "llama-synthetic", "--shape", shape, "--dtype", "bf16", "--targets", ",".join(plan.targets),
            "--max-rows", str(plan.max_rows), "--decode-rows", ",".join(map(str, plan.decode_rows)),
            "--prefill-tokens", ",".join(map(str, plan.prefill_variants)), "--context", str(plan.context),
            "--page-tokens", str(plan.page_tokens), "--namespace", NAMESPACE, "--seed", str(plan.seed),
            "--speculative", plan.kind, "--draft-tokens", str(plan.draft_tokens), "--cache-dtype", "bf16",
        )  # fmt: skip
        targets = "-".join(t.replace("_", "") for t in plan.targets)
        kind = "" if plan.kind == "history" else "-selfdraft"
        name = f"{shape}-bf16-{targets}-r{plan.max_rows}-c{plan.context}-d{plan.draft_tokens}{kind}-kvbf16.core"
        specs.append(CoreSpec(shape, str(directory / name), (*arguments, "--sign-key", str(signing_key))))
        if plan.kind == "self-draft":  # the same draft with room for every ceiling: fixed-width speculation
            fixed = name.replace(".core", "-fixed.core")
            arguments = (*arguments, "--proposal-budget", "full", "--sign-key", str(signing_key))
            specs.append(CoreSpec(f"{shape} fixed width", str(directory / fixed), arguments))
    return specs


# ------------------------------------------------------------------------------------------ workload


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, vocab, length)] for _ in range(count)]


def repeating_workload(prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]]) -> list[list[int]]:
    """Each prompt ``p`` with its continuation ``c``: ``p + c + p`` (history drafting then finds ``c``)."""
    return [[*p, *c, *p] for p, c in zip(prompts, continuations, strict=True)]


def make_workload(
    prompts: Sequence[Sequence[int]], generate: Callable[[list[Any]], Sequence[Any]], plan: Plan
) -> tuple[list[list[int]], list[float]]:
    """The repeat workload and, per pass after the first, the fraction of continuation tokens equal to
    the pass before's.

    Pass 1 generates each prompt's continuation ``c1`` (greedy, no drafting); pass ``i + 1`` the
    continuation of ``p + c_i + p``. The workload is ``p + c_n + p`` for the last pass ``n``: asking it
    again repeats text the model has just produced from nearly the same context, the case history
    drafting serves (a model rewriting or quoting earlier output). The agreements say how close the
    passes came to a fixed point; the measured acceptance is reported beside the speed either way.
    """
    continuations = [list(r.tokens) for r in generate(_requests("continue", prompts, plan.tokens))]
    agreement: list[float] = []
    for index in range(1, plan.workload_passes):
        requests = _requests(f"pass{index}", repeating_workload(prompts, continuations), plan.tokens)
        following = [list(r.tokens) for r in generate(requests)]
        pairs = zip(continuations, following, strict=True)
        same = sum(a == b for old, new in pairs for a, b in zip(old, new, strict=True))
        agreement.append(same / max(sum(len(c) for c in continuations), 1))
        continuations = following
    return repeating_workload(prompts, continuations), agreement


def _requests(prefix: str, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[Any]:
    from helios_core.runtime.messages import PreparedRequest, SamplingParams

    greedy = SamplingParams(temperature=0.0)
    return [
        PreparedRequest(f"{prefix}-{i}", list(p), max_tokens, greedy, ignore_eos=True, observe_timestamps=True)
        for i, p in enumerate(prompts)
    ]


SPECULATION_COUNTERS = ("speculative_lanes", "proposals_offered", "drafts_accepted", "speculative_emitted")


def speculation_totals(stats: Any) -> dict[str, int]:
    """The engine's speculation counters, summed over widths."""
    return {name: int(sum(getattr(stats, name).values())) for name in SPECULATION_COUNTERS}


def speculation_summary(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, Any]:
    """Tokens per round and acceptance from two readings of :func:`speculation_totals`."""
    delta = {name: after[name] - before[name] for name in SPECULATION_COUNTERS}
    lanes, offered = delta["speculative_lanes"], delta["proposals_offered"]
    return {
        **delta,
        "tokens_per_round": delta["speculative_emitted"] / lanes if lanes else None,
        "acceptance": delta["drafts_accepted"] / offered if offered else None,
    }


# ------------------------------------------------------------------------------------------- measure


def _start(spec: CoreSpec, public_key: Path, plan: Plan, mode: str) -> Any:
    from helios_core.contract import LoadOptions
    from helios_core.loading import TrustSettings
    from helios_core.runtime.startup import start

    per_request = -(-(plan.workload_prompt + plan.tokens + plan.draft_tokens + 1) // plan.page_tokens) + 1
    pages = int(plan.max_rows * per_request * 1.1) + per_request
    drafting = mode != "plain"
    options = LoadOptions(
        max_active=plan.max_rows,
        queue_capacity=plan.max_rows,
        cache_pages=pages,
        history_drafting=drafting and plan.kind == "history",
        speculative_width=None if drafting else 1,  # width one: plain decode rounds only
        speculation_payoff=mode == "payoff",
    )
    return start(Path(spec.path), TrustSettings((public_key,), NAMESPACE, None), options, backend=plan.backend)


def measure_mode(
    spec: CoreSpec,
    public_key: Path,
    plan: Plan,
    entry: dict[str, Any],
    save: Callable[[], None],
    mode: str,
) -> None:
    """One model (``plain``, ``drafting`` or ``payoff``): the workload (made first, by the first model
    started), then each batch."""
    result: dict[str, Any] = {"batches": {}}
    entry[mode] = result
    began = time.monotonic()
    running = _start(spec, public_key, plan, mode)
    result["load_s"] = time.monotonic() - began
    log(f"{spec.shape}: Helios ({mode}) started on {plan.backend} in {result['load_s']:.1f} s")
    wedged = False
    try:
        engine = running.engine
        clock = gpu_decode.RoundClock(running)
        vocab = running.verified.contract.sampled_size
        if "workload" not in entry:
            prompts = random_prompts(plan.max_rows, plan.prompt, vocab, plan.seed + 17)
            entry["workload"], entry["workload_agreement"] = make_workload(
                prompts, lambda requests: gpu_decode.collect(engine, requests, plan.timeout_s),
                plan,
            )  # fmt: skip
            agreement = ", ".join(f"{a:.2f}" for a in entry["workload_agreement"])
            log(
                f"{spec.shape}: workload of {len(prompts)} prompts of {plan.workload_prompt} tokens made in "
                f"{plan.workload_passes} passes (agreement of each pass with the one before: {agreement or '-'})"
            )
            save()
        workload: list[list[int]] = entry["workload"]
        gpu_decode.collect(engine, _requests("warm", workload[:1], 8), plan.timeout_s)
        for batch in plan.batches:
            if time.monotonic() - gpu_decode.STARTED > plan.budget_s:
                result.setdefault("errors", {})[f"batch {batch}"] = f"skipped: past the {plan.budget_s:.0f} s budget"
                log(f"{spec.shape}: {mode} batch {batch} skipped (budget)")
                continue
            before = speculation_totals(engine.statistics())
            clock.records.clear()
            try:
                outcome = gpu_decode.collect(
                    engine, _requests(f"{mode}-b{batch}", workload[:batch], plan.tokens), plan.timeout_s
                )
                window = gpu_decode.decode_window(outcome, plan.workload_prompt)
            except TimeoutError:
                wedged = True
                raise
            except Exception as exc:
                result.setdefault("errors", {})[f"batch {batch}"] = f"{type(exc).__name__}: {exc}"
                log(f"{spec.shape}: {mode} batch {batch} failed: {exc}")
                continue
            window["speculation"] = speculation_summary(before, speculation_totals(engine.statistics()))
            window["tokens"] = [r.tokens for r in outcome]
            window["rounds"] = gpu_decode.rounds_by_program(
                clock.records, window["window_begin_ns"], window["window_end_ns"]
            )
            window["trace"] = gpu_decode.round_trace(clock.records, window["window_begin_ns"], window["window_end_ns"])
            result["batches"][str(batch)] = window
            spec_note = ""
            if mode != "plain":
                s = window["speculation"]
                spec_note = f", {_fmt(s['tokens_per_round'], 2)} tokens/round, acceptance {_fmt(s['acceptance'], 2)}"
                stretches = engine.statistics().speculation_stretches
                if stretches:
                    spec_note += f", stretches so far {dict(stretches)}"
            rounds = "; ".join(
                f"{program} x{r['rounds']}: wall {r['wall_us_median']:.0f} (mean {r['wall_us_mean']:.0f}, "
                f"max {r['wall_us_max']:.0f}) wait {r['wait_us_median']:.0f} "
                f"host {r['host_us_median']:.0f} launch {r['launch_us_median']:.0f}"
                for program, r in window["rounds"].items()
            )
            log(
                f"{spec.shape}: {mode} batch {batch}: {window['ms_per_step']:.3f} ms/token, "
                f"{window['tokens_per_s']:.0f} tok/s{spec_note}; rounds (median µs) {rounds}"
            )
            save()
    except BaseException:
        wedged = True
        raise
    finally:
        save()
        gpu_decode._close(running, wedged)


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


# ---------------------------------------------------------------------------------------- the table

HEADERS = (
    "shape",
    "batch",
    "plain tok/s",
    "plain ms/token",
    "drafting tok/s",
    "drafting ms/token",
    "tokens/round",
    "acceptance",
    "speedup",
    "same tokens",
)


PAYOFF_HEADERS = ("payoff tok/s", "payoff speedup")
"""Columns of ``--payoff``: drafting with the payoff measure, and its tokens per second over plain decode's."""


def table_rows(report: Report) -> list[list[str]]:
    rows = []
    with_payoff = any("payoff" in entry for entry in report.data["shapes"].values())
    for shape, entry in report.data["shapes"].items():
        plain = entry.get("plain", {}).get("batches", {})
        drafting = entry.get("drafting", {}).get("batches", {})
        payoff = entry.get("payoff", {}).get("batches", {})
        for batch in sorted({*plain, *drafting, *payoff}, key=int):
            p, d = plain.get(batch, {}), drafting.get(batch, {})
            speculation = d.get("speculation", {})
            speedup = d["tokens_per_s"] / p["tokens_per_s"] if p and d else None
            same = "-"
            if p and d:
                equal = sum(a == b for a, b in zip(p["tokens"], d["tokens"], strict=True))
                same = f"{equal}/{len(p['tokens'])}"
            rows.append(
                [
                    shape,
                    batch,
                    _fmt(p.get("tokens_per_s"), 0),
                    _fmt(p.get("ms_per_step")),
                    _fmt(d.get("tokens_per_s"), 0),
                    _fmt(d.get("ms_per_step")),
                    _fmt(speculation.get("tokens_per_round"), 2),
                    _fmt(speculation.get("acceptance"), 2),
                    "-" if speedup is None else f"{speedup:.2f}x",
                    same,
                    *(_payoff_cells(p, payoff.get(batch, {})) if with_payoff else []),
                ]
            )
    return rows


def _payoff_cells(plain: Mapping[str, Any], payoff: Mapping[str, Any]) -> list[str]:
    speedup = payoff["tokens_per_s"] / plain["tokens_per_s"] if plain and payoff else None
    return [_fmt(payoff.get("tokens_per_s"), 0), "-" if speedup is None else f"{speedup:.2f}x"]


def markdown_table(report: Report) -> str:
    headers = HEADERS
    if any("payoff" in entry for entry in report.data["shapes"].values()):
        headers = (*HEADERS, *PAYOFF_HEADERS)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines.extend("| " + " | ".join(row) + " |" for row in table_rows(report))
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------- main


def default_out() -> Path:
    out = os.environ.get("OUT")
    return Path(out) / "speculative.json" if out else Path("speculative.json")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--shapes", help="comma-separated synthetic shapes (default 1b; reference: tiny)")
    parser.add_argument("--cores", type=Path, help="folder to reuse cores from and build missing ones into")
    parser.add_argument("--out", type=Path, help="JSON of every number (default $OUT/speculative.json or ./)")
    parser.add_argument("--backend", choices=("cuda", "reference"), default="cuda", help="reference: check the script")
    parser.add_argument("--targets", help="core targets (default reference,sm_90a; reference backend: reference)")
    parser.add_argument("--batches", help="concurrent requests per wave (default 1,8,64,256; reference: 1,2)")
    parser.add_argument("--prompt", type=int, help="random prompt tokens p (default 32)")
    parser.add_argument("--tokens", type=int, help="continuation and new tokens per request (default 128)")
    parser.add_argument("--context", type=int, help="core context tokens (default 1024)")
    parser.add_argument("--draft-tokens", type=int, default=DRAFT_TOKENS, help="proposals per round (default 7)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for one wave of requests")
    parser.add_argument("--budget", type=float, default=540.0, help="start no new phase after this many seconds")
    parser.add_argument("--seed", type=int, default=0, help="weight seed of the cores")
    parser.add_argument(
        "--workload-passes", type=int, default=3, help="passes p -> c, p + c + p -> c' ... that make the workload"
    )
    parser.add_argument(
        "--payoff",
        action="store_true",
        help="also measure drafting with --speculation-payoff (speculate only while it measures faster)",
    )
    parser.add_argument(
        "--kind",
        choices=("history", "self-draft"),
        default="history",
        help="speculation measured: history drafting, or the core's in-graph draft (first layers, greedy)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    plan = make_plan(args)
    from ignition.recipes.synthetic import SHAPES

    unknown = [s for s in plan.shapes if s not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown shapes {unknown}; known: {', '.join(SHAPES)}")
    os.environ.setdefault("IGNITION_KERNEL_CACHE", str(KERNEL_CACHE))
    kernel_cache = Path(os.environ["IGNITION_KERNEL_CACHE"])
    report = Report(args.out or default_out(), plan)  # type: ignore[arg-type]

    def on_sigterm(signum: int, frame: Any) -> None:
        raise Interrupted()

    signal.signal(signal.SIGTERM, on_sigterm)
    with contextlib.ExitStack() as stack:
        cores = args.cores or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="speculative-")))
        cores.mkdir(parents=True, exist_ok=True)
        try:
            run(plan, cores, kernel_cache, report)
        except (Interrupted, KeyboardInterrupt):
            report.data["errors"].append({"shape": "-", "phase": "run", "error": "interrupted"})
            log("interrupted: printing what finished")
        finally:
            for entry in report.data["shapes"].values():
                entry.pop("workload", None)  # large and reproducible from the seed
            report.data["table"] = markdown_table(report)
            report.save()
            print(report.data["table"], flush=True)
    failed = report.data["errors"] or any(
        entry.get(mode, {}).get("errors") for entry in report.data["shapes"].values() for mode in ("plain", "drafting")
    )
    return 1 if failed else 0


def run(plan: Plan, cores: Path, kernel_cache: Path, report: Report) -> None:
    log(f"plan: shapes {','.join(plan.shapes)}, batches {plan.batches}, backend {plan.backend}, cores in {cores}")
    log(f"kernel cache {kernel_cache}: {gpu_decode.cached_kernels(kernel_cache)} kernels")
    signing, public = gpu_decode.keys_in(cores)
    specs = core_specs(plan, cores, signing)
    gpu_decode.build_cores(specs, report)
    gpu_decode.pack_kernel_cache(kernel_cache)
    for spec in specs:
        entry = report.shape(spec.shape)
        if "build" in entry.get("errors", {}):
            continue
        for phase in plan.modes:
            if time.monotonic() - gpu_decode.STARTED > plan.budget_s:
                report.fail(spec.shape, phase, f"skipped: past the {plan.budget_s:.0f} s budget")
                continue
            try:
                measure_mode(spec, public, plan, entry, report.save, phase)
            except (Interrupted, KeyboardInterrupt):
                raise
            except Exception as exc:  # one failed phase must not hide the other
                report.fail(spec.shape, phase, f"{type(exc).__name__}: {exc}")
            finally:
                gc.collect()
        report.save()


if __name__ == "__main__":
    sys.exit(main())
