"""Image input cost: preparation per image on the CPU, and time to first token with one image beside the
same request without it.

For a ``vision-synthetic`` core (``--shape``, default ``small``; ``--layout``, default ``dynamic``), built
into ``--cores`` (or reused from there) for ``--backend`` (``cuda``: bf16 ``reference,sm_90a``, lowered with
the kernel cache of ``$IGNITION_KERNEL_CACHE``; ``reference``: f32), in one run:

* **Preparation** (CPU, no model): milliseconds per image for decoding a data URL (PNG and JPEG of
  256x256, 1024x768 and 1920x1080 pixels; ``helios_core.server.image_input``) and for preparing and laying it
  out (the core's selected image plugins, through ``ImageFrontend.expand``), median of ``--repeats``.
* **Time to first token** over HTTP (the server in-process on 127.0.0.1, streaming with
  ``return_token_ids``; the time from sending the request to the first SSE chunk carrying a generated token
  id): a chat with one 1024x768 PNG image beside the same chat without the image, alternating, ``--requests``
  each, greedy, one request at a time; median and p90, and each prompt's token count.

    tools/gpu_run.sh python3 benchmarks/vision.py --backend cuda        # on the GPU machine
    python benchmarks/vision.py --backend reference --shape tiny        # checks the script on the CPU

Prints one markdown table per part and writes every number as JSON to ``--out`` (default
``$OUT/vision.json`` when ``OUT`` is set, else ``./vision.json``).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "contrib" / "ignition"))
sys.path.insert(0, str(ROOT))

NAMESPACE = "bench/vision"
SIZES = ((256, 256), (1024, 768), (1920, 1080))
FORMATS = ("PNG", "JPEG")
PROMPT = "Describe what you see in a few words, please."


def log(message: str) -> None:
    print(f"[vision {time.strftime('%H:%M:%S')}] {message}", flush=True)


def picture(width: int, height: int, seed: int) -> Any:
    """A smooth gradient with noise (compresses like a photograph, not like random bytes)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256], axis=-1)
    noisy = np.clip(base + rng.integers(-12, 13, base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(noisy, "RGB")


def data_url(image: Any, fmt: str) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    media = "png" if fmt == "PNG" else "jpeg"
    return f"data:image/{media};base64," + base64.b64encode(buffer.getvalue()).decode()


def core_path(cores: Path, shape: str, layout: str, backend: str) -> tuple[Path, Path]:
    """Build the core (and its keys) into ``cores`` unless it is there; returns (core, public key)."""
    from ignition.recipes.llama import Capacities
    from ignition.recipes.vision import build_vision_core, vision_declaration

    from helios_core.container.keys import generate_keys, load_private_key

    gpu = backend == "cuda"
    name = f"vision-{shape}-{layout}-{'bf16-sm_90a' if gpu else 'f32'}.core"
    core, keys = cores / name, cores / "keys"
    public = keys / "signing.pub.pem"
    if core.exists() and public.exists():
        log(f"reusing {core}")
        return core, public
    cores.mkdir(parents=True, exist_ok=True)
    if not public.exists():
        generate_keys(keys)
    caps = Capacities(
        max_rows=8, prefill_tokens=(64, 256), decode_rows=(1, 2, 4, 8), page_tokens=16, cache_pages=512,
        context=2048, snapshots=0,
    )  # fmt: skip
    started = time.perf_counter()
    build_vision_core(
        vision_declaration(shape, layout=layout, seed=1), core, caps=caps,
        signing_key=load_private_key(keys / "signing.pem"), namespace=NAMESPACE, bf16=gpu,
        targets=("reference", "sm_90a") if gpu else ("reference",),
    )  # fmt: skip
    log(f"built {core} in {time.perf_counter() - started:.1f} s")
    return core, public


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def served(core: Path, public: Path, backend: str) -> Iterator[tuple[Any, str]]:
    """The core served in-process by uvicorn on a free port; yields (running model, base URL)."""
    import uvicorn

    from helios_core.contract import LoadOptions
    from helios_core.loading import TrustSettings
    from helios_core.runtime.startup import start
    from helios_core.server.app import ServerSettings, create_app

    running = start(core, TrustSettings((public,), NAMESPACE, None), LoadOptions(), backend=backend)
    port = free_port()
    config = uvicorn.Config(create_app(running, ServerSettings()), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="bench-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    try:
        yield running, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        running.close()


def median_ms(samples: Sequence[float]) -> float:
    return statistics.median(samples) * 1e3


def p90_ms(samples: Sequence[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))] * 1e3


def timed(action: Callable[[], Any], repeats: int) -> list[float]:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        samples.append(time.perf_counter() - started)
    return samples


def measure_preparation(running: Any, repeats: int) -> list[dict[str, Any]]:
    """Decode, then prepare and lay out, each size and format (ms per image)."""
    from helios_core.server.image_input import ImageLimits, decode_image_url
    from helios_core.server.preparation import Frontend

    frontend = Frontend(running)
    limits = ImageLimits()
    sentinel = min(frontend.images.sentinel_ids)
    rows = []
    for width, height in SIZES:
        image = picture(width, height, seed=width)
        for fmt in FORMATS:
            url = data_url(image, fmt)
            decoded = decode_image_url(url, limits)
            decode = timed(lambda url=url: decode_image_url(url, limits), repeats)
            layout = timed(lambda decoded=decoded: frontend.images.expand([sentinel], [decoded]), repeats)
            _, placed = frontend.images.expand([sentinel], [decoded])
            rows.append({
                "size": f"{width}x{height}", "format": fmt, "encoded_kib": len(url) * 3 / 4 / 1024,
                "decode_ms": median_ms(decode), "prepare_and_layout_ms": median_ms(layout),
                "patches": placed[0].patch_count, "features": placed[0].feature_count,
            })  # fmt: skip
            log(f"preparation {rows[-1]}")
    return rows


def first_token_s(base_url: str, model: str, content: Any) -> tuple[float, int]:
    """Seconds from sending a streamed greedy chat to its first generated token id, and its prompt tokens."""
    import httpx

    body = {
        "model": model, "messages": [{"role": "user", "content": content}], "stream": True, "max_tokens": 4,
        "temperature": 0.0, "return_token_ids": True, "ignore_eos": True,
    }  # fmt: skip
    prompt_tokens, first = -1, float("nan")
    started = time.perf_counter()
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=120) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "prompt_token_ids" in chunk:
                prompt_tokens = len(chunk["prompt_token_ids"])
            choices = chunk.get("choices") or []
            if first != first and choices and choices[0].get("token_ids"):
                first = time.perf_counter() - started
    return first, prompt_tokens


def measure_ttft(base_url: str, model: str, requests: int) -> list[dict[str, Any]]:
    url = data_url(picture(1024, 768, seed=7), "PNG")
    with_image = [{"type": "text", "text": PROMPT}, {"type": "image_url", "image_url": {"url": url}}]
    without = [{"type": "text", "text": PROMPT}]
    for content in (with_image, without):  # warm-up: every program and path once
        first_token_s(base_url, model, content)
    samples: dict[str, list[float]] = {"one image": [], "no image": []}
    prompts: dict[str, int] = {}
    for _ in range(requests):
        for name, content in (("one image", with_image), ("no image", without)):
            seconds, prompt_tokens = first_token_s(base_url, model, content)
            samples[name].append(seconds)
            prompts[name] = prompt_tokens
    rows = [
        {"request": name, "prompt_tokens": prompts[name], "ttft_median_ms": median_ms(values),
         "ttft_p90_ms": p90_ms(values), "requests": len(values)}
        for name, values in samples.items()
    ]  # fmt: skip
    for row in rows:
        log(f"ttft {row}")
    return rows


def markdown(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
    lines = ["| " + " | ".join(title for _, title, _ in columns) + " |"]
    lines.append("| " + " | ".join("---:" if fmt else "---" for _, _, fmt in columns) + " |")
    for row in rows:
        lines.append("| " + " | ".join(format(row[key], fmt) for key, _, fmt in columns) + " |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("cuda", "reference"), default="cuda")
    parser.add_argument("--shape", choices=("tiny", "small"), default="small")
    parser.add_argument("--layout", choices=("tiles", "dynamic"), default="dynamic")
    parser.add_argument("--cores", type=Path, default=ROOT / "build" / "vision-cores")
    parser.add_argument("--repeats", type=int, default=20, help="timings per preparation cell")
    parser.add_argument("--requests", type=int, default=20, help="TTFT samples per request kind")
    parser.add_argument("--build-only", action="store_true", help="build the core into --cores and stop")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.repeats <= 0 or args.requests <= 0:
        parser.error("--repeats and --requests must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out or Path(os.environ.get("OUT", ".")) / "vision.json"
    core, public = core_path(args.cores, args.shape, args.layout, args.backend)
    if args.build_only:
        return 0
    report: dict[str, Any] = {"backend": args.backend, "shape": args.shape, "layout": args.layout}
    with served(core, public, args.backend) as (running, base_url):
        report["preparation"] = measure_preparation(running, args.repeats)
        report["ttft"] = measure_ttft(base_url, f"vision-synthetic-{args.shape}", args.requests)
    out.write_text(json.dumps(report, indent=1))
    print(f"\n### Image preparation per image (CPU; {args.layout} layout of vision-synthetic {args.shape})\n")
    print(markdown(report["preparation"], (
        ("size", "image", ""), ("format", "format", ""), ("encoded_kib", "encoded KiB", ".0f"),
        ("decode_ms", "decode ms", ".2f"), ("prepare_and_layout_ms", "prepare + layout ms", ".2f"),
        ("patches", "patches", "d"), ("features", "features", "d"),
    )))  # fmt: skip
    print(f"\n### Time to first token over HTTP ({args.backend}; vision-synthetic {args.shape}, {args.layout})\n")
    print(markdown(report["ttft"], (
        ("request", "request", ""), ("prompt_tokens", "prompt tokens", "d"),
        ("ttft_median_ms", "TTFT median ms", ".2f"), ("ttft_p90_ms", "TTFT p90 ms", ".2f"), ("requests", "n", "d"),
    )))  # fmt: skip
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
