"""The kernel graph (fused operators over packed weights) computes what the operator graph computes.

Both graphs of one synthetic model run on the reference backend; greedy tokens and logprobs must
be identical, because every fused operator is defined as the composition of the operators it
replaces and the reference arithmetic of each part is unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from ignition.build import assemble
from ignition.recipes.llama import Capacities
from ignition.recipes.synthetic import synthetic_declaration

from helios_core.container.keys import generate_keys, load_private_key
from helios_core.container.writer import write_core
from helios_core.contract import LoadOptions
from helios_core.loading import TrustSettings
from helios_core.runtime.messages import PreparedRequest, SamplingParams, TokenEvent
from helios_core.runtime.startup import RunningModel, start
from helios_core.wire import manifest_pb2 as mf

NAMESPACE = "helios-tests/kernel-graph"
CAPS = Capacities(max_rows=4, prefill_tokens=(8, 32), decode_rows=(1, 2, 4), page_tokens=4, cache_pages=64, context=64)


def _write(directory: Path, shape: str, *, kernel_graph: bool) -> Path:
    keys = directory / "keys"
    if not (keys / "signing.pem").exists():
        generate_keys(keys)
    serving, builder, resources = assemble(synthetic_declaration(shape, seed=3), CAPS, kernel_graph=kernel_graph)
    path = directory / f"{shape}-{'kernel' if kernel_graph else 'operator'}.core"
    write_core(
        path,
        namespace=NAMESPACE,
        contract=serving,
        execution=builder.manifest,
        resources=resources,
        signing_key=load_private_key(keys / "signing.pem"),
    )
    return path


@pytest.fixture(scope="module", params=["tiny", "tiny-llama3"])
def both_graphs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[RunningModel, RunningModel]]:
    directory = tmp_path_factory.mktemp("graphs")
    settings = TrustSettings((directory / "keys" / "signing.pub.pem",), NAMESPACE, None)
    operator = _write(directory, request.param, kernel_graph=False)
    kernel = _write(directory, request.param, kernel_graph=True)
    models = (start(operator, settings, LoadOptions(max_active=4), backend="reference"),
              start(kernel, settings, LoadOptions(max_active=4), backend="reference"))  # fmt: skip
    yield models
    for model in models:
        model.close()


def _run(model: RunningModel, prompts: list[list[int]], max_tokens: int) -> list[list[tuple[int, float]]]:
    streams = [
        model.engine.submit(
            PreparedRequest(
                request_id=f"r{index}",
                prompt_ids=prompt,
                max_tokens=max_tokens,
                sampling=SamplingParams(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0,
                                        frequency_penalty=0.0, presence_penalty=0.0, seed=index),
                ignore_eos=True,
            )
        )
        for index, prompt in enumerate(prompts)
    ]  # fmt: skip
    return [[(e.token_id, e.logprob) for e in stream if isinstance(e, TokenEvent)] for stream in streams]


def test_kernel_graph_has_four_nodes_a_layer(both_graphs: tuple[RunningModel, RunningModel]) -> None:
    kernel = both_graphs[1]
    programs = {p.name: p for p in kernel.model.contract.execution.programs}
    names = [n.op.name for n in programs["decode_b1"].nodes]
    assert names[:6] == ["gather_rows", "embedding", "rmsnorm_linear_rope_kv_cache_write", "paged_attention",
                         "linear_add", "rmsnorm_swiglu_mlp_add"]  # fmt: skip
    layers = sum(1 for name in names if name == "rmsnorm_swiglu_mlp_add")
    assert len(names) == 2 + 4 * layers + 6
    assert "linear" not in names and "rope" not in names and "rope_kv_cache_write" not in names
    assert "silu_mul_linear_add" not in names
    buffers = {b.name for b in kernel.model.contract.execution.buffers}
    assert layers == sum(1 for name in buffers if name.endswith(".ffn_gate_up.weight")) > 0
    assert {"blk.0.attn_qkv.weight", "blk.0.ffn_gate_up.weight"} <= buffers
    assert "blk.0.attn_q.weight" not in buffers
    assert "scratch.gate_up" not in buffers  # the MLP's [gate | up] products never reach a scratch buffer


def test_kernel_graph_tokens_equal_operator_graph_tokens(both_graphs: tuple[RunningModel, RunningModel]) -> None:
    operator, kernel = both_graphs
    prompts = [[5, 17, 99, 3, 42, 7, 11], list(range(30, 60)), [250, 251], [9] * 13]
    want = _run(operator, prompts, 12)
    got = _run(kernel, prompts, 12)
    assert [len(tokens) for tokens in got] == [12] * 4
    assert got == want


@pytest.mark.parametrize(
    ("bf16", "kernel_graph", "dtype"),
    [(True, True, mf.DTYPE_BF16), (True, False, mf.DTYPE_F32), (False, True, mf.DTYPE_F32)],
)
def test_attention_rows_are_bf16_where_a_kernel_graph_projects_them_with_bf16_weights(
    bf16: bool, kernel_graph: bool, dtype: int
) -> None:
    """A bf16 kernel graph's attention writes the rows its output projection reads in bf16 (the projection
    rounds them to bf16 for its products anyway); operator graphs and float32 weights keep float32 rows."""
    _serving, builder, _resources = assemble(
        synthetic_declaration("tiny", seed=3), CAPS, bf16=bf16, kernel_graph=kernel_graph
    )
    buffers = {b.name: b for b in builder.manifest.buffers}
    assert buffers["scratch.attn"].dtype == dtype
    nodes = [node for program in builder.manifest.programs for node in program.nodes]
    readers = {node.op.name for node in nodes for a in node.args if a.view.buffer == "scratch.attn" and a.name == "x"}
    assert readers == ({"linear_add"} if kernel_graph else {"linear"})  # the output projection alone reads them
    attention = [node for node in nodes if node.op.name == "paged_attention"]
    assert {a.view.buffer for node in attention for a in node.args if a.name == "out"} == {"scratch.attn"}
