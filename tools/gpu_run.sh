#!/usr/bin/env bash
# Run a command on the GPU machine with Helios' carried wheels installed; reaches no network.
#
# Run from the repository root of the copy on the GPU machine, with .whl/ (tools/gpu_wheels.sh) and,
# when there is one, build/kernel-cache/ or its archive build/kernel-cache.tgz (unpacked here) carried along:
#
#     tools/gpu_run.sh python3 -m pytest -q tests/gpu
#     tools/gpu_run.sh python3 benchmarks/gpu_decode.py
#
# It installs .whl/*.whl into /tmp/site (no index, no dependencies resolved), puts /tmp/site, the
# repository and contrib/ignition on PYTHONPATH, points IGNITION_KERNEL_CACHE at build/kernel-cache,
# prints the GPU, driver and Python package versions, then runs the command and exits with its
# status. With $OUT set, the kernel cache (when it changed and packs small enough) is also saved as
# $OUT/kernel-cache.tar.gz, to carry into the next run as build/kernel-cache.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
root=$PWD
python=${PYTHON:-python3}
site=${HELIOS_SITE:-/tmp/site}

export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1
shopt -s nullglob
wheels=(.whl/*.whl)
shopt -u nullglob
if (( ${#wheels[@]} )); then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        "${wheels[@]}" || { echo "gpu_run: installing the carried wheels failed" >&2; exit 1; }
else
    echo "gpu_run: no wheels in .whl/ (run tools/gpu_wheels.sh and carry .whl)" >&2
fi

export PYTHONPATH="$site:$root:$root/contrib/ignition${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export IGNITION_KERNEL_CACHE=${IGNITION_KERNEL_CACHE:-$root/build/kernel-cache}
# A packed cache carried as build/kernel-cache.tgz is unpacked into the default cache once (again when the
# archive is newer than the last unpacking).
archive=$root/build/kernel-cache.tgz
stamp=$root/build/kernel-cache/.unpacked
if [[ -f "$archive" && "$IGNITION_KERNEL_CACHE" == "$root/build/kernel-cache" ]] \
    && [[ ! -e "$stamp" || "$archive" -nt "$stamp" ]]; then
    tar -xzf "$archive" -C "$root/build" && touch "$stamp" \
        || echo "gpu_run: unpacking build/kernel-cache.tgz failed" >&2
fi
mkdir -p "$IGNITION_KERNEL_CACHE"

if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader \
        || echo "gpu_run: nvidia-smi failed" >&2
else
    echo "gpu_run: nvidia-smi not found" >&2
fi
"$python" - <<'EOF'
import importlib.metadata as metadata
import sys

print(f"python {sys.version.split()[0]} ({sys.executable})")
found = []
for name in ("torch", "triton", "cuda-bindings", "numpy", "tokenizers", "protobuf", "cryptography", "zstandard",
             "msgspec", "litestar", "llguidance", "uvicorn", "httpx", "pytest"):
    try:
        found.append(f"{name} {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        found.append(f"{name} MISSING")
print(", ".join(found))
try:
    import torch

    if torch.cuda.is_available():
        print(f"torch sees {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}")
    else:
        print("torch sees no GPU")
except Exception as exc:
    print(f"torch: {type(exc).__name__}: {exc}")
EOF
before=$(find "$IGNITION_KERNEL_CACHE" -name '*.cubin' | wc -l)
echo "kernel cache: $IGNITION_KERNEL_CACHE ($before kernels)"

if (( $# == 0 )); then
    exit 0
fi
"$@"
status=$?
after=$(find "$IGNITION_KERNEL_CACHE" -name '*.cubin' | wc -l)
if [[ -n "${OUT:-}" && -d "$OUT" && "$after" != "$before" && ! -e "$OUT/kernel-cache.tar.gz" ]]; then
    tar -czf "$OUT/kernel-cache.tar.gz" -C "$(dirname "$IGNITION_KERNEL_CACHE")" "$(basename "$IGNITION_KERNEL_CACHE")"
    size=$(stat -c %s "$OUT/kernel-cache.tar.gz")
    if (( size > 16 * 1024 * 1024 )); then
        rm -f "$OUT/kernel-cache.tar.gz"
        echo "gpu_run: the kernel cache packs to $((size / 1048576)) MiB, too large to come back from \$OUT"
    else
        echo "gpu_run: kernel cache ($after kernels) saved as \$OUT/kernel-cache.tar.gz"
    fi
fi
exit "$status"
