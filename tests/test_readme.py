"""The README's commands run as written, in order, in an empty folder.

Owns the check that a new user's first steps work. Every fenced block of README.md except the test
command (the block after ``<!-- test-command -->``, which is what runs this suite) is run in order
in a temporary folder: shell blocks command by command, Python blocks with ``.venv/bin/python``.
Commands run through bash with the running environment's ``bin`` folder left off ``PATH``, so a bare
``helios`` or ``ignition`` fails as it would on a fresh machine. Only these things differ from a
fresh machine:

* ``python3 -m venv .venv`` makes ``.venv`` a link to the environment running the tests, and
  ``.venv/bin/pip install ...`` is checked rather than run: every editable path must be a project of
  this checkout and every other requirement must be installed here in a version it allows. Every
  module the Python blocks import must come from a distribution the first block installs.
* ``.venv/bin/ignition build smollm2-135m-instruct ...`` runs in this process with the README's
  arguments, the recipe's declaration replaced by the tiny synthetic model under SmolLM2's served
  name and the requested tool syntax (building and running the real model takes minutes here).
* Port 8000 becomes a free port. A ``helios run`` command starts in the background; the next block
  runs once the server answers, and at the end Ctrl+C (SIGINT) must stop it with exit status 0.

The answers of the synthetic model are noise, so outputs are checked for their shape: the plain
``curl`` returns a chat completion, the ``curl -i`` of an oversized request a permanent 503, the tool
example one call of ``get_weather`` with a ``city`` argument.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TEST_COMMAND_MARKER = "<!-- test-command -->"
DEMO_PORT = "8000"
COMMAND_TIMEOUT_S = 60.0
SERVER_START_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Block:
    """One fenced block of the README: its info string, its text and whether it is the test command."""

    language: str
    text: str
    test_command: bool


def readme_blocks(text: str) -> list[Block]:
    """The fenced blocks of ``text`` in order; the first block after the marker is the test command."""
    blocks: list[Block] = []
    lines = text.splitlines()
    index, after_marker = 0, False
    while index < len(lines):
        line = lines[index]
        if line.strip() == TEST_COMMAND_MARKER:
            after_marker = True
        elif line.startswith("```"):
            body: list[str] = []
            index += 1
            while index < len(lines) and not lines[index].startswith("```"):
                body.append(lines[index])
                index += 1
            if index == len(lines):
                raise AssertionError(f"README.md: the block opened by {line!r} is never closed")
            blocks.append(Block(line[3:].strip(), "\n".join(body), after_marker))
            after_marker = False
        index += 1
    return blocks


def shell_commands(text: str) -> list[str]:
    """The commands of a shell block: continuation lines joined, comments dropped, ``&&`` chains split."""
    joined = re.sub(r"\\\n\s*", " ", text)
    commands: list[str] = []
    for line in joined.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        for part in stripped.split(" && "):
            shlex.split(part)  # unbalanced quotes fail here, naming the command
            commands.append(part.strip())
    return commands


def _is_pip_install(argv: list[str]) -> bool:
    return len(argv) > 1 and Path(argv[0]).name == "pip" and argv[1] == "install"


def _pip_targets(argv: list[str]) -> tuple[list[str], list[Requirement]]:
    """The editable paths and the requirements of a ``pip install`` command line."""
    editable: list[str] = []
    requirements: list[Requirement] = []
    words = iter(argv[2:])
    for word in words:
        if word == "-e":
            editable.append(next(words))
        elif not word.startswith("-"):
            requirements.append(Requirement(word))
    return editable, requirements


def check_pip_install(argv: list[str]) -> list[str]:
    """Check a ``pip install`` line against this checkout and environment; returns the distribution
    names it installs (editable projects by their project name)."""
    editable, requirements = _pip_targets(argv)
    names: list[str] = []
    for target in editable:
        project = ROOT / re.sub(r"\[.*\]$", "", target)
        pyproject = project / "pyproject.toml"
        assert pyproject.is_file(), f"{shlex.join(argv)}: {target} is not a project of this checkout"
        match = re.search(r'^name = "([^"]+)"', pyproject.read_text(), re.MULTILINE)
        assert match is not None, f"{pyproject} declares no project name"
        names.append(match.group(1))
    for requirement in requirements:
        try:
            installed = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            raise AssertionError(f"{shlex.join(argv)}: {requirement.name} is not installed here") from None
        assert requirement.specifier.contains(installed, prereleases=True), (
            f"{shlex.join(argv)}: {requirement} does not allow the installed {requirement.name} {installed}"
        )
        names.append(requirement.name)
    return names


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def imported_distributions(source: str) -> dict[str, set[str]]:
    """Module -> the distributions providing it, for each non-stdlib top-level import of ``source``."""
    modules: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module.split(".")[0])
    providers = importlib.metadata.packages_distributions()
    return {
        module: {_normalized(d) for d in providers.get(module, [])}
        for module in sorted(modules - set(sys.stdlib_module_names))
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def tiny_smollm2_declaration(progress: Any = None, *, tool_syntax: str = "none") -> Any:
    """The tiny synthetic model standing in for SmolLM2 (same served name, the requested tool syntax)."""
    from ignition.recipes.smollm2 import SERVED_NAME
    from ignition.recipes.synthetic import synthetic_declaration

    declaration = synthetic_declaration("tiny", tool_syntax=tool_syntax)
    return dataclasses.replace(declaration, served_name=SERVED_NAME, description="tiny stand-in for SmolLM2")


@dataclass
class Session:
    """The folder the README's commands run in, their environment and the background server."""

    folder: Path
    port: int
    env: dict[str, str]
    server: subprocess.Popen[bytes] | None = None
    server_command: str = ""
    installed: list[str] = field(default_factory=list)
    outputs: list[tuple[Block, str]] = field(default_factory=list)

    def run_shell(self, script: str) -> str:
        return self._run(["bash", "-euo", "pipefail", "-c", script], "README command", script)

    def run_python(self, source: str, number: int) -> str:
        script = self.folder / f"readme_example_{number}.py"
        script.write_text(source)
        return self._run([str(self.folder / ".venv" / "bin" / "python"), script.name], "README Python example", source)

    def _run(self, argv: list[str], what: str, text: str) -> str:
        """Run ``argv`` in the session's folder and environment; its stdout, or a failure quoting ``text``."""
        result = subprocess.run(
            argv, cwd=self.folder, env=self.env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
        )
        assert result.returncode == 0, (
            f"{what} failed with exit status {result.returncode}:\n{text}\n"
            f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
        )
        return result.stdout

    def start_server(self, command: str) -> None:
        assert self.server is None, "the README starts a second server while the first one runs"
        log = open(self.folder / "server.log", "wb")  # noqa: SIM115 - closed with the session
        self.server = subprocess.Popen(
            ["bash", "-c", f"exec {command}"],
            cwd=self.folder,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.server_command = command
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        url = f"http://127.0.0.1:{self.port}/v1/models"
        while True:
            if self.server.poll() is not None:
                raise AssertionError(f"{command} exited with {self.server.returncode}:\n{self.server_log()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"{command} did not answer within {SERVER_START_TIMEOUT_S} s")
            time.sleep(0.1)

    def stop_server(self) -> int | None:
        """Ctrl+C the background server; its exit status (None if it was not running)."""
        if self.server is None:
            return None
        server, self.server = self.server, None
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
        try:
            return server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
            return None

    def server_log(self) -> str:
        return (self.folder / "server.log").read_text(errors="replace")


def _environment(folder: Path) -> dict[str, str]:
    """The parent environment without this environment's ``bin`` on PATH, Helios settings or proxies."""
    hidden = {str(Path(sys.prefix) / "bin"), str(Path(sys.executable).parent)}
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("HELIOS_") and key.lower() not in {"http_proxy", "https_proxy", "all_proxy"}
    }
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p and p not in hidden)
    env.pop("VIRTUAL_ENV", None)
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    env["HOME"] = str(folder)
    return env


@pytest.fixture
def session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Session]:
    environment = Path(sys.prefix)
    for script in ("python", "helios", "ignition"):
        if not (environment / "bin" / script).exists():
            raise AssertionError(f"the README test needs {environment}/bin/{script} (run it in a virtual environment)")
    env = _environment(tmp_path)
    for program in ("bash", "curl"):
        if shutil.which(program, path=env["PATH"]) is None:
            raise AssertionError(f"the README's commands need {program}, which is not on PATH")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("ignition.recipes.smollm2.smollm2_declaration", tiny_smollm2_declaration)
    value = Session(tmp_path, free_port(), env)
    try:
        yield value
    finally:
        value.stop_server()


def _run_shell_block(session: Session, block: Block, first: bool) -> str:
    from ignition.cli import main as ignition_main

    output: list[str] = []
    pending: list[str] = []

    def flush() -> None:
        if pending:
            output.append(session.run_shell("\n".join(pending)))
            pending.clear()

    for command in shell_commands(block.text):
        argv = shlex.split(command)
        if argv == ["python3", "-m", "venv", ".venv"]:
            flush()
            (session.folder / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
        elif _is_pip_install(argv):
            flush()
            names = check_pip_install(argv)
            if first:
                session.installed.extend(names)
        elif argv[:3] == [".venv/bin/ignition", "build", "smollm2-135m-instruct"]:
            flush()
            assert ignition_main(argv[1:]) == 0, f"{command} failed"
        elif argv[:2] == [".venv/bin/helios", "run"]:
            flush()
            session.start_server(command)
        else:
            pending.append(command)
    flush()
    return "".join(output)


def _check_output(block: Block, output: str) -> None:
    """Shape checks of the outputs the README shows (the synthetic model's text is noise)."""
    if block.language == "python" and "tool_choice" in block.text:
        # One line a call: split on newlines only, since str.splitlines() also breaks at characters a
        # JSON string may hold unescaped (U+0085, U+2028, U+2029).
        lines = output.rstrip("\n").split("\n")
        assert len(lines) == 1, output
        name, _, arguments = lines[0].partition(" ")
        assert name == "get_weather"
        assert set(json.loads(arguments)) == {"city"}
    elif block.language != "python" and "curl" in block.text and " -i " in block.text:
        headers, _, body = output.replace("\r\n", "\n").partition("\n\n")
        assert headers.startswith("HTTP/1.1 503"), output
        assert "x-should-retry: false" in headers.lower().splitlines(), output
        error = json.loads(body)["error"]
        assert (error["type"], error["param"], error["code"]) == ("admission_rejected", "max_tokens", 503)
    elif block.language != "python" and "curl" in block.text:
        completion = json.loads(output)
        assert completion["object"] == "chat.completion"
        assert completion["model"] == "SmolLM2-135M-Instruct"


def test_the_readme_commands_run_in_order(session: Session) -> None:
    text = README.read_text().replace("127.0.0.1:" + DEMO_PORT, f"127.0.0.1:{session.port}")
    text = text.replace("--port " + DEMO_PORT, f"--port {session.port}")
    blocks = readme_blocks(text)
    test_commands = [b for b in blocks if b.test_command]
    assert len(test_commands) == 1, "README.md needs exactly one test command after " + TEST_COMMAND_MARKER
    for command in shell_commands(test_commands[0].text):
        if _is_pip_install(shlex.split(command)):
            check_pip_install(shlex.split(command))
    runnable = [b for b in blocks if not b.test_command]
    assert runnable[0].language == "" and "helios run" in runnable[0].text, "the README must open with the demo"

    for number, block in enumerate(runnable):
        if block.language == "python":
            for module, distributions in imported_distributions(block.text).items():
                installed = {_normalized(n) for n in session.installed}
                assert distributions & installed, (
                    f"a README Python example imports {module!r}, which the first command does not install"
                )
            output = session.run_python(block.text, number)
        else:
            output = _run_shell_block(session, block, first=number == 0)
        _check_output(block, output)
        session.outputs.append((block, output))

    assert session.server is not None, "the README's demo server is not running at the end"
    log = session.server_log()
    status = session.stop_server()
    assert status == 0, f"Ctrl+C did not stop the demo server cleanly (status {status}):\n{log}"
    checked = [b for b, _ in session.outputs if "curl" in b.text or "tool_choice" in b.text]
    assert len(checked) == 3, "the README's curl examples and tool example were not all found"
