"""``tools/gpu_run.sh`` on a machine without a GPU: the packed kernel cache carried as
``build/kernel-cache.tgz`` is unpacked into the default cache once, and again only when the archive is
newer than that unpacking."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _pack(build: Path, names: list[str]) -> None:
    source = build / "packing" / "kernel-cache" / "triton-3.6.0"
    source.mkdir(parents=True)
    for name in names:
        (source / f"{name}.cubin").write_bytes(b"cubin")
        (source / f"{name}.json").write_text("{}")
    with tarfile.open(build / "kernel-cache.tgz", "w:gz") as archive:
        archive.add(build / "packing" / "kernel-cache", arcname="kernel-cache")
    shutil.rmtree(build / "packing")


def _run(checkout: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("IGNITION_KERNEL_CACHE", "OUT")}
    env.update(PYTHON=sys.executable, HELIOS_SITE=str(checkout / "site"), PATH=os.environ["PATH"])
    done = subprocess.run(
        ["bash", str(checkout / "tools" / "gpu_run.sh")], cwd=checkout, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_the_carried_archive_is_unpacked_into_the_default_cache_once(tmp_path: Path) -> None:
    checkout = tmp_path / "checkout"
    (checkout / "tools").mkdir(parents=True)
    shutil.copy(ROOT / "tools" / "gpu_run.sh", checkout / "tools" / "gpu_run.sh")
    build = checkout / "build"
    build.mkdir()
    _pack(build, ["a", "b"])
    cache = build / "kernel-cache"

    assert f"kernel cache: {cache} (2 kernels)" in _run(checkout)
    assert sorted(p.name for p in (cache / "triton-3.6.0").iterdir()) == ["a.cubin", "a.json", "b.cubin", "b.json"]

    # a kernel compiled since survives the next call: the archive is not unpacked over the cache again
    (cache / "triton-3.6.0" / "c.cubin").write_bytes(b"cubin")
    (cache / "triton-3.6.0" / "a.cubin").write_bytes(b"recompiled")
    assert f"kernel cache: {cache} (3 kernels)" in _run(checkout)
    assert (cache / "triton-3.6.0" / "a.cubin").read_bytes() == b"recompiled"

    # a newer archive is unpacked over it
    time.sleep(1.1)  # the archive's time must pass the stamp's at the file system's resolution
    (build / "kernel-cache.tgz").unlink()
    _pack(build, ["a", "d"])
    assert f"kernel cache: {cache} (4 kernels)" in _run(checkout)
    assert (cache / "triton-3.6.0" / "a.cubin").read_bytes() == b"cubin"
