"""The reference backend runs the captured Llama programs and matches an independent numpy oracle."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ignition.build import build_core
from ignition.recipes.llama import Capacities
from ignition.recipes.synthetic import synthetic_declaration

from helios_core.backends.reference import ReferenceBackend
from helios_core.container.keys import generate_keys, load_private_key
from helios_core.contract import prepare_contract
from helios_core.errors import UnsupportedFeatureError
from helios_core.loading import TrustSettings, VerifiedCore, open_core
from helios_core.wire import manifest_pb2 as mf
from tests.oracles.llama_numpy import LlamaHParams, LlamaNumpy

NAMESPACE = "helios-tests/reference-backend"
CAPS = Capacities(max_rows=2, prefill_tokens=(16,), decode_rows=(1, 2), page_tokens=4, cache_pages=32, context=64)
PAGES_PER_ROW = CAPS.pages_per_row
CACHE_PAGES = 40
STATE_ROWS = 6
VOCAB = 320
PROMPT_A = [11, 200, 37, 5, 150, 99, 250, 3, 71, 18]
PROMPT_B = [42, 7, 201, 64, 9]
NEW_TOKENS = 20


@dataclasses.dataclass
class Model:
    core: VerifiedCore
    oracle_tensors: dict[str, Any]
    hparams: LlamaHParams

    def backend(self) -> ReferenceBackend:
        return ReferenceBackend(self.core.contract, self.core.core, cache_pages=CACHE_PAGES, state_rows=STATE_ROWS)

    def oracle(self) -> LlamaNumpy:
        return LlamaNumpy(self.oracle_tensors, self.hparams)

    @property
    def sampled_size(self) -> int:
        return self.core.contract.sampled_size

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        """The oracle's greedy tokens over the sampled ids (ids >= sampled_size are logits padding)."""
        oracle = self.oracle()
        if self.sampled_size == VOCAB:
            return oracle.greedy(prompt, n)
        oracle.reset(len(prompt) + n)
        out: list[int] = []
        logits = oracle.forward(prompt)[-1]
        for _ in range(n):
            out.append(int(np.argmax(logits[: self.sampled_size])))
            logits = oracle.forward([out[-1]])[-1]
        return out


def _build(tmp: Path, *, bf16: bool) -> tuple[VerifiedCore, dict[str, Any], LlamaHParams]:
    keys = generate_keys(tmp / "keys")
    declaration = synthetic_declaration("tiny", seed=11)
    shape = dataclasses.replace(declaration.shape, rope_style="interleaved")
    declaration = dataclasses.replace(declaration, shape=shape)
    path = tmp / "tiny.core"
    signing = load_private_key(keys["signing"])
    build_core(declaration, path, caps=CAPS, signing_key=signing, namespace=NAMESPACE, bf16=bf16)
    verified = open_core(path, TrustSettings(trust_keys=(keys["public"],), acceptance=NAMESPACE, core_key_path=None))
    hparams = LlamaHParams(
        n_layer=shape.layers,
        n_head=shape.heads,
        n_head_kv=shape.kv_heads,
        n_embd=shape.hidden,
        rms_eps=shape.rms_eps,
        rope_freq_base=shape.rope_theta,
        context_length=CAPS.context,
        n_rot=shape.head_dim,
    )
    return verified, dict(declaration.weights), hparams


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Model]:
    verified, tensors, hparams = _build(tmp_path_factory.mktemp("reference-backend"), bf16=False)
    yield Model(verified, tensors, hparams)
    verified.close()


# ----------------------------------------------------------------------------------------------
# a hand-written packer (what the runtime's packer will do from the graph contracts)
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Lane:
    state_row: int
    pages: list[int]
    generation: int
    seed: int = 1234
    tokens: list[int] = dataclasses.field(default_factory=list)
    """The positions consumed so far (the prompt, then every sampled token fed back)."""

    def slot(self, position: int) -> int:
        return self.pages[position // CAPS.page_tokens] * CAPS.page_tokens + position % CAPS.page_tokens


PADDING = {
    "state_rows": -1,
    "generation": -1,
    "token_rows": -1,
    "cache_slots": -1,
    "top_p": 1,
    "repetition_penalty": 1,
    "grammar_mask": -1,
    "score_targets": -1,
}


def clear(transport: dict[str, np.ndarray]) -> None:
    for name, array in transport.items():
        if name != "frame_index":
            array[...] = PADDING.get(name, 0)


def pack_lanes(transport: dict[str, np.ndarray], lanes: Sequence[Lane], steps: Sequence[int], sequence: int) -> None:
    for i, lane in enumerate(lanes):
        transport["state_rows"][i] = lane.state_row
        transport["generation"][i] = lane.generation
        transport["page_table"][i, : len(lane.pages)] = lane.pages
        transport["sample_active"][i] = 1
        transport["temperature"][i] = 0.0
        transport["seed"][i] = lane.seed
        transport["sampling_step"][i] = steps[i]
        transport["constrained"][i] = 0
    transport["submission_sequence"][0] = sequence


def admit(backend: ReferenceBackend, frame: int, lanes: Sequence[Lane], prompts: Sequence[list[int]]) -> None:
    transport = backend.transport(frame)
    clear(transport)
    for i, (lane, prompt) in enumerate(zip(lanes, prompts, strict=True)):
        transport["state_rows"][i] = lane.state_row
        transport["generation"][i] = lane.generation
        transport["prompt_histogram"][i] = np.bincount(prompt, minlength=VOCAB)
    backend.run("initialize", frame)


def prefill(
    backend: ReferenceBackend,
    frame: int,
    lanes: Sequence[Lane],
    prompts: Sequence[list[int]],
    *,
    sequence: int,
    program: str = "prefill_p16",
) -> None:
    transport = backend.transport(frame)
    clear(transport)
    pack_lanes(transport, lanes, [0] * len(lanes), sequence)
    packed = 0
    for i, (lane, prompt) in enumerate(zip(lanes, prompts, strict=True)):
        transport["query_length"][i] = len(prompt)
        for position, token in enumerate(prompt):
            transport["input_ids"][packed] = token
            transport["positions"][packed] = position
            transport["token_rows"][packed] = i
            transport["cache_slots"][packed] = lane.slot(position)
            if position + 1 < len(prompt):
                transport["score_targets"][packed] = prompt[position + 1]
            packed += 1
        lane.tokens = list(prompt)
    backend.run(program, frame)


def decode(
    backend: ReferenceBackend, frame: int, lanes: Sequence[Lane], *, steps: Sequence[int], sequence: int
) -> None:
    """One decode round: the pending token is device-owned, only its position is packed."""
    transport = backend.transport(frame)
    clear(transport)
    pack_lanes(transport, lanes, steps, sequence)
    for i, lane in enumerate(lanes):
        position = len(lane.tokens) - 1  # the pending token was appended by the caller
        transport["query_length"][i] = 1
        transport["positions"][i] = position
        transport["token_rows"][i] = i
        transport["cache_slots"][i] = lane.slot(position)
    backend.run(f"decode_b{len(lanes)}", frame)


def sampled(backend: ReferenceBackend, frame: int, lanes: int) -> list[int]:
    ids = backend.completion(frame)[mf.COMPLETION_FIELD_SAMPLED_IDS]
    return [int(v) for v in ids[:lanes, 0]]


def generate(backend: ReferenceBackend, lanes: list[Lane], prompts: list[list[int]], n: int) -> list[list[int]]:
    """Admit, prefill together, then decode all lanes together for n - 1 rounds (frames alternate)."""
    admit(backend, 0, lanes, prompts)
    prefill(backend, 0, lanes, prompts, sequence=1)
    out = [[token] for token in sampled(backend, 0, len(lanes))]
    for step in range(1, n):
        for lane, tokens in zip(lanes, out, strict=True):
            lane.tokens.append(tokens[-1])
        frame = step % 2
        decode(backend, frame, lanes, steps=[step] * len(lanes), sequence=step + 1)
        for tokens, token in zip(out, sampled(backend, frame, len(lanes)), strict=True):
            tokens.append(token)
    return out


# ----------------------------------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------------------------------


def test_allocation_follows_the_manifest(model: Model) -> None:
    backend = model.backend()
    buffers = backend.buffers
    assert buffers["cache.k0"].shape == (CACHE_PAGES, CAPS.page_tokens, 2, 8)
    assert buffers["output_counts"].shape == (STATE_ROWS, VOCAB)
    assert buffers["pending_tokens"].shape == (STATE_ROWS, 1)
    embed = buffers["tok_embd"]
    assert not embed.flags.writeable and not embed.flags.owndata
    np.testing.assert_array_equal(embed, model.oracle_tensors["token_embd.weight"])
    np.testing.assert_array_equal(buffers["blk.1.ffn_down.weight"], model.oracle_tensors["blk.1.ffn_down.weight"])
    assert backend.transport(0)["input_ids"] is not backend.transport(1)["input_ids"]
    assert (
        backend.completion(0)[mf.COMPLETION_FIELD_SAMPLED_IDS]
        is not backend.completion(1)[mf.COMPLETION_FIELD_SAMPLED_IDS]
    )
    assert int(backend.transport(1)["frame_index"][0]) == 1


def test_greedy_tokens_match_the_oracle(model: Model) -> None:
    backend = model.backend()
    expected = model.greedy(PROMPT_A, NEW_TOKENS)
    lane = Lane(state_row=3, pages=[7, 2, 30, 11, 5, 19, 23, 1], generation=41)
    admit(backend, 0, [lane], [PROMPT_A])
    presence = backend.buffers["prompt_presence"][3]
    assert presence.sum() == len(set(PROMPT_A)) and presence[PROMPT_A].all()

    prefill(backend, 0, [lane], [PROMPT_A], sequence=100)
    record = backend.completion(0)
    got = [int(record[mf.COMPLETION_FIELD_SAMPLED_IDS][0, 0])]
    assert int(record[mf.COMPLETION_FIELD_GENERATION][0]) == 41
    assert int(record[mf.COMPLETION_FIELD_EMITTED_TOKENS][0]) == 1
    assert int(record[mf.COMPLETION_FIELD_CONSUMED_TOKENS][0]) == len(PROMPT_A)
    assert int(record[mf.COMPLETION_FIELD_DRAFT_CURSOR][0]) == -1
    assert int(record[mf.COMPLETION_FIELD_RESERVED][0]) == -1
    assert int(record[mf.COMPLETION_FIELD_SUBMISSION_SEQUENCE][0]) == 100
    # padding lanes: nothing sampled, nothing emitted
    assert int(record[mf.COMPLETION_FIELD_SAMPLED_IDS][1, 0]) == -1
    assert int(record[mf.COMPLETION_FIELD_EMITTED_TOKENS][1]) == 0
    assert int(record[mf.COMPLETION_FIELD_CONSUMED_TOKENS][1]) == 0
    assert int(backend.buffers["pending_tokens"][3, 0]) == got[0]

    for step in range(1, NEW_TOKENS):
        lane.tokens.append(got[-1])
        frame = step % 2
        decode(backend, frame, [lane], steps=[step], sequence=100 + step)
        record = backend.completion(frame)
        got.append(int(record[mf.COMPLETION_FIELD_SAMPLED_IDS][0, 0]))
        assert int(record[mf.COMPLETION_FIELD_GENERATION][0]) == 41
        assert int(record[mf.COMPLETION_FIELD_EMITTED_TOKENS][0]) == 1
        assert int(record[mf.COMPLETION_FIELD_CONSUMED_TOKENS][0]) == len(PROMPT_A) + step
        assert int(record[mf.COMPLETION_FIELD_DRAFT_CURSOR][0]) == -1
        assert int(record[mf.COMPLETION_FIELD_RESERVED][0]) == -1
        assert int(record[mf.COMPLETION_FIELD_SUBMISSION_SEQUENCE][0]) == 100 + step
        assert float(record[mf.COMPLETION_FIELD_SAMPLED_LOGPROBS][0, 0]) < 0.0
        assert int(record[mf.COMPLETION_FIELD_TOP_IDS][0, 0]) == got[-1]  # greedy = the top id
    assert got == expected
    counts = backend.buffers["output_counts"][3]
    assert counts.sum() == NEW_TOKENS
    np.testing.assert_array_equal(counts, np.bincount(got, minlength=VOCAB))


def test_batched_rows_are_independent(model: Model) -> None:
    n = 8
    alone_a = generate(model.backend(), [Lane(0, [0, 1, 2, 3, 4], 1)], [PROMPT_A], n)[0]
    alone_b = generate(model.backend(), [Lane(5, [9, 8, 7, 6, 10], 2, seed=99)], [PROMPT_B], n)[0]
    backend = model.backend()
    lanes = [Lane(4, [20, 22, 24, 26, 28], 1), Lane(1, [21, 23, 25, 27, 29], 2, seed=99)]
    together = generate(backend, lanes, [PROMPT_A, PROMPT_B], n)
    assert together == [alone_a, alone_b]
    assert alone_a == model.greedy(PROMPT_A, n)
    assert alone_b == model.greedy(PROMPT_B, n)
    counts = backend.buffers["output_counts"]
    assert counts[4].sum() == n and counts[1].sum() == n and counts[0].sum() == 0


def test_scored_prefill_matches_the_oracle_log_softmax(model: Model) -> None:
    backend = model.backend()
    lane = Lane(2, [3, 4, 5], 7)
    admit(backend, 1, [lane], [PROMPT_A])
    prefill(backend, 1, [lane], [PROMPT_A], sequence=5, program="scored_prefill_p16")
    scores = backend.completion(1)[mf.COMPLETION_FIELD_PROMPT_SCORES]
    oracle = model.oracle()
    oracle.reset(len(PROMPT_A))
    logits = oracle.forward(PROMPT_A).astype(np.float64)[:, : model.sampled_size]
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    expected = log_probs[np.arange(len(PROMPT_A) - 1), PROMPT_A[1:]]
    np.testing.assert_allclose(scores[: len(PROMPT_A) - 1], expected, rtol=0, atol=1e-5)
    assert np.all(scores[len(PROMPT_A) - 1 :] == 0.0)  # no target: last prompt token and padding
    assert sampled(backend, 1, 1) == [int(np.argmax(logits[-1]))]


def test_unknown_operator_version_fails_construction(model: Model) -> None:
    contract = model.core.contract
    execution = mf.ExecutionManifest()
    execution.CopyFrom(contract.execution)
    node = next(n for n in execution.programs[1].nodes if n.op.name == "rope")
    node.op.version = 99
    changed = prepare_contract(contract.serving, execution, list(model.core.core.resources.values()))
    with pytest.raises(UnsupportedFeatureError, match=r"rope version 99 \(known versions: \[1\]\)"):
        ReferenceBackend(changed, model.core.core, cache_pages=CACHE_PAGES, state_rows=STATE_ROWS)


def _bf16_rounded(values: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint32) << 16
    return rounded.view(np.float32)


def test_bf16_weights_are_widened(tmp_path: Path) -> None:
    verified, tensors, hparams = _build(tmp_path, bf16=True)
    try:
        rounded = {k: v if "norm" in k else _bf16_rounded(v) for k, v in tensors.items()}
        model = Model(verified, rounded, hparams)
        backend = model.backend()
        assert backend.buffers["blk.0.attn_q.weight"].dtype == np.uint16
        lane = Lane(0, [0, 1, 2, 3, 4, 5, 6, 7], 1)
        assert generate(backend, [lane], [PROMPT_A], 12) == [model.greedy(PROMPT_A, 12)]
    finally:
        verified.close()


def test_frames_and_programs_are_checked(model: Model) -> None:
    backend = model.backend()
    with pytest.raises(ValueError, match="frame 2"):
        backend.transport(2)
    with pytest.raises(ValueError, match="unknown program"):
        backend.run("decode_b64", 0)
