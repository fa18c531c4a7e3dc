"""``ignition build --speculative self-draft --draft-tokens N``: programs that draft, allocate and verify.

Two tiny synthetic cores are built through the command line (module fixtures): one whose draft is the
target's first layer (the default for two layers: every layer but the last) and one whose draft is
the whole target (``--draft-layers 2``: p = q, so a greedy round accepts everything). Both are opened
with Helios' own trust and contract checks; the tests read their contracts and execution manifests,
then run their programs on the reference backend: greedy self-drafting rounds emit exactly the tokens
greedy decode rounds emit, report offers within the ceilings and P, the draft cursor and the draft
confidences in the frame's half of the framed confidence storage.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from ignition.build import check_speculative_targets
from ignition.cli import main as ignition_main
from ignition.recipes.llama import Capacities, self_draft_packed

from helios_core.backends import reference_kernels as rk
from helios_core.backends.reference import ReferenceBackend
from helios_core.loading import TrustSettings, VerifiedCore, open_core
from helios_core.wire import contract_pb2 as ct
from helios_core.wire import manifest_pb2 as mf

NAMESPACE = "helios-tests/self-draft-build"
MAX_ROWS = 2
PAGE_TOKENS = 4
CONTEXT = 32
DRAFT_TOKENS = 3
WIDTHS = (1, 2, 4)
VOCAB = 320
BUILD_ARGS = [
    "--shape", "tiny", "--max-rows", str(MAX_ROWS), "--prefill-tokens", "8", "--page-tokens", str(PAGE_TOKENS),
    "--cache-pages", "32", "--context", str(CONTEXT), "--namespace", NAMESPACE, "--quiet",
    "--speculative", "self-draft", "--draft-tokens", str(DRAFT_TOKENS),
]  # fmt: skip
CACHE_PAGES = 40
STATE_ROWS = 4
SUB = ct.INDEXING_SUBMISSION_ROW

IDS, LOGPROBS = mf.COMPLETION_FIELD_SAMPLED_IDS, mf.COMPLETION_FIELD_SAMPLED_LOGPROBS
OFFERS, ACCEPTED = mf.COMPLETION_FIELD_OFFERS, mf.COMPLETION_FIELD_ACCEPTED_DRAFTS
EMITTED, CONSUMED = mf.COMPLETION_FIELD_EMITTED_TOKENS, mf.COMPLETION_FIELD_CONSUMED_TOKENS
CURSOR, CONFIDENCE = mf.COMPLETION_FIELD_DRAFT_CURSOR, mf.COMPLETION_FIELD_PROPOSAL_CONFIDENCE


def _build(directory: Path, name: str, extra: Sequence[str]) -> VerifiedCore:
    out = directory / f"{name}.core"
    assert ignition_main(["build", "llama-synthetic", "--out", str(out), *BUILD_ARGS, *extra]) == 0
    public = directory / f"{name}.core.keys" / "signing.pub.pem"
    return open_core(out, TrustSettings(trust_keys=(public,), acceptance=NAMESPACE, core_key_path=None))


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VerifiedCore]:
    """The default draft: the first layer of two."""
    verified = _build(tmp_path_factory.mktemp("self-draft"), "first-layer", [])
    yield verified
    verified.close()


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VerifiedCore]:
    """A draft of every layer: the draft is the target."""
    verified = _build(tmp_path_factory.mktemp("self-draft-full"), "every-layer", ["--draft-layers", "2"])
    yield verified
    verified.close()


def _graphs(core: VerifiedCore) -> dict[str, ct.GraphContract]:
    return {g.name: g for g in core.contract.model.graphs}


def _program(core: VerifiedCore, name: str) -> mf.ProgramDecl:
    return next(p for p in core.contract.execution.programs if p.name == name)


# ----------------------------------------------------------------------------------------------
# the contract
# ----------------------------------------------------------------------------------------------


def test_one_self_drafting_program_per_width_and_decode_row_count(core: VerifiedCore) -> None:
    serving = core.contract.serving
    assert list(serving.speculative_widths) == list(WIDTHS)
    assert serving.learned_speculation is True
    speculative = {g.name for g in serving.model.graphs if g.operation == ct.OPERATION_SPECULATIVE}
    assert speculative == {f"selfdraft_w{w}_b{b}" for w in WIDTHS for b in (1, 2)}


@pytest.mark.parametrize(("width", "rows"), [(w, b) for w in WIDTHS for b in (1, 2)])
def test_extents_confidence_cursor_and_rng(core: VerifiedCore, width: int, rows: int) -> None:
    graph = _graphs(core)[f"selfdraft_w{width}_b{rows}"]
    draws = DRAFT_TOKENS if width > 1 else 0
    extents = graph.extents
    assert (extents.batch_capacity, extents.token_capacity, extents.verify_tokens) == (rows, width, width)
    assert extents.packed_token_capacity == rows + (rows * (width - 1) + 1) // 2 == self_draft_packed(rows, width)
    assert (extents.draft_tokens, extents.draft_capacity, graph.confidence_width) == (draws, DRAFT_TOKENS, draws)
    assert (graph.cursor.reports_draft_cursor, graph.cursor.lag_tokens) == (True, 0)
    assert [(r.stream, r.draws_per_row) for r in graph.rng_reservations] == [("target", width), ("proposal", 0)]
    assert graph.pending_token.state_view == "pending_token"
    assert (graph.logprobs.sampled, graph.logprobs.top_n) == (True, 0)
    prepared = core.contract.graphs[graph.name]
    assert prepared.length_source == ct.VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT
    assert prepared.extents.selectable_width == width


def _bindings(graph: ct.GraphContract) -> dict[str, tuple[int, int, int]]:
    return {b.destination: (b.source, b.indexing, b.padding) for b in graph.bindings}


def test_bindings_are_ceilings_endpoints_pages_and_decode_s_sampling(core: VerifiedCore) -> None:
    graphs = _graphs(core)
    decode = _bindings(graphs["decode_b2"])
    sampling = {k: v for k, v in decode.items() if k not in ("query_length", "positions", "token_rows", "cache_slots")}
    for width in WIDTHS:
        bound = _bindings(graphs[f"selfdraft_w{width}_b2"])
        assert bound == {
            **sampling,
            "prefix_limit": (ct.VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT, SUB, 0),
            "consumed": (ct.VALUE_SOURCE_CONSUMED_TOKEN_ENDPOINT, SUB, 0),
        }
        assert bound["page_table"] == (ct.VALUE_SOURCE_PAGE_TABLE, SUB, 0)
        assert bound["state_rows"] == (ct.VALUE_SOURCE_LIVE_STATE_ROWS, SUB, -1)
        sources = {source for source, _, _ in bound.values()}
        for host_layout in (
            ct.VALUE_SOURCE_QUERY_LENGTH,
            ct.VALUE_SOURCE_PROMPT_POSITIONS,
            ct.VALUE_SOURCE_CACHE_SLOT,
            ct.VALUE_SOURCE_TOKEN_ROW,
            ct.VALUE_SOURCE_CANDIDATE_IDS,
        ):
            assert host_layout not in sources


def test_the_framed_confidence_storage_covers_the_widest_draft(core: VerifiedCore) -> None:
    execution = core.contract.execution
    record = {c.field: c.buffer for c in execution.completion}
    buffers = {b.name: b for b in execution.buffers}
    storage = buffers[record[CONFIDENCE]]
    assert storage.name == "proposal_confidence"
    assert (storage.role, storage.dtype) == (mf.BUFFER_ROLE_COMPLETION, mf.DTYPE_F32)
    assert [d.size for d in storage.shape] == [2, MAX_ROWS, DRAFT_TOKENS]
    assert execution.transport.frame_index_entry == "frame_index"
    entries = {e.name: list(e.shape) for e in execution.transport.entries}
    assert entries["prefix_limit"] == [MAX_ROWS]
    assert not any(name.startswith("candidate_") for name in entries)


def test_the_draft_runs_the_first_k_layers_then_allocates_and_verifies(core: VerifiedCore, full: VerifiedCore) -> None:
    for verified, layers in ((core, 1), (full, 2)):
        nodes = list(_program(verified, "selfdraft_w4_b2").nodes)
        names = [n.name for n in nodes]
        for step in range(DRAFT_TOKENS):
            assert [x for x in names if x.startswith(f"draft{step}.") and x.endswith(".attention")] == [
                f"draft{step}.l{layer}.attention" for layer in range(layers)
            ]
        assert f"draft{DRAFT_TOKENS}.positions" not in names
        ops = [n.op.name for n in nodes]
        assert ops.count("draft_argmax") == ops.count("lane_positions") == DRAFT_TOKENS
        tail = ["draft_allocate", "speculative_layout", "speculative_inputs", "embedding"]
        start = ops.index("draft_allocate")
        assert ops[start : start + 4] == tail
        assert ops[-5:] == ["rmsnorm", "linear", "sample_verify", "copy_rows", "completion_self_draft"]
        attrs = {a.name: a.int_value for a in nodes[start].attributes}
        assert attrs == {"packed_capacity": 5, "token_capacity": 4}
    width_one = [n.op.name for n in _program(core, "selfdraft_w1_b2").nodes]
    assert "draft_argmax" not in width_one and width_one[0] == "draft_allocate"


# ----------------------------------------------------------------------------------------------
# running the programs (reference backend)
# ----------------------------------------------------------------------------------------------

PADDING = {"state_rows": -1, "generation": -1, "token_rows": -1, "cache_slots": -1, "top_p": 1,
           "repetition_penalty": 1, "grammar_mask": -1}  # fmt: skip


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    state_row: int
    generation: int
    pages: tuple[int, ...]

    def slot(self, position: int) -> int:
        return self.pages[position // PAGE_TOKENS] * PAGE_TOKENS + position % PAGE_TOKENS


FIRST = Request((11, 200, 37, 5, 150, 99), 2, 17, (5, 9, 1, 14, 3, 20, 7, 11, 2))
SECOND = Request((7, 42, 250, 3, 88), 0, 23, (30, 22, 16, 35, 12, 27, 33, 18, 25))


def _transport(backend: ReferenceBackend, frame: int, sequence: int) -> dict[str, npt.NDArray[np.generic]]:
    transport = backend.transport(frame)
    for name, array in transport.items():
        if name != "frame_index":
            array[...] = PADDING.get(name, 0)
    transport["submission_sequence"][0] = sequence
    return transport


def _lane(transport: dict[str, npt.NDArray[np.generic]], lane: int, request: Request) -> None:
    transport["state_rows"][lane] = request.state_row
    transport["generation"][lane] = request.generation
    transport["page_table"][lane, : len(request.pages)] = request.pages
    transport["sample_active"][lane] = 1


def _prefill(backend: ReferenceBackend, request: Request) -> int:
    """Admit and prefill ``request`` alone (frame 0); returns its first sampled token."""
    transport = _transport(backend, 0, 1)
    _lane(transport, 0, request)
    transport["prompt_histogram"][0] = np.bincount(request.prompt, minlength=VOCAB)
    backend.run("initialize", 0)
    transport = _transport(backend, 0, 1)
    _lane(transport, 0, request)
    transport["query_length"][0] = len(request.prompt)
    for index, token in enumerate(request.prompt):
        transport["input_ids"][index] = token
        transport["positions"][index] = index
        transport["token_rows"][index] = 0
        transport["cache_slots"][index] = request.slot(index)
    backend.run("prefill_p8", 0)
    return int(backend.completion(0)[IDS][0, 0])


def _backend(verified: VerifiedCore) -> ReferenceBackend:
    return ReferenceBackend(verified.contract, verified.core, cache_pages=CACHE_PAGES, state_rows=STATE_ROWS)


def _greedy_decode(verified: VerifiedCore, request: Request, count: int) -> tuple[list[int], list[float]]:
    """The first sampled token and ``count`` greedy decode tokens after it, with their logprobs."""
    backend = _backend(verified)
    tokens, logprobs = [_prefill(backend, request)], [float(backend.completion(0)[LOGPROBS][0, 0])]
    for step in range(1, count + 1):
        frame = step % 2
        transport = _transport(backend, frame, 1 + step)
        _lane(transport, 0, request)
        transport["sampling_step"][0] = step
        transport["query_length"][0] = 1
        position = len(request.prompt) + step - 1
        transport["positions"][0], transport["token_rows"][0] = position, 0
        transport["cache_slots"][0] = request.slot(position)
        backend.run("decode_b1", frame)
        tokens.append(int(backend.completion(frame)[IDS][0, 0]))
        logprobs.append(float(backend.completion(frame)[LOGPROBS][0, 0]))
    return tokens, logprobs


def _round(
    backend: ReferenceBackend,
    program: str,
    frame: int,
    lanes: Sequence[tuple[Request, int, int]],
) -> Mapping[int, npt.NDArray[np.generic]]:
    """One self-drafting round; each lane is (request, consumed endpoint (= sampling step + prompt - 1),
    ceiling). Stale values fill the record first: the program must overwrite what it reports."""
    record = backend.completion(frame)
    for array in record.values():
        array[...] = 7
    transport = _transport(backend, frame, 40 + frame)
    for lane, (request, consumed, ceiling) in enumerate(lanes):
        _lane(transport, lane, request)
        transport["consumed"][lane] = consumed
        transport["prefix_limit"][lane] = ceiling
        transport["sampling_step"][lane] = consumed - len(request.prompt) + 1
    backend.run(program, frame)
    return record


def test_a_draft_equal_to_the_target_is_accepted_in_full(full: VerifiedCore) -> None:
    greedy, logprobs = _greedy_decode(full, FIRST, 4)
    backend = _backend(full)
    _prefill(backend, FIRST)
    consumed = len(FIRST.prompt)
    record = _round(backend, "selfdraft_w4_b2", 1, [(FIRST, consumed, 4)])
    assert record[IDS][0].tolist() == greedy[1:5]
    assert record[IDS][1].tolist() == [-1] * 4  # the padding lane
    assert (int(record[OFFERS][0]), int(record[ACCEPTED][0]), int(record[EMITTED][0])) == (3, 3, 4)
    assert (int(record[OFFERS][1]), int(record[EMITTED][1])) == (0, 0)
    assert int(record[CONSUMED][0]) == int(record[CURSOR][0]) == consumed + 4  # lag 0
    assert int(record[CURSOR][1]) == -1
    assert int(backend.buffers["pending_tokens"][FIRST.state_row, 0]) == greedy[4]
    # The draft is the target: its confidence in each proposal is the target's probability of it.
    confidence = record[CONFIDENCE]
    np.testing.assert_allclose(confidence[1, 0], np.exp(logprobs[1:4]), rtol=1e-5)
    assert confidence[1, 1].tolist() == [0.0] * DRAFT_TOKENS  # a lane without a ceiling drafts nothing
    assert (confidence[0] == 7).all()  # the other frame's half is untouched


def test_two_lanes_share_p_by_confidence_and_both_emit_their_greedy_tokens(full: VerifiedCore) -> None:
    first, _ = _greedy_decode(full, FIRST, 4)
    second, _ = _greedy_decode(full, SECOND, 4)
    backend = _backend(full)
    _prefill(backend, FIRST)
    _prefill(backend, SECOND)
    lanes = [(FIRST, len(FIRST.prompt), 4), (SECOND, len(SECOND.prompt), 4)]
    record = _round(backend, "selfdraft_w4_b2", 0, lanes)
    confidence = np.array(record[CONFIDENCE][0, :2])
    expected = rk.draft_allocate(confidence, np.array([4, 4]), packed_capacity=5, token_capacity=4)
    offers = record[OFFERS][:2]
    assert (offers + 1).tolist() == expected.tolist()
    assert int((offers + 1).sum()) == 5  # P: the ceilings (8 rows) do not fit
    for lane, greedy in enumerate((first, second)):
        emitted = int(record[EMITTED][lane])
        assert emitted == int(offers[lane]) + 1 == int(record[ACCEPTED][lane]) + 1
        assert record[IDS][lane, :emitted].tolist() == greedy[1 : 1 + emitted]
        endpoint = len(lanes[lane][0].prompt) + emitted
        assert int(record[CONSUMED][lane]) == int(record[CURSOR][lane]) == endpoint


def test_a_full_proposal_budget_verifies_every_lane_s_whole_ceiling(tmp_path: Path) -> None:
    """``--proposal-budget full``: P = B x W, so two lanes with ceilings 4 both verify all four rows
    (fixed-width speculation) where the default budget of 5 rows makes them share by confidence."""
    fixed = _build(tmp_path, "full-budget", ["--draft-layers", "2", "--proposal-budget", "full"])
    try:
        graphs = {g.name: g for g in fixed.contract.model.graphs}
        assert [graphs[f"selfdraft_w{w}_b2"].extents.packed_token_capacity for w in WIDTHS] == [2, 4, 8]
        first, _ = _greedy_decode(fixed, FIRST, 4)
        second, _ = _greedy_decode(fixed, SECOND, 4)
        backend = _backend(fixed)
        _prefill(backend, FIRST)
        _prefill(backend, SECOND)
        lanes = [(FIRST, len(FIRST.prompt), 4), (SECOND, len(SECOND.prompt), 4)]
        record = _round(backend, "selfdraft_w4_b2", 0, lanes)
        assert record[OFFERS][:2].tolist() == [3, 3]
        for lane, greedy in enumerate((first, second)):
            assert int(record[EMITTED][lane]) == 4  # the draft is the target: every proposal holds
            assert record[IDS][lane].tolist() == greedy[1:5]
    finally:
        fixed.close()


def test_rounds_of_a_first_layer_draft_emit_the_greedy_tokens(core: VerifiedCore) -> None:
    greedy, _ = _greedy_decode(core, FIRST, 12)
    backend = _backend(core)
    emitted_tokens = [_prefill(backend, FIRST)]
    consumed = len(FIRST.prompt)
    history: list[tuple[int, int, int]] = []
    for index, (width, ceiling) in enumerate([(4, 4), (4, 2), (2, 2), (1, 1)] * 2):
        record = _round(backend, f"selfdraft_w{width}_b1", index % 2, [(FIRST, consumed, ceiling)])
        emitted = int(record[EMITTED][0])
        offers, accepted = int(record[OFFERS][0]), int(record[ACCEPTED][0])
        assert offers + 1 <= min(ceiling, self_draft_packed(1, width))
        assert emitted == accepted + 1 and accepted <= offers
        emitted_tokens.extend(record[IDS][0, :emitted].tolist())
        consumed += emitted
        assert int(record[CONSUMED][0]) == int(record[CURSOR][0]) == consumed
        history.append((offers, accepted, emitted))
    assert emitted_tokens == greedy[: len(emitted_tokens)]
    # (offers, accepted, emitted) per round: P = 1 + ceil(3 / 2) = 3 rows at width four (two
    # proposals); a one-layer draft of this random model is mostly refused, once accepted.
    assert history == [(2, 0, 1), (1, 0, 1), (1, 0, 1), (0, 0, 1), (2, 1, 2), (1, 0, 1), (1, 0, 1), (0, 0, 1)]


def test_a_narrower_program_drafts_the_full_block_and_fills_its_columns(core: VerifiedCore) -> None:
    greedy, _ = _greedy_decode(core, FIRST, 2)
    backend = _backend(core)
    _prefill(backend, FIRST)
    record = _round(backend, "selfdraft_w2_b2", 1, [(FIRST, len(FIRST.prompt), 2)])
    emitted = int(record[EMITTED][0])
    assert record[IDS][0, :emitted].tolist() == greedy[1 : 1 + emitted]
    assert record[IDS][1, :2].tolist() == [-1, -1]  # lane 1's row, not lane 0's third and fourth columns
    assert int(record[OFFERS][0]) == 1
    drafted = record[CONFIDENCE][1, 0]  # D = 3 steps; the third lies past the ceiling's pages: skipped
    assert ((drafted[:2] > 0) & (drafted[:2] <= 1)).all() and float(drafted[2]) == 0.0
    width_one = _round(backend, "selfdraft_w1_b1", 0, [(FIRST, int(record[CONSUMED][0]), 1)])
    assert int(width_one[OFFERS][0]) == 0 and int(width_one[EMITTED][0]) == 1
    assert int(width_one[CURSOR][0]) == int(record[CONSUMED][0]) + 1


# ----------------------------------------------------------------------------------------------
# refusals
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--targets", "reference,sm_80"],
            "speculative programs are built for the targets reference, sm_90a only; build without --speculative "
            "for sm_80",
        ),
        (["--draft-layers", "0"], "--draft-layers must be at least 1, got 0"),
    ],
)
def test_the_cli_refuses_before_making_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    out = tmp_path / "refused.core"
    assert ignition_main(["build", "llama-synthetic", "--out", str(out), *BUILD_ARGS, *extra]) == 1
    assert capsys.readouterr().err == f"ignition: error: {message}\n"
    assert list(tmp_path.iterdir()) == []


def test_greedy_and_sampled_self_drafting_are_accepted_for_sm_90a_and_not_for_sm_80() -> None:
    """Every self-drafting operator, of greedy drafts and of sampled ones (``draft_sample``,
    ``sample_verify_sampled``), has sm_90a kernels."""
    for draft_sampling in ("greedy", "sampled"):
        caps = Capacities(
            speculative_widths=(1, 2, 4), speculation="self-draft", draft_tokens=3, draft_sampling=draft_sampling
        )
        check_speculative_targets(caps, ("reference", "sm_90a"))
        check_speculative_targets(caps, ("sm_90a",))
        with pytest.raises(ValueError, match=r"^speculative programs are built for the targets reference, sm_90a"):
            check_speculative_targets(caps, ("sm_80",))


def test_proposal_budget_needs_self_drafting(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "refused.core"
    argv = ["build", "llama-synthetic", "--out", str(out), "--shape", "tiny", "--quiet"]
    assert ignition_main([*argv, "--proposal-budget", "full"]) == 1
    assert capsys.readouterr().err == "ignition: error: --proposal-budget needs --speculative self-draft\n"
    assert list(tmp_path.iterdir()) == []


def test_draft_layers_needs_self_drafting(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "refused.core"
    argv = ["build", "llama-synthetic", "--out", str(out), "--shape", "tiny", "--quiet", "--draft-layers", "1"]
    assert ignition_main(argv) == 1
    assert capsys.readouterr().err == "ignition: error: --draft-layers needs --speculative self-draft\n"
    assert list(tmp_path.iterdir()) == []


def test_more_draft_layers_than_the_target_has_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "refused.core"
    assert ignition_main(["build", "llama-synthetic", "--out", str(out), *BUILD_ARGS, "--draft-layers", "3"]) == 1
    assert capsys.readouterr().err == (
        "ignition: error: --draft-layers must lie in [1, 2] (the target's layers), got 3\n"
    )
    assert list(tmp_path.iterdir()) == []
