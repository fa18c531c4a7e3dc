"""``--kv-events-config`` and the server's side of KV-cache events.

Owns the option (its JSON, vLLM's keys, decoded strictly into
:class:`~helios_core.runtime.kv_events.KvEventsConfig` by :func:`parse_kv_events_config`; a config
file's or the environment's value by :func:`config_text`), the default topic (:func:`default_topic`)
and the metrics collector of the publisher's counters (:func:`publisher_counters`). The publisher and
the wire format are the runtime's (:mod:`helios_core.runtime.kv_events`, re-exported here): it runs
where the page allocator lives, in the serving process in the thread mode and in the worker process
with ``--worker-process``, whose counters reach ``/metrics`` through the worker's load updates.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import msgspec

from helios_core.errors import StartupError
from helios_core.runtime.kv_events import (
    END_OF_REPLAY,
    MEDIUM,
    KvEventPublisher,
    KvEventsConfig,
    binds,
    encode_batch,
    encode_event,
    event_hash,
    frames,
)
from helios_core.server.metrics import KvEventCounters

__all__ = [
    "END_OF_REPLAY",
    "MEDIUM",
    "KvEventCounts",
    "KvEventPublisher",
    "KvEventsConfig",
    "binds",
    "config_text",
    "default_topic",
    "encode_batch",
    "encode_event",
    "event_hash",
    "frames",
    "parse_kv_events_config",
    "publisher_counters",
]


class KvEventCounts(Protocol):
    """Where the publisher's counters are read: the publisher itself, or the worker process's copy."""

    @property
    def dropped(self) -> int:
        """Events dropped because the publisher's queue was full."""

    @property
    def published(self) -> int:
        """Events handed to the PUB socket."""


def parse_kv_events_config(text: str, where: str = "--kv-events-config") -> KvEventsConfig:
    """Decode the option's JSON; a StartupError names the key that is unknown or of the wrong type
    (``where`` names the option and its source)."""
    try:
        config = msgspec.json.decode(text, type=KvEventsConfig)
    except msgspec.ValidationError as exc:
        raise StartupError(f"{where}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise StartupError(f"{where} is not JSON: {exc}") from None
    if config.enabled and not config.endpoint:
        raise StartupError(f"{where}: endpoint must not be empty")
    if config.replay_endpoint == "":
        raise StartupError(f"{where}: replay_endpoint must not be empty (null: no replay)")
    return config


def config_text(value: Any, where: str) -> str:
    """A config file's or the environment's ``kv_events_config`` (JSON text, or a TOML table) as JSON
    text, validated."""
    if isinstance(value, dict):
        value = json.dumps(value)
    if not isinstance(value, str):
        raise StartupError(f"{where} must be a JSON object string or a table")
    parse_kv_events_config(value, where)
    return value


def default_topic(host: str, port: int, served_name: str) -> str:
    """``kv@<host>:<port>@<served model name>``, the topic llm-d's guides give their servers."""
    return f"kv@{host}:{port}@{served_name}"


def publisher_counters(counts: KvEventCounts) -> KvEventCounters:
    """The metrics collector of ``counts``' ``dropped`` and ``published``, read at each scrape."""
    return KvEventCounters(lambda: counts.dropped, lambda: counts.published)
