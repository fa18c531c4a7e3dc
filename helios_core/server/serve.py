"""``helios run``: option resolution and the uvicorn lifecycle of one served core.

Owns the run options (their names, types and defaults), the precedence rule — explicit command-line
options over the TOML config file (``--config``) over the environment (``HELIOS_<OPTION>``, e.g.
``HELIOS_MAX_ACTIVE``) over the core's defaults — and the serving lifecycle: listen first (uvicorn
run programmatically, the app built with no model yet), then on a startup thread start the model
(verify the core, build its programs, back its cache storage; with ``--worker-process`` the worker
process was started before the HTTP server was even imported), install the chat service and make one
warm-up generation through the engine; all that time ``/ready``, ``/v1/models``, ``/metrics`` and
every inference and render route answer 503 ``not_ready`` with ``Retry-After`` and ``/health``
answers 200. Then mark the app ready and log one readiness line. A load or warm-up that fails marks
readiness failed (``/health`` 503), stops the server, closes what was loaded and raises the same
error a start that failed before listening would (the CLI's one line and exit status). A signal
during loading stops the server at once; the load step then ends and its model is closed before the
process exits (a second signal ends the process at once). On SIGINT/SIGTERM once serving, shut down:

* readiness drops at once (``/ready`` 503) while the listening socket stays open: new requests are
  answered 503 ``not_ready`` with ``Retry-After`` and ``Connection: close``, and the requests already
  admitted go on, for at most ``--shutdown-timeout`` seconds (:data:`DEFAULT_SHUTDOWN_TIMEOUT`), or
  less once none is left;
* then drop what still runs: every running response ends at once with the documented terminal error
  (a stream's ``event: error`` of type ``cancelled``, a JSON response's 503 ``cancelled``) and logs
  one line, and its request is cancelled in the model worker; the listening socket closes;
* connections still open :data:`FLUSH_SECONDS` later (a reader that takes nothing more) are closed
  without further output, quietly; uvicorn's own cancellation is only a backstop after that;
* a second signal during all this drops what still runs at once (each dropped response's one log line
  says a second signal ended the drain, and after how many seconds), closes every connection and shuts
  the app's lifespan down (uvicorn skips that on a forced close; left to the event loop's end, it would
  be reported as a failed shutdown with a traceback); a signal that comes after this process's own
  drain ended, while other HTTP processes still drain, makes them close theirs at once, and the process
  exits 0;
* then the model worker stops and the core is closed; with ``--kv-events-config`` the KV-cache event
  publisher (attached to the page allocator before the warm-up) then sends its last ``AllBlocksCleared``.

With ``--worker-process`` the model worker runs in a process of its own
(:mod:`helios_core.server.worker_process`, :mod:`helios_core.runtime.remote`): the server process
verifies the core for its frontend and talks to the worker through a pipe of typed messages, so HTTP
serving and scrapes do not share a GIL with the model. The KV-cache event publisher then runs in the
worker process beside the page allocator (the server sends it the parsed ``--kv-events-config``) and its
counters reach ``/metrics`` through the worker's load updates.

With ``--http-processes N`` (N > 1, with ``--worker-process``) HTTP is served by N processes in front of
the one model worker process (:mod:`helios_core.server.http_processes`): this process binds the listening
socket once, starts the worker process with N pipes and the N − 1 other HTTP processes (spawned, each
given the socket, its pipe and the table of shared counts), and serves as the first of them. The kernel
hands each new connection to whichever process accepts it first. Admission and the counts ``/metrics``
exports are the whole server's (:mod:`helios_core.server.server_tally`). Once its own warm-up finished
and every other process warmed up through its own pipe, this process tells them to turn ready, and once
each did it turns ready itself and prints its one readiness line. A signal here drains every process
(each drains its own admitted requests for at most ``--shutdown-timeout``), waits for the others to
exit, then stops the worker; a second signal closes every connection in every process. Another HTTP
process that dies makes the run stop as on SIGTERM and fail with ``serving stopped: HTTP process K (pid
P) exited unexpectedly (...)``. So does a model worker process that dies (``--worker-process``, any number
of HTTP processes): its open requests end with the exit's message, the run logs ``the model worker process
exited unexpectedly (...); the server stops`` and fails with ``serving stopped: ...``.

An app driven without a drain callback (``draining_server`` without ``in_flight``) keeps the older
order: stop accepting at once, drop after the drain period.

Server log lines (a 500, a dropped response) go to stderr as ``helios run: LEVEL: message``.
Startup failures are Helios errors; the CLI prints them as one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
import tomllib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, cast

from helios_core.errors import HeliosError, StartupError

if TYPE_CHECKING:
    from helios_core.contract import LoadOptions
    from helios_core.contract.selection import ProcessRankSettings
    from helios_core.loading import TrustSettings
    from helios_core.runtime.startup import RunningModel
    from helios_core.server.http_processes import HttpProcesses, HttpRole
    from helios_core.server.image_input import ImageLimits
    from helios_core.server.kv_events import KvEventPublisher, KvEventsConfig
    from helios_core.server.readiness import Readiness
    from helios_core.server.service import ChatService
    from helios_core.server.worker_process import WorkerLaunch

__all__ = [
    "DEFAULT_SHUTDOWN_TIMEOUT",
    "DRAIN_SECONDS",
    "FLUSH_SECONDS",
    "RunOptions",
    "draining_server",
    "resolve_options",
    "serve",
]

_LOG = logging.getLogger("helios_core.server")
"""The server's log (its lines reach stderr while serving, :func:`_server_log`)."""

DEFAULT_SHUTDOWN_TIMEOUT = 5.0
"""``--shutdown-timeout``: the longest drain of admitted requests after SIGTERM before they are dropped (the
serving contract's five seconds; a deployment whose requests run longer gives more, as the manifests do)."""

DRAIN_SECONDS = 5
"""The drain period of :func:`draining_server` when none is given."""

_DRAIN_POLL_SECONDS = 0.02
"""How often the drain checks whether admitted requests are left (and whether a second signal came)."""

FLUSH_SECONDS = 1.0
"""After the drain period: time for the dropped responses' terminal events to reach their readers."""

MAX_PORT = 65535
"""The highest TCP port (``--port 0`` lets the system choose one, which the readiness line then names)."""

LISTEN_BACKLOG = 2048
"""Pending connections the listening socket queues (uvicorn's own default)."""


@dataclass(frozen=True)
class RunOptions:
    """Every ``helios run`` option after resolution (None: the core's default)."""

    core: Path | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    max_active: int | None = None
    queue_capacity: int | None = None
    frontend_workers: int | None = None
    event_capacity: int | None = None
    cache_pages: int | None = None
    prefill_chunk: int | None = None
    """The most tokens one prompt-computing round computes (None: the core's largest prefill program)."""
    offload_pages: int = 0
    """Host-memory pages of the prefix cache's host tier (0: evicted pages are dropped)."""
    offload_checkpoints: int = 0
    """Host-memory slots of the checkpoint host tier (0: evicted prefix checkpoints are dropped)."""
    ranks: int | None = None
    """Tensor-parallel thread ranks on this host (None: the core's rank count; another count is refused)."""
    rank_listen: str | None = None
    """``HOST:PORT`` where rank processes (``helios rank``) join; None: the ranks run as threads here."""
    rank_secret_file: Path | None = None
    """The secret the rank processes share with this one (a private file); needed with ``rank_listen``."""
    rank_join_timeout: float | None = None
    """Seconds to wait for every rank process to join (None: 60, ``rank_processes.DEFAULT_JOIN_TIMEOUT_S``)."""
    trust_key: tuple[Path, ...] = ()
    accept: str | None = None
    core_key: Path | None = None
    backend: str = "auto"
    speculative_width: int | None = None
    history_drafting: bool = False
    speculation_payoff: bool = False
    """Speculate only while measured speculative rounds are faster than decode rounds."""
    served_name: str | None = None
    alias: tuple[str, ...] = ()
    vllm_metrics: bool = False
    """Also export the gateway load gauges under vLLM's metric names."""
    kv_events_config: str | None = None
    """KV-cache event publishing, vLLM's JSON (:mod:`helios_core.server.kv_events`); None: off."""
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT
    """Seconds admitted requests may still run after SIGTERM before they are dropped."""
    worker_process: bool = False
    """Run the model worker in its own process (:mod:`helios_core.server.worker_process`)."""
    http_processes: int = 1
    """Processes serving HTTP in front of the worker process (:mod:`helios_core.server.http_processes`);
    more than 1 needs ``worker_process``."""
    image_max_bytes: int | None = None
    """Encoded bytes of one request image (None: :data:`~helios_core.server.image_input.DEFAULT_MAX_BYTES`)."""
    image_max_pixels: int | None = None
    """Pixels of one request image (None: :data:`~helios_core.server.image_input.DEFAULT_MAX_PIXELS`)."""
    image_max_count: int | None = None
    """Images in one request (None: :data:`~helios_core.server.image_input.DEFAULT_MAX_COUNT`)."""
    image_allow_urls: bool = False
    """Fetch http(s) image URLs (off: only data URLs)."""
    image_fetch_timeout: float | None = None
    """Seconds for one remote image's fetch (None: :data:`~helios_core.server.image_input.DEFAULT_FETCH_TIMEOUT`)."""

    def image_limits(self) -> ImageLimits:
        """The image limits these options give (StartupError naming the option when one is out of range)."""
        from helios_core.server import image_input as images

        try:
            return images.ImageLimits(
                max_bytes=images.DEFAULT_MAX_BYTES if self.image_max_bytes is None else self.image_max_bytes,
                max_pixels=images.DEFAULT_MAX_PIXELS if self.image_max_pixels is None else self.image_max_pixels,
                max_count=images.DEFAULT_MAX_COUNT if self.image_max_count is None else self.image_max_count,
                allow_urls=self.image_allow_urls,
                fetch_timeout=(
                    images.DEFAULT_FETCH_TIMEOUT if self.image_fetch_timeout is None else self.image_fetch_timeout
                ),
            )
        except ValueError as exc:
            raise StartupError(str(exc).replace("image ", "--image-", 1)) from None


_BACKENDS = ("auto", "reference", "cuda")


def _convert(name: str, value: Any, source: str) -> Any:
    """``value`` (from a config file or the environment, where everything may be a string) as the
    type of option ``name``."""
    where = f"{name.replace('_', '-')} (from {source})"
    if name in ("host", "accept", "served_name", "rank_listen"):
        if not isinstance(value, str):
            raise StartupError(f"{where} must be a string")
        return value
    if name in ("core", "core_key", "rank_secret_file"):
        if not isinstance(value, str):
            raise StartupError(f"{where} must be a path string")
        return Path(value)
    if name == "backend":
        if value not in _BACKENDS:
            raise StartupError(f"{where} must be one of {', '.join(_BACKENDS)}, not {value!r}")
        return value
    if name in ("shutdown_timeout", "image_fetch_timeout", "rank_join_timeout"):
        return _seconds(value, where)
    if name == "kv_events_config":
        from helios_core.server.kv_events import config_text

        return config_text(value, where)
    if name in ("history_drafting", "speculation_payoff", "vllm_metrics", "worker_process", "image_allow_urls"):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
        raise StartupError(f"{where} must be a boolean")
    if name in ("trust_key", "alias"):
        if isinstance(value, str):
            separator = os.pathsep if name == "trust_key" else ","
            items = [item.strip() for item in value.split(separator)]
            if name == "alias" and not all(items):
                raise StartupError(f"{where} names an empty alias ({value!r}); none may be empty or blank")
            items = [item for item in items if item]  # an empty key path entry, as in PATH, names nothing
        elif isinstance(value, list) and all(isinstance(item, str) for item in value):
            items = list(value)
        else:
            raise StartupError(f"{where} must be a string or a list of strings")
        return tuple(Path(item) for item in items) if name == "trust_key" else tuple(items)
    # the integer options
    if isinstance(value, bool):
        raise StartupError(f"{where} must be an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise StartupError(f"{where} must be an integer, not {value!r}")


def _seconds(value: Any, where: str, *, positive: bool = False) -> float:
    """A finite number of seconds (a number or its string), at least 0, or above 0 when ``positive``."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise StartupError(f"{where} must be a number of seconds, not {value!r}")
    try:
        seconds = float(value)
    except ValueError:
        raise StartupError(f"{where} must be a number of seconds, not {value!r}") from None
    if positive and not (math.isfinite(seconds) and seconds > 0):
        raise StartupError(f"{where} must be a positive, finite number of seconds, not {value!r}")
    if not math.isfinite(seconds) or seconds < 0:
        raise StartupError(f"{where} must be a finite number of seconds of at least 0, not {value!r}")
    return seconds


def _config_values(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise StartupError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise StartupError(f"config file {path} is not UTF-8 text: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise StartupError(f"config file {path} is not TOML: {exc}") from exc
    known = {f.name for f in fields(RunOptions)}
    values: dict[str, Any] = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in known:
            raise StartupError(f"config file {path}: unknown option {key!r}")
        if name in values:
            raise StartupError(
                f"config file {path}: option {name.replace('_', '-')!r} is set twice (its spellings with - and _ "
                "name the same option)"
            )
        values[name] = _convert(name, value, f"config file {path}")
    return values


def _environment_values(environ: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for f in fields(RunOptions):
        variable = f"HELIOS_{f.name.upper()}"
        if environ.get(variable):
            values[f.name] = _convert(f.name, environ[variable], f"${variable}")
    return values


def resolve_options(
    explicit: Mapping[str, Any], config: Path | None = None, environ: Mapping[str, str] | None = None
) -> RunOptions:
    """Explicit options (None or empty: not given) over the config file over the environment."""
    values = _environment_values(os.environ if environ is None else environ)
    if config is not None:
        values.update(_config_values(config))
    for name, value in explicit.items():
        if value is not None and value != () and value != [] and value is not False:
            values[name] = tuple(value) if isinstance(value, list) else value
    if "shutdown_timeout" in values:  # an explicit value is checked as the others are
        values["shutdown_timeout"] = _seconds(values["shutdown_timeout"], "--shutdown-timeout")
    if values.get("image_fetch_timeout") is not None:
        values["image_fetch_timeout"] = _seconds(values["image_fetch_timeout"], "--image-fetch-timeout", positive=True)
    if values.get("rank_join_timeout") is not None:
        values["rank_join_timeout"] = _seconds(values["rank_join_timeout"], "--rank-join-timeout")
    if values.get("core") is None:
        raise StartupError("no core given: pass --core PATH (or set core in --config, or $HELIOS_CORE)")
    return RunOptions(**values)


def serve(options: RunOptions, announce: Callable[[str], None]) -> None:
    """Listen, load the core behind the readiness gate, serve it until SIGINT/SIGTERM, drain, close it.

    With ``--worker-process`` the worker process is started as soon as the options are checked, before
    the HTTP server is imported and built; anything that fails before the loader took it stops it. With
    ``--http-processes`` N > 1 the socket is bound first and the other HTTP processes are started right
    after the worker process (see the module docstring)."""
    began = time.monotonic()
    from helios_core.contract import LoadOptions
    from helios_core.loading import TrustSettings
    from helios_core.server.kv_events import parse_kv_events_config

    if options.core is None:
        raise StartupError("no core given: pass --core PATH")
    core = options.core
    if not 0 <= options.port <= MAX_PORT:
        raise StartupError(f"--port must be between 0 and {MAX_PORT}, not {options.port}")
    for name in (options.served_name, *options.alias):
        if name is not None and not name.strip():
            raise StartupError("--served-name and --alias must name the model, not be empty")
    http_processes = _http_processes(options)
    trust = TrustSettings.resolve(options.trust_key, options.accept, options.core_key)
    options.image_limits()  # an image limit out of range fails before the server listens
    lost: list[HeliosError] = []
    """A rank process or another HTTP process that was lost while serving (then serving stops and the run
    fails with it)."""
    servers: list[Any] = []
    """The uvicorn server, once built."""

    def serving_lost(error: HeliosError) -> None:
        lost.append(error)
        for server in servers:
            server.should_exit = True  # uvicorn's main loop notices within a tenth of a second

    stop_joining = threading.Event()
    """Set when serving stops while the core loads: a leader waiting for its rank processes stops waiting."""
    rank_peers = _rank_peers(options, serving_lost, stop_joining)
    load = LoadOptions(
        max_active=options.max_active,
        queue_capacity=options.queue_capacity,
        frontend_workers=options.frontend_workers,
        event_capacity=options.event_capacity,
        speculative_width=options.speculative_width,
        history_drafting=options.history_drafting,
        speculation_payoff=options.speculation_payoff,
        cache_pages=options.cache_pages,
        prefill_chunk=options.prefill_chunk,
        offload_pages=options.offload_pages,
        offload_checkpoints=options.offload_checkpoints,
        ranks=options.ranks,
        rank_peers=rank_peers,
    )
    kv_config = parse_kv_events_config(options.kv_events_config) if options.kv_events_config else None
    listener = _listen(options.host, options.port)
    if options.port == 0:  # the port the system chose is the one every line and topic names
        options = dataclasses.replace(options, port=listener.getsockname()[1])
    launch: WorkerLaunch | None = None
    group: HttpProcesses | None = None
    try:
        if options.worker_process:
            from helios_core.server.worker_process import launch_worker_process

            launch = launch_worker_process(core, trust, load, backend=options.backend, http_processes=http_processes)
        if http_processes > 1 and launch is not None:
            from helios_core.server.http_processes import HttpProcesses

            group = HttpProcesses(options, trust, load, listener, launch.peers, on_lost=serving_lost)
            launch.peers = []  # each went to its process
        from helios_core.server.app import create_pending_app
        from helios_core.server.readiness import Readiness

        readiness = Readiness()
        readiness.starting("the core is loading")
        app = create_pending_app(readiness)
        role = None if group is None else group.role()
        loader = _Loader(
            options, trust, load, kv_config, readiness, app, began=began, launch=launch, role=role, on_lost=serving_lost
        )
    except BaseException:
        try:
            if group is not None:
                group.close()
        finally:
            if launch is not None:
                launch.stop()
            listener.close()
        raise
    signals = _ClosingSignals()
    """SIGINT and SIGTERM outside uvicorn's own handling, from here to the end of the close."""
    with _handling_shutdown_signals(signals):
        try:
            config = uvicorn_config(app, options)

            def on_ready() -> None:
                readiness.mark_ready()
                signals.served = True
                announce(loader.readiness_line)

            server = draining_server(
                config,
                loader.drop_responses,
                drain_seconds=options.shutdown_timeout,
                on_started=on_ready,
                warm_up=loader.load_and_warm_up,
                in_flight=loader.in_flight,
                readiness=readiness,
                on_shutdown=None if group is None else group.drain,
                on_force=None if group is None else group.force,
            )
            servers.append(server)
            if lost:  # lost before the server was built
                server.should_exit = True
            with _server_log():
                server.run(sockets=[listener])
            signals.stopped(None if group is None else group.force)
            if server.started:
                if server.forced_by is not None and not loader.finished.is_set():
                    _end_at_once(server.forced_by)  # a second signal during loading: no waiting for the load step
                # while that load step ends, SIGINT and SIGTERM end the process at once, whatever handlers it
                # inherited (a shell's background job starts with SIGINT ignored)
                stop_joining.set()  # a leader still waiting for rank processes stops now
                with _handling_shutdown_signals(_end_at_once):
                    loader.finished.wait()  # a signal during loading: the load step ends, then its model is closed
        finally:
            # the other HTTP processes exit first (what their stop logs keeps the server's line format), then the
            # worker process stops
            with _server_log() if group is not None else contextlib.nullcontext():
                try:
                    loader.close()
                finally:
                    if group is not None:
                        group.close()
                    listener.close()
    from helios_core.contract.selection import JoinStopped

    if loader.failure is not None and not isinstance(loader.failure, JoinStopped):
        raise loader.failure  # the loading error itself: the one line and exit status of a failed start
    if group is not None and group.startup_failure is not None:
        raise group.startup_failure  # another HTTP process could not start
    if lost:
        raise StartupError(f"serving stopped: {lost[0]}")
    if not server.started:
        raise StartupError(f"could not listen on {options.host}:{options.port}")
    if server.startup_failure is not None:
        raise server.startup_failure


def uvicorn_config(app: Any, options: RunOptions) -> Any:
    """The uvicorn configuration of ``app`` under ``options``; every HTTP process of ``helios run`` serves
    with this one."""
    import uvicorn

    from helios_core.server.http_protocol import KEEP_ALIVE_TIMEOUT_S, KeepAliveHttpProtocol

    return uvicorn.Config(
        app, host=options.host, port=options.port, log_level="warning", lifespan="on",
        http=KeepAliveHttpProtocol, timeout_keep_alive=KEEP_ALIVE_TIMEOUT_S,
    )  # fmt: skip


def _http_processes(options: RunOptions) -> int:
    """``--http-processes``, checked: at least 1, and more only with ``--worker-process``."""
    count = options.http_processes
    if count < 1:
        raise StartupError(f"--http-processes must be at least 1, not {count}")
    if count > 1 and not options.worker_process:
        raise StartupError(
            f"--http-processes {count} needs --worker-process (the HTTP processes share one model worker process)"
        )
    return count


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket every HTTP process accepts on (bound once, here, at the first address ``host``
    resolves to), or a StartupError naming the address and why."""
    try:
        family, kind, protocol, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except OSError as exc:  # a name that does not resolve
        raise StartupError(f"could not listen on {host}:{port}: {exc.strerror or exc}") from None
    listener = socket.socket(family, kind, protocol)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(LISTEN_BACKLOG)
    except OSError as exc:
        listener.close()
        raise StartupError(f"could not listen on {host}:{port}: {exc.strerror or exc}") from None
    return listener


def _rank_peers(
    options: RunOptions, on_lost: Callable[[HeliosError], None], stop_joining: threading.Event | None = None
) -> ProcessRankSettings | None:
    """The rank-process settings of ``--rank-listen`` (None without it); bad settings fail before listening."""
    from helios_core.backends.rank_processes import DEFAULT_JOIN_TIMEOUT_S, parse_address, read_secret_file
    from helios_core.contract.selection import ProcessRankSettings

    if options.rank_listen is None:
        if options.rank_secret_file is not None:
            raise StartupError("--rank-secret-file is used with --rank-listen HOST:PORT, which is missing")
        return None
    if options.rank_secret_file is None:
        raise StartupError("--rank-listen needs --rank-secret-file FILE (the secret the rank processes share)")
    if options.worker_process:
        raise StartupError("--rank-listen cannot be combined with --worker-process")
    join_timeout = DEFAULT_JOIN_TIMEOUT_S if options.rank_join_timeout is None else options.rank_join_timeout
    if join_timeout <= 0:
        raise StartupError(f"--rank-join-timeout must be positive, not {join_timeout:g}")
    host, port = parse_address(options.rank_listen, "--rank-listen")
    secret = read_secret_file(options.rank_secret_file)
    return ProcessRankSettings(
        host, port, secret, join_timeout_s=join_timeout, on_lost=on_lost, stop_joining=stop_joining
    )


class _Loader:
    """Loads the core on the startup thread while the server already listens, and owns what it loaded.

    The startup thread (:func:`draining_server`'s ``warm_up``) verifies the core, builds its programs,
    backs its cache storage and starts the model worker (:func:`~helios_core.runtime.startup.start`),
    attaches the KV-cache event publisher when configured (with ``--worker-process`` the worker process
    starts its own), installs the chat service in the app, and makes the warm-up generation. Until the
    service is installed every route but ``/health`` answers 503 ``not_ready``. :meth:`close` (after the
    server stopped and the startup thread ended) stops the model worker, closes the core, then the
    publisher (the worker process closes its own once its engine stopped).

    With ``--worker-process`` the worker process was already started by :func:`serve` (before the HTTP
    server was imported and built) and is handed in as ``launch``; the load step takes it over, and
    :meth:`close` stops it if the load step never ran.

    The readiness line ends with the startup time and its main phases, each measured around the real
    step: ``(startup T s: model loaded L s, warm-up W s)``, where ``startup`` counts from ``began`` (when
    :func:`serve` began, once the options were read) to the end of the warm-up, ``model loaded`` is the
    load step (with ``--worker-process``: from starting the worker process until it is ready, and then
    ``worker loaded P s`` follows, the worker process's own load as it measured it) and ``warm-up`` the
    warm-up generation. With several HTTP processes ``N HTTP processes ready H s`` ends the list: from
    starting the other processes until the last of them turned ready (``startup`` then ends there).

    One of several HTTP processes (``role``) counts its permits, permits whose generation ended and output
    failures in the table the processes share and exports every process's admitted requests; in the
    ``helios run`` process it also waits, after its own warm-up, for every other process to warm up and
    turn ready, and
    :meth:`close` waits for them to exit before the worker stops. Another HTTP process connects to the
    worker process over its own pipe instead of starting it, and leaves the KV-cache event publisher to
    the ``helios run`` process (its counters reach every process with the worker's load updates).
    """

    def __init__(
        self,
        options: RunOptions,
        trust: TrustSettings,
        load: LoadOptions,
        kv_config: KvEventsConfig | None,
        readiness: Readiness,
        app: Any,
        *,
        began: float,
        launch: WorkerLaunch | None = None,
        role: HttpRole | None = None,
        on_lost: Callable[[HeliosError], None] | None = None,
    ) -> None:
        self._options = options
        self._on_lost = on_lost
        """Told when serving cannot go on (the model worker process died): serving stops and the run fails."""
        self._trust = trust
        self._load = load
        self._kv_config = kv_config
        self._readiness = readiness
        self._app = app
        self.running: RunningModel | None = None
        self.service: ChatService | None = None
        self.kv_events: KvEventPublisher | None = None
        self.failure: BaseException | None = None
        """What loading raised (re-raised by :func:`serve` as it is: the exit status of a failed start)."""
        self.readiness_line = ""
        self.finished = threading.Event()
        """Set once the startup thread ended (loaded and warmed up, or failed)."""
        self._began = began
        """When ``helios run`` began serving (the readiness line's startup time counts from here)."""
        self._launch = launch
        """With ``--worker-process``: the worker process already started, until the load step takes it."""
        self._role = role
        """With ``--http-processes`` N > 1: this process's place among the HTTP processes."""

    def _worker_exited(self, message: str) -> None:
        """The model worker process exited unexpectedly (its proxy's receiver thread): every other HTTP process
        learns it, the run logs it and stops serving, and fails with it, so that a supervisor restarts the
        replica (the open requests end with ``message`` as the proxy fails them)."""
        role = self._role
        if role is not None and role.processes is not None:
            role.processes.relay_worker_exit(message)
        error = StartupError(message)
        _LOG.error("%s; the server stops", error)
        if self._on_lost is not None:
            self._on_lost(error)

    def load_and_warm_up(self) -> None:
        """On the startup thread: load, install the service, warm up. Raises what failed."""
        from helios_core.runtime.startup import start
        from helios_core.server.app import ServerSettings, attach_service
        from helios_core.server.kv_events import KvEventCounts, KvEventPublisher, default_topic, publisher_counters
        from helios_core.server.service import ChatService

        options, role = self._options, self._role
        try:
            try:
                core = options.core or Path()
                loading = time.monotonic()
                if options.worker_process and role is not None and role.peer is not None:
                    from helios_core.server.worker_process import connect_worker_process

                    self.running = connect_worker_process(core, self._trust, self._load, role.peer)
                elif options.worker_process:
                    from helios_core.server.worker_process import start_worker_process

                    launched, self._launch = self._launch, None  # start_worker_process owns it from here
                    if launched is not None:
                        loading = launched.started
                    self.running = start_worker_process(
                        core,
                        self._trust,
                        self._load,
                        backend=options.backend,
                        launched=launched,
                        on_exit=self._worker_exited,
                    )
                else:
                    self.running = start(core, self._trust, self._load, backend=options.backend)
                model_seconds = time.monotonic() - loading
                settings = ServerSettings(
                    options.served_name,
                    options.alias,
                    vllm_metrics=options.vllm_metrics,
                    image_limits=options.image_limits(),
                )
                service = ChatService(self.running, settings, self._readiness)
                self.service = service
                if role is not None:
                    role.share_counts(service)
                if self._kv_config is not None and self._kv_config.enabled:
                    topic = self._kv_config.topic or default_topic(options.host, options.port, service.served_name)
                    counts: KvEventCounts
                    if options.worker_process:  # the publisher runs in the worker, beside the allocator
                        from helios_core.server.worker_process import WorkerProcessEngine

                        remote = cast(WorkerProcessEngine, self.running.engine)
                        if role is None or role.peer is None:  # the helios run process starts it, once
                            remote.start_kv_events(self._kv_config, topic)
                        counts = remote.kv_events
                    else:
                        self.kv_events = KvEventPublisher(self._kv_config, topic)
                        self.kv_events.attach(self.running.engine.allocator)
                        counts = self.kv_events
                    service.metrics.registry.register(publisher_counters(counts))
            except BaseException as exc:
                self.failure = exc
                self._readiness.fail(f"loading the core failed: {exc}")
                raise
            serving = self.running.verified.contract.serving
            names = dict.fromkeys([options.served_name or serving.served_name, *serving.aliases, *options.alias])
            width = self.running.model.selection.speculative_width
            if options.speculative_width is not None and options.speculative_width != width:
                _LOG.warning(
                    "--speculative-width %d runs as %d: the widest captured width within it (the core captures %s)",
                    options.speculative_width,
                    width,
                    ", ".join(str(w) for w in sorted(serving.speculative_widths)),
                )
            attach_service(self._app, service)
            self._readiness.starting("the warm-up generation is running")
            warming = time.monotonic()
            service.warm_up()
            ended = time.monotonic()
            phases = [f"model loaded {model_seconds:.2f} s"]
            if self.running.worker_load_seconds is not None:
                phases.append(f"worker loaded {self.running.worker_load_seconds:.2f} s")
            phases.append(f"warm-up {ended - warming:.2f} s")
            if role is not None and role.processes is not None:
                others_seconds = role.processes.wait_ready()
                ended = time.monotonic()
                phases.append(f"{role.processes.count} HTTP processes ready {others_seconds:.2f} s")
            self.readiness_line = (
                f"helios run: ready: serving {', '.join(names)} at {_url(options.host, options.port)} "
                f"(startup {ended - self._began:.2f} s: {', '.join(phases)})"
            )
        finally:
            self.finished.set()

    def in_flight(self) -> int:
        """Admitted requests this process still holds (none before the service is installed)."""
        return 0 if self.service is None else self.service.admission.held_here

    def drop_responses(self, message: str) -> int:
        return 0 if self.service is None else self.service.drop_responses(message)

    def close(self) -> None:
        """Close the service, stop the model worker and close the core, then the KV-cache publisher (a worker
        process that was started but never taken by the load step, as when the server could not listen,
        is stopped too)."""
        try:
            if self._role is not None and self._role.processes is not None:
                self._role.processes.stop()  # the other HTTP processes leave the worker before it stops
            launch, self._launch = self._launch, None
            if launch is not None:
                launch.stop()
            if self.service is not None:
                self.service.close()
            if self.running is not None:
                self.running.close()
        finally:
            if self.kv_events is not None:
                self.kv_events.close()  # after the model worker stopped: the last event is AllBlocksCleared


class _LineFormatter(logging.Formatter):
    """``helios run: LEVEL: message`` (a traceback follows only on debug records that carry one)."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"helios run: {record.levelname.lower()}: {record.getMessage()}"
        if record.exc_info and record.levelno <= logging.DEBUG:
            line += "\n" + self.formatException(record.exc_info)
        return line


@contextlib.contextmanager
def _server_log() -> Iterator[None]:
    """Server log lines on stderr while serving (warnings and errors: the logger's default level)."""
    logger = logging.getLogger("helios_core.server")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_LineFormatter())
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


def draining_server(
    config: Any,
    drop_responses: Callable[[str], int],
    *,
    drain_seconds: float = DRAIN_SECONDS,
    flush_seconds: float = FLUSH_SECONDS,
    on_started: Callable[[], None] | None = None,
    warm_up: Callable[[], None] | None = None,
    in_flight: Callable[[], int] | None = None,
    readiness: Readiness | None = None,
    on_shutdown: Callable[[], None] | None = None,
    on_force: Callable[[], None] | None = None,
    signals: bool = True,
) -> Any:
    """A uvicorn server whose shutdown drains, then drops (see the module docstring).

    ``drop_responses(message)`` ends the app's running responses with their terminal errors and says how
    many it ended (:meth:`~helios_core.server.service.ChatService.drop_responses`). Once the server
    listens, ``warm_up`` (if any: ``helios run`` loads its core and warms it up there) runs on its own
    thread and then ``on_started`` runs on the event loop; a warm-up that raises marks ``readiness``
    failed, stops the server and is kept as ``startup_failure``. With ``in_flight`` (how
    many admitted requests are still held) shutdown first marks ``readiness`` draining and waits, still
    listening, until none is held or ``drain_seconds`` passed; without it shutdown stops accepting at
    once and drops after ``drain_seconds``. A second signal drops what still runs with a message that says
    so (and after how long) and closes every connection at once; the lifespan is still shut down.
    ``config.timeout_graceful_shutdown`` is replaced by the periods. ``on_shutdown`` runs on the event loop
    as shutdown begins and ``on_force`` once a second signal forced the close (``helios run`` passes the
    word on to its other HTTP processes). With ``signals`` off the server leaves SIGINT and SIGTERM alone
    (another HTTP process: ``helios run`` tells it when to shut down by calling :meth:`handle_exit`).
    """
    import uvicorn

    config.timeout_graceful_shutdown = (0 if in_flight is not None else drain_seconds) + flush_seconds + 1

    class DrainingServer(uvicorn.Server):
        startup_failure: HeliosError | None = None
        """Why the warm-up failed (the server then stopped), or None."""
        forced_by: int | None = None
        """The second signal, which forced the close, or None."""
        _dropped: bool = False
        """The running responses were dropped (the drain period ended, or a second signal forced the close)."""

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets=sockets)
            if not self.started:
                return
            if warm_up is None:
                if on_started is not None:
                    on_started()
                return
            loop = asyncio.get_running_loop()
            thread = threading.Thread(target=self._warm_up, args=(loop, warm_up), name="helios-warm-up", daemon=True)
            thread.start()

        def _warm_up(self, loop: asyncio.AbstractEventLoop, work: Callable[[], None]) -> None:
            """On the warm-up thread (never the loop: the generation blocks until the engine answers)."""
            failure: HeliosError | None = None
            try:
                work()
            except HeliosError as exc:
                failure = exc
            except Exception as exc:  # any failure of the warm-up is a startup failure
                failure = StartupError(f"the warm-up generation failed: {type(exc).__name__}: {exc}")
            if failure is not None and readiness is not None:
                readiness.fail(str(failure))  # /health and /ready say so until the socket closes
            with contextlib.suppress(RuntimeError):  # the loop is closed: the server already stopped
                loop.call_soon_threadsafe(self._warmed, failure)

        def _warmed(self, failure: HeliosError | None) -> None:
            if failure is not None:
                self.startup_failure = failure
                self.should_exit = True
            elif not self.should_exit and on_started is not None:
                on_started()

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if self.should_exit:  # a second signal: close everything now
                self.force_exit = True
                self.forced_by = sig
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if signals:
                with super().capture_signals():
                    yield
            else:
                yield

        async def shutdown(self, sockets: Any = None) -> None:
            loop = asyncio.get_running_loop()
            drop_after = drain_seconds
            forcing = loop.create_task(self._close_when_forced(loop.time()))
            if on_shutdown is not None:
                on_shutdown()
            try:
                if in_flight is not None:
                    if readiness is not None:
                        readiness.drain("shutdown began")
                    deadline = loop.time() + drain_seconds
                    while in_flight() > 0 and not self.force_exit and loop.time() < deadline:
                        await asyncio.sleep(_DRAIN_POLL_SECONDS)
                    drop_after = 0.0
                if self.force_exit:  # the forced close drops and aborts in one step: no terminal event
                    await forcing  # gets out before the connections close (a timer here would race it)
                timers = [
                    loop.call_later(drop_after, self._drop),
                    loop.call_later(drop_after + flush_seconds, self._close),
                ]
                try:
                    await super().shutdown(sockets=sockets)
                finally:
                    for timer in timers:
                        timer.cancel()
                if self.force_exit:
                    await self._end_lifespan()
            finally:
                forcing.cancel()

        async def _end_lifespan(self) -> None:
            """Shut the app's lifespan down after a forced close, which uvicorn skips (it would wait for the
            app): its shutdown hooks only close what is left (:func:`~helios_core.server.app.create_pending_app`),
            so it is given a flush period. Left running, the lifespan would be cancelled as the event loop
            closes, and the app would report that cancellation as a failed shutdown, with a traceback."""
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.lifespan.shutdown(), flush_seconds)

        async def _close_when_forced(self, began: float) -> None:
            """Once a second signal forced the close: drop what still runs, saying so, and close every connection."""
            loop = asyncio.get_running_loop()
            while not self.force_exit:
                await asyncio.sleep(_DRAIN_POLL_SECONDS)
            if on_force is not None:
                on_force()
            self._drop(
                f"the server shut down: a second signal ended the drain after {loop.time() - began:.1f} s of its "
                f"{drain_seconds:g} s period"
            )
            self._close()

        def _drop(self, message: str | None = None) -> None:
            """End every running response with its terminal error, once: the first reason stands (a forced
            close's, or the drain period's by default)."""
            if self._dropped:
                return
            self._dropped = True
            drop_responses(
                message
                or f"the server shut down: the response was still running after the {drain_seconds:g} s drain period"
            )

        def _close(self) -> None:
            """Abort the connections still open a flush period after the drop: their readers did not take
            the terminal event in time, and their requests were cancelled at the drop."""
            for connection in list(self.server_state.connections):
                transport = getattr(connection, "transport", None)
                if transport is not None:
                    transport.abort()

    return DrainingServer(config)


def _end_at_once(sig: int, frame: FrameType | None = None) -> None:
    """End ``helios run`` now, as a second signal during loading asks: SIGINT as an interruption (the CLI's
    ``interrupted`` line, exit 1), SIGTERM by its default action (a signal handler itself)."""
    if sig == signal.SIGTERM:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
    raise KeyboardInterrupt


class _ClosingSignals:
    """What SIGINT and SIGTERM do in ``helios run`` outside uvicorn's own handling, from before the server
    runs to the end of the close.

    While the server runs uvicorn handles them (a drain, then a forced close) and as it stops re-raises the
    signals it handled to this handler, which ignores them, so a requested shutdown exits 0. Once the
    server stopped (:meth:`stopped`), a signal while the rest closes is:

    * after a server that was ready (:attr:`served`), a second signal of its shutdown: with other HTTP
      processes, which may still be draining their own requests after this one's ended, it makes them close
      their connections at once (``force``, on a thread of its own: never inside the code it interrupts),
      and ``helios run`` exits 0 as soon as they did; alone it is ignored (what is left to close, the model
      worker and the core, takes no drain) and the process exits 0 as it would have;
    * after a stop while the core loaded (or a start that failed), the end of the process at once
      (:func:`_end_at_once`), as before.
    """

    def __init__(self) -> None:
        self.served = False
        """The server turned ready before it stopped."""
        self._force: Callable[[], None] | None = None
        self._stopped = False

    def stopped(self, force: Callable[[], None] | None) -> None:
        """The server stopped; ``force`` makes the other HTTP processes close their connections now (None
        without them)."""
        self._force = force
        self._stopped = True

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if not self._stopped:
            return  # uvicorn re-raising a signal it handled
        if not self.served:
            _end_at_once(signum, frame)
        force = self._force
        if force is not None:
            threading.Thread(target=force, name="helios-force-close", daemon=True).start()


@contextlib.contextmanager
def _handling_shutdown_signals(handler: Callable[[int, FrameType | None], None]) -> Iterator[None]:
    """SIGINT and SIGTERM go to ``handler`` within the block, then to what handled them before (only the
    main thread may set handlers: elsewhere the block runs with them as they are)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, former in previous.items():
            signal.signal(sig, former)


def _url(host: str, port: int) -> str:
    """The base URL of ``host:port`` (an IPv6 address in brackets)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
