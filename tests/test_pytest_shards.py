"""``tools/pytest_shards.py``: a selection dealt round-robin over pytest processes run side by side, their
outcomes added up, a failure named and its status returned, and shards past the deadline stopped with what
they reached counted."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "pytest_shards.py"


def _suite(folder: Path) -> None:
    (folder / "test_fast.py").write_text(
        textwrap.dedent(
            """
            import pytest

            @pytest.mark.parametrize("n", range(5))
            def test_passes(n):
                assert n < 5

            def test_fails():
                assert 1 + 1 == 3

            @pytest.mark.skip(reason="never")
            def test_skipped():
                pass
            """
        )
    )
    (folder / "test_in_order.py").write_text(
        textwrap.dedent(
            """
            import time

            def test_first():
                time.sleep(0.01)

            def test_second():
                time.sleep(0.01)
            """
        )
    )
    (folder / "test_slow.py").write_text(
        textwrap.dedent(
            """
            import time

            def test_quick():
                pass

            def test_hangs():
                time.sleep(120)
            """
        )
    )


def _run(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--logs", str(folder / "logs"), *args],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )


def test_shards_deal_the_tests_round_robin_and_add_up_their_outcomes(tmp_path: Path) -> None:
    _suite(tmp_path)
    done = _run(
        tmp_path, "--shards", "3", "test_fast.py", "--serial", "test_in_order.py", "--serial", "test_slow.py",
        "-k", "not hangs",
    )  # fmt: skip
    lines = done.stdout.splitlines()
    assert lines[0] == "pytest_shards: 10 tests in 5 shards"
    # 7 dealt tests in collection order (passes 0 to 4, fails, skipped): 0, 3 and skipped; 1 and 4; 2 and fails.
    # Each serial module's tests in a shard of their own.
    assert lines[1] == "shard 0: 3 tests, exit 0: 2 passed, 1 skipped"
    assert lines[2] == "shard 1: 2 tests, exit 0: 2 passed"
    assert lines[3] == "  shard 2: FAILED test_fast.py::test_fails - assert (1 + 1) == 3"
    assert lines[4] == "shard 2: 2 tests, exit 1: 1 failed, 1 passed"
    assert lines[5] == "shard 3: 2 tests, exit 0: 2 passed"
    assert lines[6] == "shard 4: 1 tests, exit 0: 1 passed"
    assert lines[7].startswith("pytest_shards: 1 failed, 8 passed, 1 skipped in ")
    assert done.returncode == 1
    serial_log = (tmp_path / "logs" / "shard-3.log").read_text()
    assert serial_log.index("test_in_order.py::test_first PASSED") < serial_log.index("test_in_order.py::test_second")


def test_a_keyword_narrows_every_shard_and_a_clean_run_exits_zero(tmp_path: Path) -> None:
    _suite(tmp_path)
    done = _run(tmp_path, "--shards", "2", "-k", "passes", "test_fast.py")
    assert done.stdout.splitlines()[:3] == [
        "pytest_shards: 5 tests in 2 shards",
        "shard 0: 3 tests, exit 0: 3 passed",
        "shard 1: 2 tests, exit 0: 2 passed",
    ]
    assert done.returncode == 0


def test_shards_past_the_deadline_are_stopped_and_count_what_they_reached(tmp_path: Path) -> None:
    _suite(tmp_path)
    done = _run(tmp_path, "--shards", "1", "--timeout", "8", "test_slow.py")
    lines = done.stdout.splitlines()
    assert lines[1] == "shard 0: 2 tests, exit 124: 1 passed (stopped before its summary: 1 not reached)"
    assert lines[2].startswith("pytest_shards: 1 passed in ")
    assert done.returncode == 124


def test_a_selection_that_does_not_collect_names_the_paths(tmp_path: Path) -> None:
    (tmp_path / "test_broken.py").write_text("import no_such_module_here\n")
    done = _run(tmp_path, "test_broken.py")
    assert done.returncode == 1
    assert "pytest_shards: collecting test_broken.py failed" in done.stderr
    assert "no_such_module_here" in done.stderr


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pytest_shards", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_shard_gets_its_share_of_the_cores_for_numpy_unless_the_caller_set_it() -> None:
    shard_environment = _module().shard_environment
    shared = shard_environment({"PATH": "/bin", "MKL_NUM_THREADS": "3"}, 11, 16)
    assert shared == {"PATH": "/bin", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "3"}
    assert shard_environment({}, 4, 16)["OMP_NUM_THREADS"] == "4"
    assert shard_environment({}, 3, 2)["OPENBLAS_NUM_THREADS"] == "1"


def test_the_shards_run_with_those_thread_counts(tmp_path: Path) -> None:
    (tmp_path / "test_env.py").write_text(
        "import os\n\ndef test_threads():\n"
        "    assert os.environ['OPENBLAS_NUM_THREADS'] == str(max(1, (os.cpu_count() or 1) // 2))\n"
    )
    (tmp_path / "test_other.py").write_text("def test_nothing():\n    pass\n")
    done = _run(tmp_path, "--shards", "64", "test_env.py", "test_other.py")
    assert done.stdout.splitlines()[1] == "shard 0: 1 tests, exit 0: 1 passed"
    assert done.returncode == 0
