"""Schema checks shared by the freshness test and the baseline tool.

``descriptor_set()`` compiles ``proto/`` with source info; ``breaking_changes``
compares a schema against the committed baseline ``proto/baseline.binpb``:
removing a message, enum, field or value, renumbering, retyping or relabelling
a field are breaking unless the old number (and name) is reserved.
Update the baseline after a reviewed, compatible change:

    python tools/proto_schema.py --update-baseline
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
BASELINE = PROTO_ROOT / "baseline.binpb"


def descriptor_set(include_source_info: bool = True) -> descriptor_pb2.FileDescriptorSet:
    """Compile the schema into a FileDescriptorSet."""
    from grpc_tools import protoc

    sources = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "schema.binpb"
        args = ["protoc", f"-I{PROTO_ROOT}", f"--descriptor_set_out={out}", *sources]
        if include_source_info:
            args.insert(2, "--include_source_info")
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed")
        result = descriptor_pb2.FileDescriptorSet()
        result.ParseFromString(out.read_bytes())
        return result


def _messages(fds: descriptor_pb2.FileDescriptorSet) -> dict[str, descriptor_pb2.DescriptorProto]:
    found: dict[str, descriptor_pb2.DescriptorProto] = {}

    def walk(prefix: str, message: descriptor_pb2.DescriptorProto) -> None:
        name = f"{prefix}.{message.name}"
        found[name] = message
        for nested in message.nested_type:
            walk(name, nested)

    for file in fds.file:
        for message in file.message_type:
            walk(file.package, message)
    return found


def _enums(fds: descriptor_pb2.FileDescriptorSet) -> dict[str, descriptor_pb2.EnumDescriptorProto]:
    found: dict[str, descriptor_pb2.EnumDescriptorProto] = {}
    for file in fds.file:
        for enum in file.enum_type:
            found[f"{file.package}.{enum.name}"] = enum
    for name, message in _messages(fds).items():
        for enum in message.enum_type:
            found[f"{name}.{enum.name}"] = enum
    return found


def _reserved(numbers: list[tuple[int, int]], names: list[str], number: int, name: str, end_inclusive: bool) -> bool:
    in_range = any(start <= number < (end + 1 if end_inclusive else end) for start, end in numbers)
    return in_range and name in names


def breaking_changes(
    baseline: descriptor_pb2.FileDescriptorSet, current: descriptor_pb2.FileDescriptorSet
) -> list[str]:
    """Every incompatible difference of ``current`` against ``baseline``."""
    problems: list[str] = []
    old_messages, new_messages = _messages(baseline), _messages(current)
    for name, old in old_messages.items():
        new = new_messages.get(name)
        if new is None:
            problems.append(f"message {name} was removed")
            continue
        ranges = [(r.start, r.end) for r in new.reserved_range]
        by_number = {f.number: f for f in new.field}
        for field in old.field:
            now = by_number.get(field.number)
            if now is None:
                if not _reserved(ranges, list(new.reserved_name), field.number, field.name, False):
                    problems.append(f"{name}.{field.name} = {field.number} was removed without reserving it")
                continue
            if now.name != field.name:
                problems.append(f"{name} field {field.number} was renamed {field.name} -> {now.name}")
            if now.type != field.type or now.type_name != field.type_name:
                problems.append(f"{name}.{field.name} changed type")
            if now.label != field.label:
                problems.append(f"{name}.{field.name} changed label")
            if now.HasField("oneof_index") != field.HasField("oneof_index"):
                problems.append(f"{name}.{field.name} moved into or out of a oneof")
    old_enums, new_enums = _enums(baseline), _enums(current)
    for name, old_enum in old_enums.items():
        new_enum = new_enums.get(name)
        if new_enum is None:
            problems.append(f"enum {name} was removed")
            continue
        ranges = [(r.start, r.end) for r in new_enum.reserved_range]
        values = {v.number: v.name for v in new_enum.value}
        for value in old_enum.value:
            if value.number not in values:
                if not _reserved(ranges, list(new_enum.reserved_name), value.number, value.name, True):
                    problems.append(f"{name}.{value.name} = {value.number} was removed without reserving it")
            elif values[value.number] != value.name:
                problems.append(f"{name} value {value.number} was renamed {value.name} -> {values[value.number]}")
    return problems


def undocumented(fds: descriptor_pb2.FileDescriptorSet) -> list[str]:
    """Messages, fields, enums and enum values without a leading or trailing comment."""
    missing: list[str] = []
    for file in fds.file:
        comments: dict[tuple[int, ...], str] = {}
        for location in file.source_code_info.location:
            text = (location.leading_comments + location.trailing_comments).strip()
            comments[tuple(location.path)] = text

        def check(
            path: tuple[int, ...], what: str, comments: dict[tuple[int, ...], str] = comments, name: str = file.name
        ) -> None:
            if not comments.get(path):
                missing.append(f"{name}: {what}")

        def walk_message(path: tuple[int, ...], message: descriptor_pb2.DescriptorProto, prefix: str) -> None:
            name = f"{prefix}{message.name}"
            check(path, f"message {name}")
            for index, field in enumerate(message.field):
                check((*path, 2, index), f"field {name}.{field.name}")
            for index, nested in enumerate(message.nested_type):
                if nested.options.map_entry:
                    continue
                walk_message((*path, 3, index), nested, f"{name}.")
            for index, enum in enumerate(message.enum_type):
                walk_enum((*path, 4, index), enum, f"{name}.")

        def walk_enum(path: tuple[int, ...], enum: descriptor_pb2.EnumDescriptorProto, prefix: str) -> None:
            name = f"{prefix}{enum.name}"
            check(path, f"enum {name}")
            for index, value in enumerate(enum.value):
                check((*path, 2, index), f"enum value {name}.{value.name}")

        for index, message in enumerate(file.message_type):
            walk_message((4, index), message, "")
        for index, enum in enumerate(file.enum_type):
            walk_enum((5, index), enum, "")
    return missing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update-baseline", action="store_true", help="rewrite proto/baseline.binpb")
    args = parser.parse_args(argv)
    current = descriptor_set(include_source_info=False)
    if args.update_baseline:
        BASELINE.write_bytes(current.SerializeToString(deterministic=True))
        print(f"wrote {BASELINE}")
        return 0
    baseline = descriptor_pb2.FileDescriptorSet()
    baseline.ParseFromString(BASELINE.read_bytes())
    problems = breaking_changes(baseline, current)
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
