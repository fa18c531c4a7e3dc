"""The ``helios`` command line.

Owns argument parsing and what the operator reads: one-line results, one-line
errors (never a traceback) and exit codes (0 success, 1 a Helios error, 2 a
usage error, 3 an unexpected internal error). Subcommands live in functions
named ``cmd_*``; the work itself belongs to the library modules they call.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from helios_core.errors import HeliosError

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 3

BACKENDS = ("auto", "reference", "cuda")
BACKEND_HELP = (
    "cuda runs the core's kernels on an NVIDIA GPU, reference runs numpy on the CPU, auto picks cuda when a GPU "
    "is present and the core has kernels for it, else reference"
)


def _fail(command: str, message: str, code: int = EXIT_ERROR) -> int:
    text = " ".join(str(message).split())
    print(f"helios {command}: error: {text}", file=sys.stderr)
    return code


def _status_line(line: str) -> None:
    """One status line of a long-running command (``helios run``, ``helios rank``), to stderr at once."""
    print(line, file=sys.stderr, flush=True)


def _trust_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trust-key",
        type=Path,
        action="append",
        default=[],
        metavar="PEM",
        help="trusted publisher public key (repeatable; default: $HELIOS_TRUST_KEYS)",
    )
    parser.add_argument("--accept", metavar="NAMESPACE", help="acceptance string (default: $HELIOS_ACCEPT)")
    parser.add_argument(
        "--core-key", type=Path, metavar="FILE", help="core key of logical-v4 cores (default: $HELIOS_CORE_KEY)"
    )


def _fmt_bytes(count: int) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{count} B"
        value /= 1024
    return f"{count} B"


# ---------------------------------------------------------------------------- verify


def cmd_verify(args: argparse.Namespace) -> int:
    from helios_core.loading import TrustSettings, open_core

    settings = TrustSettings.resolve(args.trust_key, args.accept, args.core_key)
    verified = open_core(args.core, settings)
    try:
        core, contract = verified.core, verified.contract
        decoded = sum(r.decoded_nbytes for r in core.resources.values())
        print(
            f"OK {args.core}: namespace {core.publisher_namespace!r}, {core.layout} (format "
            f"{core.format_version}), contract v{contract.version}, {len(contract.graphs)} programs, "
            f"{len(core.resources)} resources ({_fmt_bytes(decoded)} decoded), signed by "
            f"{', '.join(k[:16] for k in core.signer_key_ids)}"
        )
    finally:
        verified.close()
    return EXIT_OK


# ---------------------------------------------------------------------------- inspect


def describe_core(path: Path, trust_keys: Sequence[Path]) -> dict[str, Any]:
    """A JSON-ready description of a core (signature checked when keys are given)."""
    from helios_core.container.description import describe_verified, read_unverified
    from helios_core.container.keys import TrustStore
    from helios_core.container.reader import CoreFile
    from helios_core.contract.prepared import operation_name
    from helios_core.wire import contract_pb2 as ct

    if trust_keys:
        with CoreFile.open(path, TrustStore.from_paths(trust_keys)) as core:
            description = describe_verified(core)
        signature = "verified"
    else:
        description = read_unverified(path)
        signature = "not checked (pass --trust-key to verify)"
    serving = description.contract
    model = serving.model
    graphs = []
    for graph in model.graphs:
        ext = graph.extents
        graphs.append(
            {
                "name": graph.name,
                "operation": operation_name(graph.operation),
                "batch_capacity": ext.batch_capacity,
                "token_capacity": ext.token_capacity,
                "packed_token_capacity": ext.packed_token_capacity,
                "draft_tokens": ext.draft_tokens,
                "nodes": next((len(p.nodes) for p in description.execution.programs if p.name == graph.name), 0),
            }
        )
    frontend = json_format.MessageToDict(model.frontend, preserving_proto_field_name=True)
    images = None
    if model.frontend.image_layout not in (ct.IMAGE_LAYOUT_NONE, ct.IMAGE_LAYOUT_UNSPECIFIED):
        vision = model.vision
        images = {
            "features_per_image": vision.features_per_window,
            "features_per_request": vision.feature_slots,
            "patches_per_feature": vision.patches_per_feature,
            "patch_capacities": list(vision.patch_capacities),
        }
    return {
        "path": str(path),
        "signature": signature,
        "publisher_namespace": description.publisher_namespace,
        "signer_key_ids": list(description.signer_key_ids),
        "description": description.description,
        "versions": {
            "payload_format": description.format_version,
            "layout": description.layout,
            "contract": model.version,
            "execution_abi": description.execution.abi_label,
        },
        "served_name": serving.served_name,
        "aliases": list(serving.aliases),
        "vocabulary": {
            "sampled_size": model.vocabulary.sampled_size,
            "logits_width": model.vocabulary.logits_width,
            "input_size": model.input_vocabulary.size,
        },
        "capacities": {
            "context_tokens": serving.context_tokens,
            "prefill_tokens": serving.prefill_tokens,
            "max_concurrency": serving.max_concurrency,
            "page_tokens": model.cache.page_tokens,
            "page_capacity": serving.page_capacity,
            "snapshot_capacity": serving.snapshot_capacity,
            "speculative_widths": list(serving.speculative_widths),
        },
        "eos_token_ids": list(serving.defaults.eos_token_ids),
        "frontend": frontend,
        "images": images,
        "graphs": graphs,
        "targets": list(description.execution.targets) or ["reference"],
        "resources": [
            {
                "id": r.id,
                "kind": _resource_kind(r.kind),
                "stored_nbytes": r.stored_nbytes,
                "decoded_nbytes": r.decoded_nbytes,
                "rank": r.rank,
            }
            for r in description.resources
        ],
    }


def _resource_kind(kind: int) -> str:
    from helios_core.wire import container_pb2 as cb

    try:
        return cb.ResourceKind.Name(kind).removeprefix("RESOURCE_KIND_").lower()  # type: ignore[arg-type]
    except ValueError:
        return str(kind)


def _signers(key_ids: Sequence[str]) -> str:
    """The signing keys' ids, shortened, or that the core carries no signature."""
    return f"keys {', '.join(k[:16] for k in key_ids)}" if key_ids else "no signatures"


def cmd_inspect(args: argparse.Namespace) -> int:
    info = describe_core(args.core, args.trust_key)
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=False))
        return EXIT_OK
    versions = info["versions"]
    caps = info["capacities"]
    lines = [
        f"core            {info['path']}",
        f"signature       {info['signature']}",
        f"publisher       {info['publisher_namespace']!r} ({_signers(info['signer_key_ids'])})",
        f"versions        payload format {versions['payload_format']} ({versions['layout']}), "
        f"contract v{versions['contract']}, execution ABI {versions['execution_abi']!r}",
        f"served name     {info['served_name']}"
        + (f" (aliases {', '.join(info['aliases'])})" if info["aliases"] else ""),
        f"vocabulary      {info['vocabulary']['sampled_size']} sampled, {info['vocabulary']['logits_width']} logits, "
        f"{info['vocabulary']['input_size']} input",
        f"capacities      context {caps['context_tokens']}, prefill {caps['prefill_tokens']}, concurrency "
        f"{caps['max_concurrency']}, pages {caps['page_capacity']} x {caps['page_tokens']} tokens, snapshots "
        f"{caps['snapshot_capacity']}, speculative widths {caps['speculative_widths'] or 'none'}",
        f"eos ids         {info['eos_token_ids']}",
        "frontend        " + ", ".join(f"{k}={v}" for k, v in info["frontend"].items() if isinstance(v, (str, int))),
        f"targets         {', '.join(info['targets'])}",
    ]
    if info["images"] is not None:
        images = info["images"]
        lines.append(
            f"images          up to {images['features_per_image']} features an image, "
            f"{images['features_per_request']} a request (patches per feature {images['patches_per_feature']}, "
            f"patch capacities {images['patch_capacities']})"
        )
    lines.append("graphs")
    for graph in info["graphs"]:
        lines.append(
            f"  {graph['name']:<22} {graph['operation']:<15} B={graph['batch_capacity']:<4} "
            f"W={graph['token_capacity']:<4} P={graph['packed_token_capacity']:<5} D={graph['draft_tokens']:<3} "
            f"{graph['nodes']} nodes"
        )
    lines.append("resources")
    for resource in info["resources"]:
        lines.append(
            f"  {resource['id']:<22} {resource['kind']:<14} stored {_fmt_bytes(resource['stored_nbytes']):>10}  "
            f"decoded {_fmt_bytes(resource['decoded_nbytes']):>10}"
        )
    print("\n".join(lines))
    return EXIT_OK


# ---------------------------------------------------------------------------- generate


def _read_messages(source: str) -> list[dict[str, Any]]:
    where = "standard input" if source == "-" else repr(source)
    try:
        raw = sys.stdin.buffer.read() if source == "-" else Path(source).read_bytes()
    except OSError as exc:
        raise HeliosError(f"cannot read --messages from {where}: {exc.strerror or exc}") from exc
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise HeliosError(f"--messages from {where} is not UTF-8 text: {exc}") from exc
    except ValueError as exc:
        raise HeliosError(f"--messages is not JSON: {exc}") from exc
    except RecursionError:
        raise HeliosError(f"--messages from {where} nests its JSON too deeply") from None
    if isinstance(data, dict):
        data = data.get("messages")
    if not isinstance(data, list) or not all(isinstance(m, dict) and "role" in m for m in data):
        raise HeliosError('--messages must be a JSON list of {"role": ..., "content": ...} objects')
    return data


def _finite_float(text: str) -> float:
    """A number option of ``generate``: finite (its range is the request field's, checked as a request's)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, not {text!r}")
    return value


def cmd_generate(args: argparse.Namespace) -> int:
    import msgspec

    from helios_core.contract import LoadOptions
    from helios_core.loading import TrustSettings
    from helios_core.runtime.startup import start
    from helios_core.server.errors import validation_error
    from helios_core.server.preparation import Frontend, prepare
    from helios_core.server.schemas import decode_request

    messages = _read_messages(args.messages)
    body: dict[str, Any] = {"messages": messages, "seed": args.seed}
    for name, value in (("max_tokens", args.max_tokens), ("temperature", args.temperature), ("top_p", args.top_p)):
        if value is not None:
            body[name] = value
    if args.ignore_eos:
        body["ignore_eos"] = True
    try:
        chat = decode_request(json.dumps(body).encode("utf-8"))
    except msgspec.DecodeError as exc:
        raise HeliosError(f"--messages: {validation_error(exc)}") from None
    settings = TrustSettings.resolve(args.trust_key, args.accept, args.core_key)
    options = LoadOptions(max_active=1, cache_pages=args.cache_pages, ranks=args.ranks)
    running = start(args.core, settings, options, backend=args.backend)
    try:
        bootstrap = running.bootstrap
        # the preparation a served chat request takes: the core's plugins resolved as `helios run` resolves
        # them, images decoded and expanded, sampling and the output limit checked
        prepared = prepare(Frontend(running), chat, "generate-1")
        prompt = prepared.request.prompt_ids
        result = running.engine.generate(prepared.request)
    finally:
        running.close()
    text = bootstrap.decode(result.token_ids)
    if args.json:
        print(
            json.dumps(
                {
                    "prompt_token_ids": prompt,
                    "token_ids": result.token_ids,
                    "text": text,
                    "finish_reason": result.finish_reason,
                }
            )
        )
    else:
        print(text)
    return EXIT_OK


# ---------------------------------------------------------------------------- run


_RUN_OPTIONS = (
    "core", "host", "port", "max_active", "queue_capacity", "frontend_workers", "event_capacity", "cache_pages",
    "prefill_chunk", "trust_key", "accept", "core_key", "backend", "speculative_width", "history_drafting",
    "speculation_payoff", "served_name", "alias",
    "vllm_metrics", "kv_events_config", "shutdown_timeout", "offload_pages", "offload_checkpoints",
    "worker_process", "http_processes",
    "image_max_bytes", "image_max_pixels", "image_max_count", "image_allow_urls", "image_fetch_timeout", "ranks",
    "rank_listen", "rank_secret_file", "rank_join_timeout",
)  # fmt: skip


def cmd_run(args: argparse.Namespace) -> int:
    from helios_core.server.serve import resolve_options, serve

    explicit = {name: getattr(args, name) for name in _RUN_OPTIONS}
    serve(resolve_options(explicit, args.config), announce=_status_line)
    return EXIT_OK


def _add_run_command(sub: Any) -> None:
    run = sub.add_parser(
        "run",
        help="serve a core over the OpenAI-compatible HTTP API",
        description="Options also come from --config (TOML) and $HELIOS_<OPTION>; explicit options win over the "
        "config file, which wins over the environment, which wins over the core's defaults.",
    )
    run.add_argument("--core", type=Path, help="the core to serve")
    run.add_argument("--config", type=Path, metavar="FILE", help="TOML file of run options")
    run.add_argument("--host", help="listen address (default 127.0.0.1)")
    run.add_argument("--port", type=int, help="listen port (default 8000)")
    run.add_argument("--max-active", type=int, help="concurrent requests on the model (default: the core's)")
    run.add_argument("--queue-capacity", type=int, help="queued requests beyond max-active (default: the core's)")
    run.add_argument("--frontend-workers", type=int, help="request preparation threads (default: the core's)")
    run.add_argument("--event-capacity", type=int, help="minimum per-response event budget (default: the core's)")
    run.add_argument("--cache-pages", type=int, help="cap on physical cache pages")
    run.add_argument(
        "--prefill-chunk",
        type=int,
        metavar="N",
        help="the most prompt tokens one round computes: only prefill programs of at most N tokens are used "
        "(default: every captured one)",
    )
    run.add_argument(
        "--offload-pages", type=int, metavar="N", help="host-memory pages evicted cache pages move to (default 0: off)"
    )
    run.add_argument(
        "--offload-checkpoints",
        type=int,
        metavar="N",
        help="host-memory slots evicted prefix checkpoints move to (default 0: off)",
    )
    run.add_argument(
        "--ranks", type=int, metavar="N", help="tensor-parallel ranks as threads on this host (default: the core's)"
    )
    run.add_argument(
        "--rank-listen",
        metavar="HOST:PORT",
        help="run ranks 1..N-1 as rank processes (helios rank) that join at this address",
    )
    run.add_argument(
        "--rank-secret-file", type=Path, metavar="FILE", help="the secret the rank processes share (mode 0600)"
    )
    run.add_argument(
        "--rank-join-timeout", type=float, metavar="SECONDS", help="wait for the rank processes (default 60)"
    )
    run.add_argument(
        "--trust-key",
        type=Path,
        action="append",
        metavar="PEM",
        help="trusted publisher key (repeatable; default: $HELIOS_TRUST_KEYS)",
    )
    run.add_argument("--accept", metavar="NAMESPACE", help="acceptance string (the signed publisher namespace)")
    run.add_argument(
        "--core-key", type=Path, metavar="FILE", help="core key of logical-v4 cores (default: $HELIOS_CORE_KEY)"
    )
    run.add_argument("--backend", choices=BACKENDS, help=f"execution backend (default auto): {BACKEND_HELP}")
    run.add_argument("--speculative-width", type=int, help="speculative width (default: the widest captured)")
    run.add_argument("--history-drafting", action="store_true", default=None, help="enable history drafting")
    run.add_argument(
        "--speculation-payoff",
        action="store_true",
        default=None,
        help="speculate only while speculative rounds measure faster than decode rounds",
    )
    run.add_argument("--served-name", help="model name clients use (default: the core's)")
    run.add_argument("--alias", action="append", metavar="NAME", help="another accepted model name (repeatable)")
    run.add_argument(
        "--shutdown-timeout", type=float, metavar="SECONDS", help="drain after SIGTERM before dropping (default 5)"
    )
    run.add_argument(
        "--vllm-metrics",
        action="store_true",
        default=None,
        help="also export the gateway load gauges under vLLM's metric names (vllm:num_requests_waiting, ...)",
    )
    run.add_argument("--kv-events-config", metavar="JSON", help="publish KV-cache events over ZeroMQ (vLLM's JSON)")
    run.add_argument(
        "--worker-process",
        action="store_true",
        default=None,
        help="run the model worker in its own process (HTTP serving and /metrics do not share its GIL)",
    )
    run.add_argument(
        "--http-processes",
        type=int,
        metavar="N",
        help="serve HTTP from N processes sharing one socket in front of the worker process (default 1; "
        "needs --worker-process)",
    )
    run.add_argument(
        "--image-max-bytes", type=int, metavar="N", help="encoded bytes of one request image (default 20 MiB)"
    )
    run.add_argument(
        "--image-max-pixels", type=int, metavar="N", help="pixels of one request image (default 33177600: 7680x4320)"
    )
    run.add_argument("--image-max-count", type=int, metavar="N", help="images in one request (default 8)")
    run.add_argument(
        "--image-allow-urls",
        action="store_true",
        default=None,
        help="fetch http(s) image URLs (default: only data: URLs are accepted)",
    )
    run.add_argument(
        "--image-fetch-timeout", type=float, metavar="SECONDS", help="whole fetch of one image URL (default 10)"
    )
    run.set_defaults(handler=cmd_run)


# ---------------------------------------------------------------------------- keys


def cmd_keys_generate(args: argparse.Namespace) -> int:
    from helios_core.container.keys import generate_keys, key_id, load_public_key

    if not args.out.strip():
        raise HeliosError("--out must name a directory, not an empty string")
    paths = generate_keys(Path(args.out))
    public = load_public_key(paths["public"])
    for role, path in paths.items():
        print(f"{role:<8} {path}")
    print(f"key id   {key_id(public)}")
    return EXIT_OK


# ---------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    import helios_core

    parser = argparse.ArgumentParser(prog="helios", description="Serve prepared LLM cores.")
    # the package's own version, not the installed distribution's: a source tree on PYTHONPATH has none
    parser.add_argument("--version", action="version", version=f"helios {helios_core.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    verify = sub.add_parser("verify", help="verify a core's signature, acceptance, resources and contract")
    verify.add_argument("core", type=Path)
    _trust_arguments(verify)
    verify.set_defaults(handler=cmd_verify)

    inspect = sub.add_parser("inspect", help="describe a core")
    inspect.add_argument("core", type=Path)
    inspect.add_argument("--json", action="store_true", help="print JSON")
    inspect.add_argument(
        "--trust-key",
        type=Path,
        action="append",
        default=[],
        metavar="PEM",
        help="trusted publisher key to check the signature with (repeatable; none: the signature is not checked)",
    )
    inspect.set_defaults(handler=cmd_inspect)

    generate = sub.add_parser("generate", help="generate one answer through the engine")
    generate.add_argument("--core", type=Path, required=True)
    generate.add_argument("--messages", required=True, metavar="FILE|-", help="JSON list of chat messages")
    generate.add_argument("--max-tokens", type=int, help="output limit (default: the core's)")
    generate.add_argument("--temperature", type=_finite_float, help="0 for greedy (default: the core's)")
    generate.add_argument("--top-p", type=_finite_float, help="nucleus mass (default: the core's)")
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS (benchmarks, checks)")
    generate.add_argument("--json", action="store_true", help="print prompt ids, token ids, text and finish reason")
    generate.add_argument("--backend", choices=BACKENDS, default="auto", help=f"execution backend: {BACKEND_HELP}")
    generate.add_argument("--cache-pages", type=int, help="cap on physical cache pages")
    generate.add_argument(
        "--ranks", type=int, metavar="N", help="tensor-parallel ranks as threads on this host (default: the core's)"
    )
    _trust_arguments(generate)
    generate.set_defaults(handler=cmd_generate)

    _add_run_command(sub)

    from helios_core.server.rank_command import add_rank_command

    add_rank_command(sub, _trust_arguments, _status_line)

    from helios_core.plugins.cli_command import add_plugins_command

    add_plugins_command(sub)

    keys = sub.add_parser("keys", help="key management")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    keys_generate = keys_sub.add_parser("generate", help="generate a signing key pair and a core key")
    keys_generate.add_argument("--out", required=True, metavar="DIR", help="directory to write the keys into")
    keys_generate.set_defaults(handler=cmd_keys_generate)
    return parser


def parse_command_line(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, except that arguments no parser recognised are a usage error of the
    (sub)command they were given to (``helios verify: error: unrecognized arguments: ...``), not of the
    top-level program."""
    args, extras = parser.parse_known_args(argv)
    if extras:
        _innermost(parser, args).error(f"unrecognized arguments: {' '.join(extras)}")
    return args


def _innermost(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The deepest subcommand parser ``args`` went through."""
    while True:
        chosen = None
        for action in parser._actions:  # argparse keeps its subcommand parsers in a private action
            if isinstance(action, argparse._SubParsersAction):
                name = getattr(args, action.dest or "", None)
                chosen = action.choices.get(name) if isinstance(name, str) else None
        if chosen is None:
            return parser
        parser = chosen


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parse_command_line(parser, argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    command = args.command
    try:
        return handler(args)
    except HeliosError as exc:
        return _fail(command, str(exc))
    except BrokenPipeError:
        # The reader went away (``helios inspect --json | head``): not an error of ours.
        sys.stderr.close()
        return EXIT_OK
    except KeyboardInterrupt:
        return _fail(command, "interrupted", EXIT_ERROR)
    except MemoryError as exc:
        return _fail(command, f"not enough memory ({exc or 'an allocation failed'})")
    except OSError as exc:  # a path the operator named cannot be read or written
        where = f"{exc.filename}: " if exc.filename is not None else ""
        return _fail(command, f"{where}{exc.strerror or exc}")
    except Exception as exc:  # the operator never sees a traceback
        return _fail(command, f"internal error ({type(exc).__name__}: {exc}); please report it", EXIT_INTERNAL)


if __name__ == "__main__":
    sys.exit(main())
