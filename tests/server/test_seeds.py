"""Seeds through the HTTP API on SmolLM2-135M-Instruct: unseeded requests sample independently, seeded
ones reproduce.

A request without ``seed`` draws a fresh one (the operating system's random source, within the core's
packed seed type), so three unseeded requests at temperature 1 with the same prompt sample three
independent 24-token answers; two requests with the same seed (sent together, so they share decode
rounds) give the same answer.

False-failure odds of the unseeded test: it fails only if the second and third answers both repeat the
first token for token. Given the first answer, an independent draw repeats it with probability
exp(sum of its 24 sampled logprobs); for this open-ended prompt at temperature 1, four unseeded
answers on SmolLM2-135M had that probability between 1e-22 and 1e-46, so both repeating it (the
square) is below 1e-40: a false failure does not happen in practice.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from .conftest import Served

pytestmark = pytest.mark.slow

PROMPT = [{"role": "user", "content": "Write a list of ten random words."}]
TOKENS = 24
TIMEOUT_S = 300.0
"""Generous: the reference backend shares two cores with the rest of the suite."""


def _answer(served: Served, **sampling: Any) -> str:
    body = {"messages": PROMPT, "max_tokens": TOKENS, "ignore_eos": True, "temperature": 1.0, **sampling}
    response = httpx.post(served.base_url + "/v1/chat/completions", json=body, timeout=TIMEOUT_S)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["usage"]["completion_tokens"] == TOKENS
    content: str = data["choices"][0]["message"]["content"]
    return content


def _answers(served: Served, count: int, **sampling: Any) -> list[str]:
    """``count`` answers to the same request, sent at once (they share decode rounds)."""
    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(lambda _: _answer(served, **sampling), range(count)))


def test_unseeded_requests_sample_independently(smol: Served) -> None:
    answers = _answers(smol, 3)
    assert len(set(answers)) >= 2, answers


def test_requests_with_the_same_seed_give_the_same_answer(smol: Served) -> None:
    first, second = _answers(smol, 2, seed=1234)
    assert first == second
