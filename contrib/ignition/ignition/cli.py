"""The ``ignition`` command line: build cores from recipes.

Owns argument parsing, the checks of every option before any key is made or
weight read (numbers, names, the namespace, the options a recipe does not take,
the third-party parser identifiers, the output path), key handling for signing
and the progress display. Errors, an interrupt (Ctrl-C) included, print one
line and exit non-zero.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import stat
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from helios_core.cli import parse_command_line
from helios_core.contract import THIRD_PARTY_IDENTIFIERS
from helios_core.contract.prepared import REQUIRED_TOOL_PARSER
from helios_core.errors import HeliosError
from helios_core.wire import contract_pb2 as ct
from ignition.recipes.llama import (
    CACHE_DTYPES,
    DRAFT_SAMPLING_KINDS,
    PROPOSAL_BUDGETS,
    SPECULATION_KINDS,
    Capacities,
    speculative_widths,
)
from ignition.recipes.smollm2 import TOOL_SYNTAXES as SMOLLM2_TOOL_SYNTAXES
from ignition.recipes.synthetic import OWN_REASONING_SYNTAXES, REASONING_KINDS, TOOL_SYNTAXES

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from helios_core.wire.contract_pb2 import ServingContract

RECIPES = ("llama-synthetic", "smollm2-135m-instruct", "recurrent-synthetic", "latent-synthetic", "vision-synthetic")

DEFAULT_SHAPE = "tiny"
"""The ``--shape`` of the synthetic recipes when none is given."""

CONTRACT_FIELD_MAX = 2**32 - 1
"""The largest value of a capacity the serving contract stores (32-bit fields)."""

EXIT_ERROR = 1
"""The exit status of a refused option, a failed build and an interrupt (argparse's usage errors exit 2)."""

_THIRD_PARTY_RANGE = f"{THIRD_PARTY_IDENTIFIERS.start}-{THIRD_PARTY_IDENTIFIERS.stop - 1}"
"""The plugin identifiers reserved for third-party implementations, as the options' messages write them."""


class ProgressBar:
    """A one-line progress display on stderr for long steps."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._last = 0.0

    def __call__(self, step: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if done < total and now - self._last < 0.1:
            return
        self._last = now
        width = 30
        filled = width * done // max(total, 1)
        bar = "#" * filled + "-" * (width - filled)
        end = "\n" if done >= total else ""
        sys.stderr.write(f"\r{step:<28} [{bar}] {done * 100 // max(total, 1):3d}%{end}")
        sys.stderr.flush()


def _int_tuple(text: str) -> tuple[int, ...]:
    """An integer-list option's value: comma-separated, distinct positive integers. An argparse type, so
    argparse refuses anything else as a usage error naming the option (``argument --prefill-tokens: ...``)."""
    parts = text.split(",")
    if "" in parts:
        raise argparse.ArgumentTypeError(f"empty entry in {text!r}; expected comma-separated positive integers")
    try:
        values = tuple(int(part) for part in parts)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    repeated = next((value for index, value in enumerate(values) if value in values[:index]), None)
    if repeated is not None:
        raise argparse.ArgumentTypeError(f"{repeated} is given twice in {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    from ignition import __version__

    parser = argparse.ArgumentParser(prog="ignition", description="Build signed Helios cores from recipes.")
    parser.add_argument("--version", action="version", version=f"ignition {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build a core from a recipe")
    build.add_argument("recipe", choices=RECIPES)
    build.add_argument(
        "--out",
        type=Path,
        required=True,
        help="core file to write (a regular file or a new path; written through a symbolic link to its target)",
    )
    build.add_argument(
        "--shape",
        help=f"synthetic shape name (default {DEFAULT_SHAPE}; llama-synthetic, recurrent-synthetic, latent-synthetic, "
        "vision-synthetic)",
    )
    build.add_argument(
        "--seed",
        type=int,
        help="weight seed (default 0; llama-synthetic, recurrent-synthetic, latent-synthetic, vision-synthetic)",
    )
    build.add_argument("--sign-key", type=Path, help="Ed25519 private key PEM; a new key is made if omitted")
    build.add_argument(
        "--namespace",
        default="local/unreviewed",
        help="publisher namespace to sign (printable, not empty, no leading or trailing whitespace; "
        "default %(default)s)",
    )
    build.add_argument(
        "--format",
        dest="layout",
        choices=("payload", "logical-v6", "logical-v4"),
        default="payload",
        help="core file layout (default %(default)s)",
    )
    build.add_argument("--core-key", type=Path, help="AES-256 core key file (logical-v4)")
    build.add_argument(
        "--targets", default="reference", help="comma-separated targets (reference, sm_90a; default %(default)s)"
    )
    build.add_argument(
        "--dtype", choices=("f32", "bf16"), default="f32", help="weight storage type (default %(default)s)"
    )
    build.add_argument(
        "--cache-dtype",
        choices=tuple(CACHE_DTYPES),
        default="f32",
        help="storage type of the key and value cache planes (bf16 halves the bytes attention reads; "
        "default %(default)s)",
    )
    build.add_argument(
        "--max-rows", type=int, default=8, help="captured concurrency (decode rows; default %(default)s)"
    )
    build.add_argument("--decode-rows", type=_int_tuple, help="decode variants (default: powers of two)")
    build.add_argument(
        "--prefill-tokens", type=_int_tuple, default=(16, 64), help="prefill variants (packed tokens; default 16,64)"
    )
    build.add_argument("--page-tokens", type=int, default=16, help="tokens a cache page holds (default %(default)s)")
    build.add_argument("--cache-pages", type=int, default=256, help="working-set cache pages (default %(default)s)")
    build.add_argument("--context", type=int, default=512, help="context tokens per request (default %(default)s)")
    build.add_argument(
        "--extra-special",
        help="comma-separated extra special tokens, each a new token (llama-synthetic)",
    )
    build.add_argument(
        "--tool-syntax",
        choices=TOOL_SYNTAXES,
        default="none",
        help=(
            "tool-call syntax (llama-synthetic: any; smollm2-135m-instruct and vision-synthetic: none or "
            "json-tags; recurrent-synthetic and latent-synthetic: none)"
        ),
    )
    build.add_argument(
        "--reasoning",
        choices=REASONING_KINDS,
        default="none",
        help=(
            "reasoning syntax (llama-synthetic with --tool-syntax none or json-tags: think-tags adds <think> and "
            "</think> tokens, think-tag reasoning and a template with an enable_thinking switch; "
            f"{' and '.join(OWN_REASONING_SYNTAXES)} carry their own reasoning; the other recipes: none)"
        ),
    )
    build.add_argument(
        "--speculative",
        choices=SPECULATION_KINDS,
        help=(
            "add speculative programs (history: verify proposals copied by the server; self-draft: draft "
            "in the graph with the target's first layers)"
        ),
    )
    build.add_argument(
        "--draft-tokens",
        type=int,
        help="proposals a speculative round can verify (N >= 1): widths 1, 2, 4, 8 up to N + 1",
    )
    build.add_argument(
        "--draft-layers",
        type=int,
        help="with --speculative self-draft: the target layers that draft (default: all but the last)",
    )
    build.add_argument(
        "--draft-sampling",
        choices=DRAFT_SAMPLING_KINDS,
        help=(
            "with --speculative self-draft: greedy drafts (default) or drafts sampled from the draft's "
            "distribution and verified by speculative sampling"
        ),
    )
    build.add_argument(
        "--proposal-budget",
        choices=PROPOSAL_BUDGETS,
        help=(
            "with --speculative self-draft: P of each program, half of the proposal rows (default: the "
            "device allocates them by confidence) or full (B x W: fixed-width speculation)"
        ),
    )
    build.add_argument(
        "--window",
        type=int,
        default=0,
        help="sliding-window attention: every layer attends to the last N positions (targets reference and "
        "sm_90a; default 0: no window)",
    )
    build.add_argument(
        "--tokens-per-record",
        type=int,
        default=1,
        help="latent-synthetic: tokens a stored latent record stands for (a divisor of --page-tokens)",
    )
    build.add_argument(
        "--page-offset",
        type=int,
        default=0,
        help="latent-synthetic: attention reads its pages through a page-table view shifted by N columns",
    )
    build.add_argument(
        "--layout",
        dest="image_layout",
        help=(
            "vision-synthetic: the image preparation and layout, tiles (default), dynamic, or a third-party "
            "layout id in 100000-199999 (with the tiles preparation and tensors)"
        ),
    )
    build.add_argument(
        "--tool-parser",
        metavar="ID",
        help=(
            f"a third-party tool parser id in {_THIRD_PARTY_RANGE} the core selects instead of the one "
            "--tool-syntax selects (the tokens, template and syntax data stay those of --tool-syntax)"
        ),
    )
    build.add_argument(
        "--reasoning-parser",
        metavar="ID",
        help=(
            f"a third-party reasoning parser id in {_THIRD_PARTY_RANGE} the core selects instead of the one "
            "--tool-syntax or --reasoning selects (none unless recipient-header, xtml or --reasoning think-tags)"
        ),
    )
    build.add_argument(
        "--tensor-parallel",
        type=int,
        metavar="N",
        help=(
            "llama-synthetic and smollm2-135m-instruct: a core of N tensor-parallel ranks with collectives "
            "(each rank holds ceil(KV/N) key-value heads and ceil(F/N) feed-forward rows, the surplus zero-padded; "
            "refused where a rank would hold padding only; 1 keeps the collectives on one rank)"
        ),
    )
    build.add_argument(
        "--engram",
        action="store_true",
        help=(
            "llama-synthetic: a hashed n-gram memory table staged by the host each round and added to the "
            "residual stream after the embedding (decode programs take host-fed pending tokens)"
        ),
    )
    build.add_argument("--quiet", action="store_true", help="no progress display")
    return parser


def _decode_variants(max_rows: int) -> tuple[int, ...]:
    rows = [1]
    while rows[-1] * 2 < max_rows:
        rows.append(rows[-1] * 2)
    if rows[-1] != max_rows:
        rows.append(max_rows)
    return tuple(rows)


def run_build(args: argparse.Namespace) -> int:
    from helios_core.container.keys import generate_keys, load_core_key, load_private_key

    progress = ProgressBar(enabled=not args.quiet and sys.stderr.isatty())
    _check_numbers(args)
    _check_recipe_options(args)
    _check_namespace(args.namespace)
    targets = _names("--targets", args.targets, "target")
    _check_compiler(targets)
    widths: tuple[int, ...] = ()
    if args.speculative is not None:
        if args.draft_tokens is None:
            raise HeliosError(f"--speculative {args.speculative} needs --draft-tokens N (N >= 1)")
        widths = speculative_widths(args.draft_tokens)
    elif args.draft_tokens is not None:
        raise HeliosError("--draft-tokens needs --speculative history or self-draft")
    if args.draft_layers is not None and args.speculative != "self-draft":
        raise HeliosError("--draft-layers needs --speculative self-draft")
    if args.draft_sampling is not None and args.speculative != "self-draft":
        raise HeliosError("--draft-sampling needs --speculative self-draft")
    if args.proposal_budget is not None and args.speculative != "self-draft":
        raise HeliosError("--proposal-budget needs --speculative self-draft")
    if args.draft_layers is not None and args.draft_layers < 1:
        raise HeliosError(f"--draft-layers must be at least 1, got {args.draft_layers}")
    caps = Capacities(
        max_rows=args.max_rows,
        prefill_tokens=tuple(sorted(args.prefill_tokens)),
        decode_rows=args.decode_rows or _decode_variants(args.max_rows),
        page_tokens=args.page_tokens,
        cache_pages=args.cache_pages,
        context=args.context,
        speculative_widths=widths,
        speculation=args.speculative or "history",
        draft_tokens=args.draft_tokens or 0,
        draft_layers=args.draft_layers or 0,
        draft_sampling=args.draft_sampling or "greedy",
        proposal_budget=args.proposal_budget or "half",
        window=args.window,
        cache_dtype=args.cache_dtype,
        engram=args.engram,
    )
    if args.engram and args.recipe != "llama-synthetic":
        raise HeliosError("--engram belongs to llama-synthetic")
    if args.engram and args.speculative is not None:
        raise HeliosError(
            "--engram cannot be combined with --speculative: speculative programs read a device-owned pending "
            "token, and the host hashes every input id"
        )
    from ignition.build import check_speculative_targets, check_window

    check_speculative_targets(caps, targets)  # before reading any weights
    check_window(caps, targets)
    if args.recipe in ("recurrent-synthetic", "latent-synthetic"):
        _check_recurrent_options(args, targets)
    elif args.tokens_per_record != 1 or args.page_offset:
        raise HeliosError("--tokens-per-record and --page-offset belong to latent-synthetic")
    if args.recipe == "vision-synthetic":
        _check_vision_options(args, caps, targets)
    elif args.image_layout is not None:
        raise HeliosError("--layout belongs to vision-synthetic")
    if max(caps.decode_rows) != caps.max_rows:
        raise HeliosError(f"--decode-rows must include --max-rows {caps.max_rows}")
    _check_tensor_parallel(args)
    if args.recipe == "smollm2-135m-instruct" and args.tool_syntax not in SMOLLM2_TOOL_SYNTAXES:
        raise HeliosError(
            f"--tool-syntax {args.tool_syntax} is not available for smollm2-135m-instruct "
            f"(choose {' or '.join(SMOLLM2_TOOL_SYNTAXES)})"
        )
    extra: tuple[str, ...] = ()
    if args.recipe == "llama-synthetic":
        from ignition.recipes.synthetic import check_extra_special, check_reasoning

        if args.extra_special is not None:
            extra = _names("--extra-special", args.extra_special, "token")
        try:
            check_reasoning(args.reasoning, args.tool_syntax)
            check_extra_special(extra, args.tool_syntax, args.reasoning)
        except ValueError as error:
            raise HeliosError(str(error)) from error
    if args.recipe == "llama-synthetic" and args.draft_layers is not None:
        from ignition.recipes.synthetic import SHAPES

        shape = SHAPES.get(args.shape)
        if shape is not None and args.draft_layers > shape.layers:
            raise HeliosError(
                f"--draft-layers must lie in [1, {shape.layers}] (the target's layers), got {args.draft_layers}"
            )
    parsers = _plugin_parsers(args)
    out = _output_path(args.out)
    if args.sign_key is None:
        key_dir = args.out.with_name(args.out.name + ".keys")
        if (key_dir / "signing.pem").exists():
            signing_key = load_private_key(key_dir / "signing.pem")
            print(f"signed with the key in {key_dir}", file=sys.stderr)
        else:
            paths = generate_keys(key_dir)
            signing_key = load_private_key(paths["signing"])
            print(f"signed with a new key; public key: {paths['public']}", file=sys.stderr)
    else:
        signing_key = load_private_key(args.sign_key)
    core_key = load_core_key(args.core_key) if args.core_key else None
    if args.layout == "logical-v4" and core_key is None:
        raise HeliosError("--format logical-v4 needs --core-key (make one with `helios keys generate`)")

    from ignition.build import CoreWriteError

    recipe = RecipeBuild(args, out, caps, targets, parsers, signing_key, core_key, progress)
    try:
        if args.recipe in ("recurrent-synthetic", "latent-synthetic"):
            return _build_recurrent(recipe)
        if args.recipe == "vision-synthetic":
            return _build_vision(recipe)
        return _build_llama(recipe, extra)
    except CoreWriteError as error:  # named for --out, not for the writer's hidden temporary file
        raise HeliosError(f"--out {_out_name(args.out, out)} cannot be written: {error.strerror}") from error


@dataclasses.dataclass(frozen=True)
class RecipeBuild:
    """What building a recipe's core takes once every option is checked: the options, the file ``--out``
    writes, the capacities, targets and third-party parsers, the keys and the progress display."""

    args: argparse.Namespace
    out: Path
    caps: Capacities
    targets: tuple[str, ...]
    parsers: PluginParsers
    signing_key: Ed25519PrivateKey
    core_key: bytes | None
    progress: ProgressBar


@dataclasses.dataclass(frozen=True)
class PluginParsers:
    """The third-party parsers ``--tool-parser`` and ``--reasoning-parser`` select (None: the one
    ``--tool-syntax`` selects)."""

    tool_parser: int | None = None
    reasoning_parser: int | None = None

    def frontend(self, frontend: ct.FrontendContract | None) -> ct.FrontendContract | None:
        """The recipe's ``frontend`` (None: no tool or reasoning syntax) with these parsers selected; the
        recipe's own when none is."""
        if self.tool_parser is None and self.reasoning_parser is None:
            return frontend
        from ignition.preparation.frontend import with_parsers

        return with_parsers(frontend, tool_parser=self.tool_parser, reasoning_parser=self.reasoning_parser)


def _build_llama(recipe: RecipeBuild, extra: tuple[str, ...]) -> int:
    """``ignition build llama-synthetic`` or ``smollm2-135m-instruct``."""
    args, progress = recipe.args, recipe.progress
    if args.recipe == "llama-synthetic":
        from ignition.recipes.synthetic import synthetic_declaration

        model = synthetic_declaration(
            args.shape, seed=args.seed, extra_special=extra, tool_syntax=args.tool_syntax, reasoning=args.reasoning
        )
    else:
        from ignition.recipes.smollm2 import smollm2_declaration

        model = smollm2_declaration(progress=progress, tool_syntax=args.tool_syntax)
    model.frontend = recipe.parsers.frontend(model.frontend)

    from ignition.build import build_core

    started = time.monotonic()
    serving = build_core(
        model,
        recipe.out,
        caps=recipe.caps,
        signing_key=recipe.signing_key,
        namespace=args.namespace,
        layout=args.layout,
        core_key=recipe.core_key,
        bf16=args.dtype == "bf16",
        targets=recipe.targets,
        progress=progress,
        tensor_parallel=args.tensor_parallel or 0,
    )
    _report_written(args, serving, started)
    return 0


def _check_numbers(args: argparse.Namespace) -> None:
    """Refuse, before anything else, a number no build can use, naming its option: a capacity below 1,
    a page of more tokens than the context (its cache planes would hold tokens no request has), a
    negative seed, and any extent past what the serving contract's 32-bit fields hold (the options
    with rules of their own, such as ``--window`` or ``--draft-tokens``, are checked where those rules
    are)."""
    capacities = [
        ("--max-rows", args.max_rows),
        ("--page-tokens", args.page_tokens),
        ("--cache-pages", args.cache_pages),
        ("--context", args.context),
    ]
    for option, value in capacities:
        if value < 1:
            raise HeliosError(f"{option} must be a positive integer, got {value}")
    if args.page_tokens > args.context:
        raise HeliosError(
            f"--page-tokens must be at most --context {args.context} (a page holds tokens of one request), "
            f"got {args.page_tokens}"
        )
    if args.seed is not None and args.seed < 0:
        raise HeliosError(f"--seed must be a non-negative integer, got {args.seed}")
    bounded: list[tuple[str, int | None]] = [
        *capacities,
        ("--prefill-tokens", max(args.prefill_tokens)),
        ("--decode-rows", max(args.decode_rows or (1,))),
        ("--draft-tokens", args.draft_tokens),
        ("--draft-layers", args.draft_layers),
        ("--window", args.window),
        ("--tokens-per-record", args.tokens_per_record),
        ("--page-offset", args.page_offset),
        ("--tensor-parallel", args.tensor_parallel),
    ]
    for option, bound in bounded:
        if bound is not None and bound > CONTRACT_FIELD_MAX:
            raise HeliosError(f"{option} must be at most {CONTRACT_FIELD_MAX}, got {bound}")


def _check_recipe_options(args: argparse.Namespace) -> None:
    """Refuse the synthetic recipes' options for ``smollm2-135m-instruct`` (its shape, weights, tokenizer
    and template come from its GGUF), then give the synthetic recipes their default shape and seed."""
    if args.recipe == "smollm2-135m-instruct":
        _refuse_options(
            args.recipe,
            ("--shape", args.shape is not None),
            ("--seed", args.seed is not None),
            ("--extra-special", args.extra_special is not None),
            (f"--reasoning {args.reasoning}", args.reasoning != "none"),
        )
    if args.shape is None:
        args.shape = DEFAULT_SHAPE
    if args.seed is None:
        args.seed = 0


def _check_namespace(namespace: str) -> None:
    """Refuse a publisher namespace an operator could not type back: operators accept a core by passing
    its namespace, compared exactly (no whitespace trimming), so it must be non-empty printable text
    without leading or trailing whitespace."""
    if not namespace:
        raise HeliosError("--namespace must not be empty")
    if namespace != namespace.strip():
        raise HeliosError(f"--namespace must not begin or end with whitespace, got {namespace!r}")
    if not namespace.isprintable():
        raise HeliosError(f"--namespace must be printable text, got {namespace!r}")


def _names(option: str, text: str, what: str) -> tuple[str, ...]:
    """The comma-separated names of ``option``, refusing an empty one and one given twice."""
    names = tuple(text.split(","))
    if "" in names:
        raise HeliosError(f"{option} has an empty {what} name in {text!r}")
    repeated = next((name for index, name in enumerate(names) if name in names[:index]), None)
    if repeated is not None:
        raise HeliosError(f"{option} names {repeated!r} twice")
    return names


_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _output_path(out: Path) -> Path:
    """The file ``--out`` writes: ``out`` itself, or the file a symbolic link ``out`` leads to (the core is
    written to a temporary file in that file's directory, then renamed over it). The directory is tried
    with a file made and removed at once, so a directory no one may write (``/proc``, ``/sys``, a
    read-only mount, which even root cannot) is refused before any key is made.

    Raises:
        HeliosError: ``out`` (or what it leads to) exists and is not a regular file, its directory does
            not exist or cannot be written, or its symbolic links loop.
    """
    try:
        target = out.resolve()
    except (OSError, RuntimeError) as error:  # RuntimeError: a symbolic-link loop (Python 3.11)
        raise HeliosError(f"--out {out} cannot be resolved: {error}") from error
    named = _out_name(out, target)
    try:
        mode = target.stat().st_mode
    except FileNotFoundError:
        mode = None
    except OSError as error:
        raise HeliosError(f"--out {named} cannot be examined: {error.strerror}") from error
    if mode is not None and not stat.S_ISREG(mode):
        kind = next((kind for test, kind in _FILE_KINDS if test(mode)), "not a regular file")
        raise HeliosError(f"--out {named} is {kind}; name a core file to write")
    directory = target.parent
    if not directory.is_dir():
        raise HeliosError(f"--out {named}: the directory {directory} does not exist")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise HeliosError(f"--out {named}: the directory {directory} is not writable")
    try:
        handle, probe = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".probe", dir=directory)
    except OSError as error:
        raise HeliosError(
            f"--out {named}: the directory {directory} cannot be written: {error.strerror or error}"
        ) from error
    os.close(handle)
    os.unlink(probe)
    return target


def _out_name(out: Path, target: Path) -> str:
    """``--out`` as its messages name it: the path given, and the file it leads to when it is a link."""
    return f"{out} (a link to {target})" if out.is_symlink() else str(out)


def _plugin_identifier(option: str, text: str | None, kind: str) -> int | None:
    """The third-party ``kind`` identifier ``option`` gives (None when it is not given).

    Raises:
        HeliosError: the text is not an integer in the third-party range.
    """
    if text is None:
        return None
    try:
        identifier = int(text)
    except ValueError:
        identifier = 0
    if identifier not in THIRD_PARTY_IDENTIFIERS:
        raise HeliosError(f"{option} must be a third-party {kind} id in {_THIRD_PARTY_RANGE}, got {text!r}")
    return identifier


def _plugin_parsers(args: argparse.Namespace) -> PluginParsers:
    """The third-party parsers ``--tool-parser`` and ``--reasoning-parser`` select, checked before any key
    or weight is touched: identifiers in the third-party range, and never one of a pair of parsers that
    share frames without the other (the reasoning and tool parsers of ``--tool-syntax recipient-header``
    and ``xtml``: the contract requires that reasoning parser's tool parser).

    Raises:
        HeliosError: an identifier outside the range, or one parser of such a pair replaced alone.
    """
    parsers = PluginParsers(
        tool_parser=_plugin_identifier("--tool-parser", args.tool_parser, "tool parser"),
        reasoning_parser=_plugin_identifier("--reasoning-parser", args.reasoning_parser, "reasoning parser"),
    )
    if (parsers.tool_parser is None) == (parsers.reasoning_parser is None):
        return parsers  # both replaced, or neither: no pair is split
    from ignition.recipes.synthetic import tool_syntax_frontend

    frontend = tool_syntax_frontend(args.tool_syntax)
    if frontend is not None and REQUIRED_TOOL_PARSER.get(frontend.reasoning_parser) == frontend.tool_parser:
        raise HeliosError(
            f"--tool-syntax {args.tool_syntax} pairs the reasoning parser "
            f"{ct.ReasoningParser.Name(frontend.reasoning_parser)} with the tool parser "
            f"{ct.ToolParser.Name(frontend.tool_parser)} (they share frames); give both --tool-parser and "
            "--reasoning-parser, or neither"
        )
    return parsers


TENSOR_PARALLEL_RECIPES = ("llama-synthetic", "smollm2-135m-instruct")
"""The recipes ``--tensor-parallel`` builds."""


def _check_tensor_parallel(args: argparse.Namespace) -> None:
    """Refuse, before any key or weight is touched, ``--tensor-parallel`` for another recipe, below 1,
    or so large that a rank would hold zero padding only (SmolLM2's shape comes from the GGUF's
    metadata)."""
    ranks = args.tensor_parallel
    if ranks is None:
        return
    if args.recipe not in TENSOR_PARALLEL_RECIPES:
        raise HeliosError(f"--tensor-parallel belongs to {' and '.join(TENSOR_PARALLEL_RECIPES)}, not {args.recipe}")
    from ignition.recipes.llama import check_tensor_parallel

    if ranks < 1:
        raise HeliosError(f"--tensor-parallel must be at least 1 (the ranks), got {ranks}")
    if args.recipe == "llama-synthetic":
        from ignition.recipes.synthetic import SHAPES

        shape = SHAPES.get(args.shape)
        if shape is None:
            return  # the recipe names the unknown shape
        model = f"llama-synthetic shape {args.shape!r}"
    else:
        from ignition.recipes.smollm2 import smollm2_shape

        shape, model = smollm2_shape(), args.recipe
    try:
        check_tensor_parallel(shape, ranks, model)
    except ValueError as error:
        raise HeliosError(str(error)) from error


def _refuse_options(recipe: str, *options: tuple[str, bool]) -> None:
    """Refuse every ``(option, given)`` pair that was given, naming them all in one error."""
    refused = [option for option, given in options if given]
    if refused:
        raise HeliosError(f"{recipe} does not take {', '.join(refused)}")


def _check_compiler(targets: tuple[str, ...]) -> None:
    """A GPU target needs Triton to compile its kernels (the ``gpu`` extra): refused now, by name, not when
    the first kernel is lowered."""
    import importlib.util

    gpu = [target for target in targets if target != "reference"]
    if gpu and importlib.util.find_spec("triton") is None:
        raise HeliosError(
            f"--targets {','.join(gpu)} needs Triton to compile kernels, which is not installed: "
            "pip install 'helios-ignition[gpu]' (or, from a checkout, pip install -e 'contrib/ignition[gpu]')"
        )


def _check_recurrent_options(args: argparse.Namespace, targets: tuple[str, ...]) -> None:
    """Refuse, before any key or weight is touched, the options the recurrent and latent recipes do not
    take (the latent recipe: every option it has no programs for)."""
    from ignition.recipes.latent import check_latent_options, check_latent_targets
    from ignition.recipes.recurrent import check_recurrent_targets

    _refuse_options(
        args.recipe,
        ("--speculative", args.speculative is not None),
        ("--window", bool(args.window)),
        ("--tool-syntax", args.tool_syntax != "none"),
        ("--extra-special", args.extra_special is not None),
        (f"--reasoning {args.reasoning}", args.reasoning != "none"),
        ("--dtype bf16", args.dtype == "bf16"),
        ("--cache-dtype bf16", args.cache_dtype == "bf16"),
        ("--tokens-per-record", args.recipe != "latent-synthetic" and args.tokens_per_record != 1),
        ("--page-offset", args.recipe != "latent-synthetic" and bool(args.page_offset)),
    )
    if args.recipe == "latent-synthetic":
        check_latent_targets(targets)
        try:
            check_latent_options(args.tokens_per_record, args.page_tokens, args.page_offset)
        except ValueError as error:
            raise HeliosError(str(error)) from error
    else:
        check_recurrent_targets(targets)


def _build_recurrent(recipe: RecipeBuild) -> int:
    """``ignition build recurrent-synthetic`` or ``latent-synthetic`` (options checked by
    :func:`_check_recurrent_options`)."""
    from ignition.recipes.latent import build_latent_core, latent_declaration
    from ignition.recipes.recurrent import build_recurrent_core, recurrent_declaration

    args = recipe.args
    started = time.monotonic()
    try:
        if args.recipe == "latent-synthetic":
            latent = latent_declaration(
                args.shape, seed=args.seed, tokens_per_record=args.tokens_per_record, page_offset=args.page_offset
            )
            latent = dataclasses.replace(latent, frontend=recipe.parsers.frontend(latent.frontend))
            build = functools.partial(build_latent_core, latent, caps=dataclasses.replace(recipe.caps, snapshots=0))
        else:
            recurrent = recurrent_declaration(args.shape, seed=args.seed)
            recurrent = dataclasses.replace(recurrent, frontend=recipe.parsers.frontend(recurrent.frontend))
            build = functools.partial(build_recurrent_core, recurrent, caps=recipe.caps)
        serving = build(
            recipe.out,
            signing_key=recipe.signing_key,
            namespace=args.namespace,
            layout=args.layout,
            core_key=recipe.core_key,
            targets=recipe.targets,
            progress=recipe.progress,
        )
    except ValueError as error:
        raise HeliosError(str(error)) from error
    _report_written(args, serving, started)
    return 0


def _check_vision_options(args: argparse.Namespace, caps: Capacities, targets: tuple[str, ...]) -> None:
    """Refuse, before any key or weight is touched, what ``vision-synthetic`` has no programs for, an
    unknown shape and an unknown layout."""
    from ignition.recipes.vision import TOWERS, VISION_TOOL_SYNTAXES, check_vision_options, image_layout_choice

    _refuse_options(
        "vision-synthetic",
        ("--speculative", args.speculative is not None),
        ("--window", bool(args.window)),
        (f"--tool-syntax {args.tool_syntax}", args.tool_syntax not in VISION_TOOL_SYNTAXES),
        ("--extra-special", args.extra_special is not None),
        (f"--reasoning {args.reasoning}", args.reasoning != "none"),
    )
    tower = TOWERS.get(args.shape)
    if tower is None:
        raise HeliosError(f"unknown vision shape {args.shape!r}; known shapes: {', '.join(TOWERS)}")
    try:
        image_layout_choice("tiles" if args.image_layout is None else args.image_layout, tower)
        check_vision_options(caps, targets)
    except ValueError as error:
        raise HeliosError(str(error)) from error


def _build_vision(recipe: RecipeBuild) -> int:
    """``ignition build vision-synthetic`` (options checked by :func:`_check_vision_options`)."""
    from ignition.recipes.vision import build_vision_core, vision_declaration

    args = recipe.args
    started = time.monotonic()
    try:
        model = vision_declaration(
            args.shape,
            layout="tiles" if args.image_layout is None else args.image_layout,
            seed=args.seed,
            tool_syntax=args.tool_syntax,
        )
        model = dataclasses.replace(model, tool_frontend=recipe.parsers.frontend(model.tool_frontend))
        serving = build_vision_core(
            model,
            recipe.out,
            caps=recipe.caps,
            signing_key=recipe.signing_key,
            namespace=args.namespace,
            layout=args.layout,
            core_key=recipe.core_key,
            bf16=args.dtype == "bf16",
            targets=recipe.targets,
            progress=recipe.progress,
        )
    except ValueError as error:
        raise HeliosError(str(error)) from error
    _report_written(args, serving, started)
    return 0


def _report_written(args: argparse.Namespace, serving: ServingContract, started: float) -> None:
    """The line a successful build prints: the core's path, size, programs and namespace, and the time taken."""
    print(
        f"wrote {args.out} ({args.out.stat().st_size / 1e6:.1f} MB, {len(serving.model.graphs)} programs, "
        f"namespace {args.namespace!r}) in {time.monotonic() - started:.1f} s"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parse_command_line(parser, argv)
    try:
        if args.command == "build":
            return run_build(args)
    except (HeliosError, ValueError, OSError) as exc:
        print(f"ignition: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:  # Ctrl-C: the writer has removed its temporary file, no core is left half-written
        print("ignition: error: interrupted", file=sys.stderr)
        return EXIT_ERROR
    return 2


if __name__ == "__main__":
    sys.exit(main())
