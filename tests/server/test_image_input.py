"""Image input over HTTP: data URLs and remote URLs to decoded pixels, the operator's limits, and the 400s.

Decoding runs on images made here with Pillow; remote URLs are fetched from a local HTTP server on
127.0.0.1 (an image, a redirect, a slow trickle, a body beyond the byte limit). Through the real app,
the golden fixture core (text-only) refuses every image, and a vision stand-in (the fixture core's
frontend with a small test preparation and layout behind the real ``ImageFrontend``, and a template
that writes ``<|endoftext|>`` for each image) shows the expanded prompt and the content-part naming
of every image error on the render endpoint.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import io
import math
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import uvicorn
from PIL import Image

from helios_core.contract import LoadOptions, PromptLayout, PromptMessage
from helios_core.errors import StartupError
from helios_core.frontend.bootstrap import compile_chat_template
from helios_core.loading import TrustSettings
from helios_core.plugins.images import (
    DecodedImage,
    ImageInputError,
    ImagePlacement,
    PreparedImage,
    VisionSettings,
)
from helios_core.runtime.messages import PromptImage
from helios_core.runtime.startup import RunningModel, start
from helios_core.server.app import ServerSettings, chat_service, create_app
from helios_core.server.image_input import ImageLimits, decode_image_bytes, decode_image_url
from helios_core.server.images import ImageFrontend
from helios_core.server.preparation import Frontend, _expanded_layout
from helios_core.server.serve import resolve_options
from helios_core.wire import contract_pb2 as ct
from tests.server.conftest import CORE, KEYS, NAMESPACE, free_port

LIMITS = ImageLimits()


def _encoded(image: Image.Image, fmt: str, **options: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def _data_url(data: bytes, media_type: str) -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def _gradient(width: int = 6, height: int = 4) -> Image.Image:
    pixels = np.zeros((height, width, 3), dtype=np.uint8)
    pixels[..., 0] = np.arange(width, dtype=np.uint8)[None, :] * 40
    pixels[..., 1] = np.arange(height, dtype=np.uint8)[:, None] * 60
    pixels[..., 2] = 200
    return Image.fromarray(pixels, "RGB")


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header declares ``width`` x ``height`` (its data is a few bytes: a bomb's shape)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")
    )


def _refusal(url: str, limits: ImageLimits = LIMITS) -> str:
    with pytest.raises(ImageInputError) as caught:
        decode_image_url(url, limits, index=3)
    assert caught.value.index == 3
    return str(caught.value)


# -- decoding -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "media_type", "options", "lossless"),
    [
        ("PNG", "image/png", {}, True),
        ("GIF", "image/gif", {}, True),
        ("WEBP", "image/webp", {"lossless": True}, True),
        ("WEBP", "image/webp", {"quality": 80}, False),
        ("JPEG", "image/jpeg", {"quality": 95}, False),
        ("JPEG", "image/jpg", {"quality": 95}, False),
    ],
)
def test_each_format_decodes_to_rgb(fmt: str, media_type: str, options: dict[str, Any], lossless: bool) -> None:
    source = _gradient()
    if fmt == "GIF":  # a palette image: exact for these few colours
        source = source.convert("P", palette=Image.Palette.ADAPTIVE, colors=256)
    data = _encoded(source, fmt, **options)
    decoded = decode_image_url(_data_url(data, media_type), LIMITS)
    assert decoded.pixels.dtype == np.uint8 and decoded.pixels.shape == (4, 6, 3)
    with Image.open(io.BytesIO(data)) as reference:  # what Pillow itself decodes
        assert np.array_equal(decoded.pixels, np.asarray(reference.convert("RGB")))
    if lossless:
        assert np.array_equal(decoded.pixels, np.asarray(source.convert("RGB")))
    assert decoded.digest == DecodedImage.of(decoded.pixels).digest


def test_transparency_is_composited_over_white() -> None:
    rgba = np.zeros((1, 3, 4), dtype=np.uint8)
    rgba[0, 0] = (255, 0, 0, 0)  # fully transparent red: white
    rgba[0, 1] = (255, 0, 0, 255)  # opaque red: red
    rgba[0, 2] = (0, 0, 0, 128)  # half-transparent black: mid grey
    data = _encoded(Image.fromarray(rgba, "RGBA"), "PNG")
    pixels = decode_image_url(_data_url(data, "image/png"), LIMITS).pixels
    assert pixels[0, 0].tolist() == [255, 255, 255]
    assert pixels[0, 1].tolist() == [255, 0, 0]
    assert pixels[0, 2].tolist() == [127, 127, 127]


def test_sixteen_bit_grey_is_scaled_to_eight_bits_not_clipped() -> None:
    """A 16-bit greyscale PNG's values 0..65535 become 0..255 (rounded), as its 8-bit twin would read; a
    transparent grey value (``tRNS``) is composited over white like any transparency."""
    values = np.array([[0, 200, 32896, 65535]], dtype=np.uint16)
    wide = Image.fromarray(values)  # mode I;16
    pixels = decode_image_url(_data_url(_encoded(wide, "PNG"), "image/png"), LIMITS).pixels
    assert pixels[0, :, 0].tolist() == [0, 1, 128, 255]
    assert np.array_equal(pixels[..., 0], pixels[..., 2])
    transparent = decode_image_url(_data_url(_encoded(wide, "PNG", transparency=200), "image/png"), LIMITS).pixels
    assert transparent[0, :, 0].tolist() == [0, 255, 128, 255]


def test_an_animated_gif_gives_its_first_frame() -> None:
    frames = [Image.new("RGB", (2, 2), colour) for colour in ((255, 0, 0), (0, 0, 255))]
    buffer = io.BytesIO()
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:], duration=10, loop=0)
    pixels = decode_image_url(_data_url(buffer.getvalue(), "image/gif"), LIMITS).pixels
    assert pixels.shape == (2, 2, 3) and pixels[0, 0].tolist() == [255, 0, 0]


@pytest.mark.parametrize("orientation", range(1, 9))
def test_an_exif_orientation_turns_the_image_upright(orientation: int) -> None:
    """A camera's JPEG stored sideways (EXIF orientation 2 to 8) reads as a viewer shows it."""
    stored = _encoded(_gradient(8, 4), "JPEG", quality=95)
    exif = Image.Exif()
    exif[0x0112] = orientation
    tagged = _encoded(Image.open(io.BytesIO(stored)), "JPEG", quality=95, exif=exif.tobytes())
    pixels = decode_image_bytes(tagged, LIMITS).pixels
    plain = decode_image_bytes(_encoded(Image.open(io.BytesIO(stored)), "JPEG", quality=95), LIMITS).pixels
    # the same stored pixels, mirrored and turned as the orientation says (EXIF's eight cases)
    turned = {
        1: plain,
        2: plain[:, ::-1],
        3: plain[::-1, ::-1],
        4: plain[::-1, :],
        5: np.transpose(plain, (1, 0, 2)),
        6: np.rot90(plain, k=-1),
        7: np.rot90(plain, k=-1)[::-1, :],
        8: np.rot90(plain, k=1),
    }[orientation]
    assert pixels.shape == turned.shape == ((4, 8, 3) if orientation < 5 else (8, 4, 3))
    assert np.array_equal(pixels, turned)


def test_the_declared_media_type_must_match_the_data() -> None:
    jpeg = _encoded(_gradient(), "JPEG")
    assert _refusal(_data_url(jpeg, "image/png")) == "the image data URL declares image/png but the data is image/jpeg"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        (
            "data:image/bmp;base64,Qk0=",
            "the image data URL's media type 'image/bmp' is not supported "
            "(image/png, image/jpeg, image/webp or image/gif)",
        ),
        (
            "data:;base64,AAAA",
            "the image data URL names no media type (image/png, image/jpeg, image/webp or image/gif)",
        ),
        ("data:image/png,rawbytes", "the image data URL must be base64-encoded (data:<media type>;base64,...)"),
        ("data:image/png;base64", "the image data URL is malformed: expected data:<media type>;base64,<data>"),
        ("data:image/png;base64,", "the image data URL holds no data"),
        ("data:image/png;base64,%%%%", "the image data URL's data is not valid base64: Only base64 data is allowed"),
        (
            "data:image/png;base64," + base64.b64encode(b"not an image at all").decode(),
            "the image data is not a PNG, JPEG, WebP or GIF image (or its header is corrupt)",
        ),
        (
            "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\nnot really").decode(),
            "the image data could not be decoded (truncated or corrupt): Truncated File Read",
        ),
        (
            "file:///etc/passwd",
            "the image URL scheme 'file' is not supported: use a data URL (data:image/png;base64,...)",
        ),
        ("not a url", "the image URL scheme is not supported: use a data URL (data:image/png;base64,...)"),
        (
            "https://example.com/cat.png",
            "image URLs are not fetched by this server; send the image inline as a data URL "
            "(data:image/png;base64,...)",
        ),
    ],
)
def test_malformed_urls_are_refused(url: str, message: str) -> None:
    assert _refusal(url) == message


def test_a_format_outside_the_four_is_never_decoded() -> None:
    bmp = _encoded(_gradient(), "BMP")  # Pillow reads BMP, but only PNG, JPEG, WebP and GIF are ever tried
    assert _refusal(_data_url(bmp, "image/png")) == (
        "the image data is not a PNG, JPEG, WebP or GIF image (or its header is corrupt)"
    )


def test_truncated_and_corrupt_data_are_refused() -> None:
    png = _encoded(Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)), "PNG")
    assert _refusal(_data_url(png[: len(png) // 2], "image/png")) == (
        "the image data could not be decoded (truncated or corrupt): image file is truncated"
    )
    corrupt = bytearray(png)
    corrupt[60:400] = bytes(340)  # the compressed pixel data zeroed
    message = _refusal(_data_url(bytes(corrupt), "image/png"))
    assert message.startswith("the image data could not be decoded (truncated or corrupt): ")


def test_the_pixel_limit_is_checked_from_the_header() -> None:
    limits = ImageLimits(max_pixels=24)
    assert decode_image_url(_data_url(_encoded(_gradient(6, 4), "PNG"), "image/png"), limits).width == 6
    assert _refusal(_data_url(_encoded(_gradient(5, 5), "PNG"), "image/png"), limits) == (
        "the image is 5x5 = 25 pixels, more than this server's limit of 24 pixels per image"
    )


def test_a_decompression_bomb_costs_only_its_header() -> None:
    # 8K UHD plus a row: over the default limit, under Pillow's own bound; nothing is decoded
    bomb = _png_header(7680, 4321)
    started = time.monotonic()
    assert _refusal(_data_url(bomb, "image/png")) == (
        "the image is 7680x4321 = 33185280 pixels, more than this server's limit of 33177600 pixels per image"
    )
    # far over Pillow's own bound: its DecompressionBombError is the same refusal
    assert _refusal(_data_url(_png_header(100_000, 100_000), "image/png")) == (
        "the image has 10000000000 pixels, more than this server's limit of 33177600 pixels per image"
    )
    assert time.monotonic() - started < 1.0


def test_the_byte_limit_is_checked_before_and_after_base64() -> None:
    png = _encoded(_gradient(), "PNG")
    assert decode_image_url(_data_url(png, "image/png"), ImageLimits(max_bytes=len(png))).width == 6
    assert _refusal(_data_url(png, "image/png"), ImageLimits(max_bytes=len(png) - 1)) == (
        f"the image holds {len(png)} bytes, more than this server's limit of {len(png) - 1} bytes per image"
    )
    huge = "data:image/png;base64," + "A" * 4000  # never base64-decoded: its length alone is over
    assert _refusal(huge, ImageLimits(max_bytes=100)) == (
        "the image holds about 3000 bytes, more than this server's limit of 100 bytes per image"
    )


def test_decode_image_bytes_needs_no_declared_format() -> None:
    decoded = decode_image_bytes(_encoded(_gradient(), "WEBP", lossless=True), LIMITS)
    assert decoded.pixels.shape == (4, 6, 3)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"max_bytes": 0}, "image max-bytes must be a positive integer, not 0"),
        ({"max_count": -1}, "image max-count must be a positive integer, not -1"),
        ({"max_pixels": True}, "image max-pixels must be a positive integer, not True"),
        ({"fetch_timeout": 0}, "image fetch-timeout must be a positive, finite number of seconds, not 0"),
        ({"fetch_timeout": math.inf}, "image fetch-timeout must be a positive, finite number of seconds, not inf"),
    ],
)
def test_limits_refuse_values_out_of_range(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as caught:
        ImageLimits(**values)
    assert str(caught.value) == message


def test_max_pixels_stays_within_pillows_bomb_bound() -> None:
    bound = Image.MAX_IMAGE_PIXELS
    assert bound is not None
    assert ImageLimits(max_pixels=bound).max_pixels == bound
    with pytest.raises(ValueError, match=r"at most \d+ \(Pillow's decompression-bomb bound\)"):
        ImageLimits(max_pixels=bound + 1)


# -- remote URLs ----------------------------------------------------------------------------------------

PNG = _encoded(_gradient(), "PNG")


class _ImageHandler(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        return None

    def do_GET(self) -> None:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client stopped reading
            self._answer()

    def _answer(self) -> None:
        path = self.path
        if path == "/cat.png":
            self._headers(200, {"Content-Type": "application/octet-stream", "Content-Length": str(len(PNG))})
            self.wfile.write(PNG)
        elif path == "/moved":
            self._headers(302, {"Location": "/cat.png", "Content-Length": "0"})
        elif path == "/to-file":
            self._headers(302, {"Location": "file:///etc/passwd", "Content-Length": "0"})
        elif path == "/to-unclosed-bracket":
            self._headers(302, {"Location": "http://[::1/x.png", "Content-Length": "0"})
        elif path == "/to-spaced-host":
            self._headers(302, {"Location": "http://a b/x.png", "Content-Length": "0"})
        elif path == "/loop":
            self._headers(302, {"Location": "/loop", "Content-Length": "0"})
        elif path == "/slow":  # a trickle: each byte well within a socket timeout, the whole far beyond
            self._headers(200, {"Content-Length": str(len(PNG))})
            for byte in PNG[:40]:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.1)
        elif path == "/big":  # no Content-Length: read until the limit passes
            self._headers(200, {"Connection": "close"})
            for _ in range(200):
                self.wfile.write(b"\0" * 65536)
        elif path == "/declared-big":
            self._headers(200, {"Content-Length": str(50 * 1024 * 1024)})
        elif path == "/declared-huge":  # more digits than int() reads
            self._headers(200, {"Content-Length": "9" * 5000})
        elif path == "/declared-superscript":  # a digit int() refuses
            self._headers(200, {"Content-Length": "\u00b2"})
        else:
            self._headers(404, {"Content-Length": "0"})

    def _headers(self, status: int, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ImageHandler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="test-image-server", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


REMOTE = ImageLimits(allow_urls=True, fetch_timeout=5.0)


def test_remote_urls_are_fetched_when_allowed(image_server: str) -> None:
    decoded = decode_image_url(f"{image_server}/cat.png", REMOTE)
    assert np.array_equal(decoded.pixels, np.asarray(_gradient()))
    assert decode_image_url(f"{image_server}/moved", REMOTE).digest == decoded.digest


def test_remote_urls_are_refused_unless_allowed(image_server: str) -> None:
    assert _refusal(f"{image_server}/cat.png").startswith("image URLs are not fetched by this server")


def test_remote_redirects_stay_on_http(image_server: str) -> None:
    assert _refusal(f"{image_server}/to-file", REMOTE) == "the image URL redirects to a URL that is not http(s)"
    assert _refusal(f"{image_server}/loop", REMOTE) == "the image URL redirects more than 5 times"
    assert _refusal(f"{image_server}/nothing", REMOTE) == "fetching the image URL failed: HTTP status 404"


def test_malformed_remote_urls_and_redirect_targets_are_refused(image_server: str) -> None:
    """URLs the parser or the connection refuses (an unclosed IPv6 bracket, a space in the host, a zone index)
    are 400s naming the URL, also as a redirect's Location."""
    assert _refusal("http://[::1/", REMOTE) == "the image URL is not a valid URL"
    assert _refusal("http://a b/x.png", REMOTE).startswith("the image URL is not valid: URL can't contain control")
    assert _refusal("http://[fe80::1%25eth0]/a.png", REMOTE).startswith("the image URL is not valid: nonnumeric port")
    for path in ("/to-unclosed-bracket", "/to-spaced-host"):
        refusal = _refusal(f"{image_server}{path}", REMOTE)
        assert refusal in (
            "the image URL redirects to a URL that is not valid",
            "the image URL is not valid: URL can't contain control characters. 'a b' (found at least ' ')",
        ), refusal


def test_a_slow_remote_image_times_out(image_server: str) -> None:
    started = time.monotonic()
    limits = ImageLimits(allow_urls=True, fetch_timeout=0.5)
    assert _refusal(f"{image_server}/slow", limits) == "fetching the image URL took longer than 0.5 s"
    assert time.monotonic() - started < 1.5  # one deadline for the whole fetch, not one per read


def test_a_remote_image_beyond_the_byte_limit_is_abandoned(image_server: str) -> None:
    limits = ImageLimits(allow_urls=True, max_bytes=100_000)
    assert _refusal(f"{image_server}/big", limits) == (
        "the image holds more than 100000 bytes, more than this server's limit of 100000 bytes per image"
    )
    assert _refusal(f"{image_server}/declared-big", limits) == (
        "the image holds 52428800 bytes, more than this server's limit of 100000 bytes per image"
    )
    assert _refusal(f"{image_server}/declared-huge", limits) == (
        "the image holds more than 100000 bytes, more than this server's limit of 100000 bytes per image"
    )
    # a length that is no number is no length: the body decides (an empty one here)
    assert _refusal(f"{image_server}/declared-superscript", limits) == "the image URL answered an empty body"


def test_an_unreachable_host_is_a_fetch_failure() -> None:
    port = free_port()  # nothing listens there
    message = _refusal(f"http://127.0.0.1:{port}/cat.png", REMOTE)
    assert message.startswith("fetching the image URL failed: ")


# -- operator options -----------------------------------------------------------------------------------


def test_run_options_give_the_image_limits(tmp_path: Path) -> None:
    from helios_core.cli import _RUN_OPTIONS, build_parser

    args = build_parser().parse_args(
        ["run", "--core", "x.core", "--image-max-bytes", "1000", "--image-allow-urls", "--image-fetch-timeout", "2.5"]
    )
    config = tmp_path / "run.toml"
    config.write_text("image-max-count = 3\nimage-max-pixels = 4000\n")
    options = resolve_options(
        {name: getattr(args, name) for name in _RUN_OPTIONS}, config, {"HELIOS_IMAGE_MAX_COUNT": "5"}
    )
    assert options.image_limits() == ImageLimits(
        max_bytes=1000, max_pixels=4000, max_count=3, allow_urls=True, fetch_timeout=2.5
    )
    defaults = resolve_options({"core": Path("x.core")}, None, {"HELIOS_IMAGE_ALLOW_URLS": "false"})
    assert defaults.image_limits() == ImageLimits()
    from_environment = resolve_options({"core": Path("x.core")}, None, {"HELIOS_IMAGE_ALLOW_URLS": "true"})
    assert from_environment.image_limits().allow_urls is True


@pytest.mark.parametrize(
    ("explicit", "message"),
    [
        ({"image_max_count": 0}, "--image-max-count must be a positive integer, not 0"),
        ({"image_fetch_timeout": 0.0}, "--image-fetch-timeout must be a positive, finite number of seconds, not 0.0"),
        (
            {"image_fetch_timeout": "nan"},
            "--image-fetch-timeout must be a positive, finite number of seconds, not 'nan'",
        ),
        (
            {"image_fetch_timeout": "inf"},
            "--image-fetch-timeout must be a positive, finite number of seconds, not 'inf'",
        ),
    ],
)
def test_run_options_out_of_range_fail_startup(explicit: dict[str, Any], message: str) -> None:
    with pytest.raises(StartupError) as caught:
        resolve_options({"core": Path("x.core"), **explicit}, None, {}).image_limits()
    assert str(caught.value) == message


# -- through the app ------------------------------------------------------------------------------------

SENTINEL = 256
"""``<|endoftext|>`` of the fixture tokenizer: the image sentinel of the vision stand-in."""
OPEN, FEATURE, CLOSE = 60, 61, 62
VISION_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<|endoftext|>"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class _SquarePreparation:
    """One patch per started 16x16 square of the image."""

    def prepare(self, image: DecodedImage) -> PreparedImage:
        rows, columns = -(-image.height // 16), -(-image.width // 16)
        if image.width == 7:  # an image this preparation cannot use
            raise ImageInputError("images 7 pixels wide are not accepted")
        return PreparedImage(np.zeros((rows * columns, 3), dtype=np.float32), (rows, columns), image.digest)


class _SpanLayout:
    tensor_names = frozenset({"patches"})

    def place(self, image: PreparedImage) -> ImagePlacement:
        count = len(image.patches)
        return ImagePlacement(
            (OPEN, *[FEATURE] * count, CLOSE), tuple(range(1, count + 1)), {"patches": image.patches}, count
        )


def _vision_stand_in(frontend: Frontend) -> None:
    """Make ``frontend`` take images: the test preparation and layout behind the real ImageFrontend."""
    settings = VisionSettings(
        ct.FrontendContract(), ct.VisionContract(feature_slots=6, features_per_window=4), (SENTINEL,)
    )
    frontend.images = ImageFrontend(settings, _SquarePreparation(), _SpanLayout(), patch_capacity=4)
    frontend.bootstrap = dataclasses.replace(
        frontend.bootstrap, chat_template=VISION_TEMPLATE, template=compile_chat_template(VISION_TEMPLATE)
    )


@contextmanager
def _serving(app: Any) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@dataclasses.dataclass
class Apps:
    running: RunningModel
    text: str
    """The fixture core as it is (text-only)."""
    vision: str
    """The fixture core behind the vision stand-in (images up to 24 pixels, 3 per request)."""


@pytest.fixture(scope="module")
def apps() -> Iterator[Apps]:
    trust = TrustSettings((KEYS / "signing.pub.pem",), NAMESPACE, None)
    running = start(CORE, trust, LoadOptions(max_active=2, queue_capacity=2), backend="reference")
    try:
        text_app = create_app(running)
        vision_app = create_app(running, ServerSettings(image_limits=ImageLimits(max_pixels=2048, max_count=3)))
        _vision_stand_in(chat_service(vision_app).frontend)
        with _serving(text_app) as text, _serving(vision_app) as vision:
            yield Apps(running, text, vision)
    finally:
        running.close()


def _post(base: str, body: dict[str, Any], path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=30)


def _image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, "detail": "auto"}}


def _png_url(width: int, height: int) -> str:
    return _data_url(_encoded(_gradient(width, height), "PNG"), "image/png")


def _error(message: str, param: str | None = "messages") -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": 400}}


def test_a_text_only_core_refuses_images(apps: Apps) -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, _image_part(_png_url(4, 4))]}]}
    response = _post(apps.text, {**body, "max_tokens": 1})
    assert response.status_code == 400
    assert response.json() == _error("this model does not accept image input")
    # even an undecodable one: the refusal comes first
    body = {"messages": [{"role": "user", "content": [_image_part("data:image/png;base64,AAAA")]}]}
    assert _post(apps.text, body).json() == _error("this model does not accept image input")


def test_images_outside_user_messages_are_refused(apps: Apps) -> None:
    for role, extra in (("system", {}), ("assistant", {}), ("tool", {"tool_call_id": "c1"}), ("developer", {})):
        messages = [
            {"role": "user", "content": "hi"},
            {"role": role, "content": [{"type": "text", "text": "x"}, _image_part(_png_url(4, 4))], **extra},
        ]
        response = _post(apps.vision, {"messages": messages, "max_tokens": 1})
        assert response.status_code == 400, role
        assert response.json() == _error("messages[1].content[1]: image parts are only accepted in user messages")


def test_other_part_types_stay_refused(apps: Apps) -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": ""}}]}]}
    response = _post(apps.vision, body)
    assert response.status_code == 400
    assert response.json() == _error(
        "invalid request: Invalid value 'input_audio' - at `$.messages[0].content[0].type`"
    )
    body = {
        "messages": [
            {"role": "user", "content": [{**_image_part("data:x"), "image_url": {"url": "x", "detail": "max"}}]}
        ]
    }
    assert _post(apps.vision, body).json() == _error(
        "invalid request: Invalid enum value 'max' - at `$.messages[0].content[0].image_url.detail`"
    )


def test_text_parts_render_as_before(apps: Apps) -> None:
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "he"}, {"type": "text", "text": "y"}]}]}
    joined = {"messages": [{"role": "user", "content": "hey"}]}
    for base in (apps.text, apps.vision):
        rendered = _post(base, parts, "/v1/chat/completions/render").json()["prompt_token_ids"]
        assert rendered == _post(base, joined, "/v1/chat/completions/render").json()["prompt_token_ids"]
    plain = _post(apps.text, joined, "/v1/chat/completions/render").json()["prompt_token_ids"]
    assert _post(apps.vision, joined, "/v1/chat/completions/render").json()["prompt_token_ids"] == plain


def test_images_expand_in_the_prompt(apps: Apps) -> None:
    content = [{"type": "text", "text": "a"}, _image_part(_png_url(20, 10)), {"type": "text", "text": "b"}]
    body = {"messages": [{"role": "user", "content": content}]}
    prompt = _post(apps.vision, body, "/v1/chat/completions/render").json()["prompt_token_ids"]
    plain = _post(apps.text, {"messages": [{"role": "user", "content": "ab"}]}, "/v1/chat/completions/render").json()
    text_ids = plain["prompt_token_ids"]
    at = text_ids.index(ord("a")) + 1  # byte-level vocabulary: "a" is its byte
    assert prompt == [*text_ids[:at], OPEN, FEATURE, FEATURE, CLOSE, *text_ids[at:]]  # 2 patches of 16x16


def test_image_errors_name_the_content_part(apps: Apps) -> None:
    def refused(content: list[dict[str, Any]], message: str) -> None:
        messages = [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "user", "content": content},
        ]
        response = _post(apps.vision, {"messages": messages, "max_tokens": 1})
        assert response.status_code == 400
        assert response.json() == _error(message)

    text = {"type": "text", "text": "t"}
    refused(
        [text, _image_part(_png_url(4, 4)), _image_part("data:image/png;base64,QUJD")],
        "messages[2].content[2]: the image data is not a PNG, JPEG, WebP or GIF image (or its header is corrupt)",
    )
    refused(
        [_image_part(_png_url(64, 64))],
        "messages[2].content[0]: the image is 64x64 = 4096 pixels, more than this server's limit of 2048 pixels "
        "per image",
    )
    refused(
        [text, _image_part(_png_url(7, 4))],  # the preparation's own refusal
        "messages[2].content[1]: images 7 pixels wide are not accepted",
    )
    refused(
        [_image_part(_png_url(4, 4)), text, _image_part(_png_url(40, 40))],  # 9 features, 4 per image
        "messages[2].content[2]: image 1 needs 9 image features, more than the model's 4 per image",
    )
    refused(
        [_image_part(_png_url(4, 4))] * 4,
        "the request carries 4 images, more than this server's limit of 3 per request",
    )
    refused(
        [_image_part(_png_url(32, 32)), _image_part(_png_url(32, 32))],  # 8 features, 6 per request
        "the request's images need 8 image features, more than the model's 6",
    )
    refused(
        [_image_part("https://example.com/cat.png")],
        "messages[2].content[0]: image URLs are not fetched by this server; send the image inline as a data URL "
        "(data:image/png;base64,...)",
    )


def test_a_client_cannot_forge_an_image_sentinel(apps: Apps) -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "<|endoftext|>"}]}]}
    response = _post(apps.vision, body, "/v1/chat/completions/render")
    assert response.status_code == 200
    assert SENTINEL not in response.json()["prompt_token_ids"]


def test_the_context_counts_the_expanded_prompt(apps: Apps) -> None:
    frontend = chat_service(create_app(apps.running)).frontend
    _vision_stand_in(frontend)
    frontend.images = ImageFrontend(
        VisionSettings(ct.FrontendContract(), ct.VisionContract(feature_slots=64, features_per_window=64), (SENTINEL,)),
        _SquarePreparation(),
        _SpanLayout(),
        patch_capacity=64,
    )
    frontend.image_limits = ImageLimits()
    from helios_core.server.errors import AdmissionRefused
    from helios_core.server.preparation import prepare
    from helios_core.server.schemas import decode_request

    def request(width: int) -> Any:
        content = [{"type": "text", "text": "x"}, _image_part(_png_url(width, 16))]
        return decode_request(
            httpx.Request("POST", "/", json={"messages": [{"role": "user", "content": content}]}).content
        )

    prepared = prepare(frontend, request(16 * 10), "fits").request
    (image,) = prepared.images
    assert (image.length, image.feature_tokens, image.patch_count) == (12, list(range(1, 11)), 10)
    assert prepared.prompt_ids[image.start : image.end] == [OPEN, *[FEATURE] * 10, CLOSE]
    assert prepared.max_tokens == frontend.context_tokens - len(prepared.prompt_ids)
    with pytest.raises(AdmissionRefused) as caught:
        prepare(frontend, request(16 * 60), "too-long")
    assert caught.value.permanent and caught.value.param == "messages"
    assert str(caught.value) == (
        f"the prompt holds {len(prepared.prompt_ids) + 50} tokens with its images, which does not fit the "
        f"core's context of {frontend.context_tokens} tokens"
    )


def test_layout_offsets_move_past_expanded_images() -> None:
    # pre-expansion prompt: [a, S, b, c, S, d]; spans of 4 and 3 tokens replace the sentinels
    images = [PromptImage(1, 4, [1, 2], 2, b"1", []), PromptImage(7, 3, [1], 1, b"2", [])]
    layout = PromptLayout(messages=(PromptMessage(1, 1), PromptMessage(2, 2), PromptMessage(3, 5)), continuation=6)
    moved = _expanded_layout(layout, images)
    assert moved is not None
    assert [message.end for message in moved.messages] == [1, 5, 10]
    assert moved.continuation == 11
    assert _expanded_layout(PromptLayout(continuation=-1), images) == PromptLayout(continuation=-1)
    assert _expanded_layout(None, images) is None
