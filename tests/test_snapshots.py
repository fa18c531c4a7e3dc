"""Snapshot and restore programs of the Llama recipe, run by the reference backend.

A snapshot keeps a request's complete pages shared (immutable) in the cache, copies the partial
last page of every plane into continuation storage and the sampling state into a snapshot row; a
restore copies them back into a different request's private tail page and state row. Rounds are
packed by the runtime's GraphPacker from each graph's value bindings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import pytest
from ignition.build import build_core
from ignition.recipes.llama import Capacities
from ignition.recipes.synthetic import synthetic_declaration

from helios_core.backends import reference_kernels as rk
from helios_core.backends.reference import ReferenceBackend
from helios_core.container.keys import generate_keys, load_private_key
from helios_core.loading import TrustSettings, VerifiedCore, open_core
from helios_core.runtime.packing import GraphPacker, Lane, Submission
from helios_core.sampling import SamplingParams
from helios_core.wire import contract_pb2 as ct
from helios_core.wire import manifest_pb2 as mf

NAMESPACE = "helios-tests/snapshots"
PAGE_TOKENS = 4
CAPS = Capacities(
    max_rows=2,
    prefill_tokens=(16,),
    decode_rows=(1, 2),
    page_tokens=PAGE_TOKENS,
    cache_pages=32,
    context=64,
    snapshots=4,
)
CACHE_PAGES = 40
STATE_ROWS = 6
SNAPSHOT_ROWS = 3
"""Physical snapshot rows chosen at load (the core declares a working set of 4)."""
PROMPT = [11, 200, 37, 5, 150, 99, 250, 3, 71, 18]
CONTINUATION = 8
PLANES = [f"cache.{kind}{layer}" for layer in range(2) for kind in "kv"]
SAMPLING = {
    "sampling": SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2)
}
"""Greedy, with penalties, so the continuation depends on the restored sampling state."""


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VerifiedCore]:
    tmp = tmp_path_factory.mktemp("snapshots")
    keys = generate_keys(tmp / "keys")
    path = tmp / "tiny.core"
    serving = build_core(
        synthetic_declaration("tiny", seed=11),
        path,
        caps=CAPS,
        signing_key=load_private_key(keys["signing"]),
        namespace=NAMESPACE,
    )
    assert serving.snapshot_capacity == CAPS.snapshots
    verified = open_core(path, TrustSettings(trust_keys=(keys["public"],), acceptance=NAMESPACE, core_key_path=None))
    yield verified
    verified.close()


@dataclasses.dataclass
class Request:
    slot: int
    generation: int
    state_row: int
    pages: list[int]
    consumed: int = 0
    step: int = 0
    packers: dict[tuple[str, int], GraphPacker] = dataclasses.field(default_factory=dict)
    """This request's packers: a packer remembers the page-table rows it uploaded."""

    def table(self, tokens: int) -> list[int]:
        return self.pages[: -(-tokens // PAGE_TOKENS)]

    def cache_slot(self, position: int) -> int:
        return self.pages[position // PAGE_TOKENS] * PAGE_TOKENS + position % PAGE_TOKENS

    def lane(self, positions: list[int], **values: object) -> Lane:
        end = positions[-1] + 1 if positions else self.consumed
        return Lane(
            slot=self.slot,
            generation=self.generation,
            state_row=self.state_row,
            positions=positions,
            cache_slots=[self.cache_slot(p) for p in positions],
            page_table=self.table(end),
            consumed=self.consumed,
            **values,  # type: ignore[arg-type]
        )


class Runner:
    """One backend; each round is packed by GraphPacker into alternating frames."""

    def __init__(self, core: VerifiedCore) -> None:
        self.contract = core.contract
        self.backend = ReferenceBackend(
            core.contract, core.core, cache_pages=CACHE_PAGES, state_rows=STATE_ROWS, snapshot_rows=SNAPSHOT_ROWS
        )
        self.sequence = 0

    def run(self, request: Request, graph: str, lane: Lane, *, completes: bool = True) -> dict[int, np.ndarray]:
        self.sequence += 1
        frame = self.sequence % self.backend.frames
        staging = self.backend.transport(frame)
        packer = request.packers.get((graph, frame))
        if packer is None:
            packer = GraphPacker(self.contract.graphs[graph], staging)
            request.packers[(graph, frame)] = packer
        packer.pack(Submission([lane], self.sequence), frame, staging)
        # The transport owns the submission sequence entry (the engine writes it, not the packer).
        staging[self.contract.execution.transport.submission_sequence_entry][0] = self.sequence
        self.backend.run(graph, frame)
        record = self.backend.completion(frame)
        if not completes:  # initialization writes no completion record
            return record
        assert int(record[mf.COMPLETION_FIELD_GENERATION][0]) == request.generation
        assert int(record[mf.COMPLETION_FIELD_SUBMISSION_SEQUENCE][0]) == self.sequence
        assert int(record[mf.COMPLETION_FIELD_DRAFT_CURSOR][0]) == -1
        assert int(record[mf.COMPLETION_FIELD_RESERVED][0]) == -1
        return record

    def _sampled(self, request: Request, graph: str, lane: Lane) -> int:
        record = self.run(request, graph, lane)
        request.consumed += lane.query_length
        request.step += 1
        assert int(record[mf.COMPLETION_FIELD_EMITTED_TOKENS][0]) == 1
        assert int(record[mf.COMPLETION_FIELD_CONSUMED_TOKENS][0]) == request.consumed
        return int(record[mf.COMPLETION_FIELD_SAMPLED_IDS][0, 0])

    def start(self, request: Request, prompt: list[int]) -> int:
        """Initialize and prefill; returns the first sampled (pending) token."""
        histogram = np.bincount(prompt, minlength=self.contract.histogram_width).astype(np.uint8)
        self.run(request, "initialize", request.lane([], prompt_histogram=histogram), completes=False)
        positions = list(range(len(prompt)))
        return self._sampled(request, "prefill_p16", request.lane(positions, tokens=prompt, sample=True, **SAMPLING))

    def decode(self, request: Request) -> int:
        """One round: the device-owned pending token is consumed and the next one sampled."""
        lane = request.lane([request.consumed], sample=True, sampling_step=request.step, **SAMPLING)
        return self._sampled(request, "decode_b1", lane)

    def snapshot(self, request: Request, row: int) -> None:
        record = self.run(request, "snapshot", request.lane([], snapshot_row=row))
        self._check_copy_record(record, request.consumed)

    def restore(self, request: Request, row: int, consumed: int, step: int) -> None:
        request.consumed, request.step = consumed, step
        record = self.run(request, "restore", request.lane([], restore_row=row))
        self._check_copy_record(record, consumed)

    @staticmethod
    def _check_copy_record(record: dict[int, np.ndarray], consumed: int) -> None:
        assert int(record[mf.COMPLETION_FIELD_EMITTED_TOKENS][0]) == 0
        assert int(record[mf.COMPLETION_FIELD_CONSUMED_TOKENS][0]) == consumed

    def pages(self, ids: list[int]) -> dict[str, np.ndarray]:
        return {plane: self.backend.buffers[plane][ids].copy() for plane in PLANES}

    def state(self, row: int) -> list[np.ndarray]:
        buffers = self.backend.buffers
        return [buffers[name][row].copy() for name in ("pending_tokens", "prompt_presence", "output_counts")]


def _equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)


def _snapshot_then_continue(runner: Runner, request: Request, decodes: int, row: int) -> tuple[int, list[int]]:
    """Run ``request`` to an endpoint, snapshot it into ``row`` and continue it; returns (endpoint, continuation)."""
    runner.start(request, PROMPT)
    for _ in range(decodes):
        runner.decode(request)
    endpoint = request.consumed
    runner.snapshot(request, row)
    return endpoint, [runner.decode(request) for _ in range(CONTINUATION)]


def test_contract_declares_snapshot_storage(core: VerifiedCore) -> None:
    contract = core.contract
    snapshot, restore = contract.graphs["snapshot"], contract.graphs["restore"]
    assert (snapshot.operation, restore.operation) == (ct.OPERATION_SNAPSHOT, ct.OPERATION_RESTORE)
    for graph in (snapshot, restore):
        assert (graph.extents.batch_capacity, graph.extents.token_capacity) == (1, 1)
        assert graph.extents.packed_token_capacity == 1
        assert not graph.contract.rng_reservations and not graph.contract.logprobs.sampled
    writes = {a.view for a in restore.contract.state_accesses if a.mode == ct.ACCESS_MODE_WRITE}
    assert writes == {"pending_token", "prompt_presence", "output_counts"}
    region = next(r for r in contract.model.cache.regions if r.kind == ct.HISTORY_KIND_CONTINUATION)
    assert sorted(region.planes) == sorted(p.replace("cache.", "continuation.") for p in PLANES)
    decl = contract.buffers["continuation.k0"]
    assert decl.shape[0].symbol == mf.DIM_SYMBOL_SNAPSHOT_ROWS and decl.shape[0].size == CAPS.snapshots
    # The physical snapshot rows come from the load; 0 keeps the declared working set.
    sized = ReferenceBackend(contract, core.core, cache_pages=CACHE_PAGES, state_rows=STATE_ROWS, snapshot_rows=3)
    default = ReferenceBackend(contract, core.core, cache_pages=CACHE_PAGES, state_rows=STATE_ROWS)
    assert sized.buffers["continuation.v1"].shape == (3, PAGE_TOKENS, 2, 8)
    assert sized.buffers["snapshot.output_counts"].shape == (3, contract.histogram_width)
    assert default.buffers["snapshot.pending_tokens"].shape == (CAPS.snapshots, 1)


def test_tail_page_kernel() -> None:
    table = np.array([[7, 2, 30, 11], [4, 5, 6, 8], [9, 1, 3, 0], [12, 13, 14, 15]], dtype=np.int32)
    consumed = np.array([13, 12, 0, 1], dtype=np.int32)
    assert rk.tail_page(table, consumed, 4).tolist() == [11, -1, -1, 12]
    with pytest.raises(ValueError, match="past the page table"):
        rk.tail_page(table, np.array([17, 0, 0, 0]), 4)


def test_restore_reproduces_the_continuation_from_a_partial_page(core: VerifiedCore) -> None:
    runner = Runner(core)
    a = Request(slot=0, generation=41, state_row=3, pages=[7, 2, 30, 11, 5, 19, 23, 1])
    runner.start(a, PROMPT)
    for _ in range(3):
        runner.decode(a)
    endpoint = a.consumed
    assert endpoint == 13 and endpoint % PAGE_TOKENS  # a partial page: one token in page 11
    complete = endpoint // PAGE_TOKENS
    tail_at_snapshot = runner.pages([a.pages[complete]])
    state_at_snapshot = runner.state(a.state_row)
    runner.snapshot(a, 1)
    for plane in PLANES:
        saved = runner.backend.buffers[plane.replace("cache.", "continuation.")][1]
        np.testing.assert_array_equal(saved, tail_at_snapshot[plane][0])
    expected = [runner.decode(a) for _ in range(CONTINUATION)]  # A goes on writing its tail page

    a_pages = runner.pages(a.table(a.consumed))
    b = Request(slot=1, generation=7, state_row=5, pages=[*a.pages[:complete], 12, 14, 16, 18])
    tail = b.pages[complete]
    for plane in PLANES:
        runner.backend.buffers[plane][tail] = 7.0  # stale contents of the fresh private page
    runner.restore(b, 1, endpoint, step=a.step - CONTINUATION)
    assert _equal(runner.pages(a.table(a.consumed)), a_pages)  # A's pages, complete and tail, untouched
    restored = runner.pages([tail])
    used = endpoint % PAGE_TOKENS
    for plane in PLANES:
        np.testing.assert_array_equal(restored[plane][0, :used], tail_at_snapshot[plane][0, :used])
    for got, want in zip(runner.state(b.state_row), state_at_snapshot, strict=True):
        np.testing.assert_array_equal(got, want)

    continued = [runner.decode(b) for _ in range(CONTINUATION)]
    assert continued == expected
    assert _equal(runner.pages(a.table(a.consumed)), a_pages)  # shared complete pages stay immutable


def test_restore_at_a_page_boundary_copies_no_page(core: VerifiedCore) -> None:
    runner = Runner(core)
    a = Request(slot=0, generation=3, state_row=0, pages=[20, 21, 22, 23, 24, 25, 26])
    continuation = runner.backend.buffers["continuation.k0"]
    continuation[2] = 5.0
    endpoint, expected = _snapshot_then_continue(runner, a, 2, row=2)
    assert endpoint == 12 and endpoint % PAGE_TOKENS == 0
    assert np.all(continuation[2] == 5.0)  # no partial page: nothing saved

    b = Request(slot=1, generation=4, state_row=2, pages=[*a.pages[:3], 30, 31, 32])
    before = {plane: runner.backend.buffers[plane].copy() for plane in PLANES}
    runner.restore(b, 2, endpoint, step=a.step - CONTINUATION)
    assert all(runner.backend.buffers[p].tobytes() == before[p].tobytes() for p in PLANES)  # no page written
    assert [runner.decode(b) for _ in range(CONTINUATION)] == expected


def test_restores_into_other_tail_pages_leave_the_source_tail_alone(core: VerifiedCore) -> None:
    """Two restores of one snapshot into different private tails both continue identically."""
    runner = Runner(core)
    a = Request(slot=0, generation=9, state_row=1, pages=[3, 4, 5, 6, 8, 9, 10])
    endpoint, expected = _snapshot_then_continue(runner, a, 1, row=0)
    assert endpoint % PAGE_TOKENS == 3
    complete = endpoint // PAGE_TOKENS
    a_tail = runner.pages([a.pages[complete]])
    targets: list[tuple[int, list[int]]] = [(4, [33, 34, 35, 36]), (2, [37, 38, 39, 0])]
    for slot, (state_row, pages) in enumerate(targets, start=1):
        b = Request(slot=slot, generation=100 + slot, state_row=state_row, pages=[*a.pages[:complete], *pages])
        runner.restore(b, 0, endpoint, step=a.step - CONTINUATION)
        assert _equal(runner.pages([a.pages[complete]]), a_tail)
        assert [runner.decode(b) for _ in range(CONTINUATION)] == expected
        assert _equal(runner.pages([a.pages[complete]]), a_tail)
