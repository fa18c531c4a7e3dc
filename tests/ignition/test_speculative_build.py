"""``ignition build --speculative history --draft-tokens N``: the speculative programs a core declares.

One tiny synthetic core is built through the command line (module fixture) and opened with Helios'
own trust and contract checks; the tests read its contract and execution manifest, then run its
programs on the reference backend: a greedy round verifying copied proposals emits exactly the
tokens greedy decode rounds emit. The refusals (a GPU target, fewer than one draft token) come from
the command line before any key or weight is touched.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from ignition.build import assemble, check_speculative_targets
from ignition.cli import main as ignition_main
from ignition.recipes.llama import Capacities, speculative_widths
from ignition.recipes.synthetic import synthetic_declaration

from helios_core.backends.reference import ReferenceBackend
from helios_core.contract import prepare_contract
from helios_core.loading import TrustSettings, VerifiedCore, open_core
from helios_core.wire import container_pb2 as cb
from helios_core.wire import contract_pb2 as ct
from helios_core.wire import manifest_pb2 as mf

NAMESPACE = "helios-tests/speculative-build"
MAX_ROWS = 2
PAGE_TOKENS = 4
CONTEXT = 32
DRAFT_TOKENS = 3
WIDTHS = (1, 2, 4)
BUILD_ARGS = [
    "--shape", "tiny", "--max-rows", str(MAX_ROWS), "--prefill-tokens", "8", "--page-tokens", str(PAGE_TOKENS),
    "--cache-pages", "32", "--context", str(CONTEXT), "--namespace", NAMESPACE, "--quiet",
]  # fmt: skip
PROMPT = [11, 200, 37, 5, 150, 99]
CACHE_PAGES = 24
STATE_ROWS = 4

SUB, PACKED = ct.INDEXING_SUBMISSION_ROW, ct.INDEXING_PACKED_TOKEN


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VerifiedCore]:
    directory = tmp_path_factory.mktemp("speculative")
    out = directory / "tiny-speculative.core"
    argv = ["build", "llama-synthetic", "--out", str(out), *BUILD_ARGS]
    assert ignition_main([*argv, "--speculative", "history", "--draft-tokens", str(DRAFT_TOKENS)]) == 0
    public = directory / "tiny-speculative.core.keys" / "signing.pub.pem"
    verified = open_core(out, TrustSettings(trust_keys=(public,), acceptance=NAMESPACE, core_key_path=None))
    yield verified
    verified.close()


def _graphs(core: VerifiedCore) -> dict[str, ct.GraphContract]:
    return {g.name: g for g in core.contract.model.graphs}


def _program(core: VerifiedCore, name: str) -> mf.ProgramDecl:
    return next(p for p in core.contract.execution.programs if p.name == name)


# ----------------------------------------------------------------------------------------------
# the contract
# ----------------------------------------------------------------------------------------------


def test_the_widths_are_powers_of_two_up_to_n_plus_one() -> None:
    assert speculative_widths(1) == (1, 2)
    assert speculative_widths(3) == (1, 2, 4)
    assert speculative_widths(6) == (1, 2, 4)
    assert speculative_widths(7) == (1, 2, 4, 8)
    assert speculative_widths(40) == (1, 2, 4, 8)


def test_one_speculative_program_per_width_and_decode_row_count(core: VerifiedCore) -> None:
    serving = core.contract.serving
    assert list(serving.speculative_widths) == list(WIDTHS)
    assert serving.learned_speculation is True  # history drafting requires it (the spec)
    speculative = {g.name for g in serving.model.graphs if g.operation == ct.OPERATION_SPECULATIVE}
    assert speculative == {f"speculative_w{w}_b{b}" for w in WIDTHS for b in (1, 2)}
    assert {p.name for p in core.contract.execution.programs if p.operation == ct.OPERATION_SPECULATIVE} == speculative


@pytest.mark.parametrize(("width", "rows"), [(w, b) for w in WIDTHS for b in (1, 2)])
def test_extents_rng_cursor_and_pending_token(core: VerifiedCore, width: int, rows: int) -> None:
    graph = _graphs(core)[f"speculative_w{width}_b{rows}"]
    extents = graph.extents
    assert (extents.batch_capacity, extents.token_capacity, extents.verify_tokens) == (rows, width, width)
    assert extents.packed_token_capacity == rows * width
    assert extents.draft_tokens == width - 1
    assert graph.confidence_width == 0
    assert graph.cursor.reports_draft_cursor is False
    assert [(r.stream, r.draws_per_row) for r in graph.rng_reservations] == [("target", width)]
    assert graph.pending_token.state_view == "pending_token"
    assert graph.pending_token == _graphs(core)[f"decode_b{rows}"].pending_token
    assert (graph.logprobs.sampled, graph.logprobs.top_n) == (True, 0)
    prepared = core.contract.graphs[graph.name]
    assert prepared.extents.selectable_width == width
    assert prepared.length_source == ct.VALUE_SOURCE_QUERY_LENGTH


def _bindings(graph: ct.GraphContract) -> dict[str, tuple[int, int, int]]:
    return {b.destination: (b.source, b.indexing, b.padding) for b in graph.bindings}


def test_bindings_are_decode_s_plus_copied_proposals_and_packed_positions(core: VerifiedCore) -> None:
    graphs = _graphs(core)
    decode = _bindings(graphs["decode_b2"])
    for width in WIDTHS:
        bound = _bindings(graphs[f"speculative_w{width}_b2"])
        candidates = {
            "candidate_count": (ct.VALUE_SOURCE_CANDIDATE_COUNT, SUB, 0),
            "candidate_generation": (ct.VALUE_SOURCE_CANDIDATE_GENERATION, SUB, -1),
            "candidate_consumed": (ct.VALUE_SOURCE_CANDIDATE_CONSUMED_ENDPOINT, SUB, -1),
            "candidate_grammar_mask": (ct.VALUE_SOURCE_CANDIDATE_GRAMMAR_MASKS, PACKED, -1),
        }
        if width > 1:
            candidates[f"candidate_ids_w{width}"] = (ct.VALUE_SOURCE_CANDIDATE_IDS, SUB, -1)
        assert bound == {**decode, **candidates}
        assert bound["query_length"] == (ct.VALUE_SOURCE_QUERY_LENGTH, SUB, 0)
        assert bound["positions"] == (ct.VALUE_SOURCE_PROMPT_POSITIONS, PACKED, 0)
        assert bound["cache_slots"] == (ct.VALUE_SOURCE_CACHE_SLOT, PACKED, -1)
        assert bound["token_rows"] == (ct.VALUE_SOURCE_TOKEN_ROW, PACKED, -1)
        assert "input_ids" not in bound
        assert bound["constrained"] == (ct.VALUE_SOURCE_CONSTRAINED, SUB, 0)  # decode's, which lanes masks bind
    sources = [b.source for b in graphs["speculative_w1_b2"].bindings]
    assert ct.VALUE_SOURCE_CANDIDATE_IDS not in sources


def test_transport_record_and_page_rows_hold_the_widest_round(core: VerifiedCore) -> None:
    execution = core.contract.execution
    entries = {e.name: list(e.shape) for e in execution.transport.entries}
    assert entries["candidate_ids_w2"] == [MAX_ROWS, 1]
    assert entries["candidate_ids_w4"] == [MAX_ROWS, 3]
    assert "candidate_ids_w1" not in entries
    for name in ("candidate_count", "candidate_generation", "candidate_consumed"):
        assert entries[name] == [MAX_ROWS]
    assert entries["positions"] == [MAX_ROWS * 4]  # P of speculative_w4_b2 exceeds the prefill's 8
    assert entries["candidate_grammar_mask"] == [MAX_ROWS * 4, 10]  # a mask row a packed token: 320 ids
    # every lane's full ceiling (W - 1 positions past the last context position) has a page
    pages_per_row = -(-(CONTEXT + 4 - 1) // PAGE_TOKENS)
    assert entries["page_table"] == [MAX_ROWS, pages_per_row]
    assert core.contract.model.cache.page_table_views[0].pages_per_row == pages_per_row
    record = {c.field: c.buffer for c in execution.completion}
    shapes = {b.name: [d.size for d in b.shape] for b in execution.buffers}
    assert shapes[record[mf.COMPLETION_FIELD_SAMPLED_IDS]] == [MAX_ROWS, 4]
    assert shapes[record[mf.COMPLETION_FIELD_SAMPLED_LOGPROBS]] == [MAX_ROWS, 4]
    assert shapes[record[mf.COMPLETION_FIELD_OFFERS]] == [MAX_ROWS]
    assert shapes[record[mf.COMPLETION_FIELD_ACCEPTED_DRAFTS]] == [MAX_ROWS]


def test_the_program_packs_device_ids_and_verifies_every_packed_row(core: VerifiedCore) -> None:
    nodes = list(_program(core, "speculative_w4_b2").nodes)
    ops = [n.op.name for n in nodes]
    assert ops[0] == "speculative_inputs"
    assert ops[-5:] == ["rmsnorm", "linear", "sample_verify", "copy_rows", "completion_speculative"]
    args = {a.name: (a.view.buffer, list(a.view.shape)) for a in nodes[ops.index("sample_verify")].args}
    assert args["logits"][1] == [MAX_ROWS * 4, 320]
    assert args["candidate_ids"] == ("candidate_ids_w4", [MAX_ROWS, 3])
    assert args["ids"] == ("out_sampled_ids", [MAX_ROWS, 4])  # the widest writes the record directly
    assert args["allowed_mask"] == ("candidate_grammar_mask", [MAX_ROWS * 4, 10])
    assert args["constrained"] == ("constrained", [MAX_ROWS])
    narrow = list(_program(core, "speculative_w1_b2").nodes)
    verify = next(n for n in narrow if n.op.name == "sample_verify")
    assert [list(a.view.shape) for a in verify.args if a.name == "candidate_ids"] == [[MAX_ROWS, 0]]
    assert [n.name for n in narrow][-5:] == [
        "sample_verify",
        "record_ids",
        "record_logprobs",
        "store_pending_token",
        "completion_speculative",
    ]


# ----------------------------------------------------------------------------------------------
# running the programs (reference backend)
# ----------------------------------------------------------------------------------------------

PADDING = {
    "state_rows": -1,
    "generation": -1,
    "token_rows": -1,
    "cache_slots": -1,
    "top_p": 1,
    "repetition_penalty": 1,
    "grammar_mask": -1,
    "candidate_ids_w2": -1,
    "candidate_ids_w4": -1,
    "candidate_generation": -1,
    "candidate_consumed": -1,
    "candidate_grammar_mask": -1,
}
STATE_ROW, GENERATION = 2, 17
PAGES = [5, 9, 1, 14, 3, 20, 7, 11, 2]


def _slot(position: int) -> int:
    return PAGES[position // PAGE_TOKENS] * PAGE_TOKENS + position % PAGE_TOKENS


def _transport(backend: ReferenceBackend, frame: int, sequence: int) -> dict[str, npt.NDArray[np.generic]]:
    transport = backend.transport(frame)
    for name, array in transport.items():
        if name != "frame_index":
            array[...] = PADDING.get(name, 0)
    transport["state_rows"][0] = STATE_ROW
    transport["generation"][0] = GENERATION
    transport["page_table"][0, : len(PAGES)] = PAGES
    transport["sample_active"][0] = 1
    transport["submission_sequence"][0] = sequence
    return transport


def _pack(transport: dict[str, npt.NDArray[np.generic]], tokens: Sequence[int] | None, first: int, count: int) -> None:
    transport["query_length"][0] = count
    for index in range(count):
        if tokens is not None:
            transport["input_ids"][index] = tokens[index]
        transport["positions"][index] = first + index
        transport["token_rows"][index] = 0
        transport["cache_slots"][index] = _slot(first + index)


def _prefill(backend: ReferenceBackend) -> int:
    """Admit and prefill PROMPT into lane 0 (frame 0); returns the first sampled token."""
    transport = _transport(backend, 0, 1)
    transport["prompt_histogram"][0] = np.bincount(PROMPT, minlength=320)
    backend.run("initialize", 0)
    transport = _transport(backend, 0, 1)
    _pack(transport, PROMPT, 0, len(PROMPT))
    backend.run("prefill_p8", 0)
    return int(backend.completion(0)[mf.COMPLETION_FIELD_SAMPLED_IDS][0, 0])


def test_decode_writes_column_zero_of_the_wide_record(core: VerifiedCore) -> None:
    backend = ReferenceBackend(core.contract, core.core, cache_pages=CACHE_PAGES, state_rows=STATE_ROWS)
    first = _prefill(backend)
    record = backend.completion(0)
    assert int(record[mf.COMPLETION_FIELD_EMITTED_TOKENS][0]) == 1
    assert float(record[mf.COMPLETION_FIELD_SAMPLED_LOGPROBS][0, 0]) < 0.0
    assert int(record[mf.COMPLETION_FIELD_SAMPLED_IDS][1, 0]) == -1  # the padding lane
    assert int(backend.buffers["pending_tokens"][STATE_ROW, 0]) == first


def _greedy_decode(core: VerifiedCore, count: int) -> list[int]:
    """The first sampled token and ``count`` greedy decode tokens after it."""
    backend = ReferenceBackend(core.contract, core.core, cache_pages=CACHE_PAGES, state_rows=STATE_ROWS)
    tokens = [_prefill(backend)]
    for step in range(1, count + 1):
        frame = step % 2
        transport = _transport(backend, frame, 1 + step)
        transport["sampling_step"][0] = step
        _pack(transport, None, len(PROMPT) + step - 1, 1)
        backend.run("decode_b1", frame)
        tokens.append(int(backend.completion(frame)[mf.COMPLETION_FIELD_SAMPLED_IDS][0, 0]))
    return tokens


def _verify(
    core: VerifiedCore, program: str, candidates: list[int], masks: npt.NDArray[np.int32] | None = None
) -> Mapping[int, npt.NDArray[np.generic]]:
    """Prefill, then one round of ``program`` offering ``candidates`` after the pending token (frame 1);
    with ``masks`` (a row per packed token of lane 0) the lane is constrained."""
    backend = ReferenceBackend(core.contract, core.core, cache_pages=CACHE_PAGES, state_rows=STATE_ROWS)
    _prefill(backend)
    record = backend.completion(1)
    for array in record.values():
        array[...] = 7  # stale values a program must overwrite
    transport = _transport(backend, 1, 2)
    transport["sampling_step"][0] = 1
    _pack(transport, None, len(PROMPT), 1 + len(candidates))
    if candidates:
        transport[f"candidate_ids_w{_graphs(core)[program].extents.token_capacity}"][0, : len(candidates)] = candidates
    transport["candidate_count"][0] = len(candidates)
    transport["candidate_generation"][0] = GENERATION
    transport["candidate_consumed"][0] = len(PROMPT)
    if masks is not None:
        transport["candidate_grammar_mask"][: len(masks)] = masks
        transport["constrained"][0] = 1
    backend.run(program, 1)
    assert int(backend.buffers["pending_tokens"][STATE_ROW, 0]) == int(
        record[mf.COMPLETION_FIELD_SAMPLED_IDS][0, int(record[mf.COMPLETION_FIELD_EMITTED_TOKENS][0]) - 1]
    )
    return record


def test_a_greedy_round_accepts_the_decode_tokens_and_emits_one_more(core: VerifiedCore) -> None:
    greedy = _greedy_decode(core, 4)
    record = _verify(core, "speculative_w4_b2", greedy[1:4])
    assert record[mf.COMPLETION_FIELD_SAMPLED_IDS][0].tolist() == greedy[1:5]
    assert record[mf.COMPLETION_FIELD_SAMPLED_IDS][1].tolist() == [-1] * 4  # the padding lane
    assert int(record[mf.COMPLETION_FIELD_OFFERS][0]) == 3
    assert int(record[mf.COMPLETION_FIELD_ACCEPTED_DRAFTS][0]) == 3
    assert int(record[mf.COMPLETION_FIELD_EMITTED_TOKENS][0]) == 4
    assert int(record[mf.COMPLETION_FIELD_CONSUMED_TOKENS][0]) == len(PROMPT) + 4
    assert int(record[mf.COMPLETION_FIELD_DRAFT_CURSOR][0]) == -1
    assert int(record[mf.COMPLETION_FIELD_RESERVED][0]) == -1
    assert int(record[mf.COMPLETION_FIELD_GENERATION][0]) == GENERATION
    assert (record[mf.COMPLETION_FIELD_SAMPLED_LOGPROBS][0] < 0.0).all()


def test_a_narrower_round_fills_its_columns_of_each_lane_s_row(core: VerifiedCore) -> None:
    greedy = _greedy_decode(core, 2)
    wrong = (greedy[1] + 1) % 256
    record = _verify(core, "speculative_w2_b2", [wrong])
    ids = record[mf.COMPLETION_FIELD_SAMPLED_IDS]
    assert ids[0, :2].tolist() == [greedy[1], -1]  # the proposal is refused; the target's token is emitted
    assert ids[1, :2].tolist() == [-1, -1]  # lane 1's row, not lane 0's third and fourth columns
    assert int(record[mf.COMPLETION_FIELD_OFFERS][0]) == 1
    assert int(record[mf.COMPLETION_FIELD_ACCEPTED_DRAFTS][0]) == 0
    assert int(record[mf.COMPLETION_FIELD_EMITTED_TOKENS][0]) == 1
    assert int(record[mf.COMPLETION_FIELD_CONSUMED_TOKENS][0]) == len(PROMPT) + 1
    width_one = _verify(core, "speculative_w1_b1", [])
    assert int(width_one[mf.COMPLETION_FIELD_SAMPLED_IDS][0, 0]) == greedy[1]
    assert int(width_one[mf.COMPLETION_FIELD_OFFERS][0]) == 0


def _allowing(*tokens: int) -> npt.NDArray[np.int32]:
    """Mask rows (10 words, 320 ids) each allowing exactly one token."""
    rows = np.zeros((len(tokens), 10), np.uint32)
    for row, token in enumerate(tokens):
        rows[row, token // 32] = np.uint32(1) << np.uint32(token % 32)
    return rows.view(np.int32)


def test_a_constrained_lane_samples_each_position_under_its_own_mask_row(core: VerifiedCore) -> None:
    greedy = _greedy_decode(core, 4)
    forced = [(token + 1) % 256 for token in greedy[1:5]]  # never the greedy token
    record = _verify(core, "speculative_w4_b2", forced[:3], _allowing(*forced))
    assert record[mf.COMPLETION_FIELD_SAMPLED_IDS][0].tolist() == forced
    assert int(record[mf.COMPLETION_FIELD_ACCEPTED_DRAFTS][0]) == 3
    # a proposal the position's mask refuses ends the lane with the mask's token
    refused = _verify(core, "speculative_w4_b2", [forced[0], greedy[2], forced[2]], _allowing(*forced))
    assert refused[mf.COMPLETION_FIELD_SAMPLED_IDS][0].tolist() == [forced[0], forced[1], -1, -1]
    assert int(refused[mf.COMPLETION_FIELD_ACCEPTED_DRAFTS][0]) == 1
    # the mask rows of an unconstrained lane are padding: its tokens are greedy decode's
    plain = _verify(core, "speculative_w4_b2", greedy[1:4])
    assert plain[mf.COMPLETION_FIELD_SAMPLED_IDS][0].tolist() == greedy[1:5]


# ----------------------------------------------------------------------------------------------
# refusals
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--speculative", "history", "--draft-tokens", "3", "--targets", "reference,sm_80"],
            "speculative programs are built for the targets reference, sm_90a only; "
            "build without --speculative for sm_80",
        ),
        (
            ["--speculative", "history", "--draft-tokens", "0"],
            "--draft-tokens must be at least 1 (the proposals a round verifies), got 0",
        ),
        (["--speculative", "history"], "--speculative history needs --draft-tokens N (N >= 1)"),
        (["--draft-tokens", "3"], "--draft-tokens needs --speculative history or self-draft"),
    ],
)
def test_the_cli_refuses_before_making_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    out = tmp_path / "refused.core"
    assert ignition_main(["build", "llama-synthetic", "--out", str(out), *BUILD_ARGS, *extra]) == 1
    assert capsys.readouterr().err == f"ignition: error: {message}\n"
    assert list(tmp_path.iterdir()) == []


def test_smollm2_refuses_a_target_without_speculative_kernels_before_reading_its_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "smol.core"
    argv = ["build", "smollm2-135m-instruct", "--out", str(out), "--targets", "sm_80"]
    assert ignition_main([*argv, "--speculative", "history", "--draft-tokens", "7", "--quiet"]) == 1
    assert capsys.readouterr().err == (
        "ignition: error: speculative programs are built for the targets reference, sm_90a only; "
        "build without --speculative for sm_80\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_assemble_refuses_targets_without_speculative_kernels() -> None:
    caps = Capacities(
        max_rows=1, prefill_tokens=(4,), decode_rows=(1,), page_tokens=4, cache_pages=8, context=16, snapshots=0,
        speculative_widths=speculative_widths(1),
    )  # fmt: skip
    model = synthetic_declaration("tiny")
    with pytest.raises(ValueError) as refused:
        assemble(model, caps, gpu_targets=("sm_80",))
    assert str(refused.value) == (
        "speculative programs are built for the targets reference, sm_90a only; build without --speculative for sm_80"
    )
    check_speculative_targets(caps, ("reference", "sm_90a"))  # both have kernels for the speculative operators
    serving, builder, resources = assemble(model, caps, kernel_graph=True)
    described = [cb.ExecutableResource(id=r.id, kind=r.kind, decoded_nbytes=len(r.data)) for r in resources]  # type: ignore[arg-type]
    prepared = prepare_contract(serving, builder.manifest, described)
    assert sorted(n for n in prepared.graphs if n.startswith("speculative")) == [
        "speculative_w1_b1",
        "speculative_w2_b1",
    ]
