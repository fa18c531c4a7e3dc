"""``ignition build``'s checks of its options: the output path, numbers, integer lists, names, the
namespace, third-party parser ids and the options a recipe does not take, each refused with one line
naming the option before anything is made (integer lists by argparse, as usage errors); an output
that cannot be written and an interrupt, each one line with no core left behind; and the third-party
parsers a built core selects."""

from __future__ import annotations

import argparse
import errno
import os
import re
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from ignition.build import CONTRACT_ERROR_CHARS, assemble, shortened_contract_error, validate_and_write
from ignition.cli import build_parser
from ignition.recipes.llama import Capacities
from ignition.recipes.synthetic import synthetic_declaration

from helios_core.container.keys import TrustStore, generate_keys, load_private_key
from helios_core.container.reader import CoreFile
from helios_core.errors import ContractError
from helios_core.wire import contract_pb2 as ct
from tests.ignition.cli_helpers import build as _build
from tests.ignition.cli_helpers import refused as _refused

RECIPES = ("llama-synthetic", "smollm2-135m-instruct", "recurrent-synthetic", "latent-synthetic", "vision-synthetic")
SYNTHETIC_RECIPES = ("llama-synthetic", "recurrent-synthetic", "latent-synthetic", "vision-synthetic")


@pytest.fixture(scope="module")
def key_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A key set outside every test's own folder, so a test can require its folder to stay empty."""
    return generate_keys(tmp_path_factory.mktemp("keys") / "keys")


@pytest.fixture(scope="module")
def signing_key(key_paths: dict[str, Path]) -> Path:
    return key_paths["signing"]


# --out


def test_a_gpu_target_without_triton_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    found = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *rest: None if name == "triton" else found(name, *rest)
    )
    out = tmp_path / "gpu.core"
    _refused(
        capsys,
        _build(out, "--targets", "reference,sm_90a"),
        "--targets sm_90a needs Triton to compile kernels, which is not installed: pip install "
        "'helios-ignition[gpu]' (or, from a checkout, pip install -e 'contrib/ignition[gpu]')",
    )
    assert not out.exists()


def test_a_fifo_out_is_refused_and_left_in_place(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], signing_key: Path
) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    _refused(capsys, _build(fifo, key=signing_key), f"--out {fifo} is a FIFO; name a core file to write")
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    assert [p.name for p in tmp_path.iterdir()] == ["fifo"]


def test_a_directory_out_is_refused_naming_the_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], signing_key: Path
) -> None:
    folder = tmp_path / "cores"
    folder.mkdir()
    _refused(capsys, _build(folder, key=signing_key), f"--out {folder} is a directory; name a core file to write")
    assert list(folder.iterdir()) == [] and [p.name for p in tmp_path.iterdir()] == ["cores"]


def test_a_link_to_a_fifo_is_refused_naming_both(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], signing_key: Path
) -> None:
    fifo, link = tmp_path / "fifo", tmp_path / "link.core"
    os.mkfifo(fifo)
    link.symlink_to(fifo)
    _refused(
        capsys, _build(link, key=signing_key), f"--out {link} (a link to {fifo}) is a FIFO; name a core file to write"
    )
    assert link.is_symlink() and stat.S_ISFIFO(fifo.lstat().st_mode)


def test_an_out_in_a_missing_directory_is_refused_before_any_key_is_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "missing" / "x.core"
    _refused(capsys, _build(out), f"--out {out}: the directory {tmp_path / 'missing'} does not exist")
    assert list(tmp_path.iterdir()) == []


def test_an_out_link_loop_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], signing_key: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    first.symlink_to(second)
    second.symlink_to(first)
    assert _build(first, key=signing_key) == 1
    assert re.fullmatch(rf"ignition: error: --out {first} cannot be resolved: .*\n", capsys.readouterr().err)


def test_a_core_is_written_through_a_link_to_its_target(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], signing_key: Path
) -> None:
    direct, target, link = tmp_path / "direct.core", tmp_path / "store" / "target.core", tmp_path / "link.core"
    target.parent.mkdir()
    target.write_bytes(b"an older core")
    link.symlink_to(target)
    assert _build(direct, key=signing_key) == 0
    assert _build(link, key=signing_key) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith(f"wrote {link} (")
    assert link.is_symlink() and link.readlink() == target
    assert target.read_bytes() == direct.read_bytes()
    assert sorted(p.name for p in target.parent.iterdir()) == ["target.core"]  # the temporary file is gone


def test_a_dangling_link_makes_its_target(tmp_path: Path, signing_key: Path) -> None:
    target, link = tmp_path / "new.core", tmp_path / "link.core"
    link.symlink_to(target.name)
    assert _build(link, key=signing_key) == 0
    assert link.is_symlink() and target.is_file() and not target.is_symlink()


def test_an_out_in_a_directory_no_one_may_write_is_refused_before_any_key_is_made(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # root may write almost anywhere, but not into /proc: the directory is tried, not only its mode bits
    assert _build("/proc/x.core") == 1
    error = capsys.readouterr().err
    assert re.fullmatch(
        r"ignition: error: --out /proc/x\.core: the directory /proc (is not writable|cannot be written: .+)\n", error
    )
    assert not Path("/proc/x.core.keys").exists()


@pytest.mark.parametrize(
    ("step", "error"),
    [
        ("helios_core.container.writer.open", errno.EACCES),  # the temporary file cannot be made
        ("helios_core.container.writer.os.fsync", errno.ENOSPC),  # the disk fills up (an error naming no file)
    ],
)
def test_an_out_that_fails_when_written_names_out_not_a_temporary_file(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    signing_key: Path,
    step: str,
    error: int,
) -> None:
    def refuse(target: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(target, int):
            raise OSError(error, os.strerror(error))
        raise OSError(error, os.strerror(error), str(target))

    monkeypatch.setattr(step, refuse, raising=False)
    out = tmp_path / "x.core"
    _refused(capsys, _build(out, key=signing_key), f"--out {out} cannot be written: {os.strerror(error)}")
    assert list(tmp_path.iterdir()) == []


# interrupts


@pytest.mark.parametrize(
    "step",
    [
        "ignition.build.assemble",  # while the programs are written
        "helios_core.container.writer.os.fsync",  # once every byte is in the temporary file
    ],
)
def test_an_interrupted_build_prints_one_line_and_leaves_no_core(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, signing_key: Path, step: str
) -> None:
    def interrupt(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(step, interrupt)
    try:
        code = _build(tmp_path / "x.core", key=signing_key)
    except KeyboardInterrupt:
        pytest.fail("the interrupt escaped ignition's main as a traceback")
    _refused(capsys, code, "interrupted")
    assert list(tmp_path.iterdir()) == []


# numbers


@pytest.mark.parametrize("recipe", RECIPES)
def test_page_tokens_zero_is_refused_for_every_recipe(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], recipe: str
) -> None:
    code = _build(tmp_path / "x.core", "--page-tokens", "0", recipe=recipe)
    _refused(capsys, code, "--page-tokens must be a positive integer, got 0")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--page-tokens", "4294967295"],
            "--page-tokens must be at most --context 512 (a page holds tokens of one request), got 4294967295",
        ),
        (
            ["--page-tokens", "65", "--context", "64"],
            "--page-tokens must be at most --context 64 (a page holds tokens of one request), got 65",
        ),
    ],
)
def test_a_page_larger_than_the_context_is_refused_for_every_recipe(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], recipe: str, extra: list[str], message: str
) -> None:
    _refused(capsys, _build(tmp_path / "x.core", *extra, recipe=recipe), message)
    assert list(tmp_path.iterdir()) == []


def test_a_page_of_the_whole_context_builds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], signing_key: Path
) -> None:
    out = tmp_path / "x.core"
    extra = ("--page-tokens", "64", "--context", "64", "--prefill-tokens", "16", "--max-rows", "2")
    assert _build(out, *extra, key=signing_key) == 0
    assert capsys.readouterr().out.startswith(f"wrote {out} (")


@pytest.mark.parametrize(
    ("recipe", "extra", "message"),
    [
        ("llama-synthetic", ["--context", "-5"], "--context must be a positive integer, got -5"),
        ("llama-synthetic", ["--context", "0"], "--context must be a positive integer, got 0"),
        ("llama-synthetic", ["--cache-pages", "-1"], "--cache-pages must be a positive integer, got -1"),
        ("llama-synthetic", ["--cache-pages", "0"], "--cache-pages must be a positive integer, got 0"),
        ("smollm2-135m-instruct", ["--cache-pages", "0"], "--cache-pages must be a positive integer, got 0"),
        ("recurrent-synthetic", ["--cache-pages", "0"], "--cache-pages must be a positive integer, got 0"),
        ("llama-synthetic", ["--page-tokens", "-4"], "--page-tokens must be a positive integer, got -4"),
        ("llama-synthetic", ["--max-rows", "0"], "--max-rows must be a positive integer, got 0"),
        ("latent-synthetic", ["--max-rows", "-3"], "--max-rows must be a positive integer, got -3"),
        ("llama-synthetic", ["--seed", "-1"], "--seed must be a non-negative integer, got -1"),
        ("vision-synthetic", ["--seed", "-1"], "--seed must be a non-negative integer, got -1"),
        (
            "llama-synthetic",
            ["--cache-pages", "100000000000"],
            "--cache-pages must be at most 4294967295, got 100000000000",
        ),
        ("llama-synthetic", ["--window", "4294967296"], "--window must be at most 4294967295, got 4294967296"),
        (
            "llama-synthetic",
            ["--prefill-tokens", "16,4294967296"],
            "--prefill-tokens must be at most 4294967295, got 4294967296",
        ),
    ],
)
def test_a_bad_number_is_refused_naming_its_option_before_any_key_is_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], recipe: str, extra: list[str], message: str
) -> None:
    _refused(capsys, _build(tmp_path / "x.core", *extra, recipe=recipe), message)
    assert list(tmp_path.iterdir()) == []


def test_capacities_refuse_an_empty_page() -> None:
    with pytest.raises(ValueError, match=r"^Capacities\.page_tokens must be at least 1, got 0$"):
        Capacities(page_tokens=0)
    with pytest.raises(ValueError, match=r"^Capacities\.page_tokens must be at most context 64, got 128$"):
        Capacities(page_tokens=128, context=64)
    with pytest.raises(ValueError, match=r"^Capacities\.decode_rows must be positive extents, got \(\)$"):
        Capacities(decode_rows=())


# integer lists


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--prefill-tokens", "16,,64", "empty entry in '16,,64'; expected comma-separated positive integers"),
        ("--prefill-tokens", ",16", "empty entry in ',16'; expected comma-separated positive integers"),
        ("--prefill-tokens", "16,", "empty entry in '16,'; expected comma-separated positive integers"),
        ("--prefill-tokens", "", "empty entry in ''; expected comma-separated positive integers"),
        ("--decode-rows", "2,,4", "empty entry in '2,,4'; expected comma-separated positive integers"),
        ("--decode-rows", "1,2,8,", "empty entry in '1,2,8,'; expected comma-separated positive integers"),
        ("--prefill-tokens", "16,16", "16 is given twice in '16,16'"),
        ("--prefill-tokens", "64,16,64", "64 is given twice in '64,16,64'"),
        ("--decode-rows", "1,2,2,8", "2 is given twice in '1,2,2,8'"),
        ("--prefill-tokens", "16,x", "expected comma-separated integers, got '16,x'"),
        ("--decode-rows", "0,8", "expected positive integers, got '0,8'"),
    ],
)
def test_an_integer_list_with_an_empty_or_repeated_entry_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str, value: str, message: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        _build(tmp_path / "x.core", option, value)
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.endswith(f"\nignition build: error: argument {option}: {message}\n")
    assert list(tmp_path.iterdir()) == []


# contract errors


def test_a_long_contract_error_names_three_problems_and_counts_the_rest() -> None:
    problems = "; ".join(f"problem {index}" for index in range(1, 44))
    assert shortened_contract_error(f"invalid contract (43 problems): {problems}") == (
        "invalid contract (43 problems): problem 1; problem 2; problem 3; and 40 more"
    )
    assert shortened_contract_error("invalid contract (2 problems): a; b") == "invalid contract (2 problems): a; b"
    assert shortened_contract_error("invalid contract: one") == "invalid contract: one"
    long = shortened_contract_error("invalid contract: " + "x" * 5000)
    assert len(long) == CONTRACT_ERROR_CHARS and long.endswith("...")


def test_validation_raises_the_shortened_error(tmp_path: Path, signing_key: Path) -> None:
    caps = Capacities(max_rows=2, prefill_tokens=(16,), decode_rows=(1, 2), page_tokens=4, cache_pages=32, context=64)
    serving, builder, resources = assemble(synthetic_declaration("tiny"), caps)
    builder.manifest.ClearField("transport")  # every binding then names a missing entry
    out = tmp_path / "broken.core"
    with pytest.raises(ContractError) as raised:
        validate_and_write(
            out, serving, builder, resources, signing_key=load_private_key(signing_key), namespace="tests/broken",
            layout="payload", core_key=None, description="",
        )  # fmt: skip
    message = str(raised.value)
    listing = re.fullmatch(r"invalid contract \((\d+) problems\): [^\n]*; and (\d+) more", message)
    assert listing is not None and int(listing.group(2)) == int(listing.group(1)) - 3 > 100
    assert len(message) <= CONTRACT_ERROR_CHARS
    assert len(str(raised.value.__cause__)) > 10_000  # what Helios' own check listed
    assert list(tmp_path.iterdir()) == []


# names, the namespace and options a recipe does not take


@pytest.mark.parametrize(
    ("recipe", "extra", "message"),
    [
        ("smollm2-135m-instruct", ["--shape", "tiny"], "smollm2-135m-instruct does not take --shape"),
        (
            "smollm2-135m-instruct",
            ["--seed", "0", "--extra-special", "<x>"],
            "smollm2-135m-instruct does not take --seed, --extra-special",
        ),
        ("smollm2-135m-instruct", ["--extra-special", ""], "smollm2-135m-instruct does not take --extra-special"),
        ("recurrent-synthetic", ["--extra-special", ""], "recurrent-synthetic does not take --extra-special"),
        ("vision-synthetic", ["--extra-special", ""], "vision-synthetic does not take --extra-special"),
        (
            "llama-synthetic",
            ["--extra-special", "<|im_end|>"],
            "--extra-special token '<|im_end|>' is already a special token of the synthetic tokenizer",
        ),
        ("llama-synthetic", ["--extra-special", ","], "--extra-special has an empty token name in ','"),
        ("llama-synthetic", ["--extra-special", ""], "--extra-special has an empty token name in ''"),
        ("llama-synthetic", ["--extra-special", "<a>,,<b>"], "--extra-special has an empty token name in '<a>,,<b>'"),
        ("llama-synthetic", ["--extra-special", "<a>,<a>"], "--extra-special names '<a>' twice"),
        (
            "llama-synthetic",
            ["--extra-special", "a"],
            "--extra-special token 'a' is already a byte token of the synthetic tokenizer",
        ),
        (
            "llama-synthetic",
            ["--extra-special", "<tool_call>", "--tool-syntax", "json-tags"],
            "--extra-special token '<tool_call>' is already added by --tool-syntax json-tags",
        ),
        ("llama-synthetic", ["--targets", ""], "--targets has an empty target name in ''"),
        ("llama-synthetic", ["--targets", "reference,"], "--targets has an empty target name in 'reference,'"),
        ("recurrent-synthetic", ["--targets", ",reference"], "--targets has an empty target name in ',reference'"),
        ("llama-synthetic", ["--targets", "reference,reference"], "--targets names 'reference' twice"),
        ("llama-synthetic", ["--namespace", ""], "--namespace must not be empty"),
        (
            "llama-synthetic",
            ["--namespace", " weird ns "],
            "--namespace must not begin or end with whitespace, got ' weird ns '",
        ),
        (
            "vision-synthetic",
            ["--namespace", "acme/tiny\n"],
            "--namespace must not begin or end with whitespace, got 'acme/tiny\\n'",
        ),
        ("llama-synthetic", ["--namespace", "acme\tx"], "--namespace must be printable text, got 'acme\\tx'"),
        ("vision-synthetic", ["--tool-syntax", "xtml"], "vision-synthetic does not take --tool-syntax xtml"),
        (
            "vision-synthetic",
            ["--tool-syntax", "recipient-header"],
            "vision-synthetic does not take --tool-syntax recipient-header",
        ),
    ],
)
def test_a_name_or_option_the_recipe_cannot_use_is_refused_before_any_key_is_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], recipe: str, extra: list[str], message: str
) -> None:
    _refused(capsys, _build(tmp_path / "x.core", *extra, recipe=recipe), message)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("recipe", "extra"),
    [
        ("llama-synthetic", ["--extra-special", "<a>,<b>", "--namespace", "acme tiny"]),
        ("vision-synthetic", ["--tool-syntax", "json-tags", "--seed", "3"]),
        ("recurrent-synthetic", ["--shape", "small", "--seed", "2"]),
    ],
)
def test_the_options_a_recipe_takes_still_build(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], signing_key: Path, recipe: str, extra: Sequence[str]
) -> None:
    out = tmp_path / "x.core"
    assert _build(out, *extra, recipe=recipe, key=signing_key) == 0
    assert capsys.readouterr().out.startswith(f"wrote {out} (")


def test_extra_special_tokens_are_new_tokens_in_order() -> None:
    model = synthetic_declaration("tiny", extra_special=("<a>", "<b>"), tool_syntax="json-tags")
    assert model.sampled_size == 263  # 256 bytes, 3 special tokens, <a>, <b>, <tool_call>, </tool_call>
    with pytest.raises(ValueError, match=r"^--extra-special names '<a>' twice$"):
        synthetic_declaration("tiny", extra_special=("<a>", "<a>"))


@pytest.mark.parametrize("option", ["--shape", "--seed"])
def test_the_help_names_the_recipes_that_take_shape_and_seed(option: str) -> None:
    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    (action,) = [a for a in commands.choices["build"]._actions if option in a.option_strings]
    help_text = action.help or ""
    assert [recipe for recipe in RECIPES if recipe in help_text] == list(SYNTHETIC_RECIPES)


# third-party parsers


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--tool-parser", "7"], "--tool-parser must be a third-party tool parser id in 100000-199999, got '7'"),
        (
            ["--tool-parser", "200000"],
            "--tool-parser must be a third-party tool parser id in 100000-199999, got '200000'",
        ),
        (
            ["--tool-parser", "json-tags"],
            "--tool-parser must be a third-party tool parser id in 100000-199999, got 'json-tags'",
        ),
        (
            ["--reasoning-parser", "99999"],
            "--reasoning-parser must be a third-party reasoning parser id in 100000-199999, got '99999'",
        ),
        (
            ["--reasoning-parser", ""],
            "--reasoning-parser must be a third-party reasoning parser id in 100000-199999, got ''",
        ),
        (
            ["--tool-syntax", "xtml", "--tool-parser", "100001"],
            "--tool-syntax xtml pairs the reasoning parser REASONING_PARSER_XTML_THINK with the tool parser "
            "TOOL_PARSER_XTML (they share frames); give both --tool-parser and --reasoning-parser, or neither",
        ),
        (
            ["--tool-syntax", "recipient-header", "--reasoning-parser", "100001"],
            "--tool-syntax recipient-header pairs the reasoning parser REASONING_PARSER_RECIPIENT_HEADER with the "
            "tool parser TOOL_PARSER_ATEM (they share frames); give both --tool-parser and --reasoning-parser, "
            "or neither",
        ),
    ],
)
def test_a_parser_id_outside_the_third_party_range_is_refused_before_any_key_is_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    _refused(capsys, _build(tmp_path / "x.core", *extra), message)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("recipe", "extra", "selected"),
    [
        ("llama-synthetic", ["--tool-parser", "100001"], (100001, ct.REASONING_PARSER_NONE)),
        ("llama-synthetic", ["--reasoning-parser", "199999"], (ct.TOOL_PARSER_NONE, 199999)),
        ("llama-synthetic", ["--tool-parser", "100001", "--reasoning-parser", "100002"], (100001, 100002)),
        (
            "llama-synthetic",
            ["--tool-syntax", "json-tags", "--reasoning-parser", "100002"],
            (ct.TOOL_PARSER_JSON_TAGS, 100002),
        ),
        (
            "llama-synthetic",
            ["--tool-syntax", "xtml", "--tool-parser", "100001", "--reasoning-parser", "100002"],
            (100001, 100002),
        ),
        ("recurrent-synthetic", ["--tool-parser", "100001"], (100001, ct.REASONING_PARSER_NONE)),
        ("latent-synthetic", ["--reasoning-parser", "100002"], (ct.TOOL_PARSER_NONE, 100002)),
        (
            "vision-synthetic",
            ["--tool-syntax", "json-tags", "--tool-parser", "100001"],
            (100001, ct.REASONING_PARSER_NONE),
        ),
    ],
)
def test_a_built_core_selects_the_third_party_parsers(
    tmp_path: Path, key_paths: dict[str, Path], recipe: str, extra: list[str], selected: tuple[int, int]
) -> None:
    out = tmp_path / "x.core"
    assert (
        _build(out, "--max-rows", "2", "--prefill-tokens", "16", *extra, recipe=recipe, key=key_paths["signing"]) == 0
    )
    with CoreFile.open(out, TrustStore.from_paths([key_paths["public"]])) as core:
        frontend = core.contract.model.frontend
    assert (frontend.tool_parser, frontend.reasoning_parser) == selected
    tool_syntax = extra[extra.index("--tool-syntax") + 1] if "--tool-syntax" in extra else "none"
    # the tool syntax's data stays for the selected parsers to read; the image selections are the recipe's
    family = {"none": None, "json-tags": "json_tags", "xtml": "xtml"}[tool_syntax]
    assert frontend.tool_syntax.WhichOneof("family") == family
    if recipe == "vision-synthetic":
        assert (frontend.image_preparation, frontend.image_layout) == (
            ct.IMAGE_PREPARATION_FIXED_TILE,
            ct.IMAGE_LAYOUT_RASTER_SPAN,
        )
