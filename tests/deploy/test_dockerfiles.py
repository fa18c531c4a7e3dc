"""deploy/docker, checked without a Docker engine: each Dockerfile parses into known instructions,
copies only paths that exist in the build context (the repository root), runs as a non-root user
and starts ``helios`` with arguments ``helios run`` accepts; the CPU image builds the demo core with
the same Ignition command as README.md's first command.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from helios_core.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
INSTRUCTIONS = {
    "FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME", "USER", "WORKDIR",
    "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL",
}  # fmt: skip


@dataclass(frozen=True)
class Instruction:
    keyword: str
    arguments: str
    line: int


class DockerfileError(Exception):
    """A Dockerfile line that is not an instruction Docker knows."""


def parse(text: str) -> list[Instruction]:
    """Instructions with their continuation lines joined; comments and parser directives dropped."""
    instructions: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        joined = " ".join(part for part in pending if part)
        pending = []
        keyword, _, arguments = joined.partition(" ")
        if keyword.upper() not in INSTRUCTIONS or keyword != keyword.upper():
            raise DockerfileError(f"line {start}: unknown instruction {keyword!r}")
        instructions.append(Instruction(keyword, arguments.strip(), start))
    if pending:
        raise DockerfileError("the file ends inside a continued line")
    return instructions


def stages(instructions: list[Instruction]) -> list[list[Instruction]]:
    result: list[list[Instruction]] = []
    for instruction in instructions:
        if instruction.keyword == "FROM":
            result.append([])
        elif not result:
            raise DockerfileError(f"line {instruction.line}: {instruction.keyword} before the first FROM")
        result[-1].append(instruction)
    return result


def exec_form(instruction: Instruction) -> list[str]:
    value = json.loads(instruction.arguments)
    if not (isinstance(value, list) and all(isinstance(item, str) for item in value)):
        raise DockerfileError(f"line {instruction.line}: {instruction.keyword} is not in exec (JSON) form")
    return value


def last(stage: list[Instruction], keyword: str) -> Instruction:
    return [instruction for instruction in stage if instruction.keyword == keyword][-1]


def _dockerfile(name: str) -> list[Instruction]:
    return parse((DOCKER / name).read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_the_image_copies_existing_paths_runs_unprivileged_and_starts_helios_run(name: str) -> None:
    instructions = _dockerfile(name)
    all_stages = stages(instructions)
    for instruction in instructions:
        if instruction.keyword == "COPY" and not instruction.arguments.startswith("--from="):
            *sources, _ = shlex.split(instruction.arguments)
            assert [source for source in sources if not (ROOT / source).exists()] == [], instruction
    runtime = all_stages[-1]
    assert last(runtime, "USER").arguments == "10001"
    assert last(runtime, "EXPOSE").arguments == "8000"
    assert exec_form(last(runtime, "ENTRYPOINT")) == ["helios"]
    command = exec_form(last(runtime, "CMD"))
    if command != ["run", "--help"]:
        build_parser().parse_args(command)
    # the context excludes local state
    ignored = (DOCKER / f"{name}.dockerignore").read_text(encoding="utf-8").split()
    assert {".git", ".venv", ".tox"} <= set(ignored)


def test_the_cpu_image_builds_the_readme_demo_core_and_serves_it_on_all_interfaces() -> None:
    instructions = _dockerfile("Dockerfile.cpu")
    core_stage, runtime = stages(instructions)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    first_command = readme.split("```")[1]
    readme_build = re.search(r"ignition build (\S+) .*?--tool-syntax \S+", first_command)
    assert readme_build is not None
    wanted = shlex.split(readme_build.group(0))
    built = next(i.arguments for i in core_stage if i.keyword == "RUN" and "ignition build" in i.arguments)
    image_build = shlex.split(built[built.index("ignition build") :].split("&&")[0])
    assert _options(image_build) == _options(wanted) | {"--out": "/opt/demo/smol.core",
                                                        "--sign-key": "/opt/demo/keys/signing.pem"}  # fmt: skip
    assert image_build[2] == wanted[2] == "smollm2-135m-instruct"
    command = build_parser().parse_args(exec_form(last(runtime, "CMD")))
    assert (command.host, command.port, str(command.core), command.accept) == (
        "0.0.0.0", 8000, "/opt/demo/smol.core", "demo/smollm2",
    )  # fmt: skip
    # the runtime stage takes the core and the public key, never the signing key
    copied = [i.arguments for i in runtime if i.keyword == "COPY" and i.arguments.startswith("--from=core")]
    assert copied == [
        "--from=core /opt/demo/smol.core /opt/demo/smol.core",
        "--from=core /opt/demo/keys/signing.pub.pem /opt/demo/keys/signing.pub.pem",
    ]


def _options(arguments: list[str]) -> dict[str, str]:
    return {arguments[i]: arguments[i + 1] for i in range(3, len(arguments) - 1, 2) if arguments[i].startswith("--")}


def test_the_cuda_image_uses_a_cuda_runtime_base_and_the_cuda_extra() -> None:
    instructions = _dockerfile("Dockerfile.cuda")
    (stage,) = stages(instructions)
    base = next(i for i in instructions if i.keyword == "FROM").arguments
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-runtime-ubuntu\d+\.\d+", base)
    assert any(i.keyword == "RUN" and "pip install --no-cache-dir '.[cuda]'" in i.arguments for i in stage)


def test_the_parser_refuses_an_unknown_instruction_and_a_dangling_continuation() -> None:
    with pytest.raises(DockerfileError, match="line 2: unknown instruction 'COPPY'"):
        parse("FROM python:3.11-slim\nCOPPY . /src\n")
    with pytest.raises(DockerfileError, match="ends inside a continued line"):
        parse("FROM python:3.11-slim\nRUN true \\\n")
    with pytest.raises(DockerfileError, match="not in exec"):
        exec_form(Instruction("CMD", '"helios run"', 3))
