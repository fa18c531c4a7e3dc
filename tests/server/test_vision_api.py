"""Image input end to end through the official openai client, on the synthetic vision cores.

The served cores are the golden ``vision-*.core`` fixtures (tiny ``vision-synthetic``, seed 7): the fixed
tile layout, the dynamic merged-grid layout and the third-party example layout (identifier 100001, from
``contrib/example-image-layout``, installed by the test command). Greedy tokens of chats with one and two
images equal the independent numpy forward pass of ``tests/ignition/vision_oracle.py`` fed with patches cut
by hand from the same pixels; images combine with tools, structured output and streaming; concurrent
image requests give their solo tokens; a shared image prefix is reused and a different image is not;
bad images on a vision core are 400s naming the content part and leave no permit behind.
"""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from PIL import Image

from helios_core.loading import TrustSettings, open_core
from tests.ignition.vision_oracle import START, ImageInput, cut_patches, oracle_greedy, random_pixels

from .conftest import FIXTURES, Served, serve_fixture
from .helpers import CITY_TOOL, admitted, chat

MODEL = "vision-synthetic-tiny"
GOLDEN = TrustSettings((FIXTURES / "keys" / "signing.pub.pem",), "helios-fixtures/golden", None)
GENERATED = 8


def data_url(pixels: npt.NDArray[np.uint8]) -> str:
    """A PNG data URL of ``pixels`` (lossless: the server decodes these exact pixels)."""
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_part(pixels: npt.NDArray[np.uint8]) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_url(pixels)}}


def user(*parts: dict[str, Any] | str) -> list[dict[str, Any]]:
    content = [{"type": "text", "text": part} if isinstance(part, str) else part for part in parts]
    return [{"role": "user", "content": content}]


def greedy(served: Served, messages: list[dict[str, Any]], **body: Any) -> Any:
    return served.client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        temperature=0.0,
        max_tokens=body.pop("max_tokens", GENERATED),
        extra_body={"return_token_ids": True, "ignore_eos": True, **body.pop("extra_body", {})},
        **body,
    )


def response_ids(reply: Any) -> tuple[list[int], list[int]]:
    """(prompt ids, generated ids) of a reply with ``return_token_ids``."""
    extra = reply.model_extra or {}
    choice_extra = reply.choices[0].model_extra or {}
    return list(extra["prompt_token_ids"]), list(choice_extra["token_ids"])


def feature_starts(prompt: Sequence[int]) -> list[int]:
    """The prompt index of each image's first feature token (right after its span's opening token)."""
    return [index + 1 for index, token in enumerate(prompt) if token == START]


def oracle_tokens(core: str, prompt: Sequence[int], images: Sequence[ImageInput]) -> list[int]:
    verified = open_core(FIXTURES / core, GOLDEN)
    try:
        return oracle_greedy(verified, prompt, list(zip(feature_starts(prompt), images, strict=True)), GENERATED)
    finally:
        verified.close()


def hand_cut(core: str, pixels: npt.NDArray[np.uint8]) -> ImageInput:
    verified = open_core(FIXTURES / core, GOLDEN)
    try:
        return cut_patches(pixels, verified.contract.model.vision)
    finally:
        verified.close()


def column_major(image: ImageInput, side: int) -> ImageInput:
    """``image`` (raster order over a ``side`` x ``side`` patch grid) in column-major order: the example
    layout's feature order."""
    order = [row * side + column for column in range(side) for row in range(side)]
    return ImageInput({name: tensor[order] for name, tensor in image.tensors.items()}, image.features)


@pytest.fixture(scope="module")
def tiles() -> Iterator[Served]:
    with serve_fixture(core=FIXTURES / "vision-tiles.core", trust=GOLDEN, max_active=4) as served:
        yield served


def test_one_image_gives_the_forward_pass_tokens(tiles: Served) -> None:
    pixels = random_pixels(11, 16, 16)
    reply = greedy(tiles, user("What is in this picture?", image_part(pixels)))
    prompt, generated = response_ids(reply)
    assert len(feature_starts(prompt)) == 1 and prompt.count(262) == 16  # one span of 16 feature tokens
    assert generated == oracle_tokens("vision-tiles.core", prompt, [hand_cut("vision-tiles.core", pixels)])
    assert reply.usage is not None and reply.usage.prompt_tokens == len(prompt)


def test_two_images_give_the_forward_pass_tokens(tiles: Served) -> None:
    first, second = random_pixels(12, 16, 16), random_pixels(13, 16, 16)
    reply = greedy(tiles, user("Compare", image_part(first), "with", image_part(second)))
    prompt, generated = response_ids(reply)
    images = [hand_cut("vision-tiles.core", pixels) for pixels in (first, second)]
    assert generated == oracle_tokens("vision-tiles.core", prompt, images)
    swapped = greedy(tiles, user("Compare", image_part(second), "with", image_part(first)))
    assert response_ids(swapped)[0] == prompt  # the same token ids: only the image content differs
    assert response_ids(swapped)[1] == oracle_tokens("vision-tiles.core", prompt, images[::-1])


def test_the_dynamic_layout_serves_images_of_two_sizes() -> None:
    small, wide = random_pixels(14, 8, 8), random_pixels(15, 16, 24)
    with serve_fixture(core=FIXTURES / "vision-dynamic.core", trust=GOLDEN) as served:
        reply = greedy(served, user(image_part(small), "and", image_part(wide)))
    prompt, generated = response_ids(reply)
    images = [hand_cut("vision-dynamic.core", pixels) for pixels in (small, wide)]
    assert [image.features for image in images] == [1, 6]  # 2 x 2 patches a feature
    assert generated == oracle_tokens("vision-dynamic.core", prompt, images)


def test_the_third_party_layout_is_selected_by_its_core() -> None:
    pixels = random_pixels(16, 16, 16)
    with serve_fixture(core=FIXTURES / "vision-example-layout.core", trust=GOLDEN) as served:
        plugins = served.running.verified.contract.model.frontend.image_layout
        reply = greedy(served, user("Look", image_part(pixels)))
    assert plugins == 100001
    prompt, generated = response_ids(reply)
    transposed = column_major(hand_cut("vision-example-layout.core", pixels), side=4)
    assert generated == oracle_tokens("vision-example-layout.core", prompt, [transposed])
    raster = oracle_tokens("vision-example-layout.core", prompt, [hand_cut("vision-example-layout.core", pixels)])
    assert generated != raster  # the layout, not the built-in raster order, decided the features


def test_streaming_with_an_image_gives_the_unstreamed_text(tiles: Served) -> None:
    messages = user("Describe", image_part(random_pixels(17, 16, 16)))
    whole = greedy(tiles, messages, max_tokens=12)
    stream = tiles.client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0.0, max_tokens=12, stream=True,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == whole.choices[0].message.content


def test_concurrent_image_requests_give_their_solo_tokens(tiles: Served) -> None:
    conversations = [user(f"Picture {n}:", image_part(random_pixels(20 + n, 16, 16))) for n in range(6)]
    solo = [response_ids(greedy(tiles, messages))[1] for messages in conversations]
    with ThreadPoolExecutor(max_workers=6) as pool:
        together = list(pool.map(lambda messages: response_ids(greedy(tiles, messages))[1], conversations))
    assert together == solo
    assert len({tuple(tokens) for tokens in solo}) > 1  # the images decide the tokens


def test_a_shared_image_prefix_is_reused_and_a_different_image_is_not(tiles: Served) -> None:
    shared, other = random_pixels(30, 16, 16), random_pixels(31, 16, 16)
    first = greedy(tiles, user(image_part(shared), "abcdefghijklmnop one"))
    prompt = response_ids(first)[0]
    span_end = prompt.index(261) + 1  # the span's closing token
    same = greedy(tiles, user(image_part(shared), "abcdefghijklmnop two"))
    different = greedy(tiles, user(image_part(other), "abcdefghijklmnop one"))
    assert same.usage is not None and different.usage is not None
    reused_same = same.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    reused_different = different.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    assert reused_same >= span_end  # the whole image span came from the cache
    assert reused_different <= prompt.index(START) + 1  # nothing of the other image's span
    # reuse never changes what is generated
    again = greedy(tiles, user(image_part(other), "abcdefghijklmnop one"))
    assert response_ids(again)[1] == response_ids(different)[1]


def png_bytes(pixels: npt.NDArray[np.uint8]) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def claimed_size(png: bytes, width: int, height: int) -> bytes:
    """``png`` whose header claims ``width`` x ``height`` pixels (a decompression bomb's header), CRC fixed."""
    header = b"IHDR" + struct.pack(">II", width, height) + png[24:29]
    return png[:12] + header + struct.pack(">I", zlib.crc32(header)) + png[33:]


def test_bad_images_on_a_vision_core_are_400s_and_leave_nothing_behind(tiles: Served) -> None:
    good = png_bytes(random_pixels(50, 16, 16))
    encoded = base64.b64encode(good).decode()

    def url(payload: bytes, media: str = "png") -> dict[str, Any]:
        return {
            "type": "image_url",
            "image_url": {"url": f"data:image/{media};base64," + base64.b64encode(payload).decode()},
        }

    bad_parts: list[tuple[list[dict[str, Any]], str]] = [
        ([url(good[: len(good) // 2])], "messages[0].content[1]"),  # truncated
        ([url(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))], "messages[0].content[1]"),  # corrupt
        ([url(claimed_size(good, 100_000, 100_000))], "messages[0].content[1]"),  # a bomb's header
        ([url(good, "gif")], "messages[0].content[1]"),  # the declared type is not the data's
        ([{"type": "image_url", "image_url": {"url": "data:image/bmp;base64," + encoded}}], "messages[0].content[1]"),
        ([{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}], "messages[0].content[1]"),
        ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}], "messages[0].content[1]"),
    ]
    for parts, where in bad_parts:
        response = chat(tiles.base_url, model=MODEL, messages=[{"role": "user", "content": [
            {"type": "text", "text": "Look"}, *parts]}], max_tokens=4)  # fmt: skip
        assert response.status_code == 400, (where, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and where in error["message"], error
    nine = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + encoded}}] * 9
    response = chat(tiles.base_url, model=MODEL, messages=[{"role": "user", "content": nine}], max_tokens=4)
    assert response.status_code == 400 and "images" in response.json()["error"]["message"]
    assert admitted(tiles.base_url) == 0  # no permit, slot or page was kept by a refused request
    reply = greedy(
        tiles, user("Still there?", {"type": "image_url", "image_url": {"url": "data:image/png;base64," + encoded}})
    )
    assert reply.choices[0].finish_reason == "length" and len(response_ids(reply)[1]) == GENERATED


def test_prompt_logprobs_of_a_prompt_with_an_image_are_a_400_where_no_scored_program_takes_images(
    tiles: Served,
) -> None:
    """The tile core's scored prefill programs take no images: prompt logprobs of an image prompt are a
    request this core cannot serve (400, ``prompt_logprobs``), as on a core without scored programs; the same
    request without the image is served."""
    image = {"type": "image_url", "image_url": {"url": data_url(random_pixels(51, 16, 16))}}
    response = chat(tiles.base_url, model=MODEL, messages=[{"role": "user", "content": [
        {"type": "text", "text": "Look"}, image]}], max_tokens=2, prompt_logprobs=0)  # fmt: skip
    assert response.status_code == 400, response.text
    assert response.json()["error"] == {
        "message": "prompt_logprobs are not supported for a prompt with images by this core: its scored prefill "
        "programs take no images",
        "type": "invalid_request_error",
        "param": "prompt_logprobs",
        "code": 400,
    }
    text_only = chat(tiles.base_url, model=MODEL, messages=[{"role": "user", "content": "Look"}], max_tokens=2,
                     prompt_logprobs=0)  # fmt: skip
    assert text_only.status_code == 200, text_only.text
    assert admitted(tiles.base_url) == 0


@pytest.fixture(scope="module")
def served_tools(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A tiny tiles vision core with JSON-tag tool calls and room for a tools system message and a long
    sampled answer."""
    from ignition.recipes.llama import Capacities
    from ignition.recipes.vision import build_vision_core, vision_declaration

    from helios_core.container.keys import generate_keys, load_private_key

    directory = tmp_path_factory.mktemp("vision-tools")
    keys = generate_keys(directory / "keys")
    caps = Capacities(
        max_rows=2, prefill_tokens=(64,), decode_rows=(1, 2), page_tokens=16, cache_pages=64, context=1024, snapshots=0
    )
    core = directory / "vision-tools.core"
    build_vision_core(
        vision_declaration("tiny", layout="tiles", seed=5, tool_syntax="json-tags"), core, caps=caps,
        signing_key=load_private_key(keys["signing"]), namespace="tests/vision-tools",
    )  # fmt: skip
    trust = TrustSettings((keys["public"],), "tests/vision-tools", None)
    with serve_fixture(core=core, trust=trust) as served:
        yield served


def test_an_image_with_a_required_tool_call(served_tools: Served) -> None:
    reply = served_tools.client.chat.completions.create(
        model=MODEL,
        messages=user("Where was this taken?", image_part(random_pixels(40, 16, 16))),  # type: ignore[arg-type]
        tools=[CITY_TOOL],  # type: ignore[list-item]
        tool_choice="required",
        temperature=1.0,
        seed=3,
        max_tokens=200,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}


def test_structured_output_with_an_image(served_tools: Served) -> None:
    schema = {
        "type": "object",
        "properties": {"temperature": {"type": "integer", "minimum": -40, "maximum": 50}},
        "required": ["temperature"],
        "additionalProperties": False,
    }
    reply = served_tools.client.chat.completions.create(
        model=MODEL,
        messages=user("How warm is it there?", image_part(random_pixels(41, 16, 16))),  # type: ignore[arg-type]
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": schema}},
        temperature=1.0,
        seed=2,
        max_tokens=900,
    )
    assert reply.choices[0].finish_reason == "stop"
    answer = json.loads(reply.choices[0].message.content or "")
    assert set(answer) == {"temperature"} and type(answer["temperature"]) is int
    assert -40 <= answer["temperature"] <= 50
