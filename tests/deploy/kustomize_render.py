"""Render a kustomization of deploy/kubernetes in Python, offline: the subset of kustomize those files use.

Supported: `resources` (files and other kustomization folders), `images`, `configMapGenerator` (literals and
files; behavior create or merge), `generatorOptions` (labels, disableNameSuffixHash), `patches` (inline JSON 6902
operations with a kind/name target). Generated ConfigMaps get kustomize's content-hash name suffix and the pod
templates' references to them follow, as `kubectl kustomize` does. Anything else in a kustomization.yaml is an
error, so the tests never pass on a file this renderer misread.
"""
from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import yaml

KNOWN_KEYS = {"apiVersion", "kind", "resources", "images", "configMapGenerator", "generatorOptions", "patches"}
_OPS = {"add", "replace", "remove"}


class KustomizeError(ValueError):
    """A kustomization this renderer rejects (unknown field, bad reference, patch that does not apply)."""


def render(folder: Path) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize folder` prints, sorted by kind and name."""
    objects, generated = _build(Path(folder))
    names = {}
    for obj, options in generated:
        if not options.get("disableNameSuffixHash", False):
            old = obj["metadata"]["name"]
            obj["metadata"]["name"] = f"{old}-{config_map_hash(obj)}"
            names[old] = obj["metadata"]["name"]
    for obj in objects:
        _rename_config_map_references(obj, names)
    return sorted(objects, key=lambda obj: (obj["kind"], obj["metadata"]["name"]))


def config_map_hash(config_map: dict[str, Any]) -> str:
    """kustomize's name suffix of a generated ConfigMap: sha256 of its kind, name and data as Go encodes them as
    JSON. The name hashed is empty: so `kubectl kustomize` (kustomize 5.5) names generated ConfigMaps, which
    test_kustomize_render checks where kubectl is installed."""
    fields = {"data": config_map.get("data", {}), "kind": "ConfigMap", "name": ""}
    if config_map.get("binaryData"):
        fields["binaryData"] = config_map["binaryData"]
    encoded = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    for char, escape in (("&", "\\u0026"), ("<", "\\u003c"), (">", "\\u003e"), ("\u2028", "\\u2028"),
                         ("\u2029", "\\u2029")):  # Go's json.Marshal escapes these
        encoded = encoded.replace(char, escape)
    digest = hashlib.sha256(encoded.encode()).hexdigest()[:10]
    return digest.translate(str.maketrans({"0": "g", "1": "h", "3": "k", "a": "m", "e": "t"}))


def _build(folder: Path) -> tuple[list[dict[str, Any]], list[tuple[dict[str, Any], dict[str, Any]]]]:
    """Objects of one kustomization before names get their suffixes, and its generated ConfigMaps with options."""
    path = folder / "kustomization.yaml"
    if not path.is_file():
        raise KustomizeError(f"{folder}: no kustomization.yaml")
    spec = yaml.safe_load(path.read_text()) or {}
    unknown = set(spec) - KNOWN_KEYS
    if unknown:
        raise KustomizeError(f"{path}: fields this renderer does not handle: {sorted(unknown)}")
    if spec.get("kind", "Kustomization") != "Kustomization":
        raise KustomizeError(f"{path}: kind must be Kustomization")
    objects: list[dict[str, Any]] = []
    generated: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for entry in spec.get("resources", []):
        target = (folder / entry).resolve()
        if target.is_dir():
            sub_objects, sub_generated = _build(target)
            objects += sub_objects
            generated += sub_generated
        elif target.is_file():
            objects += [doc for doc in yaml.safe_load_all(target.read_text()) if doc]
        else:
            raise KustomizeError(f"{path}: resource {entry} does not exist")
    options = spec.get("generatorOptions", {})
    unknown = set(options) - {"labels", "disableNameSuffixHash"}
    if unknown:
        raise KustomizeError(f"{path}: generatorOptions this renderer does not handle: {sorted(unknown)}")
    for generator in spec.get("configMapGenerator", []):
        _generate(folder, path, generator, options, objects, generated)
    for image in spec.get("images", []):
        _set_image(objects, image)
    for patch in spec.get("patches", []):
        _apply_patch(path, objects, patch)
    return objects, generated


def _generate(folder: Path, path: Path, generator: dict[str, Any], options: dict[str, Any],
              objects: list[dict[str, Any]], generated: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
    unknown = set(generator) - {"name", "behavior", "literals", "files"}
    if unknown:
        raise KustomizeError(f"{path}: configMapGenerator fields this renderer does not handle: {sorted(unknown)}")
    data: dict[str, str] = {}
    for literal in generator.get("literals", []):
        key, sep, value = literal.partition("=")
        if not sep:
            raise KustomizeError(f"{path}: literal {literal!r} is not KEY=VALUE")
        data[key] = value
    for file_entry in generator.get("files", []):
        source = folder / file_entry
        if not source.is_file():
            raise KustomizeError(f"{path}: file {file_entry} does not exist")
        data[source.name] = source.read_text()
    name, behavior = generator["name"], generator.get("behavior", "create")
    existing = [obj for obj, _ in generated if obj["metadata"]["name"] == name]
    if behavior == "merge":
        if not existing:
            raise KustomizeError(f"{path}: merge into {name}, which no base generates")
        existing[0]["data"].update(data)
        return
    if behavior != "create" or existing:
        raise KustomizeError(f"{path}: cannot {behavior} ConfigMap {name}")
    config_map: dict[str, Any] = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": data}
    if options.get("labels"):
        config_map["metadata"]["labels"] = dict(options["labels"])
    objects.append(config_map)
    generated.append((config_map, options))


def _containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    pod = obj.get("spec", {}).get("template", {}).get("spec", {})
    return pod.get("initContainers", []) + pod.get("containers", [])


def _set_image(objects: list[dict[str, Any]], image: dict[str, Any]) -> None:
    unknown = set(image) - {"name", "newName", "newTag"}
    if unknown:
        raise KustomizeError(f"images: fields this renderer does not handle: {sorted(unknown)}")
    for obj in objects:
        for container in _containers(obj):
            name, _, tag = container["image"].partition(":")
            if name == image["name"]:
                new_tag = image.get("newTag", tag)
                container["image"] = image.get("newName", name) + (f":{new_tag}" if new_tag else "")


def _apply_patch(path: Path, objects: list[dict[str, Any]], patch: dict[str, Any]) -> None:
    target = patch.get("target", {})
    if set(patch) - {"target", "patch"} or set(target) - {"kind", "name"} or "patch" not in patch:
        raise KustomizeError(f"{path}: only inline JSON 6902 patches with a kind/name target are handled")
    matches = [obj for obj in objects
               if obj.get("kind") == target.get("kind") and obj["metadata"]["name"] == target.get("name")]
    if not matches:
        raise KustomizeError(f"{path}: patch target {target} matches nothing")
    operations = yaml.safe_load(patch["patch"])
    if not isinstance(operations, list):
        raise KustomizeError(f"{path}: a JSON 6902 patch is a list of operations")
    for obj in matches:
        for operation in operations:
            _apply_operation(path, obj, operation)


def _apply_operation(path: Path, obj: dict[str, Any], operation: dict[str, Any]) -> None:
    op, pointer = operation.get("op"), operation.get("path", "")
    if op not in _OPS or not pointer.startswith("/"):
        raise KustomizeError(f"{path}: unsupported operation {operation}")
    parts = [part.replace("~1", "/").replace("~0", "~") for part in pointer[1:].split("/")]
    parent = obj
    for part in parts[:-1]:
        try:
            parent = parent[int(part)] if isinstance(parent, list) else parent[part]
        except (KeyError, IndexError, ValueError):
            raise KustomizeError(f"{path}: {pointer} does not exist in {obj['kind']} {obj['metadata']['name']}")
    last = parts[-1]
    if isinstance(parent, list):
        index = len(parent) if last == "-" else int(last)
        if op != "add" and not 0 <= index < len(parent) or op == "add" and not 0 <= index <= len(parent):
            raise KustomizeError(f"{path}: {pointer} is out of range")
        if op == "remove":
            del parent[index]
        elif op == "replace":
            parent[index] = copy.deepcopy(operation["value"])
        else:
            parent.insert(index, copy.deepcopy(operation["value"]))
        return
    if op != "add" and last not in parent:
        raise KustomizeError(f"{path}: {pointer} does not exist in {obj['kind']} {obj['metadata']['name']}")
    if op == "remove":
        del parent[last]
    else:
        parent[last] = copy.deepcopy(operation["value"])


def _rename_config_map_references(obj: dict[str, Any], names: dict[str, str]) -> None:
    """Point a pod template's ConfigMap volumes and env references at the suffixed names."""
    pod = obj.get("spec", {}).get("template", {}).get("spec", {})
    for volume in pod.get("volumes", []):
        if "configMap" in volume:
            volume["configMap"]["name"] = names.get(volume["configMap"]["name"], volume["configMap"]["name"])
    for container in _containers(obj):
        for source in container.get("envFrom", []):
            if "configMapRef" in source:
                source["configMapRef"]["name"] = names.get(source["configMapRef"]["name"],
                                                           source["configMapRef"]["name"])
        for env in container.get("env", []):
            ref = env.get("valueFrom", {}).get("configMapKeyRef")
            if ref:
                ref["name"] = names.get(ref["name"], ref["name"])
