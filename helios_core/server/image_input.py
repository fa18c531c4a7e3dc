"""Image input of chat requests: an ``image_url`` content part's URL to a :class:`DecodedImage`.

Owns the operator's image limits (:class:`ImageLimits`: ``--image-max-bytes``, ``--image-max-pixels``,
``--image-max-count``, ``--image-allow-urls``, ``--image-fetch-timeout``), reading an image's bytes
from a ``data:`` URL or, only where the operator allows it, from an ``http``/``https`` URL, and
decoding them with Pillow into RGB pixels. Every failure raises
:class:`~helios_core.plugins.images.ImageInputError` with a message for the client; the server turns
it into a 400 naming the content part (:mod:`helios_core.server.preparation`).

Decoding, in order, each step bounded:

* ``data:image/<png|jpeg|jpg|webp|gif>;base64,<data>`` only (another media type, a data URL without
  ``;base64`` or invalid base64 is refused); the encoded length is checked against
  ``max_bytes`` before the base64 is decoded.
* A remote URL is refused unless ``allow_urls``; then it is fetched with one deadline for the whole
  fetch (connect, headers, body and redirects: ``fetch_timeout`` seconds; a watchdog shuts the
  socket down when it passes, however slowly the peer sends), redirects followed only to
  ``http``/``https`` (at most :data:`MAX_REDIRECTS`), a declared ``Content-Length`` above
  ``max_bytes`` refused before the body is read, and the body read in chunks and abandoned as soon
  as it passes ``max_bytes``. Environment proxies are not used. The format is taken from the bytes
  (servers often send ``application/octet-stream``).
* Pillow opens the bytes with only the four formats enabled (no other decoder, e.g. EPS or PSD, is
  ever tried), and the header's size is checked against ``max_pixels`` before any pixel is decoded,
  so a decompression bomb costs a header parse; the decode is then linear in that bounded size.
  Pillow's own bound (``PIL.Image.MAX_IMAGE_PIXELS``) is left as it is, and ``max_pixels`` may not
  exceed it.
* A data URL's declared media type must match the decoded format (``image/jpg`` is read as
  ``image/jpeg``); a mismatch is refused, since it usually means a client bug.
* Truncated or corrupt data fails the decode. An animated GIF, PNG or WebP gives its first frame.
* An image with an EXIF orientation (a camera's JPEG stored sideways) is turned upright, as a viewer
  shows it.
* Pixels become RGB: an image with transparency (an alpha channel, or a palette or grey image with
  a transparent colour) is composited over white, so transparent areas read as white, as they
  look on a page; others are converted directly.

Changed by the server owners when the accepted image inputs change; docs/http-api.md lists them.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import http.client
import io
import re
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from helios_core.plugins.images import DecodedImage, ImageInputError

__all__ = [
    "DEFAULT_FETCH_TIMEOUT",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_COUNT",
    "DEFAULT_MAX_PIXELS",
    "MAX_REDIRECTS",
    "MEDIA_TYPES",
    "ImageLimits",
    "decode_image_bytes",
    "decode_image_url",
    "read_image_url",
]

DEFAULT_MAX_BYTES = 20 * 1024 * 1024
"""``--image-max-bytes``: encoded bytes of one image (20 MiB, OpenAI's own per-image limit)."""
DEFAULT_MAX_PIXELS = 7680 * 4320
"""``--image-max-pixels``: pixels of one image (33,177,600: an 8K UHD frame, 7680 x 4320; about 100 MB
of RGB while it is decoded)."""
DEFAULT_MAX_COUNT = 8
"""``--image-max-count``: images in one request."""
DEFAULT_FETCH_TIMEOUT = 10.0
"""``--image-fetch-timeout``: seconds for the whole fetch of one remote image."""
MAX_REDIRECTS = 5
"""Redirects one remote image fetch follows."""

MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP", "image/gif": "GIF"}
"""Accepted media types of a data URL and the Pillow format each must decode as."""
_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
"""The only Pillow decoders ever tried."""
_CHUNK = 64 * 1024
_LENGTH_DIGITS = 18
"""The longest ``Content-Length`` a remote image server's answer is read as a number (more digits: too large)."""
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_DATA_URL = re.compile(r"data:(?P<type>[^;,]*)(?P<params>(?:;[^;,]*)*),", re.IGNORECASE)


@dataclass(frozen=True)
class ImageLimits:
    """What one request's images may cost the server (the ``--image-*`` run options)."""

    max_bytes: int = DEFAULT_MAX_BYTES
    """Encoded bytes of one image (after base64 decoding, or as fetched)."""
    max_pixels: int = DEFAULT_MAX_PIXELS
    """Width times height of one image, checked from its header before decoding."""
    max_count: int = DEFAULT_MAX_COUNT
    """Images in one request."""
    allow_urls: bool = False
    """Fetch ``http``/``https`` image URLs (off: only ``data:`` URLs are accepted)."""
    fetch_timeout: float = DEFAULT_FETCH_TIMEOUT
    """Seconds for the whole fetch of one remote image."""

    def __post_init__(self) -> None:
        from PIL import Image

        for name in ("max_bytes", "max_pixels", "max_count"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"image {name.replace('_', '-')} must be a positive integer, not {value!r}")
        bomb_bound = Image.MAX_IMAGE_PIXELS
        if bomb_bound is not None and self.max_pixels > bomb_bound:
            raise ValueError(
                f"image max-pixels must be at most {bomb_bound} (Pillow's decompression-bomb bound), "
                f"not {self.max_pixels}"
            )
        timeout = self.fetch_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < float("inf"):
            raise ValueError(f"image fetch-timeout must be a positive, finite number of seconds, not {timeout!r}")


def decode_image_url(url: str, limits: ImageLimits, *, index: int | None = None) -> DecodedImage:
    """The image an ``image_url`` content part's ``url`` holds; :class:`ImageInputError` (carrying
    ``index``) when it cannot be read or decoded within ``limits``."""
    data, expected = read_image_url(url, limits, index=index)
    return decode_image_bytes(data, limits, expected_format=expected, index=index)


def read_image_url(url: str, limits: ImageLimits, *, index: int | None = None) -> tuple[bytes, str | None]:
    """(the image's encoded bytes, the Pillow format a data URL declares or None for a fetched image)."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _read_data_url(url, limits, index)
    if scheme in ("http", "https"):
        if not limits.allow_urls:
            raise ImageInputError(
                "image URLs are not fetched by this server; send the image inline as a data URL "
                "(data:image/png;base64,...)",
                index=index,
            )
        return _fetch(url, limits, index), None
    shown = f"{scheme!r} " if scheme and len(scheme) <= 32 else ""
    raise ImageInputError(
        f"the image URL scheme {shown}is not supported: use a data URL (data:image/png;base64,...)"
        + (" or an http(s) URL" if limits.allow_urls else ""),
        index=index,
    )


def _read_data_url(url: str, limits: ImageLimits, index: int | None) -> tuple[bytes, str]:
    header = _DATA_URL.match(url)
    if header is None:
        raise ImageInputError("the image data URL is malformed: expected data:<media type>;base64,<data>", index=index)
    media_type = header["type"].strip().lower()
    params = [param.strip().lower() for param in header["params"].split(";")[1:]]
    expected = MEDIA_TYPES.get(media_type)
    if expected is None:
        problem = (
            f"the image data URL's media type {media_type[:64]!r} is not supported"
            if media_type
            else "the image data URL names no media type"
        )
        raise ImageInputError(f"{problem} (image/png, image/jpeg, image/webp or image/gif)", index=index)
    if "base64" not in params:
        raise ImageInputError("the image data URL must be base64-encoded (data:<media type>;base64,...)", index=index)
    encoded = url[header.end() :]
    if (len(encoded) // 4) * 3 > limits.max_bytes + 2:  # checked before decoding anything
        raise ImageInputError(_too_many_bytes(f"about {(len(encoded) // 4) * 3}", limits), index=index)
    try:
        data = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageInputError(f"the image data URL's data is not valid base64: {exc}", index=index) from None
    if len(data) > limits.max_bytes:
        raise ImageInputError(_too_many_bytes(str(len(data)), limits), index=index)
    if not data:
        raise ImageInputError("the image data URL holds no data", index=index)
    return data, expected


def _too_many_bytes(size: str, limits: ImageLimits) -> str:
    return f"the image holds {size} bytes, more than this server's limit of {limits.max_bytes} bytes per image"


def _fetch(url: str, limits: ImageLimits, index: int | None) -> bytes:
    """The body of ``url`` (following http(s) redirects), all within one deadline and the byte limit."""
    deadline = time.monotonic() + limits.fetch_timeout
    current = url
    for _ in range(MAX_REDIRECTS + 1):
        location = _fetch_once(current, limits, deadline, index)
        if isinstance(location, bytes):
            return location
        try:
            target = urllib.parse.urljoin(current, location)
            scheme = urllib.parse.urlsplit(target).scheme.lower()
        except ValueError:
            raise ImageInputError("the image URL redirects to a URL that is not valid", index=index) from None
        if scheme not in ("http", "https"):
            raise ImageInputError("the image URL redirects to a URL that is not http(s)", index=index)
        current = target
    raise ImageInputError(f"the image URL redirects more than {MAX_REDIRECTS} times", index=index)


def _fetch_once(url: str, limits: ImageLimits, deadline: float, index: int | None) -> bytes | str:
    """The body of one GET of ``url``, or the ``Location`` of its redirect, by ``deadline``."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname
    except ValueError:  # an unclosed IPv6 bracket, say
        raise ImageInputError("the image URL is not a valid URL", index=index) from None
    if not host:
        raise ImageInputError("the image URL names no host", index=index)
    try:
        port = parts.port
    except ValueError:
        raise ImageInputError("the image URL's port is not valid", index=index) from None
    connection_type = http.client.HTTPSConnection if parts.scheme.lower() == "https" else http.client.HTTPConnection
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise _timed_out(limits, index)
    try:
        connection = connection_type(host, port, timeout=remaining)
    except (http.client.HTTPException, ValueError) as exc:  # a host with spaces or a zone index: InvalidURL
        raise ImageInputError(f"the image URL is not valid: {exc}", index=index) from None
    watchdog: _Watchdog | None = None
    try:
        try:
            connection.connect()  # within the socket timeout: the deadline's remaining time
            watchdog = _Watchdog(connection.sock, deadline - time.monotonic())
            connection.request("GET", target, headers={"Accept": "image/*", "User-Agent": "helios"})
            response = connection.getresponse()
            if response.status in _REDIRECT_STATUSES:
                location = response.getheader("Location")
                if not location:
                    raise ImageInputError(f"the image URL answered {response.status} without a Location", index=index)
                return location
            if response.status != 200:
                raise ImageInputError(f"fetching the image URL failed: HTTP status {response.status}", index=index)
            declared = (response.getheader("Content-Length") or "").strip()
            if declared.isascii() and declared.isdecimal():  # ("²" is a digit that int() refuses)
                if len(declared) > _LENGTH_DIGITS:  # past int()'s digit limit, and past any image
                    raise ImageInputError(_too_many_bytes(f"more than {limits.max_bytes}", limits), index=index)
                if int(declared) > limits.max_bytes:
                    raise ImageInputError(_too_many_bytes(declared, limits), index=index)
            body = bytearray()
            while chunk := response.read1(_CHUNK):  # what has arrived: the limit is checked as it grows
                body += chunk
                if len(body) > limits.max_bytes:
                    raise ImageInputError(_too_many_bytes(f"more than {limits.max_bytes}", limits), index=index)
            if watchdog.expired.is_set():  # the body ended because the deadline shut the socket down
                raise _timed_out(limits, index)
            if not body:
                raise ImageInputError("the image URL answered an empty body", index=index)
            return bytes(body)
        except ImageInputError:
            raise
        except (OSError, http.client.HTTPException, ValueError) as exc:
            if isinstance(exc, TimeoutError) or (watchdog is not None and watchdog.expired.is_set()):
                raise _timed_out(limits, index) from None
            reason = str(exc) or type(exc).__name__
            raise ImageInputError(f"fetching the image URL failed: {reason}", index=index) from None
    finally:
        if watchdog is not None:
            watchdog.cancel()
        connection.close()


class _Watchdog:
    """Shuts a connection's socket down at the fetch's deadline: a peer that sends slowly (a byte per
    socket timeout) cannot stretch the fetch beyond it."""

    def __init__(self, sock: socket.socket, seconds: float) -> None:
        self.expired = threading.Event()
        self._sock = sock  # the connection's own reference goes once an HTTP/1.0 response is read
        self._timer = threading.Timer(max(seconds, 0.0), self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        self.expired.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def cancel(self) -> None:
        self._timer.cancel()


def _timed_out(limits: ImageLimits, index: int | None) -> ImageInputError:
    return ImageInputError(f"fetching the image URL took longer than {limits.fetch_timeout:g} s", index=index)


def decode_image_bytes(
    data: bytes, limits: ImageLimits, *, expected_format: str | None = None, index: int | None = None
) -> DecodedImage:
    """``data`` (PNG, JPEG, WebP or GIF) decoded to RGB within ``max_pixels``; ``expected_format`` (a
    Pillow format name) must match what the data is."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data), formats=_FORMATS) as image:
            width, height = image.size
            found = "JPEG" if image.format == "MPO" else image.format  # a multi-picture JPEG is a JPEG
            if expected_format is not None and found != expected_format:
                raise ImageInputError(
                    f"the image data URL declares {_media_type(expected_format)} but the data is "
                    f"{_media_type(found) if found else 'another format'}",
                    index=index,
                )
            if width < 1 or height < 1:
                raise ImageInputError(f"the image is empty ({width}x{height})", index=index)
            if width * height > limits.max_pixels:
                raise ImageInputError(_too_many_pixels(width, height, limits), index=index)
            image.load()  # the first frame only; truncated or corrupt data fails here
            upright = _upright(image)
            if upright is not image:
                width, height = upright.size
            pixels = _rgb(upright)
    except ImageInputError:
        raise
    except Image.DecompressionBombError as exc:  # Pillow's bound, past twice its limit: before the header's size
        counted = re.search(r"\((\d+) pixels\)", str(exc))
        raise ImageInputError(_too_many_pixels(None, None, limits, counted and int(counted[1])), index=index) from None
    except UnidentifiedImageError:
        raise ImageInputError(
            "the image data is not a PNG, JPEG, WebP or GIF image (or its header is corrupt)", index=index
        ) from None
    except Exception as exc:  # Pillow's decoders raise OSError, ValueError, SyntaxError, EOFError, ...
        reason = str(exc) or type(exc).__name__
        raise ImageInputError(
            f"the image data could not be decoded (truncated or corrupt): {reason}", index=index
        ) from None
    if pixels.shape[:2] != (height, width):
        raise ImageInputError(
            f"the decoded image is {pixels.shape[1]}x{pixels.shape[0]}, not the {width}x{height} its header says",
            index=index,
        )
    return DecodedImage.of(pixels)


def _rgb(image: Any) -> npt.NDArray[np.uint8]:
    """``[height, width, 3]`` uint8 RGB of a loaded Pillow image; transparency composited over white."""
    from PIL import Image

    image = _eight_bit_grey(image)
    transparent = image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info
    if transparent:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        rgb = Image.alpha_composite(white, rgba).convert("RGB")
    else:
        rgb = image.convert("RGB")
    return np.asarray(rgb, dtype=np.uint8)


_WIDE_GREY_MODES = frozenset({"I", "I;16", "I;16B", "I;16L", "I;16N"})
"""The Pillow modes a 16-bit greyscale PNG opens in, whose ``convert`` clips values to 0..255 instead of
scaling them."""


def _eight_bit_grey(image: Any) -> Any:
    """``image`` with 16-bit grey values scaled to 8 bits (0..65535 to 0..255, rounded), its transparent grey
    value (a PNG's ``tRNS``) as an alpha channel; any other image as it is."""
    from PIL import Image

    if image.mode not in _WIDE_GREY_MODES:
        return image
    values = np.clip(np.asarray(image).astype(np.int64), 0, 65535)
    grey = ((values * 255 + 32767) // 65535).astype(np.uint8)
    transparency = image.info.get("transparency")
    if isinstance(transparency, int):
        alpha = np.where(values == transparency, 0, 255).astype(np.uint8)
        return Image.fromarray(np.stack([grey, alpha], axis=-1))
    return Image.fromarray(grey)


_EXIF_ORIENTATION = 0x0112
"""The EXIF tag saying how a camera's stored pixels turn to stand upright (1: as stored; 2 to 8: mirrored
and rotated)."""


def _upright(image: Any) -> Any:
    """``image`` as a viewer shows it: turned by its EXIF orientation (a phone's JPEG is often stored
    sideways), or ``image`` itself when it has none."""
    from PIL import ImageOps

    orientation = image.getexif().get(_EXIF_ORIENTATION, 1)
    if orientation not in range(2, 9):
        return image
    return ImageOps.exif_transpose(image)


def _too_many_pixels(width: int | None, height: int | None, limits: ImageLimits, pixels: int | None = None) -> str:
    size = "has too many pixels" if pixels is None else f"has {pixels} pixels"
    if width is not None and height is not None:
        size = f"is {width}x{height} = {width * height} pixels"
    return f"the image {size}, more than this server's limit of {limits.max_pixels} pixels per image"


def _media_type(pillow_format: str) -> str:
    return f"image/{pillow_format.lower()}"
