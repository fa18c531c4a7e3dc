"""What an operator gets for a path, file or option that cannot work: one line naming it, exit 1.

Covers the core path (a directory, a FIFO, a missing file), key files that never end, the
``--messages`` file of ``helios generate``, ``helios keys generate --out``, and ``helios generate``
taking a chat request the way a served one is taken (images, the core's plugins).
"""

from __future__ import annotations

import base64
import io
import json
import os
from pathlib import Path

import pytest
from PIL import Image

from helios_core.cli import main

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "cores"
KEYS = FIXTURES / "keys"
TRUST = ["--trust-key", str(KEYS / "signing.pub.pem"), "--accept", "helios-fixtures/golden"]


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _one_line(command: str, err: str) -> str:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    prefix = f"helios {command}: error: "
    assert err.startswith(prefix), err
    return err[len(prefix) : -1]


@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_a_directory_as_the_core_is_named(command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = [command, str(tmp_path), *(TRUST if command == "verify" else [])]
    code, out, err = run(args, capsys)
    assert (code, out) == (1, "")
    assert _one_line(command, err) == f"cannot open core file '{tmp_path}': it is a directory"


@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_a_fifo_as_the_core_is_refused_without_waiting(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fifo = tmp_path / "core.fifo"
    os.mkfifo(fifo)
    code, _, err = run([command, str(fifo), *(TRUST if command == "verify" else [])], capsys)
    assert code == 1
    assert _one_line(command, err) == f"cannot open core file '{fifo}': it is not a regular file"


def test_inspect_names_a_missing_core(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.core"
    code, _, err = run(["inspect", str(missing)], capsys)
    assert code == 1
    assert _one_line("inspect", err) == f"cannot open core file '{missing}': No such file or directory"


@pytest.mark.parametrize("option", ["--trust-key", "--core-key"])
def test_a_key_file_that_never_ends_is_refused(option: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["verify", str(FIXTURES / "payload-v3.core"), *TRUST]
    args = [*args, option, "/dev/zero"] if option == "--core-key" else [*args[:2], option, "/dev/zero", *args[4:]]
    code, _, err = run(args, capsys)
    what = "public key" if option == "--trust-key" else "core key"
    assert code == 1
    assert _one_line("verify", err) == f"the {what} file '/dev/zero' holds more than 65536 bytes; it is not a key file"


def _generate(messages: str, *extra: str, core: str = "payload-v3.core") -> list[str]:
    core_path = str(FIXTURES / core)
    return ["generate", "--core", core_path, "--messages", messages, "--backend", "reference", *TRUST, *extra]


def test_a_messages_file_that_cannot_be_read_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.json"
    latin = tmp_path / "latin.json"
    latin.write_bytes(b'[{"role": "user", "content": "caf\xe9"}]')
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    expected = {
        str(missing): f"cannot read --messages from '{missing}': No such file or directory",
        str(tmp_path): f"cannot read --messages from '{tmp_path}': Is a directory",
        str(latin): f"--messages from '{latin}' is not UTF-8 text: 'utf-8' codec can't decode byte 0xe9 in "
        "position 33: invalid continuation byte",
        str(deep): f"--messages from '{deep}' nests its JSON too deeply",
    }
    for source, message in expected.items():
        code, out, err = run(_generate(source), capsys)
        assert (code, out) == (1, "")
        assert _one_line("generate", err) == message


def test_keys_generate_names_an_out_that_cannot_hold_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    cases = {
        "": "--out must name a directory, not an empty string",
        str(a_file): f"cannot write keys into '{a_file}': it exists and is not a directory",
        str(a_file / "keys"): f"cannot create the key directory '{a_file / 'keys'}': Not a directory",
    }
    for out_dir, message in cases.items():
        code, out, err = run(["keys", "generate", "--out", out_dir], capsys)
        assert (code, out) == (1, "")
        assert _one_line("keys", err) == message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def _png_url(side: int) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (side, side), (200, 30, 90)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_generate_takes_a_request_image_as_the_server_does(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = [{"role": "user", "content": "What is this?"}]
    image = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": _png_url(8)}},
            ],
        }
    ]
    prompts = []
    for index, messages in enumerate((text, image)):
        path = tmp_path / f"m{index}.json"
        path.write_text(json.dumps(messages))
        code, out, err = run(_generate(str(path), "--json", "--max-tokens", "2", core="vision-tiles.core"), capsys)
        assert (code, err) == (0, ""), err
        prompts.append(json.loads(out)["prompt_token_ids"])
    from helios_core.contract import LoadOptions
    from helios_core.loading import TrustSettings
    from helios_core.runtime.startup import start
    from helios_core.server.preparation import Frontend, prepare
    from helios_core.server.schemas import decode_request

    trust = TrustSettings((KEYS / "signing.pub.pem",), "helios-fixtures/golden", None)
    running = start(FIXTURES / "vision-tiles.core", trust, LoadOptions(max_active=1), backend="reference")
    try:
        body = json.dumps({"messages": image, "max_tokens": 2, "seed": 0}).encode()
        served = prepare(Frontend(running), decode_request(body), "served")
    finally:
        running.close()
    assert prompts[1] == served.request.prompt_ids
    assert len(prompts[1]) > len(prompts[0]) + 1  # the image's span, not its one sentinel


def test_generate_resolves_the_core_plugins_as_run_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "m.json"
    path.write_text(json.dumps([{"role": "user", "content": "hi"}]))
    monkeypatch.setenv("HELIOS_DISABLE_PLUGIN_AUTOLOAD", "1")
    code, out, err = run(_generate(str(path), core="vision-example-layout.core"), capsys)
    assert (code, out) == (1, "")
    assert _one_line("generate", err).startswith(
        "image layout 100001 is selected by the core but no installed plugin provides it"
    )


def test_the_trust_keys_come_from_either_environment_name(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    core = str(FIXTURES / "payload-v3.core")
    for name in ("HELIOS_TRUST_KEYS", "HELIOS_TRUST_KEY"):
        monkeypatch.delenv("HELIOS_TRUST_KEYS", raising=False)
        monkeypatch.delenv("HELIOS_TRUST_KEY", raising=False)
        monkeypatch.setenv(name, str(KEYS / "signing.pub.pem"))
        code, out, err = run(["verify", core, "--accept", "helios-fixtures/golden"], capsys)
        assert (code, err) == (0, ""), (name, err)
        assert out.startswith(f"OK {core}: namespace 'helios-fixtures/golden'")


def test_both_tools_print_their_version(capsys: pytest.CaptureFixture[str]) -> None:
    from ignition import __version__ as ignition_version
    from ignition.cli import main as ignition_main

    from helios_core import __version__

    for entry, name, version in ((main, "helios", __version__), (ignition_main, "ignition", ignition_version)):
        with pytest.raises(SystemExit) as exited:
            entry(["--version"])
        assert exited.value.code == 0
        assert capsys.readouterr().out == f"{name} {version}\n"


def test_helios_starts_from_a_source_tree_without_package_metadata(tmp_path: Path) -> None:
    """``python -m helios_core.cli`` with the repository on ``PYTHONPATH`` and no installed distribution (as
    on a machine that runs the checkout itself) parses its arguments: the version is the package's own."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    (tmp_path / "sitecustomize.py").write_text(
        "import importlib.metadata as metadata\n"
        "real = metadata.distribution\n"
        "def hidden(name):\n"
        "    if name == 'helios':\n"
        "        raise metadata.PackageNotFoundError(name)\n"
        "    return real(name)\n"
        "metadata.distribution = hidden\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{root}"}
    for arguments, expected in ((["--version"], "helios "), (["inspect", str(tmp_path / "missing.core")], "")):
        done = subprocess.run(
            [sys.executable, "-m", "helios_core.cli", *arguments], env=env, capture_output=True, text=True, timeout=120
        )
        assert "Traceback" not in done.stderr, done.stderr
        assert done.stdout.startswith(expected)
    assert done.returncode == 1  # the missing core, named on one line


@pytest.mark.parametrize(("option", "value"), [("--temperature", "nan"), ("--temperature", "inf"), ("--top-p", "nan")])
def test_generate_refuses_a_number_option_that_is_not_finite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str, value: str
) -> None:
    messages = tmp_path / "hi.json"
    messages.write_text('[{"role": "user", "content": "hi"}]')
    with pytest.raises(SystemExit) as exit_info:
        run(_generate(str(messages), option, value), capsys)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: must be a finite number, not '{value}'" in err
    assert "--messages" not in err.splitlines()[-1]


@pytest.mark.parametrize(
    ("tool", "argv", "prog"),
    [
        ("helios", ["verify", "x.core", "--bogus"], "helios verify"),
        ("helios", ["inspect", "x.core", "--json", "--bogus", "extra"], "helios inspect"),
        ("helios", ["run", "--core", "x.core", "--bogus"], "helios run"),
        ("helios", ["keys", "generate", "--out", "k", "--bogus"], "helios keys generate"),
        ("ignition", ["build", "llama-synthetic", "--out", "x.core", "--bogus"], "ignition build"),
    ],
)
def test_an_unknown_option_is_a_usage_error_of_its_subcommand(
    tool: str, argv: list[str], prog: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from ignition.cli import main as ignition_main

    entry = main if tool == "helios" else ignition_main
    with pytest.raises(SystemExit) as exited:
        entry(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: {prog} ")
    unknown = " ".join(argv[argv.index("--bogus") :])
    assert err.endswith(f"\n{prog}: error: unrecognized arguments: {unknown}\n")
