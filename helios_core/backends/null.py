"""The null backend (benchmarks only): programs that write well-formed completion records, computing nothing.

Owns per-frame staging and completion arrays shaped exactly as the core declares them, and for each
program the handful of transport entries its completion depends on, found through the graph's own
value bindings (generation, sampling decision, query length, positions). ``run`` echoes the
submission sequence and generations, reports one emitted token per sampling lane, the consumed
endpoint after the round, -1 cursors and reserved fields, and a deterministic sampled id. Host cost
(scheduling, packing, validation) can then be measured without a model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

from helios_core.contract import PreparedContract
from helios_core.dtypes import NUMPY_DTYPES
from helios_core.wire import contract_pb2 as ct
from helios_core.wire import manifest_pb2 as mf

AnyArray = npt.NDArray[np.generic]


class NullBackend:
    """Completion records without computation."""

    def __init__(self, contract: PreparedContract, *, frames: int = 2) -> None:
        self._frames = frames
        execution = contract.execution
        self._transport = [
            {e.name: np.zeros(tuple(e.shape), dtype=NUMPY_DTYPES[e.dtype]) for e in execution.transport.entries}
            for _ in range(frames)
        ]
        completion_buffers = {c.buffer for c in execution.completion}
        self._completion_buffers = [
            {
                b.name: np.zeros(tuple(int(d.size) for d in b.shape), dtype=NUMPY_DTYPES[b.dtype])
                for b in execution.buffers
                if b.name in completion_buffers
            }
            for _ in range(frames)
        ]
        self._fields = {int(c.field): c.buffer for c in execution.completion}
        self._sequence_entry = execution.transport.submission_sequence_entry
        self._sampled_size = contract.sampled_size
        self._sources: dict[str, dict[int, str]] = {
            name: {b.source: b.destination for b in graph.contract.bindings} for name, graph in contract.graphs.items()
        }
        self._rows = {name: graph.extents.batch_capacity for name, graph in contract.graphs.items()}

    def transport(self, frame: int) -> Mapping[str, AnyArray]:
        return self._transport[frame]

    def completion(self, frame: int) -> Mapping[int, AnyArray]:
        buffers = self._completion_buffers[frame]
        return {field: buffers[name] for field, name in self._fields.items()}

    def run(self, program: str, frame: int) -> None:
        staging = self._transport[frame]
        out = self.completion(frame)
        sources = self._sources[program]
        rows = self._rows[program]
        generation_entry = sources.get(ct.VALUE_SOURCE_GENERATION)
        positions_entry = sources.get(ct.VALUE_SOURCE_PROMPT_POSITIONS)
        if generation_entry is None or positions_entry is None or mf.COMPLETION_FIELD_GENERATION not in out:
            return  # a program without per-token lanes (state initialization) reports nothing
        generations = staging[generation_entry].reshape(-1)[:rows]
        lengths = _entry(staging, sources, ct.VALUE_SOURCE_QUERY_LENGTH, rows)
        sampling = _entry(staging, sources, ct.VALUE_SOURCE_SAMPLING_DECISION, rows)
        positions = staging[positions_entry].reshape(-1)
        ends = np.cumsum(lengths.astype(np.int64))
        consumed = np.where(lengths.astype(np.int64) > 0, positions[np.maximum(ends - 1, 0)] + 1, 0)
        out[mf.COMPLETION_FIELD_GENERATION].reshape(-1)[:rows] = generations
        out[mf.COMPLETION_FIELD_EMITTED_TOKENS].reshape(-1)[:rows] = sampling != 0
        out[mf.COMPLETION_FIELD_CONSUMED_TOKENS].reshape(-1)[:rows] = consumed
        out[mf.COMPLETION_FIELD_DRAFT_CURSOR].reshape(-1)[:rows] = -1
        out[mf.COMPLETION_FIELD_RESERVED].reshape(-1)[:rows] = -1
        ids = out[mf.COMPLETION_FIELD_SAMPLED_IDS]
        ids.reshape(ids.shape[0], -1)[:rows, 0] = np.where(sampling != 0, (consumed * 7 + 3) % self._sampled_size, -1)
        out[mf.COMPLETION_FIELD_SUBMISSION_SEQUENCE].reshape(-1)[0] = staging[self._sequence_entry].reshape(-1)[0]

    def close(self) -> None:
        self._transport.clear()
        self._completion_buffers.clear()


def _entry(staging: Mapping[str, AnyArray], sources: Mapping[int, str], source: int, rows: int) -> AnyArray:
    name = sources.get(source)
    if name is None:
        return np.zeros(rows, dtype=np.int64)
    return staging[name].reshape(-1)[:rows]


def transport_nbytes(contract: PreparedContract) -> int:
    """Staging bytes of one frame (for reports)."""
    return sum(math.prod(e.shape) * NUMPY_DTYPES[e.dtype].itemsize for e in contract.execution.transport.entries)
