#!/usr/bin/env bash
# Download into .whl/ every wheel the GPU machine lacks for Helios' server, tests and benchmarks.
#
# The GPU machine (Python 3.12, manylinux x86_64) reaches no package registry; its image already
# holds torch, triton, numpy, cuda-bindings, tokenizers, pluggy, jinja2, prometheus-client, httpx,
# anyio, click, h11, rich, pyyaml, multidict, typing-extensions and pytest. What is missing are the
# packages below: Helios' own dependencies and each of their dependencies the image lacks, one
# version of each (the versions the CPU suite runs with). protobuf is carried too: the generated
# code in helios_core/wire needs a 7.x runtime of at least 7.35, newer than the image is known to
# hold. Run this on a machine with pip and PyPI; then carry .whl to the GPU machine, where
# tools/gpu_run.sh installs the wheels into /tmp/site.
#
#     tools/gpu_wheels.sh            # PYTHON=... picks the interpreter whose pip downloads
set -euo pipefail

cd "$(dirname "$0")/.."
DEST=.whl
if [[ -n "${PYTHON:-}" ]]; then
    python=$PYTHON
elif [[ -x .venv/bin/python ]]; then
    python=.venv/bin/python
else
    python=python3
fi

WHEELS=(
    cryptography==50.0.2   # container signatures (helios_core.container.keys)
    cffi==2.1.1            # needed by cryptography
    pycparser==3.12        # needed by cffi
    zstandard==0.25.0      # core resource frames
    msgspec==0.23.0        # engine messages, HTTP schemas
    litestar==2.25.0       # the HTTP server
    litestar-htmx==0.5.0   # needed by litestar
    multipart==2.0.1       # needed by litestar
    polyfactory==3.5.0     # needed by litestar
    faker==40.63.0         # needed by polyfactory
    rich-click==1.9.9      # needed by litestar
    sniffio==1.3.1         # needed by litestar
    llguidance==1.9.1      # structured output
    uvicorn==0.54.0        # the ASGI server of helios run
    protobuf==7.36.2       # wire schema runtime (see above)
    pyzmq==27.3.0          # KV-cache events (helios_core.server.kv_events)
    msgpack==1.2.4         # KV-cache event payloads
    uvloop==0.23.0         # the event loop of helios run
    httptools==0.9.0       # the HTTP parser of helios run
    pillow==13.0.0         # decoding image inputs (helios_core.frontend.image_input)
)

PLATFORMS=()
for minor in 39 35 34 31 28 27 24 17; do
    PLATFORMS+=(--platform "manylinux_2_${minor}_x86_64")
done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)

mkdir -p "$DEST"
grep -qxF "/$DEST/" .gitignore 2>/dev/null || echo "warning: $DEST/ is not ignored by git; it must not be committed" >&2

for pinned in "${WHEELS[@]}"; do
    name=${pinned%%==*}
    version=${pinned##*==}
    stem=$(echo "$name" | tr '[:upper:]-' '[:lower:]_')
    # One version of each: drop other versions of this package left by an earlier run.
    while IFS= read -r -d '' old; do
        base=$(basename "$old")
        if [[ "$base" != "${stem}-${version}-"* ]]; then
            echo "removing $base (want $version)"
            rm -f "$old"
        fi
    done < <(find "$DEST" -maxdepth 1 -type f -iname "${stem}-*.whl" -print0)
    if find "$DEST" -maxdepth 1 -type f -iname "${stem}-${version}-*.whl" | grep -q .; then
        continue
    fi
    "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORMS[@]}" -d "$DEST" "$pinned"
done

count=$(find "$DEST" -maxdepth 1 -type f -name '*.whl' | wc -l)
total=$(du -cb "$DEST"/*.whl | tail -n 1 | cut -f 1)
ls -l "$DEST"/*.whl | awk '{printf "%10d  %s\n", $5, $9}'
echo "$count wheels in $DEST: $((total / 1024)) KiB ($(awk -v b="$total" 'BEGIN {printf "%.1f", b / 1048576}') MiB)"
if (( total > 40 * 1024 * 1024 )); then
    echo "error: the wheels exceed 40 MiB" >&2
    exit 1
fi
