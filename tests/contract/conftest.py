"""Fixtures for the contract tests: the golden ``payload-v3`` core, opened once, copied per test.

``make_parts()`` returns fresh deep copies (``CopyFrom``) of the fixture's serving contract,
execution manifest and resource descriptions, so a test may mutate them freely. Helpers live on
``CoreParts`` because test modules here are plain modules (no package) and cannot share imports.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

from helios_core.container.keys import TrustStore
from helios_core.container.reader import CoreFile
from helios_core.contract import PreparedContract, prepare_contract
from helios_core.wire import container_pb2 as cb
from helios_core.wire import contract_pb2 as ct
from helios_core.wire import manifest_pb2 as mf

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "cores"
KEYS = FIXTURES / "keys"
NAMESPACE = "helios-fixtures/golden"


@dataclass
class CoreParts:
    """Mutable copies of one core's contract, manifest and resource descriptions."""

    serving: ct.ServingContract
    execution: mf.ExecutionManifest
    resources: list[cb.ExecutableResource]

    @property
    def model(self) -> ct.ModelContract:
        return self.serving.model

    def prepare(self) -> PreparedContract:
        return prepare_contract(self.serving, self.execution, self.resources)

    # ------------------------------------------------------------------ lookups by name

    def graph(self, name: str) -> ct.GraphContract:
        return next(g for g in self.model.graphs if g.name == name)

    def program(self, name: str) -> mf.ProgramDecl:
        return next(p for p in self.execution.programs if p.name == name)

    def node(self, program: str, name: str) -> mf.Node:
        return next(n for n in self.program(program).nodes if n.name == name)

    def arg(self, program: str, node: str, name: str) -> mf.TensorArg:
        return next(a for a in self.node(program, node).args if a.name == name)

    def buffer(self, name: str) -> mf.BufferDecl:
        return next(b for b in self.execution.buffers if b.name == name)

    def entry(self, name: str) -> mf.TransportEntry:
        return next(e for e in self.execution.transport.entries if e.name == name)

    def binding(self, graph: str, destination: str) -> ct.ValueBinding:
        return next(b for b in self.graph(graph).bindings if b.destination == destination)

    def access(self, graph: str, view: str) -> ct.StateAccess:
        return next(a for a in self.graph(graph).state_accesses if a.view == view)

    def state_view(self, name: str) -> ct.StateView:
        return next(v for v in self.model.state_views if v.name == name)

    def region(self, name: str) -> ct.HistoryRegion:
        return next(r for r in self.model.cache.regions if r.name == name)

    # ------------------------------------------------------------------ edits

    def add_entry(self, name: str, dtype: int, shape: Iterable[int]) -> mf.TransportEntry:
        return self.execution.transport.entries.add(name=name, dtype=dtype, shape=list(shape))

    def remove_graph(self, name: str) -> None:
        """Remove a graph contract and its execution program."""
        graphs = self.model.graphs
        del graphs[[g.name for g in graphs].index(name)]
        programs = self.execution.programs
        del programs[[p.name for p in programs].index(name)]

    def add_speculative(
        self,
        name: str = "speculative_w4",
        *,
        batch: int = 4,
        width: int = 4,
        packed: int = 16,
        draft: int = 3,
        widths: Iterable[int] = (4,),
        candidate_ids: bool = False,
    ) -> ct.GraphContract:
        """A valid SPECULATIVE graph contract plus a matching (empty) program.

        B x W rows, P packed tokens, D draws with confidence of width D; one QUERY_LENGTH length
        source; it produces the device-owned pending token. ``widths`` become the serving
        contract's speculative_widths. ``candidate_ids`` adds a CANDIDATE_IDS binding.
        """
        graph = self.model.graphs.add(
            name=name,
            operation=ct.OPERATION_SPECULATIVE,
            confidence_width=draft,
            state_rows_per_request=1,
        )
        graph.extents.batch_capacity = batch
        graph.extents.token_capacity = width
        graph.extents.packed_token_capacity = packed
        graph.extents.draft_tokens = draft
        graph.extents.draft_capacity = draft
        graph.cursor.reports_draft_cursor = True
        graph.bindings.add(
            destination="query_length",
            source=ct.VALUE_SOURCE_QUERY_LENGTH,
            indexing=ct.INDEXING_SUBMISSION_ROW,
        )
        graph.state_accesses.add(view="pending_token", mode=ct.ACCESS_MODE_READ_WRITE)
        graph.pending_token.state_view = "pending_token"
        if candidate_ids:
            if "candidate_ids" not in {e.name for e in self.execution.transport.entries}:
                self.add_entry("candidate_ids", mf.DTYPE_I32, (4, 4))
            graph.bindings.add(
                destination="candidate_ids",
                source=ct.VALUE_SOURCE_CANDIDATE_IDS,
                indexing=ct.INDEXING_SUBMISSION_ROW,
            )
        self.execution.programs.add(name=name, operation=ct.OPERATION_SPECULATIVE)
        self.serving.speculative_widths[:] = list(widths)
        return graph

    def add_tuned(self, graph: str = "decode_b4") -> ct.TunedBinding:
        """A valid tuned binding: TUNED buffer ``tuned.table`` filled by producer ``tune_table``."""
        self.execution.buffers.add(
            name="tuned.table", role=mf.BUFFER_ROLE_TUNED, dtype=mf.DTYPE_I32, shape=[mf.Dim(size=8)]
        )
        self.execution.tuning_programs.add(name="tune_table")
        self.execution.tuning.add(program="tune_table", outputs=["tuned.table"])
        return self.graph(graph).tuned_bindings.add(buffer="tuned.table", producer="tune_table")


Golden = tuple[ct.ServingContract, mf.ExecutionManifest, tuple[cb.ExecutableResource, ...]]


@pytest.fixture(scope="session")
def golden_payload_v3() -> Golden:
    """The pristine payload-v3 fixture, opened once per session. Never mutate it: use make_parts."""
    trust = TrustStore.from_paths([KEYS / "signing.pub.pem"])
    with CoreFile.open(FIXTURES / "payload-v3.core", trust, core_key=None) as core:
        serving = ct.ServingContract()
        serving.CopyFrom(core.contract)
        execution = mf.ExecutionManifest()
        execution.CopyFrom(core.execution)
        resources = tuple(core.resources.values())
    return serving, execution, resources


@pytest.fixture
def make_parts(golden_payload_v3: Golden) -> Callable[[], CoreParts]:
    """A factory of fresh deep copies of the payload-v3 fixture."""
    serving, execution, resources = golden_payload_v3

    def make() -> CoreParts:
        serving_copy = ct.ServingContract()
        serving_copy.CopyFrom(serving)
        execution_copy = mf.ExecutionManifest()
        execution_copy.CopyFrom(execution)
        resource_copies = []
        for resource in resources:
            copy = cb.ExecutableResource()
            copy.CopyFrom(resource)
            resource_copies.append(copy)
        return CoreParts(serving_copy, execution_copy, resource_copies)

    return make


@pytest.fixture
def parts(make_parts: Callable[[], CoreParts]) -> CoreParts:
    """One fresh, mutable copy of the payload-v3 fixture."""
    return make_parts()
