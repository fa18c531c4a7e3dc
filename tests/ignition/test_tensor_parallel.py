"""``ignition build --tensor-parallel N``: the per-rank declarations, shards and collectives of a core.

Tiny synthetic cores of one seed are built through the command line (module fixture): without the
flag, with ``--tensor-parallel 1``, ``2`` and ``3`` (three ranks do not divide the tiny shape's 2
key-value heads and 64 feed-forward rows: each rank holds 1 key-value head and 22 rows, zero-padded, so
rank 2 holds no real head and 20 real rows), then opened with Helios' own trust and contract checks.
The tests read the manifests (ranks, per-rank weight declarations and their resources, replicated cache
planes of each rank's key-value heads, weight catalogs and the real extents they list, collective
nodes), reassemble the ranks' shards without their padding with numpy and compare them with the
one-rank core's weights, and run the rank programs on per-rank reference backends whose ``all_reduce``
is a sum over the ranks written here: the logits equal the one-rank core's within float tolerance
(exactly with one rank), as they do through the runtime's thread ranks, and a padded head's attention
output is exactly zero. The refusals come from the command line before any key or weight is touched.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from ignition.build import assemble, validate_and_write
from ignition.cli import main as ignition_main
from ignition.recipes.llama import Capacities, partition_ranks
from ignition.recipes.synthetic import SHAPES, synthetic_declaration

from helios_core.backends.reference import ReferenceBackend
from helios_core.container.keys import generate_keys, load_private_key
from helios_core.loading import TrustSettings, VerifiedCore, open_core
from helios_core.wire import container_pb2 as cb
from helios_core.wire import manifest_pb2 as mf

NAMESPACE = "helios-tests/tensor-parallel"
SEED = 7
MAX_ROWS, PREFILL, PAGE_TOKENS, CONTEXT = 2, 8, 4, 32
BUILD_ARGS = [
    "--shape", "tiny", "--seed", str(SEED), "--max-rows", str(MAX_ROWS), "--prefill-tokens", str(PREFILL),
    "--page-tokens", str(PAGE_TOKENS), "--cache-pages", "16", "--context", str(CONTEXT), "--namespace", NAMESPACE,
    "--quiet",
]  # fmt: skip
# The tiny shape: vocabulary 320, hidden 32, 2 layers, 4 heads, 2 key-value heads of 8, feed-forward 64.
VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 320, 32, 2, 4, 2, 8, 64
SPLIT_AXIS = {"attn_q": 0, "attn_k": 0, "attn_v": 0, "ffn_gate": 0, "ffn_up": 0, "attn_output": 1, "ffn_down": 1}
"""Each sharded layer weight and the axis its rank shards concatenate along (rows or columns)."""
REPLICATED = ["tok_embd", "output_norm.weight", "output.weight"] + [
    f"blk.{layer}.{kind}_norm.weight" for layer in range(LAYERS) for kind in ("attn", "ffn")
]
PROMPT = [11, 200, 37, 5, 150, 99]
CACHE_PAGES, STATE_ROWS = 24, 4


def _build(directory: Path, name: str, *extra: str) -> VerifiedCore:
    out = directory / f"{name}.core"
    assert ignition_main(["build", "llama-synthetic", "--out", str(out), *BUILD_ARGS, *extra]) == 0
    public = directory / f"{name}.core.keys" / "signing.pub.pem"
    return open_core(out, TrustSettings(trust_keys=(public,), acceptance=NAMESPACE, core_key_path=None))


@pytest.fixture(scope="module")
def cores(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, VerifiedCore]]:
    directory = tmp_path_factory.mktemp("tensor-parallel")
    built = {
        "plain": _build(directory, "plain"),
        "tp1": _build(directory, "tp1", "--tensor-parallel", "1"),
        "tp2": _build(directory, "tp2", "--tensor-parallel", "2"),
        "tp3": _build(directory, "tp3", "--tensor-parallel", "3"),
    }
    yield built
    for core in built.values():
        core.close()


def _decls(core: VerifiedCore) -> dict[str, list[mf.BufferDecl]]:
    found: dict[str, list[mf.BufferDecl]] = {}
    for decl in core.contract.execution.buffers:
        found.setdefault(decl.name, []).append(decl)
    return found


def _shape(decl: mf.BufferDecl) -> list[int]:
    return [int(d.size) for d in decl.shape]


def _program(core: VerifiedCore, name: str) -> mf.ProgramDecl:
    return next(p for p in core.contract.execution.programs if p.name == name)


def _catalogs(core: VerifiedCore) -> tuple[cb.WeightCatalog, ...]:
    return core.core.weight_catalogs


# ----------------------------------------------------------------------------------------------
# the manifest
# ----------------------------------------------------------------------------------------------


def test_ranks_and_the_per_rank_weight_declarations(cores: dict[str, VerifiedCore]) -> None:
    core = cores["tp2"]
    assert core.contract.execution.ranks == 2
    assert core.contract.ranks == 2
    decls = _decls(core)
    per_rank = {name: found for name, found in decls.items() if len(found) > 1}
    expected_shapes = {
        "attn_q": [HEADS // 2 * HEAD_DIM, HIDDEN],
        "attn_k": [KV_HEADS // 2 * HEAD_DIM, HIDDEN],
        "attn_v": [KV_HEADS // 2 * HEAD_DIM, HIDDEN],
        "attn_output": [HIDDEN, HEADS // 2 * HEAD_DIM],
        "ffn_gate": [FFN // 2, HIDDEN],
        "ffn_up": [FFN // 2, HIDDEN],
        "ffn_down": [HIDDEN, FFN // 2],
    }
    assert set(per_rank) == {f"blk.{layer}.{kind}.weight" for layer in range(LAYERS) for kind in expected_shapes}
    resources = core.core.resources
    for name, found in per_rank.items():
        layer, kind = int(name.split(".")[1]), name.split(".")[2]
        assert [d.rank for d in found] == [0, 1]
        for decl in found:
            assert decl.role == mf.BUFFER_ROLE_WEIGHTS
            assert _shape(decl) == expected_shapes[kind]
            assert decl.resource_id == f"weights.layer{layer}.rank{decl.rank}"
            assert resources[decl.resource_id].rank == decl.rank
    for name in REPLICATED:
        assert [(d.rank, resources[d.resource_id].rank) for d in decls[name]] == [(0, 0)]
    # every rank's cache planes hold its own key-value heads: one declaration, the per-rank shape
    for layer in range(LAYERS):
        for kind in ("k", "v"):
            (plane,) = decls[f"cache.{kind}{layer}"]
            assert (plane.rank, _shape(plane)) == (0, [16, PAGE_TOKENS, KV_HEADS // 2, HEAD_DIM])
    assert _shape(decls["scratch.q"][0]) == [PREFILL, HEADS // 2, HEAD_DIM]
    assert _shape(decls["scratch.gate"][0]) == [PREFILL, FFN // 2]
    assert _shape(decls["scratch.logits"][0]) == [MAX_ROWS, VOCAB]  # the head is replicated


@pytest.mark.parametrize(
    ("shape", "ranks", "extents", "real_kv_heads", "real_ffn"),
    [
        # SmolLM2-135M: 9 heads, 3 key-value heads of 64, feed-forward 1536
        ("135m", 2, (6, 2, 768), [2, 1], [768, 768]),
        ("135m", 3, (3, 1, 512), [1, 1, 1], [512, 512, 512]),
        ("135m", 4, (3, 1, 384), [1, 1, 1, 0], [384, 384, 384, 384]),
        ("tiny", 3, (2, 1, 22), [1, 1, 0], [22, 22, 20]),
        ("tiny", 4, (2, 1, 16), [1, 1, 0, 0], [16, 16, 16, 16]),
        ("small", 3, (4, 2, 128), [2, 2, 0], [128, 128, 128]),
    ],
)
def test_each_rank_holds_the_same_padded_extents(
    shape: str, ranks: int, extents: tuple[int, int, int], real_kv_heads: list[int], real_ffn: list[int]
) -> None:
    """ceil(KV/N) key-value heads and their query heads, ceil(F/N) feed-forward rows a rank; the model's
    from the first rank on, zeros where they run out."""
    model = SHAPES[shape]
    partition = partition_ranks(model, ranks)
    assert (partition.heads, partition.kv_heads, partition.ffn) == extents
    assert partition.padded == (ranks != 3 or shape != "135m")
    head_dim, group = model.head_dim, model.heads // model.kv_heads
    assert [partition.real("wk", r) for r in range(ranks)] == [n * head_dim for n in real_kv_heads]
    assert [partition.real("wq", r) for r in range(ranks)] == [n * group * head_dim for n in real_kv_heads]
    assert [partition.real("wo", r) for r in range(ranks)] == [n * group * head_dim for n in real_kv_heads]
    assert [partition.real("w_down", r) for r in range(ranks)] == real_ffn
    weight = np.arange(model.heads * head_dim * model.hidden, dtype=np.float32).reshape(-1, model.hidden)
    shards = partition.shards("wq", weight)
    assert [s.shape for s in shards] == [(extents[0] * head_dim, model.hidden)] * ranks
    real = [shard[: partition.real("wq", r)] for r, shard in enumerate(shards)]
    assert np.array_equal(np.concatenate(real), weight)
    assert all(not shard[partition.real("wq", r) :].any() for r, shard in enumerate(shards))


def test_three_ranks_declare_padded_shards_of_one_shape(cores: dict[str, VerifiedCore]) -> None:
    """The tiny shape on three ranks: 1 key-value head (2 query heads) and 22 feed-forward rows a rank."""
    core = cores["tp3"]
    assert core.contract.ranks == 3
    decls = _decls(core)
    expected_shapes = {
        "attn_q": [2 * HEAD_DIM, HIDDEN],
        "attn_k": [HEAD_DIM, HIDDEN],
        "attn_v": [HEAD_DIM, HIDDEN],
        "attn_output": [HIDDEN, 2 * HEAD_DIM],
        "ffn_gate": [22, HIDDEN],
        "ffn_up": [22, HIDDEN],
        "ffn_down": [HIDDEN, 22],
    }
    for layer in range(LAYERS):
        for kind, shape in expected_shapes.items():
            found = decls[f"blk.{layer}.{kind}.weight"]
            assert [(d.rank, _shape(d), d.resource_id) for d in found] == [
                (rank, shape, f"weights.layer{layer}.rank{rank}") for rank in range(3)
            ]
        for kind in ("k", "v"):
            (plane,) = decls[f"cache.{kind}{layer}"]
            assert (plane.rank, _shape(plane)) == (0, [16, PAGE_TOKENS, 1, HEAD_DIM])
    assert _shape(decls["scratch.q"][0]) == [PREFILL, 2, HEAD_DIM]
    assert _shape(decls["scratch.gate"][0]) == [PREFILL, 22]


def test_one_rank_and_no_flag(cores: dict[str, VerifiedCore]) -> None:
    plain, tp1 = cores["plain"], cores["tp1"]
    for core in (plain, tp1):
        assert core.contract.execution.ranks == 1
        assert all(len(found) == 1 and found[0].rank == 0 for found in _decls(core).values())
        assert all(resource.rank == 0 for resource in core.core.resources.values())
    assert _catalogs(plain) == ()
    assert [(c.version, c.rank) for c in _catalogs(tp1)] == [(1, 0)]
    weights = {name for name, found in _decls(plain).items() if found[0].role == mf.BUFFER_ROLE_WEIGHTS}
    assert {name for name, found in _decls(tp1).items() if found[0].role == mf.BUFFER_ROLE_WEIGHTS} == weights
    assert plain.contract.serving.cache_identity != tp1.contract.serving.cache_identity


def test_one_catalog_a_rank(cores: dict[str, VerifiedCore]) -> None:
    core = cores["tp2"]
    catalogs = _catalogs(core)
    assert [(c.version, c.rank) for c in catalogs] == [(1, 0), (1, 1)]
    decls = _decls(core)
    for catalog in catalogs:
        listed = {t.name: t for t in catalog.tensors}
        assert len(listed) == len(catalog.tensors)
        names = {n for n, found in decls.items() if found[0].role == mf.BUFFER_ROLE_WEIGHTS and "blk." in n}
        assert names | set(REPLICATED) <= set(listed) | {"tok_embd"}
        assert "token_embd.weight" in listed  # the embedding under its source tensor name
        for name in names:
            (decl,) = [d for d in decls[name] if d.rank == catalog.rank] if len(decls[name]) > 1 else decls[name]
            tensor = listed[name]
            assert (tensor.resource_id, tensor.byte_offset) == (decl.resource_id, decl.resource_offset)
            assert (tensor.dtype, list(tensor.shape)) == (decl.dtype, _shape(decl))


REAL_ROWS_OF_THREE = {
    "attn_q": [16, 16, 0],
    "attn_k": [8, 8, 0],
    "attn_v": [8, 8, 0],
    "attn_output": [16, 16, 0],
    "ffn_gate": [22, 22, 20],
    "ffn_up": [22, 22, 20],
    "ffn_down": [22, 22, 20],
}
"""The tiny shape on three ranks: each rank's real rows (columns of output and down) of each shard."""


def test_a_padded_shard_s_catalog_entry_gives_its_real_extent(cores: dict[str, VerifiedCore]) -> None:
    core = cores["tp3"]
    decls = _decls(core)
    catalogs = _catalogs(core)
    assert [(c.version, c.rank) for c in catalogs] == [(1, 0), (1, 1), (1, 2)]
    for catalog in catalogs:
        listed = {t.name: t for t in catalog.tensors}
        assert len(listed) == len(catalog.tensors)
        for layer in range(LAYERS):
            for kind, axis in SPLIT_AXIS.items():
                name = f"blk.{layer}.{kind}.weight"
                (decl,) = [d for d in decls[name] if d.rank == catalog.rank]
                tensor = listed[name]
                real = _shape(decl)
                real[axis] = REAL_ROWS_OF_THREE[kind][catalog.rank]
                assert (tensor.resource_id, tensor.byte_offset, tensor.dtype) == (
                    decl.resource_id,
                    decl.resource_offset,
                    decl.dtype,
                )
                assert list(tensor.shape) == real


@pytest.mark.parametrize("bf16", [False, True])
def test_a_packed_shard_is_listed_as_its_source_tensors_real_rows(bf16: bool) -> None:
    """A kernel graph's [q | k | v] and [gate | up] shards: each source tensor's real rows at its
    start in the packed shard (rank 2 of three holds none of q, k, v and 20 of its 22 gate and up rows),
    byte offsets in the stored type's size."""
    caps = Capacities(
        max_rows=MAX_ROWS, prefill_tokens=(PREFILL,), decode_rows=(1, 2), page_tokens=PAGE_TOKENS, cache_pages=16
    )
    declaration = synthetic_declaration("tiny", seed=SEED)
    _, builder, _ = assemble(declaration, caps, bf16=bf16, kernel_graph=True, tensor_parallel=3)
    packed = {(d.name, d.rank): d for d in builder.manifest.buffers if d.name.startswith("blk.0.")}
    size = 2 if bf16 else 4
    for catalog in builder.weight_catalogs():
        rank = catalog.rank
        listed = {t.name: (t.resource_id, t.byte_offset, list(t.shape)) for t in catalog.tensors}
        assert "blk.0.attn_qkv.weight" not in listed and "blk.0.ffn_gate_up.weight" not in listed
        qkv, gate_up = packed["blk.0.attn_qkv.weight", rank], packed["blk.0.ffn_gate_up.weight", rank]
        assert _shape(qkv) == [32, HIDDEN] and _shape(gate_up) == [44, HIDDEN]
        starts = {"attn_q": 0, "attn_k": 16 * HIDDEN, "attn_v": 24 * HIDDEN}
        for kind, start in starts.items():
            where = (qkv.resource_id, qkv.resource_offset + start * size, [REAL_ROWS_OF_THREE[kind][rank], HIDDEN])
            assert listed[f"blk.0.{kind}.weight"] == where
        for kind, start in {"ffn_gate": 0, "ffn_up": 22 * HIDDEN}.items():
            offset = gate_up.resource_offset + start * size
            assert listed[f"blk.0.{kind}.weight"] == (
                gate_up.resource_id,
                offset,
                [REAL_ROWS_OF_THREE[kind][rank], HIDDEN],
            )


def _collectives(program: mf.ProgramDecl) -> list[tuple[str, str, str]]:
    """Each collective node's (name, the node before it, the node after it)."""
    nodes = list(program.nodes)
    return [
        (node.name, nodes[i - 1].name, nodes[i + 1].name)
        for i, node in enumerate(nodes)
        if node.op.name in ("all_reduce", "all_gather", "broadcast")
    ]


@pytest.mark.parametrize("which", ["tp1", "tp2", "tp3"])
def test_every_row_parallel_projection_is_summed_before_its_residual_add(
    cores: dict[str, VerifiedCore], which: str
) -> None:
    core = cores[which]
    expected = [
        (f"l{layer}.{part}_all_reduce", f"l{layer}.{part}", f"l{layer}.{residual}")
        for layer in range(LAYERS)
        for part, residual in (("o", "attn_residual"), ("down", "ffn_residual"))
    ]
    for name in (f"prefill_p{PREFILL}", "decode_b1", "decode_b2"):
        program = _program(core, name)
        assert _collectives(program) == expected
        node = next(n for n in program.nodes if n.name == "l0.o_all_reduce")
        args = {a.name: (a.view.buffer, list(a.view.shape)) for a in node.args}
        rows = PREFILL if name.startswith("prefill") else int(name[-1])
        assert args == {"x": ("scratch.o", [rows, HIDDEN]), "out": ("scratch.o", [rows, HIDDEN])}
    assert all(_collectives(p) == [] for p in cores["plain"].contract.execution.programs)


# ----------------------------------------------------------------------------------------------
# the shards
# ----------------------------------------------------------------------------------------------


def _weight(core: VerifiedCore, decl: mf.BufferDecl) -> npt.NDArray[np.float32]:
    data = core.core.read_resource(decl.resource_id, cb.RESOURCE_KIND_WEIGHTS)
    count = int(np.prod(_shape(decl)))
    return np.frombuffer(data, np.float32, count, int(decl.resource_offset)).reshape(_shape(decl))


def _check_reassembly(one_rank: VerifiedCore, ranked: VerifiedCore) -> None:
    """Every sharded weight of ``ranked`` (rank order, along its split axis, each shard cut to the real
    extent its rank's catalog lists) equals ``one_rank``'s, and the rest of every shard is zeros; every
    replicated one equals it as stored."""
    plain, decls = _decls(one_rank), _decls(ranked)
    catalogs = {c.rank: {t.name: t for t in c.tensors} for c in _catalogs(ranked)}
    for layer in range(LAYERS):
        for kind, axis in SPLIT_AXIS.items():
            name = f"blk.{layer}.{kind}.weight"
            shards = [_weight(ranked, d) for d in sorted(decls[name], key=lambda d: d.rank)]
            real = []
            for rank, shard in enumerate(shards):
                extent = catalogs[rank][name].shape[axis]
                real.append(np.take(shard, range(extent), axis=axis))
                assert not np.take(shard, range(extent, shard.shape[axis]), axis=axis).any()  # zero padding
            whole = _weight(one_rank, plain[name][0])
            assert np.array_equal(np.concatenate(real, axis=axis), whole)
            assert not np.array_equal(shards[0], shards[1])
    for name in REPLICATED:
        assert np.array_equal(_weight(ranked, decls[name][0]), _weight(one_rank, plain[name][0]))


@pytest.mark.parametrize("which", ["tp2", "tp3"])
def test_the_shards_reassemble_the_one_rank_weights_exactly(cores: dict[str, VerifiedCore], which: str) -> None:
    _check_reassembly(cores["plain"], cores[which])


def test_the_golden_two_rank_fixture_holds_the_one_rank_fixture_s_weights() -> None:
    """``tp2-tiny.core`` (tools/make_fixture_cores.py): the tiny shape of seed 7 on two ranks, beside
    ``payload-v3.core``, the same model on one."""
    folder = Path(__file__).resolve().parent.parent / "fixtures" / "cores"
    trust = TrustSettings(
        trust_keys=(folder / "keys" / "signing.pub.pem",), acceptance="helios-fixtures/golden", core_key_path=None
    )
    ranked, one_rank = open_core(folder / "tp2-tiny.core", trust), open_core(folder / "payload-v3.core", trust)
    try:
        assert ranked.contract.ranks == 2
        assert [(c.version, c.rank) for c in _catalogs(ranked)] == [(1, 0), (1, 1)]
        assert sorted({r.rank for r in ranked.core.resources.values()}) == [0, 1]
        _check_reassembly(one_rank, ranked)
    finally:
        ranked.close()
        one_rank.close()


# ----------------------------------------------------------------------------------------------
# running the rank programs
# ----------------------------------------------------------------------------------------------


class _SumOverRanks:
    """A test communicator: ``all_reduce`` adds every rank's array in rank order (float32) once all
    have posted theirs; thread ranks meet at a barrier."""

    def __init__(self, rank: int, size: int, barrier: threading.Barrier, posted: list[Any]) -> None:
        self._rank, self._size, self._barrier, self._posted = rank, size, barrier, posted

    @staticmethod
    def group(size: int) -> list[_SumOverRanks]:
        barrier, posted = threading.Barrier(size, timeout=30), [None] * size
        return [_SumOverRanks(rank, size, barrier, posted) for rank in range(size)]

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def all_reduce(self, array: npt.NDArray[Any]) -> npt.NDArray[Any]:
        self._posted[self._rank] = np.array(array, dtype=np.float32)
        self._barrier.wait()
        total = np.zeros_like(self._posted[0])
        for part in self._posted:
            total += part
        self._barrier.wait()  # every rank has read every part before any posts the next
        return total

    def all_gather(self, array: npt.NDArray[Any], axis: int) -> npt.NDArray[Any]:
        raise NotImplementedError("these programs gather nothing")

    def broadcast(self, array: npt.NDArray[Any], root: int) -> npt.NDArray[Any]:
        raise NotImplementedError("these programs broadcast nothing")

    def abort(self, reason: str) -> None:
        self._barrier.abort()

    def reset(self) -> None:
        self._barrier.reset()


PADDING = {"state_rows": -1, "generation": -1, "token_rows": -1, "cache_slots": -1, "top_p": 1}
PADDING.update(repetition_penalty=1, grammar_mask=-1)
PAGES = [5, 9, 1, 14, 3, 20, 7, 11]
STATE_ROW = 2


def _stage(transport: dict[str, npt.NDArray[Any]], sequence: int, tokens: Sequence[int] | None, first: int) -> None:
    """Lane 0 of a round: ``tokens`` (or the device's pending token: one) from position ``first``."""
    for name, array in transport.items():
        if name != "frame_index":
            array[...] = PADDING.get(name, 0)
    transport["state_rows"][0] = STATE_ROW
    transport["generation"][0] = 17
    transport["page_table"][0, : len(PAGES)] = PAGES
    transport["sample_active"][0] = 1
    transport["submission_sequence"][0] = sequence
    transport["sampling_step"][0] = first - len(PROMPT) + 1 if tokens is None else 0
    count = 1 if tokens is None else len(tokens)
    transport["query_length"][0] = count
    transport["prompt_histogram"][0] = np.bincount(PROMPT, minlength=VOCAB)
    for index in range(count):
        position = first + index
        if tokens is not None:
            transport["input_ids"][index] = tokens[index]
        transport["positions"][index] = position
        transport["token_rows"][index] = 0
        transport["cache_slots"][index] = PAGES[position // PAGE_TOKENS] * PAGE_TOKENS + position % PAGE_TOKENS


Runner = Callable[[str, int, Sequence[int] | None, int, int], None]


def _rounds(run: Runner, logits: Callable[[], npt.NDArray[np.float32]], decodes: int) -> list[npt.NDArray[Any]]:
    """Admit and prefill PROMPT, then ``decodes`` decode rounds; lane 0's logits after each round."""
    run("initialize", 0, PROMPT, 0, 1)
    run(f"prefill_p{PREFILL}", 0, PROMPT, 0, 1)
    seen = [logits().copy()]
    for step in range(1, decodes + 1):
        run("decode_b1", step % 2, None, len(PROMPT) + step - 1, 1 + step)
        seen.append(logits().copy())
    return seen


def _one_rank(core: VerifiedCore, decodes: int = 2) -> list[npt.NDArray[Any]]:
    backend = ReferenceBackend(core.contract, core.core, cache_pages=CACHE_PAGES, state_rows=STATE_ROWS)

    def run(program: str, frame: int, tokens: Sequence[int] | None, first: int, sequence: int) -> None:
        _stage(backend.transport(frame), sequence, tokens, first)
        backend.run(program, frame)

    return _rounds(run, lambda: backend.buffers["scratch.logits"][0], decodes)


def _thread_ranks(
    core: VerifiedCore, decodes: int = 2, inspect: Callable[[str, list[ReferenceBackend]], None] | None = None
) -> tuple[list[npt.NDArray[Any]], list[npt.NDArray[Any]]]:
    """Every rank's backend on its own thread, ``all_reduce`` through :class:`_SumOverRanks`; rank 0's
    logits after each round, and the last rank's; ``inspect`` sees each program's name and every rank's
    backend after it ran."""
    ranks = core.contract.ranks
    communicators = _SumOverRanks.group(ranks)
    backends = [
        ReferenceBackend(
            core.contract,
            core.core,
            cache_pages=CACHE_PAGES,
            state_rows=STATE_ROWS,
            rank=rank,
            communicator=communicators[rank],  # type: ignore[arg-type]
        )
        for rank in range(ranks)
    ]

    def run(program: str, frame: int, tokens: Sequence[int] | None, first: int, sequence: int) -> None:
        errors: list[BaseException] = []

        def one(backend: ReferenceBackend) -> None:
            try:
                backend.run(program, frame)
            except BaseException as exc:
                errors.append(exc)
                communicators[0].abort("a rank failed")

        for backend in backends:
            _stage(backend.transport(frame), sequence, tokens, first)
        threads = [threading.Thread(target=one, args=(backend,)) for backend in backends]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        if inspect is not None:
            inspect(program, backends)

    other: list[npt.NDArray[Any]] = []

    def logits() -> npt.NDArray[np.float32]:
        other.append(backends[-1].buffers["scratch.logits"][0].copy())
        return backends[0].buffers["scratch.logits"][0]

    return _rounds(run, logits, decodes), other


def test_two_ranks_compute_the_one_rank_logits(cores: dict[str, VerifiedCore]) -> None:
    expected = _one_rank(cores["plain"])
    rank0, rank1 = _thread_ranks(cores["tp2"])
    for want, got, peer in zip(expected, rank0, rank1, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        assert np.array_equal(got, peer)  # every rank computes the same logits
        assert int(np.argmax(got)) == int(np.argmax(want))


def test_three_padded_ranks_compute_the_one_rank_logits(cores: dict[str, VerifiedCore]) -> None:
    """Rank 2 of three holds one zero-padded key-value head (its two query heads) and 2 zero feed-forward
    rows: its attention output is exactly zero (finite: the softmax of equal zero scores over zero
    values), its padded SwiGLU columns are exactly zero, and the ranks' sum is the one-rank product."""
    checked: list[str] = []

    def padding_adds_nothing(program: str, backends: list[ReferenceBackend]) -> None:
        if program == "initialize":
            return  # no layer runs
        real, padded = backends[1].buffers, backends[2].buffers
        assert np.isfinite(padded["scratch.attn"]).all() and not padded["scratch.attn"].any()
        assert real["scratch.attn"].any()  # rank 1's head is the model's
        assert not padded["scratch.act"][:, 20:].any() and padded["scratch.act"][:, :20].any()
        checked.append(program)

    expected = _one_rank(cores["plain"])
    rank0, rank2 = _thread_ranks(cores["tp3"], inspect=padding_adds_nothing)
    assert checked == [f"prefill_p{PREFILL}", "decode_b1", "decode_b1"]
    for want, got, peer in zip(expected, rank0, rank2, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        assert np.array_equal(got, peer)
        assert int(np.argmax(got)) == int(np.argmax(want))


def test_one_rank_with_collectives_computes_the_same_bits(cores: dict[str, VerifiedCore]) -> None:
    expected = _one_rank(cores["plain"])
    for want, got in zip(expected, _one_rank(cores["tp1"]), strict=True):
        assert np.array_equal(got, want)


@pytest.mark.parametrize("ranks", [2, 3])
def test_the_kernel_graph_of_several_ranks_computes_the_one_rank_logits(
    cores: dict[str, VerifiedCore], tmp_path: Path, ranks: int
) -> None:
    """The fused form: packed [q | k | v] and [gate | up] shards (three ranks: zero-padded), and the MLP's
    partial product over the zero residual."""
    caps = Capacities(
        max_rows=MAX_ROWS,
        prefill_tokens=(PREFILL,),
        decode_rows=(1, 2),
        page_tokens=PAGE_TOKENS,
        cache_pages=16,
        context=CONTEXT,
    )
    serving, builder, resources = assemble(
        synthetic_declaration("tiny", seed=SEED), caps, kernel_graph=True, tensor_parallel=ranks
    )
    nodes = [n.op.name for n in _program_of(builder.manifest, "decode_b1").nodes]
    layer = nodes[nodes.index("rmsnorm_linear_rope_kv_cache_write") :][:8]
    assert layer == [
        "rmsnorm_linear_rope_kv_cache_write",
        "paged_attention",
        "linear",
        "all_reduce",
        "add",
        "rmsnorm_swiglu_mlp_add",
        "all_reduce",
        "add",
    ]
    paths = generate_keys(tmp_path / "keys")
    out = tmp_path / f"tp{ranks}-kernel.core"
    validate_and_write(
        out,
        serving,
        builder,
        resources,
        signing_key=load_private_key(paths["signing"]),
        namespace=NAMESPACE,
        layout="payload",
        core_key=None,
        description="",
    )
    core = open_core(out, TrustSettings(trust_keys=(paths["public"],), acceptance=NAMESPACE, core_key_path=None))
    try:
        expected = _one_rank(cores["plain"])
        rank0, _ = _thread_ranks(core)
    finally:
        core.close()
    for want, got in zip(expected, rank0, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def _program_of(manifest: mf.ExecutionManifest, name: str) -> mf.ProgramDecl:
    return next(p for p in manifest.programs if p.name == name)


def test_the_runtime_s_thread_ranks_compute_the_one_rank_logits(cores: dict[str, VerifiedCore]) -> None:
    from helios_core.backends.ranks import RankedBackend, ThreadCommunicator

    core = cores["tp2"]
    communicators = ThreadCommunicator.group(2, deadline_s=30.0)
    ranked = RankedBackend(
        [
            ReferenceBackend(
                core.contract,
                core.core,
                cache_pages=CACHE_PAGES,
                state_rows=STATE_ROWS,
                rank=rank,
                communicator=communicators[rank],
            )
            for rank in range(2)
        ],
        communicators=communicators,
        deadline_s=30.0,
    )

    def run(program: str, frame: int, tokens: Sequence[int] | None, first: int, sequence: int) -> None:
        _stage(dict(ranked.transport(frame)), sequence, tokens, first)
        ranked.run(program, frame)

    def logits() -> npt.NDArray[np.float32]:
        return ranked.ranks[0].buffers["scratch.logits"][0]  # type: ignore[no-any-return]

    got = _rounds(run, logits, 2)
    for want, have in zip(_one_rank(cores["plain"]), got, strict=True):
        np.testing.assert_allclose(have, want, rtol=1e-4, atol=1e-4)
    records = ranked.rank_completions(1)
    assert records[0][mf.COMPLETION_FIELD_SAMPLED_IDS].tolist() == records[1][mf.COMPLETION_FIELD_SAMPLED_IDS].tolist()


# ----------------------------------------------------------------------------------------------
# refusals
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--tensor-parallel", "9"],
            "--tensor-parallel 9 would leave rank 8 of llama-synthetic shape 'tiny' with zero padding only: a "
            "rank holds 1 of the 2 key-value heads, which ranks 0..1 hold, and 8 of the 64 feed-forward rows, "
            "which ranks 0..7 hold",
        ),
        (
            ["--tensor-parallel", "40"],
            "--tensor-parallel 40 would leave ranks 32..39 of llama-synthetic shape 'tiny' with zero padding "
            "only: a rank holds 1 of the 2 key-value heads, which ranks 0..1 hold, and 2 of the 64 feed-forward "
            "rows, which ranks 0..31 hold",
        ),
        (["--tensor-parallel", "0"], "--tensor-parallel must be at least 1 (the ranks), got 0"),
    ],
)
def test_a_rank_count_that_would_leave_a_rank_padding_only_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    out = tmp_path / "refused.core"
    assert ignition_main(["build", "llama-synthetic", "--out", str(out), *BUILD_ARGS, *extra]) == 1
    assert capsys.readouterr().err == f"ignition: error: {message}\n"
    assert not out.exists()
    assert not (tmp_path / "refused.core.keys").exists()  # refused before any key is made


def test_smollm2_refuses_ranks_that_would_hold_padding_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Its 3 key-value heads and 1536 feed-forward rows (read from the GGUF's metadata): 769 ranks of 2
    rows use the rows up on rank 767. Two and four ranks build (tests/runtime/test_smollm2_ranks.py)."""
    out = tmp_path / "smol.core"
    assert ignition_main(["build", "smollm2-135m-instruct", "--out", str(out), "--tensor-parallel", "769"]) == 1
    assert capsys.readouterr().err == (
        "ignition: error: --tensor-parallel 769 would leave rank 768 of smollm2-135m-instruct with zero padding "
        "only: a rank holds 1 of the 3 key-value heads, which ranks 0..2 hold, and 2 of the 1536 feed-forward "
        "rows, which ranks 0..767 hold\n"
    )
    assert not out.exists()


def test_other_recipes_refuse_tensor_parallel(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "recurrent.core"
    assert ignition_main(["build", "recurrent-synthetic", "--out", str(out), "--tensor-parallel", "2"]) == 1
    assert capsys.readouterr().err == (
        "ignition: error: --tensor-parallel belongs to llama-synthetic and smollm2-135m-instruct, not "
        "recurrent-synthetic\n"
    )


# ----------------------------------------------------------------------------------------------
# lowering
# ----------------------------------------------------------------------------------------------


def test_a_collective_node_gets_no_launch_and_its_output_is_written_for_later_nodes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The runtime runs collectives between kernels: sm_90a lowering leaves their nodes without a launch;
    the kernel after one reads its output as written by an earlier node (it waits before reading)."""
    pytest.importorskip("triton")
    from ignition.kernels import lowering

    seen: list[tuple[str, bool]] = []

    def recorder(ctx: lowering.LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
        seen.append((node.name, ctx.settled(mf.BufferView(buffer="o"))))
        return [mf.KernelLaunch(target="sm_90a")]

    monkeypatch.setitem(lowering.LOWERINGS, ("add", 1), recorder)
    manifest = mf.ExecutionManifest()
    program = manifest.programs.add(name="decode")
    for op, name, args in (
        ("add", "before", {"a": "h", "b": "h", "out": "h"}),
        ("all_reduce", "sum", {"x": "o", "out": "o"}),
        ("add", "residual", {"a": "h", "b": "o", "out": "h"}),
    ):
        node = program.nodes.add(name=name)
        node.op.name, node.op.version = op, 1
        for arg, buffer in args.items():
            node.args.add(name=arg, view=mf.BufferView(buffer=buffer))
    lowering._lower_programs(lowering.LoweringContext(manifest, "sm_90a"), manifest, "sm_90a")
    assert seen == [("before", True), ("residual", False)]
    assert [len(node.launches) for node in program.nodes] == [1, 0, 1]
