"""Reading a core's weights resources for a backend: decoded and verified on a few threads at once.

Owns how every backend turns the WEIGHTS resources its buffers name into host bytes:
:func:`decode_resources` decodes them (each stored 4 MiB chunk checked against its signed SHA-256,
then the zstd frame or sealed chunks decoded, exactly as ``CoreFile.read_resource``) on a small pool
of threads, each resource into its own freshly allocated host array, and hands each one to the
caller on the calling thread, in the order the caller listed them. The CUDA backend uploads each
one and drops it; the reference backend keeps them as its weights.

The host arrays are uninitialized numpy memory (large ones are backed by transparent huge pages
where the system offers them), so no pass zero-fills gigabytes before decoding overwrites them; every
byte is written by the decoder or the resource fails. Hashing, decompression and file reads release
the GIL on large buffers, so the threads overlap on several cores.

Bounds and failures: at most ``workers`` resources are being decoded or wait decoded, plus the one
the caller is consuming, so at most ``workers + 1`` resources' host arrays are alive at once. The
first resource, in the caller's order, that fails raises its own error (an ``IntegrityError`` or
``CoreFormatError`` naming it, as a sequential read would); the resources after it are cancelled or
discarded, and the pool's threads have all ended before the error propagates, so nothing reads the
core after this function returned or raised.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
from numpy.typing import NDArray

from helios_core.container import CoreFile

__all__ = ["MAX_DECODE_WORKERS", "DecodedResource", "decode_resources", "decode_workers"]

MAX_DECODE_WORKERS = 4
"""The most resources decoded at once (and so the most host arrays in flight, plus the consumed one)."""

DecodedResource = NDArray[np.uint8]
"""A decoded resource: a one-dimensional, writable, C-contiguous uint8 array of its signed decoded length."""


def decode_workers(resources: int) -> int:
    """How many threads decode ``resources`` resources: at most 4, one per CPU, one per resource."""
    return max(1, min(MAX_DECODE_WORKERS, os.cpu_count() or 1, resources))


def decode_resource(core: CoreFile, resource_id: str, expected_kind: int) -> DecodedResource:
    """One resource decoded and verified into a fresh host array (see the module docstring)."""
    decoded: list[DecodedResource] = []

    def allocate(nbytes: int) -> memoryview:  # called once the resource's frame header was checked
        decoded.append(np.empty(nbytes, dtype=np.uint8))
        return decoded[0].data

    core.read_resource_into(resource_id, expected_kind, allocate)
    return decoded[0]


def decode_resources(
    core: CoreFile,
    resource_ids: Sequence[str],
    expected_kind: int,
    consume: Callable[[str, DecodedResource], None],
    *,
    workers: int | None = None,
) -> None:
    """Decode each of ``resource_ids`` (a repeated id once) and call ``consume(resource_id, data)`` for each,
    on this thread and in that order; raises the first failure in that order (see the module docstring).

    ``workers`` threads decode ahead of ``consume`` (default :func:`decode_workers`); with one, everything
    runs on this thread. What ``consume`` raises propagates the same way, after the pool stopped.
    """
    ids = list(dict.fromkeys(resource_ids))
    count = decode_workers(len(ids)) if workers is None else workers
    if count < 1:
        raise ValueError(f"workers must be at least 1, not {count}")
    if count == 1:
        for resource_id in ids:
            consume(resource_id, decode_resource(core, resource_id, expected_kind))
        return
    pool = ThreadPoolExecutor(max_workers=count, thread_name_prefix="helios-decode")
    pending: deque[tuple[str, Future[DecodedResource]]] = deque()
    try:
        waiting = iter(ids)
        for resource_id in waiting:
            pending.append((resource_id, pool.submit(decode_resource, core, resource_id, expected_kind)))
            if len(pending) == count:
                break
        while pending:
            resource_id, future = pending.popleft()
            data = future.result()
            following = next(waiting, None)
            if following is not None:  # keep the pool busy while this one is consumed
                pending.append((following, pool.submit(decode_resource, core, following, expected_kind)))
            consume(resource_id, data)
            del data  # the host array lives no longer than the caller keeps it
    finally:
        for _, future in pending:
            future.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
