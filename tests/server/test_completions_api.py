"""The legacy completions endpoint (``POST /v1/completions``) through the openai client and raw HTTP.

Runs on the golden fixture core (byte-level tokenizer, context of 64 tokens, logprobs top_n 5,
scored prefill). The chat rendering of ``[{"role": "user", "content": "hi"}]`` given as a raw
completions prompt encodes to the same ids (the template's markup is spelled in the prompt and the
tokenizer reads those spellings as its control tokens), so the two endpoints can be compared token for
token.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from helios_core.frontend.prompt_encoding import PromptEncoder
from tests.server.conftest import MODEL, Served
from tests.server.helpers import admitted, chat, held_requests, sse_events, wait_for

CHAT_HI: Any = [{"role": "user", "content": "hi"}]
RENDERED_HI = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
"""The fixture core's chat template applied to CHAT_HI."""
LONG = {"ignore_eos": True}
"""Generate to the output limit: random fixture weights may sample EOS at any point."""


def completions(served: Served, **body: Any) -> httpx.Response:
    return httpx.post(served.base_url + "/v1/completions", json=body, timeout=30)


def prompt_ids(served: Served, text: str) -> list[int]:
    return list(served.running.bootstrap.tokenizer.encode(text, add_special_tokens=True).ids)


# -- text, usage, prompt forms ------------------------------------------------------------------------
def test_text_and_usage(served: Served) -> None:
    out = served.client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=5, temperature=0, extra_body=LONG, user="someone"
    )
    assert out.id.startswith("cmpl-")
    assert out.object == "text_completion"
    assert out.model == MODEL
    assert isinstance(out.created, int)
    (choice,) = out.choices
    assert choice.index == 0
    assert choice.finish_reason == "length"
    assert choice.logprobs is None
    assert isinstance(choice.text, str) and choice.text
    assert out.usage is not None
    assert out.usage.prompt_tokens == len(prompt_ids(served, "Hello")) == 5
    assert out.usage.completion_tokens == 5
    assert out.usage.total_tokens == 10


def test_alias_and_default_output_limit(served: Served) -> None:
    out = served.client.completions.create(model="tiny", prompt="Hello", temperature=0, extra_body=LONG)
    assert out.model == "tiny"
    assert out.usage is not None
    # like chat: min(core default 512, context 64 - prompt 5)
    assert out.usage.completion_tokens == 64 - 5
    assert out.choices[0].finish_reason == "length"


def test_token_id_prompt_equals_the_text_prompt(served: Served) -> None:
    ids = prompt_ids(served, "Hello there")
    as_text = served.client.completions.create(model=MODEL, prompt="Hello there", max_tokens=6, temperature=0)
    as_ids = served.client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    as_nested = served.client.completions.create(model=MODEL, prompt=[ids], max_tokens=6, temperature=0)
    as_list = served.client.completions.create(model=MODEL, prompt=["Hello there"], max_tokens=6, temperature=0)
    texts = {out.choices[0].text for out in (as_text, as_ids, as_nested, as_list)}
    assert len(texts) == 1
    assert {out.usage.prompt_tokens for out in (as_text, as_ids, as_nested, as_list) if out.usage} == {len(ids)}


def test_the_prompt_is_raw_text_without_the_chat_template(served: Served) -> None:
    """Template markup spelled in a raw prompt encodes as the control tokens, so the raw rendering
    continues exactly as the chat request does; "hi" alone is a different, shorter prompt."""
    via_chat = served.client.chat.completions.create(model=MODEL, messages=CHAT_HI, max_tokens=6, temperature=0)
    raw = served.client.completions.create(model=MODEL, prompt=RENDERED_HI, max_tokens=6, temperature=0)
    assert raw.usage is not None and via_chat.usage is not None
    assert raw.usage.prompt_tokens == via_chat.usage.prompt_tokens == len(prompt_ids(served, RENDERED_HI)) == 21
    assert raw.choices[0].text == via_chat.choices[0].message.content
    bare = served.client.completions.create(model=MODEL, prompt="hi", max_tokens=1, temperature=0)
    assert bare.usage is not None and bare.usage.prompt_tokens == 2
    control = served.client.completions.create(model=MODEL, prompt="<|im_start|>", max_tokens=1, temperature=0)
    assert control.usage is not None and control.usage.prompt_tokens == 1


def test_raw_encoding_adds_what_the_post_processor_adds() -> None:
    """A tokenizer configured to add a BOS gets it on a raw prompt; added-token spellings are tokens."""
    vocab = {"<s>": 0, "<unk>": 1, "<|end|>": 2, "a": 3, "b": 4}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<s>", "<|end|>"])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    encoder = PromptEncoder(tokenizer)
    assert encoder.encode_raw("a b") == [0, 3, 4]
    assert encoder.encode_raw("a<|end|>b") == [0, 3, 2, 4]
    assert encoder.encode("a b") == [3, 4]  # the chat path adds nothing: the template spells its BOS


# -- stops, determinism, streaming ----------------------------------------------------------------------
def test_stop_strings_cut_exactly(served: Served) -> None:
    base = served.client.completions.create(model=MODEL, prompt="Hello", max_tokens=10, temperature=0, extra_body=LONG)
    text = base.choices[0].text
    start = next(i for i in range(2, len(text) - 1) if text.find(text[i : i + 2]) == i)
    stop = text[start : start + 2]
    for given in (stop, [stop, "\x00never"]):
        cut = served.client.completions.create(
            model=MODEL, prompt="Hello", max_tokens=10, temperature=0, stop=given, extra_body=LONG
        )
        assert cut.choices[0].text == text[:start]
        assert cut.choices[0].finish_reason == "stop"


def test_token_stops_end_at_the_matching_ids(served: Served) -> None:
    """vLLM's ``stop_token_ids`` (and Helios' ``stop_token_sequences``) as for chat: the output ends at the
    first match, whose ids are not presented, with finish ``stop`` (the rendered chat prompt given raw
    generates chat's tokens, so chat's ids and text with the same stops are the reference)."""
    greedy: dict[str, Any] = {"max_tokens": 10, "temperature": 0, **LONG}
    ids = chat(served.base_url, messages=CHAT_HI, return_token_ids=True, **greedy).json()["choices"][0]["token_ids"]
    full = completions(served, prompt=RENDERED_HI, **greedy).json()["choices"][0]["text"]
    cut = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])
    for stops in ({"stop_token_ids": [ids[cut]]}, {"stop_token_sequences": [ids[cut : cut + 2]]}):
        response = completions(served, prompt=RENDERED_HI, **greedy, **stops)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        reference = chat(served.base_url, messages=CHAT_HI, **greedy, **stops).json()["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (reference["message"]["content"], "stop")
        assert full.startswith(choice["text"]) and len(choice["text"]) < len(full)
    both = completions(served, prompt="x", stop="a", stop_token_ids=[ids[0]])
    assert both.status_code == 400 and both.json()["error"]["param"] == "stop"
    outside = completions(served, prompt="x", stop_token_ids=[10**6])
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "stop_token_ids"


def test_greedy_is_deterministic_and_seeds_reproduce(served: Served) -> None:
    greedy = [
        served.client.completions.create(model=MODEL, prompt="Once", max_tokens=8, temperature=0, extra_body=LONG)
        for _ in range(2)
    ]
    assert greedy[0].choices[0].text == greedy[1].choices[0].text
    seeded = [
        served.client.completions.create(
            model=MODEL, prompt="Once", max_tokens=8, temperature=1.0, top_p=0.9, seed=1234, extra_body=LONG
        )
        for _ in range(2)
    ]
    assert seeded[0].choices[0].text == seeded[1].choices[0].text
    others = {
        served.client.completions.create(
            model=MODEL, prompt="Once", max_tokens=8, temperature=1.0, seed=seed, extra_body=LONG
        )
        .choices[0]
        .text
        for seed in range(5)
    }
    assert len(others) > 1  # the seed reaches sampling


def test_stream_concatenates_to_the_non_streamed_text(served: Served) -> None:
    body: dict[str, Any] = {"model": MODEL, "prompt": "Hello", "max_tokens": 8, "temperature": 0, "extra_body": LONG}
    whole = served.client.completions.create(**body)
    chunks = list(served.client.completions.create(stream=True, stream_options={"include_usage": True}, **body))
    assert all(chunk.object == "text_completion" and chunk.id.startswith("cmpl-") for chunk in chunks)
    assert len({chunk.id for chunk in chunks}) == 1
    *choice_chunks, usage_chunk = chunks
    assert "".join(chunk.choices[0].text for chunk in choice_chunks) == whole.choices[0].text
    assert [chunk.choices[0].finish_reason for chunk in choice_chunks][-1] == "length"
    assert all(chunk.choices[0].finish_reason is None for chunk in choice_chunks[:-1])
    assert all(chunk.usage is None for chunk in choice_chunks)
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None and whole.usage is not None
    assert usage_chunk.usage.model_dump() == whole.usage.model_dump()


def test_raw_stream_shape(served: Served) -> None:
    response = completions(served, prompt="Hello", max_tokens=3, temperature=0, stream=True, ignore_eos=True)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["x-request-id"].startswith("cmpl-")
    events = sse_events(response)
    assert events[-1] == (None, "[DONE]")
    terminal = events[-2][1]
    assert terminal["choices"] == [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}]
    assert "usage" not in terminal  # only with stream_options.include_usage
    for _, data in events[:-2]:
        assert set(data) == {"id", "object", "created", "model", "choices"}
        (choice,) = data["choices"]
        assert set(choice) == {"index", "text", "logprobs", "finish_reason"} and choice["text"]


# -- logprobs and echo ------------------------------------------------------------------------------
def test_logprobs_match_chat_for_the_same_tokens(served: Served) -> None:
    via_chat = served.client.chat.completions.create(
        model=MODEL, messages=CHAT_HI, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2, extra_body=LONG
    )
    raw = served.client.completions.create(
        model=MODEL, prompt=RENDERED_HI, max_tokens=6, temperature=0, logprobs=2, extra_body=LONG
    )
    entries = via_chat.choices[0].logprobs.content if via_chat.choices[0].logprobs else None
    legacy = raw.choices[0].logprobs
    assert entries is not None and legacy is not None
    assert legacy.tokens == [entry.token for entry in entries]
    assert legacy.token_logprobs == [entry.logprob for entry in entries]
    assert "".join(legacy.tokens) == raw.choices[0].text == via_chat.choices[0].message.content
    offsets, position = [], 0
    for token in legacy.tokens:
        offsets.append(position)
        position += len(token)
    assert legacy.text_offset == offsets
    assert legacy.top_logprobs is not None and len(legacy.top_logprobs) == 6
    for top, entry in zip(legacy.top_logprobs, entries, strict=True):
        expected: dict[str, float] = {}  # the alternatives (the best of equal texts), then the sampled token
        for alternative in entry.top_logprobs:
            expected.setdefault(alternative.token, alternative.logprob)
        expected.setdefault(entry.token, entry.logprob)
        assert top == expected


def test_logprobs_zero_carries_only_the_sampled_token(served: Served) -> None:
    out = completions(served, prompt="Hello", max_tokens=4, temperature=0, logprobs=0, ignore_eos=True).json()
    legacy = out["choices"][0]["logprobs"]
    assert set(legacy) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(legacy["tokens"]) == 4
    for token, logprob, top in zip(legacy["tokens"], legacy["token_logprobs"], legacy["top_logprobs"], strict=True):
        assert top == {token: logprob} and logprob <= 0.0


def test_streamed_logprobs_equal_the_non_streamed_ones(served: Served) -> None:
    body = {"prompt": RENDERED_HI, "max_tokens": 6, "temperature": 0, "logprobs": 2, "ignore_eos": True}
    whole = completions(served, **body).json()["choices"][0]["logprobs"]
    events = sse_events(completions(served, stream=True, **body))
    merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for _, data in events[:-1]:
        logprobs = data["choices"][0]["logprobs"]
        if logprobs is not None:
            assert "".join(logprobs["tokens"]) == data["choices"][0]["text"]
            for key, values in logprobs.items():
                merged[key].extend(values)
    assert merged == whole


def test_echo_prepends_the_prompt_and_its_logprobs(served: Served) -> None:
    plain = served.client.completions.create(model=MODEL, prompt=RENDERED_HI, max_tokens=4, temperature=0)
    echoed = served.client.completions.create(
        model=MODEL, prompt=RENDERED_HI, max_tokens=4, temperature=0, echo=True, logprobs=0
    )
    assert echoed.choices[0].text == RENDERED_HI + plain.choices[0].text
    scored = chat(served.base_url, max_tokens=1, temperature=0, prompt_logprobs=0, return_token_ids=True).json()
    legacy = echoed.choices[0].logprobs
    assert legacy is not None and legacy.token_logprobs is not None and legacy.top_logprobs is not None
    prompt_length = len(scored["prompt_token_ids"])
    assert legacy.token_logprobs[:prompt_length] == scored["prompt_logprobs"]
    assert legacy.tokens is not None and "".join(legacy.tokens[:prompt_length]) == RENDERED_HI
    assert legacy.top_logprobs[0] is None
    assert legacy.top_logprobs[1] == {legacy.tokens[1]: legacy.token_logprobs[1]}
    assert legacy.text_offset is not None and legacy.text_offset[prompt_length] == len(RENDERED_HI)
    # the tokens spell the text, but for a character the output leaves incomplete (released at the end, no token)
    assert echoed.choices[0].text.startswith("".join(legacy.tokens))
    assert len(legacy.tokens) == prompt_length + 4
    streamed = list(
        served.client.completions.create(
            model=MODEL, prompt=RENDERED_HI, max_tokens=4, temperature=0, echo=True, stream=True
        )
    )
    assert streamed[0].choices[0].text == RENDERED_HI
    assert "".join(chunk.choices[0].text for chunk in streamed) == echoed.choices[0].text


def test_echo_of_a_token_id_prompt_is_its_decoding(served: Served) -> None:
    ids = prompt_ids(served, RENDERED_HI)
    out = completions(served, prompt=ids, max_tokens=1, temperature=0, echo=True).json()
    assert out["choices"][0]["text"].startswith(RENDERED_HI)


# -- refusals ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "status", "param", "words"),
    [
        ({"prompt": ["one", "two"]}, 400, "prompt", "2 prompts in one request are not supported"),
        ({"prompt": [[1, 2], [3]]}, 400, "prompt", "2 prompts in one request are not supported"),
        ({"prompt": [72, "a"]}, 400, "prompt", "a one-element list of either"),
        ({"prompt": [72, 259]}, 400, "prompt", "prompt token ids [259] lie outside the input vocabulary [0, 259)"),
        ({"prompt": [[-1]]}, 400, "prompt", "outside the input vocabulary"),
        ({"prompt": ""}, 400, "prompt", "prompt must not be empty"),
        ({"prompt": [""]}, 400, "prompt", "prompt must not be empty"),
        ({"prompt": []}, 400, "prompt", "prompt must not be empty"),
        ({"prompt": [[]]}, 400, "prompt", "prompt must not be empty"),
        ({"prompt": [True]}, 400, "prompt", "Expected"),
        ({"prompt": 7}, 400, "prompt", "Expected"),
        ({}, 400, "prompt", "missing required field `prompt`"),
        ({"prompt": "x", "n": 129}, 400, "n", "n must lie in [1, 128], not 129"),
        ({"prompt": "x", "best_of": 3}, 400, "best_of", "best_of=3 (only as many candidates as choices, n)"),
        ({"prompt": "x", "suffix": "tail"}, 400, "suffix", "is not supported by this server"),
        ({"prompt": "x", "suffix": ""}, 400, "suffix", "is not supported by this server"),
        ({"prompt": "x", "logprobs": 6}, 400, "logprobs", "logprobs=6 exceeds this core's limit of 5"),
        ({"prompt": "x", "logprobs": -1}, 400, "logprobs", "logprobs must be >= 0"),
        ({"prompt": "x", "logprobs": True}, 400, "logprobs", "Expected"),
        ({"prompt": "x", "echo": True, "logprobs": 1}, 400, "echo", "use logprobs=0"),
        ({"prompt": "x", "logit_bias": {"72": 5}}, 400, "logit_bias", "logit_bias value 5.0 for token 72 is not"),
        ({"prompt": "x", "logit_bias": {"x": -100}}, 400, "logit_bias", "logit_bias key 'x' is not a token id"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", "only allowed"),
        ({"prompt": "x", "temperature": -1}, 400, "temperature", "temperature must lie in"),
        ({"prompt": "x", "top_k": -1}, 400, "top_k", "top_k must lie in"),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "max_tokens must be positive"),
        ({"prompt": "x", "stop": [""]}, 400, "stop", "stop"),
        ({"prompt": "x", "messages": []}, 400, "messages", "unknown field"),
        ({"prompt": "x", "response_format": {"type": "text"}}, 400, "response_format", "unknown field"),
        ({"prompt": "Hello", "max_tokens": 60}, 503, "max_tokens", "exceeds the core's context of 64 tokens"),
        ({"prompt": "x" * 70}, 503, "prompt", "which does not fit the core's context of 64 tokens"),
        ({"prompt": [72] * 64}, 503, "prompt", "at least 64 tokens, which does not fit"),
    ],
)
def test_refusals(served: Served, body: dict[str, Any], status: int, param: str, words: str) -> None:
    response = completions(served, **body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["type"] == ("invalid_request_error" if status == 400 else "admission_rejected")
    assert error["code"] == status
    assert words in error["message"]
    assert response.headers["x-request-id"].startswith("cmpl-")
    if status == 503:
        assert response.headers["x-should-retry"] == "false"


def test_refusals_through_the_client(served: Served) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": "a", "n": 0}, "n"),
        ({"prompt": "a", "best_of": 2}, "best_of"),
        ({"prompt": "a", "suffix": "b"}, "suffix"),
        ({"prompt": [300]}, "prompt"),
        ({"prompt": "a", "echo": True, "logprobs": 2}, "echo"),
    ]
    for body, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            served.client.completions.create(model=MODEL, max_tokens=2, **body)
        assert caught.value.status_code == 400
        assert isinstance(caught.value.body, dict) and caught.value.body["param"] == param
    with pytest.raises(openai.NotFoundError):
        served.client.completions.create(model="other", prompt="a", max_tokens=2)


def test_a_stream_beyond_the_context_is_an_error_event(served: Served) -> None:
    response = completions(served, prompt="Hello", max_tokens=60, stream=True)
    assert response.status_code == 200
    name, data = sse_events(response)[-1]
    assert name == "error"
    assert data["error"]["type"] == "admission_rejected" and data["error"]["param"] == "max_tokens"


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": ',
        b"[]",
        b'"Hello"',
        b"",
        b'{"prompt": "a",}',
        b'{"prompt": [["a"]]}',
        b'{"prompt": [[1, [2]]]}',
        b'{"prompt": {"text": "a"}}',
        b'{"prompt": "a", "max_tokens": "3"}',
        b'{"prompt": "a", "stream": 1}',
        b'{"prompt": "a", "echo": "yes"}',
        b'{"prompt": "a", "stop": [1]}',
        b'{"prompt": "\\ud800"}',
        b'{"prompt": "a", "seed": -1}',
        b'{"prompt": "a", "seed": 18446744073709551616}',
        b"\xff\xfe",
        b"[" * 10000,
    ],
)
def test_malformed_bodies_are_400(served: Served, body: bytes) -> None:
    response = httpx.post(
        served.base_url + "/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=30
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400


def test_a_body_declared_as_text_is_415(served: Served) -> None:
    response = httpx.post(
        served.base_url + "/v1/completions", content=b'{"prompt": "a"}', headers={"content-type": "text/plain"}
    )
    assert response.status_code == 415
    assert response.json()["error"]["type"] == "invalid_request_error"


# -- admission, cancellation, metrics -------------------------------------------------------------------
def test_full_ingress_is_429_shared_with_chat(served: Served) -> None:
    def hold(base_url: str, index: int) -> httpx.Response:
        body = {"max_tokens": 10, "ignore_eos": True, "stream": True}
        if index % 2:
            return completions(served, prompt="Hello", **body)
        return chat(base_url, **body)

    with served.slow(0.03), held_requests(served.base_url, 4, hold) as statuses:  # 2 queued + 2 active
        refused = completions(served, prompt="Hello", max_tokens=2)
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "1"
    error = refused.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("rate_limit_error", None, 429)
    assert statuses == [200] * 4
    wait_for(lambda: admitted(served.base_url) == 0)


def test_disconnect_cancels_a_completion_stream(served: Served) -> None:
    before = served.running.engine.statistics().finished.get("cancelled", 0)
    with served.slow(0.03), httpx.Client(timeout=10) as client:
        body = {"prompt": "Hello", "max_tokens": 40, "ignore_eos": True, "stream": True}
        with client.stream("POST", served.base_url + "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
        wait_for(lambda: served.running.engine.statistics().finished.get("cancelled", 0) == before + 1)
    served.wait_idle()
    assert served.running.engine.statistics().pages_referenced == 0
    wait_for(lambda: admitted(served.base_url) == 0)


def test_openapi_lists_the_completions_operation(served: Served) -> None:
    document = httpx.get(served.base_url + "/schema/openapi.json").json()
    operation = document["paths"]["/v1/completions"]["post"]
    assert sorted(operation["responses"]) == ["200", "400", "404", "413", "415", "429", "500", "503"]
    properties = operation["requestBody"]["content"]["application/json"]["schema"]["properties"]
    assert {"prompt", "max_tokens", "logprobs", "echo", "stream", "stop", "top_k", "ignore_eos"} <= set(properties)
    assert properties["suffix"]["type"] == "null"


# -- observation: token ids, timestamps, prompt logprobs ---------------------------------------------
def test_return_token_ids_reports_the_prompt_and_generated_ids_as_chat_does(served: Served) -> None:
    """A raw completion of the rendered chat prompt and the chat request observe the same ids: the prompt's
    in the choice (where vLLM's completions put them), the generated ones beside the text."""
    body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    completion = completions(served, prompt=RENDERED_HI, **body).json()
    reply = chat(served.base_url, messages=CHAT_HI, **body).json()
    (choice,) = completion["choices"]
    assert choice["prompt_token_ids"] == reply["prompt_token_ids"] == prompt_ids(served, RENDERED_HI)
    assert choice["token_ids"] == reply["choices"][0]["token_ids"]
    assert len(choice["token_ids"]) == completion["usage"]["completion_tokens"] == 6
    assert choice["text"] == served.running.bootstrap.tokenizer.decode(choice["token_ids"])
    assert completion["reused_prompt_tokens"] == completion["usage"]["prompt_tokens_details"]["cached_tokens"]
    plain = completions(served, prompt=RENDERED_HI, max_tokens=6, temperature=0, ignore_eos=True).json()
    assert "prompt_token_ids" not in plain["choices"][0] and "token_ids" not in plain["choices"][0]


def test_a_stream_observes_the_prompt_first_and_one_id_a_chunk(served: Served) -> None:
    body = {"prompt": "Hello", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    whole = completions(served, **body).json()["choices"][0]
    events = [data for name, data in sse_events(completions(served, stream=True, return_token_timestamps=True, **body))]
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert chunks[0]["choices"][0]["text"] == ""
    observed = [chunk["choices"][0] for chunk in chunks if "token_ids" in chunk["choices"][0]]
    assert [choice["token_ids"][0] for choice in observed] == whole["token_ids"]
    assert all(choice["text"] == "" and len(choice["token_timestamps_ns"]) == 1 for choice in observed)
    times = [choice["token_timestamps_ns"][0] for choice in observed]
    assert times == sorted(times)
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == whole["text"]
    terminal = chunks[-1]
    assert terminal["choices"][0]["finish_reason"] == "length"
    assert terminal["usage"]["completion_tokens"] == 5
    assert set(terminal["performance"]) == {"ingress_ns", "enqueue_ns", "reused_prompt_tokens"}


def test_prompt_logprobs_score_the_prompt_as_chat_does(served: Served) -> None:
    completion = completions(served, prompt=RENDERED_HI, max_tokens=2, prompt_logprobs=0).json()
    reply = chat(served.base_url, messages=CHAT_HI, max_tokens=2, prompt_logprobs=0).json()
    scores = completion["choices"][0]["prompt_logprobs"]
    assert len(scores) == completion["usage"]["prompt_tokens"]
    assert scores[0] is None and all(isinstance(score, float) and score <= 0 for score in scores[1:])
    assert scores == pytest.approx(reply["prompt_logprobs"])
    assert completion["choices"][0]["logprobs"] is None  # generated logprobs only when asked
    stream = [
        data
        for _, data in sse_events(completions(served, prompt=RENDERED_HI, max_tokens=2, prompt_logprobs=0, stream=True))
    ]
    assert stream[0]["choices"][0]["prompt_logprobs"] == pytest.approx(scores)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"return_token_timestamps": True}, "return_token_timestamps", "requires return_token_ids=true"),
        ({"prompt_logprobs": 2}, "prompt_logprobs", "top alternatives for prompt tokens are not supported"),
        ({"prompt_logprobs": -1}, "prompt_logprobs", "prompt_logprobs must be >= 0"),
    ],
)
def test_observation_refusals(served: Served, body: dict[str, Any], param: str, words: str) -> None:
    response = completions(served, prompt="x", max_tokens=2, **body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param
    assert words in response.json()["error"]["message"]


def test_min_tokens_as_for_chat(served: Served) -> None:
    """``min_tokens`` holds a ``stop_token_ids`` id back from the first tokens, as on chat, and is a 400
    naming it past the output limit."""
    greedy: dict[str, Any] = {"max_tokens": 10, "temperature": 0, "return_token_ids": True, **LONG}
    ids = completions(served, prompt=RENDERED_HI, **greedy).json()["choices"][0]["token_ids"]
    target = ids[1]
    first = ids.index(target)
    held = completions(served, prompt=RENDERED_HI, **greedy, stop_token_ids=[target], min_tokens=first + 2)
    assert held.status_code == 200, held.text
    produced = held.json()["choices"][0]["token_ids"]
    assert produced[:first] == ids[:first] and target not in produced[: first + 2] and len(produced) >= first + 2
    beyond = completions(served, prompt="x", max_tokens=2, min_tokens=3)
    assert beyond.status_code == 400 and beyond.json()["error"]["param"] == "min_tokens"
    assert beyond.json()["error"]["message"] == "min_tokens=3 exceeds max_tokens=2"
