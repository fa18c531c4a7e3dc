"""The wire schema: generated code is fresh, every element is documented, no breaking change."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import gen_proto  # noqa: E402
import proto_schema  # noqa: E402


@pytest.fixture(scope="module")
def schema() -> descriptor_pb2.FileDescriptorSet:
    return proto_schema.descriptor_set()


def test_generated_python_is_fresh(tmp_path: Path) -> None:
    gen_proto.generate(tmp_path)
    generated = sorted((tmp_path / "helios_core" / "wire").glob("*_pb2.py*"))
    assert [p.name for p in generated] == sorted(p.name for p in (ROOT / "helios_core" / "wire").glob("*_pb2.py*"))
    for fresh in generated:
        committed = ROOT / "helios_core" / "wire" / fresh.name
        assert committed.read_bytes() == fresh.read_bytes(), f"{fresh.name} is stale: run python tools/gen_proto.py"


def test_every_schema_element_has_a_doc_comment(schema: descriptor_pb2.FileDescriptorSet) -> None:
    assert proto_schema.undocumented(schema) == []


def test_no_breaking_change_against_the_baseline() -> None:
    baseline = descriptor_pb2.FileDescriptorSet()
    baseline.ParseFromString(proto_schema.BASELINE.read_bytes())
    current = proto_schema.descriptor_set(include_source_info=False)
    assert proto_schema.breaking_changes(baseline, current) == []


def _message(fds: descriptor_pb2.FileDescriptorSet, name: str) -> descriptor_pb2.DescriptorProto:
    for file in fds.file:
        for message in file.message_type:
            if message.name == name:
                return message
    raise KeyError(name)


def test_breaking_change_check_reports_removed_renamed_and_retyped_fields() -> None:
    baseline = proto_schema.descriptor_set(include_source_info=False)
    changed = descriptor_pb2.FileDescriptorSet()
    changed.CopyFrom(baseline)
    resource = _message(changed, "ExecutableResource")
    removed = resource.field[1]  # kind = 2
    del resource.field[1]
    resource.field[0].name = "identifier"  # id = 1
    _message(changed, "CoreBody").field[0].type = descriptor_pb2.FieldDescriptorProto.TYPE_UINT64
    problems = proto_schema.breaking_changes(baseline, changed)
    assert f"helios.wire.ExecutableResource.{removed.name} = 2 was removed without reserving it" in problems
    assert "helios.wire.ExecutableResource field 1 was renamed id -> identifier" in problems
    assert "helios.wire.CoreBody.format_version changed type" in problems


def test_reserving_a_removed_field_is_not_breaking() -> None:
    baseline = proto_schema.descriptor_set(include_source_info=False)
    changed = descriptor_pb2.FileDescriptorSet()
    changed.CopyFrom(baseline)
    resource = _message(changed, "ExecutableResource")
    name = resource.field[1].name
    del resource.field[1]
    resource.reserved_range.add(start=2, end=3)
    resource.reserved_name.append(name)
    assert proto_schema.breaking_changes(baseline, changed) == []


def test_every_enum_has_an_unspecified_zero(schema: descriptor_pb2.FileDescriptorSet) -> None:
    for file in schema.file:
        enums = list(file.enum_type) + [e for m in file.message_type for e in m.enum_type]
        for enum in enums:
            zero = [v.name for v in enum.value if v.number == 0]
            assert zero and zero[0].endswith("_UNSPECIFIED"), enum.name


def test_removed_operations_and_fields_stay_reserved(schema: descriptor_pb2.FileDescriptorSet) -> None:
    contract_file = next(f for f in schema.file if f.name.endswith("contract.proto"))
    operation = next(e for e in contract_file.enum_type if e.name == "Operation")
    assert {"OPERATION_PROPOSE", "OPERATION_VERIFY"} <= set(operation.reserved_name)
    model = next(m for m in contract_file.message_type if m.name == "ModelContract")
    assert "history_drafting" in model.reserved_name
