"""The streaming write path: events already queued for a response go out in one write, in order and
byte for byte as they would one by one; the event bridge wakes its loop once per batch of events."""

from __future__ import annotations

import asyncio
import re
import threading
from types import SimpleNamespace
from typing import Any

import httpx

from helios_core.runtime.messages import Event, Finished, TokenEvent
from helios_core.server.bridge import EventQueue, Interrupt, _Inbox
from helios_core.server.service import ChatService
from tests.server.conftest import Served


class _Presenter:
    """Presents each token event as one data event naming its token, the end as ``[DONE]``."""

    def first_chunk(self) -> bytes:
        return b"data: first\n\n"

    def stream_token(self, event: TokenEvent) -> list[bytes]:
        return [b"data: %d\n\n" % event.token_id]

    def stream_finish(self, finished: Finished) -> list[bytes]:
        return [b"data: end\n\n", b"data: [DONE]\n\n"]


def _service() -> tuple[ChatService, list[str]]:
    cancelled: list[str] = []
    service = ChatService.__new__(ChatService)
    service._responses = {}
    service._drop_message = None
    service._settling = set()
    service.running = SimpleNamespace(engine=SimpleNamespace(cancel=cancelled.append))  # type: ignore[assignment]
    return service, cancelled


def _writes(queued: list[Event | Interrupt]) -> tuple[list[bytes], list[str]]:
    """What the response's body iterator yields when ``queued`` is already on its queue."""
    service, cancelled = _service()
    prepared: Any = SimpleNamespace(request=SimpleNamespace(request_id="r"), prompt_logprobs=False)
    permit: Any = SimpleNamespace(release=lambda: None)

    async def run() -> list[bytes]:
        events: EventQueue = asyncio.Queue()
        for event in queued:
            events.put_nowait(event)
        return [chunk async for chunk in service._sse(prepared, _Presenter(), events, permit)]  # type: ignore[arg-type]

    return asyncio.run(run()), cancelled


def _token(token_id: int) -> TokenEvent:
    return TokenEvent("r", token_id, 0.0, ((token_id, "x"),))


def test_queued_events_leave_in_one_write_in_order() -> None:
    writes, cancelled = _writes([_token(1), _token(2), _token(3), Finished("r", "length", 1, 3)])
    assert writes == [
        b"data: first\n\n",
        b"data: 1\n\ndata: 2\n\ndata: 3\n\ndata: end\n\ndata: [DONE]\n\n",
    ]
    assert cancelled == []


def test_an_interrupt_behind_queued_events_ends_their_write() -> None:
    writes, cancelled = _writes([_token(1), _token(2), Interrupt("shutting down")])
    assert writes[0] == b"data: first\n\n"
    assert len(writes) == 2
    assert writes[1] == (
        b"data: 1\n\ndata: 2\n\nevent: error\n"
        b'data: {"error":{"message":"shutting down","type":"cancelled","param":null,"code":503}}\n\n'
    )
    assert cancelled == ["r"]


def test_inbox_wakes_its_loop_once_per_batch() -> None:
    loop = asyncio.new_event_loop()
    wakes: list[object] = []
    real = loop.call_soon_threadsafe

    def counted(callback: Any, *args: Any) -> Any:
        wakes.append(callback)
        return real(callback, *args)

    loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
    try:
        inbox = _Inbox(loop)
        first: EventQueue = asyncio.Queue()
        second: EventQueue = asyncio.Queue()
        sent = [_token(1), _token(2), _token(3)]

        def pump() -> None:  # the loop is not running: every event waits for one drain
            inbox.put(first, sent[0])
            inbox.put(second, sent[1])
            inbox.put(first, sent[2])

        thread = threading.Thread(target=pump)
        thread.start()
        thread.join()
        loop.run_until_complete(asyncio.sleep(0))
        assert len(wakes) == 1
        assert [first.get_nowait(), first.get_nowait()] == [sent[0], sent[2]]
        assert second.get_nowait() == sent[1]
        inbox.put(second, sent[0])  # a later event wakes the loop again
        loop.run_until_complete(asyncio.sleep(0))
        assert len(wakes) == 2
        assert second.get_nowait() == sent[0]
    finally:
        loop.close()


def test_streams_are_byte_identical_whatever_the_write_batching(served: Served) -> None:
    """A reader that falls behind gets the same bytes as one that keeps up (observed chunks included)."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "ignore_eos": True, "stream": True,
            "temperature": 0.0, "return_token_ids": True, "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.Client(timeout=10) as client:
        with client.stream("POST", served.base_url + "/v1/chat/completions", json=body) as response:
            prompt = response.read()
        with client.stream("POST", served.base_url + "/v1/chat/completions", json=body) as response:
            served.wait_idle()  # generation ends before anything is read: the events queue up
            behind = response.read()
    assert _normalised(behind) == _normalised(prompt)
    assert prompt.count(b'"token_ids":[') == 12


def _normalised(stream: bytes) -> bytes:
    """The stream with its response id, creation time and prompt-cache reuse blanked (every other byte
    is fixed by the greedy request)."""
    stream = re.sub(rb'"id":"chatcmpl-[0-9a-f]+"', b'"id":""', stream)
    return re.sub(rb'"(created|reused_prompt_tokens|cached_tokens)":\d+', rb'"\1":0', stream)
