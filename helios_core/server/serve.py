"""``helios run``: option resolution and the uvicorn lifecycle of one served core.

Owns the run options (their names, types and defaults), the precedence rule — explicit command-line
options over the TOML config file (``--config``) over the environment (``HELIOS_<OPTION>``, e.g.
``HELIOS_MAX_ACTIVE``) over the core's defaults — and the serving lifecycle: start the model, build
the app, run uvicorn programmatically, log one readiness line, and on SIGINT/SIGTERM shut down:

* stop accepting connections and give open ones :data:`DRAIN_SECONDS` to finish;
* then drop what still runs: every running response ends at once with the documented terminal error
  (a stream's ``event: error`` of type ``cancelled``, a JSON response's 503 ``cancelled``) and logs
  one line, and its request is cancelled in the model worker;
* connections still open :data:`FLUSH_SECONDS` later (a reader that takes nothing more) are closed
  without further output, quietly; uvicorn's own cancellation is only a backstop after that;
* then the model worker stops and the core is closed.

Server log lines (a 500, a dropped response) go to stderr as ``helios run: LEVEL: message``.
Startup failures are Helios errors; the CLI prints them as one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import tomllib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from types import FrameType
from typing import Any

from helios_core.errors import StartupError

__all__ = ["DRAIN_SECONDS", "FLUSH_SECONDS", "RunOptions", "draining_server", "resolve_options", "serve"]

DRAIN_SECONDS = 5
"""How long shutdown lets open connections finish before it drops the responses still running."""

FLUSH_SECONDS = 1.0
"""After the drain period: time for the dropped responses' terminal events to reach their readers."""


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
    trust_key: tuple[Path, ...] = ()
    accept: str | None = None
    core_key: Path | None = None
    backend: str = "auto"
    speculative_width: int | None = None
    history_drafting: bool = False
    served_name: str | None = None
    alias: tuple[str, ...] = ()
    vllm_metrics: bool = False
    """Also export the gateway load gauges under vLLM's metric names."""


_BACKENDS = ("auto", "reference", "cuda")


def _convert(name: str, value: Any, source: str) -> Any:
    """``value`` (from a config file or the environment, where everything may be a string) as the
    type of option ``name``."""
    where = f"{name.replace('_', '-')} (from {source})"
    if name in ("host", "accept", "served_name"):
        if not isinstance(value, str):
            raise StartupError(f"{where} must be a string")
        return value
    if name in ("core", "core_key"):
        if not isinstance(value, str):
            raise StartupError(f"{where} must be a path string")
        return Path(value)
    if name == "backend":
        if value not in _BACKENDS:
            raise StartupError(f"{where} must be one of {', '.join(_BACKENDS)}, not {value!r}")
        return value
    if name in ("history_drafting", "vllm_metrics"):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
        raise StartupError(f"{where} must be a boolean")
    if name in ("trust_key", "alias"):
        if isinstance(value, str):
            separator = os.pathsep if name == "trust_key" else ","
            items = [item.strip() for item in value.split(separator) if item.strip()]
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


def _config_values(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise StartupError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise StartupError(f"config file {path} is not TOML: {exc}") from exc
    known = {f.name for f in fields(RunOptions)}
    values: dict[str, Any] = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in known:
            raise StartupError(f"config file {path}: unknown option {key!r}")
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
    if values.get("core") is None:
        raise StartupError("no core given: pass --core PATH (or set core in --config, or $HELIOS_CORE)")
    return RunOptions(**values)


def serve(options: RunOptions, announce: Callable[[str], None]) -> None:
    """Start the core, serve it until SIGINT/SIGTERM, drain, close the model."""
    import uvicorn

    from helios_core.contract import LoadOptions
    from helios_core.loading import TrustSettings
    from helios_core.runtime.startup import start
    from helios_core.server.app import ServerSettings, chat_service, create_app

    if options.core is None:
        raise StartupError("no core given: pass --core PATH")
    trust = TrustSettings.resolve(options.trust_key, options.accept, options.core_key)
    load = LoadOptions(
        max_active=options.max_active,
        queue_capacity=options.queue_capacity,
        frontend_workers=options.frontend_workers,
        event_capacity=options.event_capacity,
        speculative_width=options.speculative_width,
        history_drafting=options.history_drafting,
        cache_pages=options.cache_pages,
    )
    running = start(options.core, trust, load, backend=options.backend)
    try:
        app = create_app(running, ServerSettings(options.served_name, options.alias, vllm_metrics=options.vllm_metrics))
        config = uvicorn.Config(app, host=options.host, port=options.port, log_level="warning", lifespan="on")
        serving = running.verified.contract.serving
        names = dict.fromkeys([options.served_name or serving.served_name, *serving.aliases, *options.alias])
        line = f"helios run: ready: serving {', '.join(names)} at http://{options.host}:{options.port}"
        server = draining_server(config, chat_service(app).drop_responses, on_started=lambda: announce(line))
        with _quiet_after_shutdown(), _server_log():
            server.run()
        if not server.started:
            raise StartupError(f"could not listen on {options.host}:{options.port}")
    finally:
        running.close()


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
) -> Any:
    """A uvicorn server whose shutdown drains, then drops (see the module docstring).

    ``drop_responses(message)`` ends the app's running responses with their terminal errors and says how
    many it ended (:meth:`~helios_core.server.service.ChatService.drop_responses`); ``on_started`` runs
    once the server listens. ``config.timeout_graceful_shutdown`` is replaced by the two periods.
    """
    import uvicorn

    config.timeout_graceful_shutdown = drain_seconds + flush_seconds + 1

    class DrainingServer(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets=sockets)
            if self.started and on_started is not None:
                on_started()

        async def shutdown(self, sockets: Any = None) -> None:
            loop = asyncio.get_running_loop()
            timers = [
                loop.call_later(drain_seconds, self._drop),
                loop.call_later(drain_seconds + flush_seconds, self._close),
            ]
            try:
                await super().shutdown(sockets=sockets)
            finally:
                for timer in timers:
                    timer.cancel()

        def _drop(self) -> None:
            drop_responses(
                f"the server shut down: the response was still running after the {drain_seconds:g} s drain period"
            )

        def _close(self) -> None:
            """Abort the connections still open a flush period after the drop: their readers did not take
            the terminal event in time, and their requests were cancelled at the drop."""
            for connection in list(self.server_state.connections):
                transport = getattr(connection, "transport", None)
                if transport is not None:
                    transport.abort()

    return DrainingServer(config)


@contextlib.contextmanager
def _quiet_after_shutdown() -> Iterator[None]:
    """uvicorn handles SIGINT/SIGTERM (graceful shutdown) and re-raises the signal afterwards to the
    handler it found; that handler is a no-op here, so a requested shutdown exits 0."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _ignore_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _ignore_signal(signum: int, frame: FrameType | None) -> None:
    return None
