"""The README's demo core through LangChain and LiteLLM (``tox -e integrations``).

The core is SmolLM2-135M-Instruct built as the README builds it (``--context 8192 --tool-syntax
json-tags``; two request rows keep startup small), served by ``helios run`` in a child process on a
free loopback port. Both libraries send ``tool_choice="required"``, which constrains the answer to
one JSON-tag call; greedy decoding makes its arguments exact. A request beyond the context is a
permanent 503: each library raises after a single request, with its default retries left on.

``langchain-openai`` and ``litellm`` are heavy, so they are installed only in that tox environment;
the default suite checks the same calls with the ``openai`` client (``tests/server/test_demo_tools.py``).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import litellm
import openai
import pytest
from ignition.cli import main as ignition_main
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from helios_core.container.keys import generate_keys

NAMESPACE = "demo/smollm2"
MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the weather in Paris?"
TIMEOUT_S = 300.0
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@tool
def get_weather(city: str) -> str:
    """Current weather in a city."""
    return f"18 C and clear in {city}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``http://127.0.0.1:PORT/v1`` of ``helios run`` serving the demo core."""
    directory = tmp_path_factory.mktemp("integrations")
    keys = generate_keys(directory / "keys")
    core = directory / "smol.core"
    code = ignition_main(
        [
            "build", "smollm2-135m-instruct", "--out", str(core), "--sign-key", str(keys["signing"]),
            "--namespace", NAMESPACE, "--context", "8192", "--tool-syntax", "json-tags", "--max-rows", "2",
            "--prefill-tokens", "64,256", "--quiet",
        ]
    )  # fmt: skip
    assert code == 0
    port = _free_port()
    helios = Path(sys.executable).parent / "helios"
    log = open(directory / "server.log", "wb")  # noqa: SIM115 - closed below
    server = subprocess.Popen(
        [str(helios), "run", "--core", str(core), "--trust-key", str(keys["public"]), "--accept", NAMESPACE,
         "--host", "127.0.0.1", "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, (directory / "server.log").read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                assert time.monotonic() < deadline, "helios run did not answer within 120 s"
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def test_langchain_binds_a_required_tool(base_url: str) -> None:
    llm = ChatOpenAI(model=MODEL, base_url=base_url, api_key="unused", temperature=0, timeout=TIMEOUT_S)
    message = llm.bind_tools([get_weather], tool_choice="required").invoke(QUESTION)
    assert [(call["name"], call["args"], call["type"]) for call in message.tool_calls] == [
        ("get_weather", {"city": "Paris"}, "tool_call")
    ]


def test_litellm_completion_with_a_required_tool(base_url: str) -> None:
    response = litellm.completion(
        model=f"openai/{MODEL}",
        api_base=base_url,
        api_key="unused",
        messages=[{"role": "user", "content": QUESTION}],
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        timeout=TIMEOUT_S,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_langchain_does_not_retry_a_request_beyond_the_context(base_url: str) -> None:
    sent: list[httpx.Request] = []
    llm = ChatOpenAI(
        model=MODEL,
        base_url=base_url,
        api_key="unused",
        max_tokens=9000,
        http_client=httpx.Client(event_hooks={"request": [sent.append]}),
    )
    with pytest.raises(openai.InternalServerError) as raised:
        llm.invoke(QUESTION)
    assert len(sent) == 1
    assert raised.value.response.headers["x-should-retry"] == "false"
    assert raised.value.body["type"] == "admission_rejected"


def test_litellm_does_not_retry_a_request_beyond_the_context(base_url: str) -> None:
    sent: list[httpx.Request] = []
    client = openai.OpenAI(
        base_url=base_url, api_key="unused", http_client=httpx.Client(event_hooks={"request": [sent.append]})
    )
    with pytest.raises(litellm.ServiceUnavailableError) as raised:
        litellm.completion(
            model=f"openai/{MODEL}",
            api_base=base_url,
            api_key="unused",
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=9000,
            client=client,
        )
    assert len(sent) == 1
    assert raised.value.status_code == 503
    assert "exceeds the core's context of 8192 tokens" in raised.value.message
