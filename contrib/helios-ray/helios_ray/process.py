"""One ``helios run`` child process on a free loopback port: start, readiness wait, supervision, stop.

The process is started from a supervision thread that lives as long as the replica, with the Linux
parent-death signal set to SIGTERM, so a replica that is killed outright (not shut down) does not
leave its Helios process behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import httpx

__all__ = ["HeliosProcess", "HeliosStartupError", "free_loopback_port", "helios_command"]

_PR_SET_PDEATHSIG = 1


class HeliosStartupError(RuntimeError):
    """``helios run`` exited, or did not become ready in time."""


def free_loopback_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def helios_command() -> list[str]:
    """The command that runs the ``helios`` CLI of this Python environment."""
    return [sys.executable, "-m", "helios_core.cli"]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class HeliosProcess:
    """``helios run RUN_ARGS --worker-process --host 127.0.0.1 --port PORT``, supervised.

    ``run_args`` must not contain ``--host`` or ``--port``: the process always listens on a free
    loopback port of its own. The model worker always runs in a process of its own, so the replica's
    HTTP serving and health checks never wait on the model's interpreter lock. :meth:`start` returns
    once ``GET ready_path`` answers 200.
    """

    def __init__(
        self,
        run_args: Sequence[str],
        *,
        ready_path: str = "/ready",
        startup_timeout_s: float = 300.0,
        command: Sequence[str] | None = None,
    ) -> None:
        for forbidden in ("--host", "--port"):
            if any(arg == forbidden or arg.startswith(forbidden + "=") for arg in run_args):
                raise ValueError(
                    f"run_args must not contain {forbidden}: each replica listens on its own loopback port"
                )
        if startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be positive, not {startup_timeout_s}")
        self._run_args = [*run_args, "--worker-process"]
        self._ready_path = ready_path
        self._startup_timeout_s = startup_timeout_s
        self._command = list(command) if command is not None else helios_command()
        self.port = 0
        self._process: subprocess.Popen[bytes] | None = None
        self._started = threading.Event()
        self._launch_error: BaseException | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def exit_code(self) -> int | None:
        """None while the process runs (or before it started), else its exit status."""
        return None if self._process is None else self._process.poll()

    def start(self) -> None:
        """Start the process and wait until it is ready; retries once on a port taken in between."""
        for attempt in range(2):
            self.port = free_loopback_port()
            self._spawn()
            try:
                self._wait_ready()
                return
            except HeliosStartupError:
                code = self.exit_code()
                self.stop(grace_s=2.0)
                if attempt == 1 or code is None:
                    raise

    def _spawn(self) -> None:
        argv = [*self._command, "run", *self._run_args, "--host", "127.0.0.1", "--port", str(self.port)]
        self._started.clear()
        self._launch_error = None

        def supervise() -> None:
            try:
                process = subprocess.Popen(argv, preexec_fn=_die_with_parent)
            except OSError as exc:
                self._launch_error = exc
                self._started.set()
                return
            self._process = process
            self._started.set()
            process.wait()

        threading.Thread(target=supervise, name=f"helios-run-{self.port}", daemon=True).start()
        self._started.wait()
        if self._launch_error is not None:
            raise HeliosStartupError(f"cannot start {argv[0]}: {self._launch_error}")

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self._startup_timeout_s
        url = self.base_url + self._ready_path
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                code = self.exit_code()
                if code is not None:
                    raise HeliosStartupError(f"helios run exited with status {code} before it was ready")
                with contextlib.suppress(httpx.TransportError):
                    if client.get(url).status_code == 200:
                        return
                time.sleep(0.1)
        raise HeliosStartupError(f"helios run was not ready within {self._startup_timeout_s:g} s ({url})")

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM (Helios drains running responses), then SIGKILL after ``grace_s``."""
        process = self._process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
