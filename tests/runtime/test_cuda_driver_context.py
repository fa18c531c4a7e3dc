"""``cuda_driver.Context`` calls that need no GPU to check: the driver entry points they call, in order,
recorded by a stand-in for the driver module (``cuda.bindings.driver`` itself is imported for its
result codes)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from helios_core.backends import cuda_driver
from helios_core.backends.cuda_driver import Context, CudaError

driver = pytest.importorskip("cuda.bindings.driver")


class RecordingDriver:
    """Records each call as (name, *arguments) and answers success, or ``failing``'s code for that call."""

    def __init__(self, failing: dict[str, Any] | None = None) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.failing = failing or {}

    def __getattr__(self, name: str) -> Any:
        def call(*arguments: Any) -> tuple[Any, ...]:
            self.calls.append((name, *arguments))
            return (self.failing.get(name, driver.CUresult.CUDA_SUCCESS),)

        return call


def _context(recording: RecordingDriver) -> Context:
    context = object.__new__(Context)  # no device: only the attributes memset, upload and download read
    context._cu = recording
    context.stream = "context-stream"
    return context


def test_memset_sets_the_bytes_on_the_context_stream_and_returns_once_they_are_set() -> None:
    """The memset is ordered on the context's (non-blocking) stream and waited for: work launched after it
    on that stream, or read after it returns, sees the bytes (a plain ``cuMemsetD8`` runs on the legacy
    stream, which the context's stream does not wait for)."""
    recording = RecordingDriver()
    _context(recording).memset(0x7F0000, 4096, 0x3C)
    assert recording.calls == [
        ("cuMemsetD8Async", 0x7F0000, 0x3C, 4096, "context-stream"),
        ("cuStreamSynchronize", "context-stream"),
    ]


def test_memset_of_nothing_calls_no_driver_entry_point() -> None:
    recording = RecordingDriver()
    _context(recording).memset(0x7F0000, 0)
    assert recording.calls == []


def test_a_failed_memset_raises_naming_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    recording = RecordingDriver(failing={"cuMemsetD8Async": driver.CUresult.CUDA_ERROR_INVALID_VALUE})
    names = SimpleNamespace(  # the error name as a driver library would give it (none is loaded here)
        CUresult=driver.CUresult, cuGetErrorName=lambda code: (driver.CUresult.CUDA_SUCCESS, code.name.encode())
    )
    monkeypatch.setattr(cuda_driver, "_driver", lambda: names)
    with pytest.raises(CudaError, match="cuMemsetD8Async failed: CUDA_ERROR_INVALID_VALUE"):
        _context(recording).memset(0x7F0000, 16)
    assert [call[0] for call in recording.calls] == ["cuMemsetD8Async"]


def test_upload_copies_on_the_context_stream_and_returns_once_the_bytes_landed() -> None:
    """An upload is ordered on the context's stream after the work enqueued there and waited for: a kernel
    launched after it reads the bytes, and no kernel before it has its results overwritten once it returns
    (a plain ``cuMemcpyHtoD`` from pageable memory runs on the legacy stream and may return before its bytes
    land)."""
    recording = RecordingDriver()
    values = np.arange(6, dtype=np.float32)
    _context(recording).upload(0x7F0000, values)
    (copy, wait) = recording.calls
    assert copy[0] == "cuMemcpyHtoDAsync" and copy[1] == 0x7F0000 and copy[3:] == (24, "context-stream")
    assert copy[2] == values.ctypes.data
    assert wait == ("cuStreamSynchronize", "context-stream")
    recording.calls.clear()
    _context(recording).upload(0x7F0000, b"")
    assert recording.calls == []


def test_download_copies_on_the_context_stream_and_returns_once_the_bytes_arrived() -> None:
    """A download is ordered on the context's stream after the work enqueued there and waited for: it reads
    what a kernel launched before it wrote (a plain ``cuMemcpyDtoH`` runs on the legacy stream, which does
    not wait for the context's non-blocking stream)."""
    recording = RecordingDriver()
    out = np.zeros(5, dtype=np.int64)
    _context(recording).download(0x7F0000, out)
    (copy, wait) = recording.calls
    assert copy == ("cuMemcpyDtoHAsync", out.ctypes.data, 0x7F0000, 40, "context-stream")
    assert wait == ("cuStreamSynchronize", "context-stream")
    recording.calls.clear()
    _context(recording).download(0x7F0000, np.zeros(0, dtype=np.int64))
    assert recording.calls == []


def test_download_refuses_an_array_it_cannot_write_in_place() -> None:
    recording = RecordingDriver()
    strided = np.zeros((4, 4), dtype=np.float32)[:, 1]
    with pytest.raises(ValueError, match="writable C-contiguous"):
        _context(recording).download(0x7F0000, strided)
    assert recording.calls == []
