"""The subset of kustomize that deploy/kubernetes uses, in Python, so the manifests can be composed
and validated offline without the kustomize binary.

Supported ``kustomization.yaml`` fields: ``resources`` (YAML files, or directories holding a
kustomization), ``patches`` (a ``target`` with group, version, kind and name, and an inline
``patch`` or a ``path``; the patch is a JSON 6902 operation list) and ``images`` (``name`` to
``newName``/``newTag``). Any other field is an error rather than being silently ignored, so a
kustomization that grows a feature this module lacks fails its tests until the feature is added.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

Manifest = dict[str, Any]

KNOWN_FIELDS = frozenset({"apiVersion", "kind", "resources", "patches", "images"})


class KustomizeError(Exception):
    """A kustomization this module cannot compose: unknown field, missing file, bad patch."""


def load_documents(path: Path) -> list[Manifest]:
    """Every non-empty YAML document of one manifest file."""
    documents = [document for document in yaml.safe_load_all(path.read_text(encoding="utf-8")) if document]
    for document in documents:
        if not isinstance(document, dict):
            raise KustomizeError(f"{path}: a document is not a mapping")
    return documents


def build(directory: Path) -> list[Manifest]:
    """The objects ``kustomize build directory`` would print, in resource order."""
    kustomization_path = directory / "kustomization.yaml"
    if not kustomization_path.is_file():
        raise KustomizeError(f"{directory}: no kustomization.yaml")
    kustomization = yaml.safe_load(kustomization_path.read_text(encoding="utf-8")) or {}
    unknown = sorted(set(kustomization) - KNOWN_FIELDS)
    if unknown:
        raise KustomizeError(f"{kustomization_path}: unsupported fields {unknown}")
    objects: list[Manifest] = []
    for resource in kustomization.get("resources", []):
        target = (directory / resource).resolve()
        if target.is_dir():
            objects.extend(build(target))
        elif target.is_file():
            objects.extend(load_documents(target))
        else:
            raise KustomizeError(f"{kustomization_path}: resource {resource!r} does not exist")
    _reject_duplicates(objects, kustomization_path)
    for patch in kustomization.get("patches", []):
        _apply_patch(objects, patch, directory)
    for image in kustomization.get("images", []):
        _apply_image(objects, image)
    return objects


def object_id(manifest: Manifest) -> tuple[str, str, str]:
    """(apiVersion, kind, name): what kustomize keys resources by (one namespace here)."""
    return manifest.get("apiVersion", ""), manifest.get("kind", ""), manifest.get("metadata", {}).get("name", "")


def _reject_duplicates(objects: list[Manifest], where: Path) -> None:
    seen: set[tuple[str, str, str]] = set()
    for manifest in objects:
        key = object_id(manifest)
        if key in seen:
            raise KustomizeError(f"{where}: {key} is declared twice")
        seen.add(key)


def _matches(manifest: Manifest, target: dict[str, str]) -> bool:
    api_version = manifest.get("apiVersion", "")
    group, _, version = api_version.rpartition("/")
    checks = {
        "group": group,
        "version": version,
        "kind": manifest.get("kind", ""),
        "name": manifest.get("metadata", {}).get("name", ""),
    }
    unknown = sorted(set(target) - set(checks))
    if unknown:
        raise KustomizeError(f"patch target fields {unknown} are not supported")
    return all(checks[key] == value for key, value in target.items())


def _apply_patch(objects: list[Manifest], patch: dict[str, Any], directory: Path) -> None:
    target = patch.get("target")
    if not isinstance(target, dict):
        raise KustomizeError(f"{directory}: a patch without a target")
    if "patch" in patch:
        text = patch["patch"]
    elif "path" in patch:
        text = (directory / patch["path"]).read_text(encoding="utf-8")
    else:
        raise KustomizeError(f"{directory}: a patch needs `patch` or `path`")
    operations = yaml.safe_load(text)
    if not isinstance(operations, list):
        raise KustomizeError(f"{directory}: only JSON 6902 patches (an operation list) are supported")
    matched = [manifest for manifest in objects if _matches(manifest, target)]
    if not matched:
        raise KustomizeError(f"{directory}: patch target {target} matches no resource")
    for manifest in matched:
        for operation in operations:
            apply_json_patch_operation(manifest, operation)


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise KustomizeError(f"JSON pointer {path!r} must start with /")
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def _child(node: Any, token: str, path: str) -> Any:
    if isinstance(node, dict):
        if token not in node:
            raise KustomizeError(f"{path}: no member {token!r}")
        return node[token]
    if isinstance(node, list):
        index = _index(node, token, path, allow_end=False)
        return node[index]
    raise KustomizeError(f"{path}: cannot descend into a scalar")


def _index(node: list[Any], token: str, path: str, *, allow_end: bool) -> int:
    if token == "-" and allow_end:
        return len(node)
    if not token.isdigit():
        raise KustomizeError(f"{path}: {token!r} is not an array index")
    index = int(token)
    limit = len(node) if allow_end else len(node) - 1
    if index > limit:
        raise KustomizeError(f"{path}: index {index} is out of range")
    return index


def apply_json_patch_operation(document: Manifest, operation: dict[str, Any]) -> None:
    """One RFC 6902 ``add``, ``replace`` or ``remove`` operation, in place."""
    op, path = operation.get("op"), operation.get("path", "")
    tokens = _pointer(path)
    parent: Any = document
    for token in tokens[:-1]:
        parent = _child(parent, token, path)
    last = tokens[-1]
    if op in ("add", "replace"):
        if "value" not in operation:
            raise KustomizeError(f"{path}: {op} without a value")
        value = copy.deepcopy(operation["value"])
        if isinstance(parent, dict):
            if op == "replace" and last not in parent:
                raise KustomizeError(f"{path}: replace of a missing member")
            parent[last] = value
        elif isinstance(parent, list):
            index = _index(parent, last, path, allow_end=op == "add")
            if op == "add":
                parent.insert(index, value)
            else:
                parent[index] = value
        else:
            raise KustomizeError(f"{path}: parent is a scalar")
    elif op == "remove":
        if isinstance(parent, dict):
            if last not in parent:
                raise KustomizeError(f"{path}: remove of a missing member")
            del parent[last]
        elif isinstance(parent, list):
            del parent[_index(parent, last, path, allow_end=False)]
        else:
            raise KustomizeError(f"{path}: parent is a scalar")
    else:
        raise KustomizeError(f"{path}: operation {op!r} is not supported")


def _split_image(image: str) -> tuple[str, str | None]:
    name, slash, last = image.rpartition("/")
    if ":" in last:
        repository, tag = last.split(":", 1)
        return (name + slash + repository), tag
    return image, None


def _apply_image(objects: list[Manifest], image: dict[str, str]) -> None:
    for manifest in objects:
        template = manifest.get("spec", {}).get("template", {}).get("spec", {})
        for container in [*template.get("initContainers", []), *template.get("containers", [])]:
            repository, tag = _split_image(container.get("image", ""))
            if repository != image["name"]:
                continue
            new_repository = image.get("newName", repository)
            new_tag = image.get("newTag", tag)
            container["image"] = new_repository if new_tag is None else f"{new_repository}:{new_tag}"
