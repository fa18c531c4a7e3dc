"""The sampled-draft operators (``draft_sample``, ``sample_verify_sampled``) lower to sm_90a launches on a
machine without a GPU, and a self-drafting core with sampled drafts builds for ``reference,sm_90a``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("triton")

from ignition.build import assemble, check_speculative_targets
from ignition.cli import main as ignition_main
from ignition.kernels import sampling, speculative
from ignition.kernels.lowering import LOWERINGS, LoweringContext, LoweringError
from ignition.recipes.llama import Capacities
from ignition.recipes.synthetic import synthetic_declaration

from helios_core.backends import reference_kernels as rk
from helios_core.loading import TrustSettings, VerifiedCore, open_core
from helios_core.wire import manifest_pb2 as mf
from tests.gpu.harness import lower
from tests.ignition.test_lowering_self_draft import _named, _scalars
from tests.ignition.test_lowering_speculative import _verify_arrays as copied_proposal_arrays

pytestmark = pytest.mark.kernels  # minutes of Triton compilation: tox -e kernels

VOCAB = 49152  # as the sampling lowering tests: the sample kernels compile once per session
CHUNKS = VOCAB // sampling.CHUNK
LANES = 2
DRAFTS = 3
SAMPLE_SYMBOLS = ["_sample_chunk_kernel", "_sample_weight_kernel", "_sample_finish_kernel"]
DRAFT_SYMBOLS = [
    "_draft_argmax_kernel",
    "_draft_chunk_kernel",
    "_draft_status_kernel",
    "_sample_weight_kernel",
    "_draft_cut_kernel",
    "_draft_row_kernel",
    "_draft_draw_kernel",
]
VERIFY_SYMBOLS = [
    "_sample_chunk_kernel",
    "_sample_weight_kernel",
    "_verify_accept_kernel",
    "_verify_residual_kernel",
    "_verify_finish_kernel",
]
NAMESPACE = "helios-tests/sampled-draft-lowering"


def _check_launch(launch: mf.KernelLaunch, grid: tuple[int, int, int]) -> None:
    assert launch.target == "sm_90a"
    assert tuple(launch.grid) == grid
    assert launch.programmatic_wait
    assert 0 <= launch.shared_bytes <= 227 * 1024


def _draft_arrays(*, rows: bool = True, vocab: int = VOCAB) -> dict[str, Any]:
    arrays: dict[str, Any] = {
        "logits": np.zeros((LANES, vocab), np.float32),
        "temperature": np.ones(LANES, np.float32),
        "top_k": np.zeros(LANES, np.int32),
        "top_p": np.ones(LANES, np.float32),
        "min_p": np.zeros(LANES, np.float32),
        "seed": np.zeros(LANES, np.uint64),
        "step": np.zeros(LANES, np.int32),
        "draft_probabilities": np.zeros((LANES, DRAFTS, vocab), np.float32),
    }
    if rows:
        arrays["token_rows"] = np.zeros(LANES, np.int32)
    arrays.update(ids=np.zeros(LANES, np.int32), confidence=np.zeros(LANES, np.float32))
    return arrays


def test_the_stream_keys_are_compiled_in_as_the_reference_names_them() -> None:
    """The kernels take the keys as int64 constants: both fit, and ``stream_uniform`` is the target
    stream's ``counter_uniform`` on the seed the key selects."""
    assert 0 < rk.PROPOSAL_STREAM_KEY < 2**63 and 0 < rk.RESIDUAL_STREAM_KEY < 2**63
    seed, step = np.array([12345], np.uint64), np.array([7], np.int64)
    keyed = rk.splitmix64(seed, np.array([rk.PROPOSAL_STREAM_KEY], np.uint64))
    assert rk.stream_uniform(seed, step, rk.PROPOSAL_STREAM_KEY)[0] == rk.counter_uniform(keyed, step)[0]


def test_draft_sample_is_draft_argmax_then_the_sampled_lanes_launches() -> None:
    context, launches = lower("draft_sample", _draft_arrays(), {"vocab_limit": VOCAB - 100, "draft_index": 1})
    assert [launch.symbol for launch in launches] == DRAFT_SYMBOLS
    grids = [(LANES, 1, 1), (LANES, CHUNKS, 1), (LANES, 1, 1), (LANES, CHUNKS, 1), (LANES, 1, 1)]
    grids += [(LANES, CHUNKS, 1), (LANES, 1, 1)]
    for launch, grid in zip(launches, grids, strict=True):
        _check_launch(launch, grid)
    argmax, chunk, status, weights, cut, row, draw = launches
    # the greedy lanes' ids and confidences are draft_argmax's own launch
    assert _named(argmax) == ["logits", "token_rows", "ids", "confidence"]
    assert _named(chunk)[:2] == ["logits", "token_rows"]
    assert {"token_rows", "temperature", "top_k", "top_p", "min_p", "step", "ids", "confidence"} <= set(_named(status))
    assert _named(weights)[:4] == ["workspace.draft_sample.sampled"] * 2 + ["temperature", "min_p"]
    assert {"top_k", "top_p", "min_p", "workspace.sample.weights"} <= set(_named(cut))
    assert "draft_probabilities" in _named(row) and "draft_probabilities" in _named(draw)
    assert {"seed", "step", "ids", "confidence"} <= set(_named(draw))
    # the draft index is a runtime scalar of the row and draw launches
    assert _scalars(row) == [1] and _scalars(draw) == [1]
    buffers = {b.name: b for b in context.manifest.buffers}
    weights_space = buffers["workspace.sample.weights"]  # shared with the sample kernels
    assert (int(weights_space.shape[0].size), weights_space.dtype) == (LANES * VOCAB, mf.DTYPE_F64)
    assert buffers["workspace.draft_sample.sampled"].dtype == mf.DTYPE_U8


def test_every_draft_step_shares_the_same_modules() -> None:
    modules = [
        [
            launch.module
            for launch in lower("draft_sample", _draft_arrays(), {"vocab_limit": VOCAB, "draft_index": i})[1]
        ]
        for i in range(DRAFTS)
    ]
    assert modules[0] == modules[1] == modules[2]


def test_draft_sample_without_token_rows_binds_the_ids() -> None:
    _, launches = lower("draft_sample", _draft_arrays(rows=False), {"vocab_limit": VOCAB, "draft_index": 0})
    assert [launch.symbol for launch in launches] == DRAFT_SYMBOLS
    assert _named(launches[0]) == ["logits", "ids", "ids", "confidence"]  # never read
    assert _named(launches[1])[:2] == ["logits", "ids"]


def _verify_arrays(width: int, *, depth: int | None = None, state_rows: int = 5) -> dict[str, Any]:
    """``sample_verify``'s arrays (``tests/ignition/test_lowering_speculative.py``) with the drafted
    distributions (``depth`` rows a lane, the candidate count by default) and the log-probabilities."""
    candidates = width - 1
    return {
        **copied_proposal_arrays(width, state_rows=state_rows),
        "draft_probabilities": np.zeros((LANES, candidates if depth is None else depth, VOCAB), np.float32),
        "logprob": np.zeros((LANES, width), np.float32),
    }


def test_sample_verify_sampled_verifies_each_candidate_position_and_samples_the_bonus() -> None:
    width = 3
    context, launches = lower("sample_verify_sampled", _verify_arrays(width), {"vocab_limit": VOCAB})
    symbols = [launch.symbol for launch in launches]
    per_candidate = [*SAMPLE_SYMBOLS, *VERIFY_SYMBOLS, "_verify_record_kernel"]
    assert symbols == [
        "_verify_begin_kernel",
        "_verify_split_kernel",
        *per_candidate * (width - 1),
        *SAMPLE_SYMBOLS,
        "_verify_record_kernel",
    ]
    copies = -(-VOCAB // speculative.GATHER_BLOCK)
    _check_launch(launches[0], (LANES, copies, 1))
    _check_launch(launches[1], (LANES, 1, 1))
    records = [launch for launch in launches if launch.symbol == "_verify_record_kernel"]
    for record in records[:-1]:
        _check_launch(record, (LANES, copies, 1))  # records position j and copies row j + 1
    _check_launch(records[-1], (LANES, 1, 1))  # the last position copies nothing
    grids = {
        "_verify_accept_kernel": (LANES, 1, 1),
        "_verify_residual_kernel": (LANES, CHUNKS, 1),
        "_verify_finish_kernel": (LANES, 1, 1),
    }
    for launch in launches:
        if launch.symbol in grids:
            _check_launch(launch, grids[launch.symbol])
    # position j's sample launches read the sampled flags, the verified lanes' launches the verified ones
    chunk_launches = [launch for launch in launches if launch.symbol == "_sample_chunk_kernel"]
    assert len(chunk_launches) == 2 * (width - 1) + 1
    for index, launch in enumerate(chunk_launches):
        position, verified = index // 2, index % 2 == 1
        flags = "workspace.verify.verified" if verified else "workspace.verify.sampled"
        offsets = {p.buffer: p.byte_offset for p in launch.params if p.buffer.startswith("workspace.verify")}
        assert offsets[flags] == position * speculative.ROW_ALIGN
        assert offsets["workspace.verify.logits"] == 0
        if verified:  # the node's penalties and counts, the scratch row, no grammar mask
            assert {"repetition_penalty", "output_counts", "prompt_presence"} <= set(_named(launch))
    for position, launch in enumerate(launch for launch in launches if launch.symbol == "_verify_accept_kernel"):
        assert _scalars(launch) == [position]
        assert {"draft_probabilities", "candidate_ids", "seed", "top_k", "top_p", "min_p"} <= set(_named(launch))
        offsets = {p.buffer: p.byte_offset for p in launch.params if p.buffer.startswith("workspace.verify")}
        assert offsets["workspace.verify.steps"] == position * speculative.ROW_ALIGN * 8
    for position, launch in enumerate(launch for launch in launches if launch.symbol == "_verify_finish_kernel"):
        assert {"output_counts", "draft_probabilities"} <= set(_named(launch))
        offsets = {p.buffer: p.byte_offset for p in launch.params if p.buffer.startswith("workspace.verify")}
        assert offsets["workspace.verify.ids"] == position * speculative.ROW_ALIGN * 4
        assert offsets["workspace.verify.taken"] == position * speculative.ROW_ALIGN
    # every candidate position runs the same modules (the positions differ in addresses and scalars only)
    steps = [launches[2 + i * len(per_candidate) : 2 + (i + 1) * len(per_candidate)] for i in range(width - 1)]
    assert [launch.module for launch in steps[0]] == [launch.module for launch in steps[1]]
    workspaces = {b.name: b for b in context.manifest.buffers if b.name.startswith("workspace.")}
    assert int(workspaces["workspace.verify.logits"].shape[0].size) == LANES * VOCAB
    assert workspaces["workspace.verify.verified"].dtype == mf.DTYPE_U8
    assert int(workspaces["workspace.sampled.chunk_sums"].shape[0].size) == LANES * CHUNKS * 2


def test_width_one_verification_only_samples_the_bonus() -> None:
    _, launches = lower("sample_verify_sampled", _verify_arrays(1, depth=1), {"vocab_limit": VOCAB})
    symbols = [launch.symbol for launch in launches]
    assert symbols == ["_verify_begin_kernel", "_verify_split_kernel", *SAMPLE_SYMBOLS, "_verify_record_kernel"]


@pytest.mark.parametrize(
    ("op", "arrays", "attributes", "message"),
    [
        (
            "draft_sample",
            _draft_arrays(vocab=320),
            {"vocab_limit": 320, "draft_index": DRAFTS},
            r"attribute draft_index: expected an integer in \[0, 2\], got 3",
        ),
        (
            "draft_sample",
            _draft_arrays(vocab=320),
            {"vocab_limit": 321, "draft_index": 0},
            r"attribute vocab_limit: expected an integer in \[1, 320\], got 321",
        ),
        (
            "draft_sample",
            {**_draft_arrays(vocab=320), "draft_probabilities": np.zeros((LANES, DRAFTS, 300), np.float32)},
            {"vocab_limit": 320, "draft_index": 0},
            r"draft_probabilities: expected \[2, D, 320\], got shape \[2, 3, 300\]",
        ),
        (
            "draft_sample",
            {**_draft_arrays(vocab=320), "seed": np.zeros(LANES, np.int32)},
            {"vocab_limit": 320, "draft_index": 0},
            "seed: dtype DTYPE_I32 is not one of",
        ),
        (
            "sample_verify_sampled",
            _verify_arrays(3, depth=1),
            {"vocab_limit": VOCAB},
            "draft_probabilities: 1 draft rows cannot cover 2 candidates",
        ),
        (
            "sample_verify_sampled",
            {**_verify_arrays(3), "ids": np.zeros((LANES, 2), np.int32)},
            {"vocab_limit": VOCAB},
            r"ids: expected \[2, W >= 3\], got shape \[2, 2\]",
        ),
    ],
)
def test_bad_nodes_are_refused(op: str, arrays: dict[str, Any], attributes: dict[str, Any], message: str) -> None:
    with pytest.raises(LoweringError, match=message):
        lower(op, arrays, attributes)


def _sampled_caps() -> Capacities:
    return Capacities(
        max_rows=2, prefill_tokens=(8,), decode_rows=(1, 2), page_tokens=4, cache_pages=16, context=32, snapshots=0,
        speculative_widths=(1, 2, 4), speculation="self-draft", draft_tokens=3, draft_sampling="sampled",
    )  # fmt: skip


def test_sampled_self_drafting_is_accepted_for_sm_90a() -> None:
    check_speculative_targets(_sampled_caps(), ("reference", "sm_90a"))
    check_speculative_targets(_sampled_caps(), ("sm_90a",))
    with pytest.raises(ValueError, match=r"^speculative programs are built for the targets reference, sm_90a only"):
        check_speculative_targets(_sampled_caps(), ("reference", "sm_80"))


def test_the_sampled_self_drafting_program_s_own_nodes_lower() -> None:
    """Every ``draft_sample`` and ``sample_verify_sampled`` node of a tiny core's kernel graph, with the
    recipe's own views, dtypes and attributes, lowers to its launches."""
    _, builder, _ = assemble(synthetic_declaration("tiny"), _sampled_caps(), kernel_graph=True)
    manifest = builder.manifest
    context = LoweringContext(manifest, "sm_90a")
    lowered: dict[str, list[str]] = {}
    for program in manifest.programs:
        if not program.name.startswith("selfdraft_"):
            continue
        context.program = program.name
        for node in program.nodes:
            if node.op.name in ("draft_sample", "sample_verify_sampled"):
                context.node = node.name
                launches = LOWERINGS[(node.op.name, 1)](context, node)
                lowered.setdefault(program.name, []).append(launches[-1].symbol)
    # D draft steps then the verification; width one drafts nothing and verifies with sample_verify
    assert lowered == {
        f"selfdraft_w{w}_b{b}": ["_draft_draw_kernel"] * 3 + ["_verify_record_kernel"] for w in (2, 4) for b in (1, 2)
    }


BUILD_ARGS = [
    "--shape", "tiny", "--max-rows", "2", "--prefill-tokens", "8", "--page-tokens", "4", "--cache-pages", "32",
    "--context", "32", "--namespace", NAMESPACE, "--quiet", "--speculative", "self-draft", "--draft-tokens", "3",
    "--draft-sampling", "sampled", "--targets", "reference,sm_90a",
]  # fmt: skip


@pytest.fixture(scope="module")
def gpu_core(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VerifiedCore]:
    folder = tmp_path_factory.mktemp("sampled-draft-sm90a")
    out = folder / "sampled.core"
    assert ignition_main(["build", "llama-synthetic", "--out", str(out), *BUILD_ARGS]) == 0
    public = folder / "sampled.core.keys" / "signing.pub.pem"
    verified = open_core(out, TrustSettings(trust_keys=(public,), acceptance=NAMESPACE, core_key_path=None))
    yield verified
    verified.close()


def test_a_sampled_self_drafting_core_builds_for_reference_and_sm_90a(gpu_core: VerifiedCore) -> None:
    manifest = gpu_core.contract.execution
    assert "sm_90a" in manifest.targets
    seen: dict[str, int] = {}
    for program in manifest.programs:
        for node in program.nodes:
            if node.op.name in ("draft_sample", "sample_verify_sampled"):
                launches = [launch for launch in node.launches if launch.target == "sm_90a"]
                assert launches, (program.name, node.name)
                seen[node.op.name] = seen.get(node.op.name, 0) + 1
                expected = "_draft_draw_kernel" if node.op.name == "draft_sample" else "_verify_record_kernel"
                assert launches[-1].symbol == expected
    # D = 3 draft steps in each of the widths 2 and 4, for each of the two decode row counts
    assert seen == {"draft_sample": 2 * 2 * 3, "sample_verify_sampled": 2 * 2}
    assert any(m.target == "sm_90a" for m in manifest.modules)
