"""The round plan: one planned program launch, immutable, the seam between planning and completion.

Owns :class:`RoundPlan`. The scheduler's planner returns one; the engine packs its lanes, launches its
graph and reads its completion record against its expectations; the scheduler's completion takes the
same plan and the validated results and applies them. A plan holds values only (request ids, slots,
lanes, expectations; no request objects and no planner-private state), and nothing changes it after
it is made: it and its lanes are frozen, the columns it shares with other plans (a decode cohort's) are
read-only, and the rest are fresh arrays that only it holds.

A decode plan's lanes are a :class:`~helios_core.runtime.packing.LaneBatch` whose ``unchanged`` and
``staged_as`` say which values are those of the previous decode plan of the same cohort (so the packer
writes only what changed); every other plan's lanes are a tuple of
:class:`~helios_core.runtime.packing.Lane`.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from helios_core.contract import PreparedGraph
from helios_core.runtime.completion import ExpectationBatch, LaneExpectation
from helios_core.runtime.packing import Lane, LaneBatch
from helios_core.wire import contract_pb2 as ct


class RoundPlan(msgspec.Struct, frozen=True, eq=False, gc=False):
    """One planned launch of ``graph`` over its lanes (lane ``i`` is request ``request_ids[i]`` in slot
    ``slots[i]``)."""

    graph: PreparedGraph
    request_ids: tuple[str, ...]
    slots: npt.NDArray[np.int64]
    """Each lane's slot (read-only)."""
    lanes: tuple[Lane, ...] | LaneBatch
    expectations: tuple[LaneExpectation, ...] | ExpectationBatch
    constrained: bool
    """Some lane samples under a grammar (a constrained submission)."""
    cohort: int = -1
    """For a decode plan: the decode cohort it runs (the planner's count of cohorts formed); else -1."""
    ahead: int = 0
    """1 for a follow-up decode plan, made before the previous round's completion was read."""

    @property
    def operation(self) -> int:
        return self.graph.operation

    @property
    def decode(self) -> bool:
        return self.graph.operation == ct.OPERATION_DECODE

    def __len__(self) -> int:
        return len(self.request_ids)

    def lane_list(self) -> list[Lane]:
        """The lanes as :class:`Lane` objects (a decode plan's batch converted)."""
        lanes = self.lanes
        return lanes.to_lanes() if isinstance(lanes, LaneBatch) else list(lanes)

    def expectation_list(self) -> list[LaneExpectation]:
        expectations = self.expectations
        return expectations.to_list() if isinstance(expectations, ExpectationBatch) else list(expectations)


def frozen(array: Any) -> Any:
    """``array``, made read-only (a plan's columns are never modified once planned)."""
    array.flags.writeable = False
    return array


def slot_array(slots: list[int]) -> npt.NDArray[np.int64]:
    return frozen(np.asarray(slots, dtype=np.int64))  # type: ignore[no-any-return]
