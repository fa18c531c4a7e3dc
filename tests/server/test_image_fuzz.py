"""Fuzzing of image input: malformed data URLs and content parts get a 400, never anything else.

Hypothesis builds data URLs from pieces (schemes, media types, parameters, base64 or not, payloads
that are random bytes, truncated or bit-flipped real images, or real images) and content parts of
every shape (wrong types, missing and extra fields, parts in other roles). Decoding alone must raise
only ``ImageInputError``; through the real app (``tests.server.test_image_input``'s text-only
fixture core and its vision stand-in, on the render endpoint, which runs the whole preparation),
every answer is a 200, a 400 with an OpenAI error object, or the documented permanent 503 refusal of a
prompt whose image spans outgrow the context, and after every batch and at the end a plain request
still succeeds.

The module runs under ``tox -e fuzz`` (``pytest -m fuzz``), 1000 cases per test; the example count is
``$HELIOS_FUZZ_EXAMPLES`` (default 100, half a minute).
"""

from __future__ import annotations

import base64
import io
import os
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from helios_core.plugins.images import ImageInputError
from helios_core.server.image_input import ImageLimits, decode_image_url
from tests.server.test_image_input import Apps, apps  # noqa: F401 (the module fixture)

pytestmark = pytest.mark.fuzz

EXAMPLES = int(os.environ.get("HELIOS_FUZZ_EXAMPLES") or 100)
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
LIMITS = ImageLimits(max_bytes=4096, max_pixels=4096, max_count=3)


def _real_images() -> list[bytes]:
    found = []
    for fmt in ("PNG", "JPEG", "WEBP", "GIF"):
        buffer = io.BytesIO()
        Image.new("RGB", (9, 5), (30, 140, 250)).save(buffer, fmt)
        found.append(buffer.getvalue())
    return found


REAL = _real_images()


@st.composite
def _payloads(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["random", "truncated", "flipped", "real"]))
    if kind == "random":
        return draw(st.binary(max_size=256))
    image = draw(st.sampled_from(REAL))
    if kind == "truncated":
        return image[: draw(st.integers(0, len(image)))]
    if kind == "flipped":
        flipped = bytearray(image)
        for _ in range(draw(st.integers(1, 8))):
            at = draw(st.integers(0, len(flipped) - 1))
            flipped[at] ^= 1 << draw(st.integers(0, 7))
        return bytes(flipped)
    return image


@st.composite
def data_urls(draw: st.DrawFn) -> str:
    scheme = draw(st.sampled_from(["data:", "DATA:", "data", "dat:", "", "http://", "file:///", "ftp://"]))
    media = draw(
        st.one_of(
            st.sampled_from(
                ["image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif", "image/bmp", "", "IMAGE/PNG"]
            ),
            st.text(max_size=12),
        )
    )
    params = draw(st.sampled_from([";base64", "", ";charset=utf-8;base64", ";base64;base64", ";BASE64", ";b64"]))
    separator = draw(st.sampled_from([",", "", ",,", ";"]))
    payload = draw(_payloads())
    encoded = draw(
        st.sampled_from(
            [
                base64.b64encode(payload).decode(),
                base64.b64encode(payload).decode().rstrip("="),
                base64.urlsafe_b64encode(payload).decode(),
                payload.decode("latin-1"),
            ]
        )
    )
    return scheme + media + params + separator + encoded


def _parts(urls: st.SearchStrategy[str]) -> st.SearchStrategy[Any]:
    image_url = st.one_of(
        st.fixed_dictionaries({"url": urls}),
        st.fixed_dictionaries({"url": urls, "detail": st.sampled_from(["auto", "low", "high", "max", None])}),
        st.fixed_dictionaries({"url": urls, "extra": st.integers()}),
        urls,
        st.none(),
        st.integers(),
        st.fixed_dictionaries({}),
    )
    return st.one_of(
        st.fixed_dictionaries({"type": st.just("image_url"), "image_url": image_url}),
        st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)}),
        st.fixed_dictionaries(
            {"type": st.sampled_from(["image", "input_audio", "file", "", "IMAGE_URL"]), "image_url": image_url}
        ),
        st.fixed_dictionaries({"image_url": image_url}),
        st.fixed_dictionaries({"type": st.just("image_url")}),
    )


@st.composite
def bodies(draw: st.DrawFn) -> dict[str, Any]:
    content = draw(st.lists(_parts(data_urls()), min_size=0, max_size=4))
    role = draw(st.sampled_from(["user", "user", "user", "system", "assistant", "developer"]))
    messages: list[dict[str, Any]] = [{"role": role, "content": content}]
    if role != "user":
        messages.append({"role": "user", "content": "u"})
    return {"messages": messages, "max_tokens": 1}


@FUZZ
@given(url=data_urls())
def test_decoding_raises_only_image_input_errors(url: str) -> None:
    try:
        decoded = decode_image_url(url, LIMITS, index=0)
    except ImageInputError as exc:
        assert exc.index == 0 and str(exc)
    else:
        assert decoded.pixels.ndim == 3 and decoded.pixels.shape[2] == 3


def _healthy(base: str) -> None:
    response = httpx.post(
        base + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 2},
        timeout=30,
    )
    assert response.status_code == 200, response.text


def _check(response: httpx.Response) -> None:
    """A 200, a 400 for a bad request, or the documented permanent capacity refusal: a well-formed image whose
    span makes the prompt longer than the core's context is a 503 ``admission_rejected`` with
    ``x-should-retry: false``, as an over-long text prompt is (errors.py's table)."""
    assert response.status_code in (200, 400, 503), (response.status_code, response.text)
    error = response.json().get("error") if response.status_code != 200 else None
    if response.status_code == 400:
        assert error["type"] == "invalid_request_error" and error["code"] == 400 and error["message"]
    elif response.status_code == 503:
        assert error["type"] == "admission_rejected" and "the core's context" in error["message"], error
        assert response.headers.get("x-should-retry") == "false", response.headers


def test_the_server_answers_malformed_image_parts_with_400s(apps: Apps) -> None:  # noqa: F811
    sent = [0]

    @FUZZ
    @given(body=bodies())
    def case(body: dict[str, Any]) -> None:
        for base in (apps.vision, apps.text):
            _check(httpx.post(base + "/v1/chat/completions/render", json=body, timeout=30))
        text_only = httpx.post(apps.text + "/v1/chat/completions", json=body, timeout=30)
        _check(text_only)  # images: 400 before any generation; a text prompt may fill the context (503)
        sent[0] += 1
        if sent[0] % 50 == 0:
            _healthy(apps.text)

    case()
    _healthy(apps.text)
    _healthy(apps.vision)
    apps.running.engine.statistics()  # the model worker still answers
