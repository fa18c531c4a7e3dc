"""The disk kernel cache keeps each Triton version's cubins in a folder of their own: a build reads the
cubins its own compiler version made and never one another version made (at the cache's root, as the
cache kept them before, or in another version's folder); an entry appears whole or not at all."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from ignition.kernels import compiler  # noqa: E402
from ignition.kernels.compiler import KernelCompileError, compile_triton  # noqa: E402


@triton.jit  # type: ignore[misc, untyped-decorator]
def _double(x_ptr, out_ptr, N: tl.constexpr):  # type: ignore[no-untyped-def]
    offsets = tl.arange(0, N)
    tl.store(out_ptr + offsets, 2 * tl.load(x_ptr + offsets))


SIGNATURE = {"x_ptr": "*fp32", "out_ptr": "*fp32"}
CONSTANTS = {"N": 16}


def _entry(folder: Path, key: str, cubin: bytes) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{key}.cubin").write_bytes(cubin)
    meta = {"symbol": "_double", "num_warps": 4, "shared_bytes": 0, "scratch_params": 2}
    (folder / f"{key}.json").write_text(json.dumps(meta))


def _refuse_to_compile(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("compiled instead of reading the cache")


def test_a_build_reads_only_its_own_compiler_versions_cubins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = compiler._request_key(
        _double, SIGNATURE, CONSTANTS, aligned=frozenset(), target="sm_90a", num_warps=4, num_stages=2
    )[0]
    monkeypatch.setenv("IGNITION_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(compiler, "_MEMORY", {})
    monkeypatch.setattr(triton, "compile", _refuse_to_compile)
    version = compiler.compiler_version()
    assert version == triton.__version__
    _entry(tmp_path / f"triton-{version}", key, b"this version's cubin")
    _entry(tmp_path, key, b"a cubin of unknown version")
    _entry(tmp_path / "triton-0.0.1", key, b"another version's cubin")
    kernel = compile_triton(_double, SIGNATURE, CONSTANTS)
    assert kernel.cubin == b"this version's cubin" and kernel.scratch_params == 2

    monkeypatch.setattr(compiler, "_MEMORY", {})
    monkeypatch.setattr(compiler, "compiler_version", lambda: "0.0.2")  # a version with no cubin cached
    with pytest.raises(KernelCompileError, match="compiled instead of reading the cache"):
        compile_triton(_double, SIGNATURE, CONSTANTS)


def test_an_entry_appears_whole_or_not_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IGNITION_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(compiler, "_MEMORY", {})
    folder = tmp_path / f"triton-{compiler.compiler_version()}"
    real_replace = compiler.os.replace
    renamed: list[str] = []

    def interrupted(src: Any, dst: Any) -> None:  # the writer dies between writing and renaming the metadata
        if Path(dst).parent != folder:  # the compiler's own caches
            real_replace(src, dst)
            return
        if str(dst).endswith(".json"):
            raise OSError("interrupted")
        renamed.append(Path(dst).name)
        real_replace(src, dst)

    monkeypatch.setattr(compiler.os, "replace", interrupted)
    with pytest.raises(OSError, match="interrupted"):
        compile_triton(_double, SIGNATURE, CONSTANTS)
    # the cubin was published, the metadata that makes it an entry was not, and nothing half written is left
    assert [p.name for p in folder.iterdir()] == renamed and renamed[0].endswith(".cubin")

    monkeypatch.setattr(compiler.os, "replace", real_replace)
    monkeypatch.setattr(compiler, "_MEMORY", {})
    kernel = compile_triton(_double, SIGNATURE, CONSTANTS)  # compiles again rather than reading a partial entry
    names = sorted(p.name for p in folder.iterdir())
    assert names == [renamed[0].removesuffix(".cubin") + ".cubin", renamed[0].removesuffix(".cubin") + ".json"]
    assert json.loads((folder / names[1]).read_text())["symbol"] == kernel.symbol
    assert (folder / names[0]).read_bytes() == kernel.cubin
