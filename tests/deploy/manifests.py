"""Where the deployment files are and what they render to: shared by the deploy tests."""
from __future__ import annotations

import copy
import functools
import re
from pathlib import Path
from typing import Any

from tests.deploy.kustomize_render import render

REPO_ROOT = Path(__file__).resolve().parents[2]
KUBERNETES_DIR = REPO_ROOT / "deploy" / "kubernetes"
# every folder that kubectl apply -k takes
KUSTOMIZATIONS = sorted(str(path.parent.relative_to(KUBERNETES_DIR))
                        for path in KUBERNETES_DIR.rglob("kustomization.yaml"))
# the folders that deploy Tandem itself: the base and each overlay
SERVING_KUSTOMIZATIONS = [name for name in KUSTOMIZATIONS if name == "base" or name.startswith("overlays/")]
MODEL_CONFIG = "tandem-model-config"
SERVER_CONTAINER = "triton"


@functools.lru_cache(maxsize=None)
def _rendered(name: str) -> tuple[dict[str, Any], ...]:
    return tuple(render(KUBERNETES_DIR / name))


def rendered(name: str) -> list[dict[str, Any]]:
    """The objects of one kustomization (a fresh copy: tests may change them)."""
    return copy.deepcopy(list(_rendered(name)))


def find(objects: list[dict[str, Any]], kind: str, name_prefix: str = "tandem") -> dict[str, Any]:
    """The one object of that kind whose name starts with name_prefix (generated ConfigMaps carry a suffix)."""
    found = [obj for obj in objects if obj["kind"] == kind and obj["metadata"]["name"].startswith(name_prefix)]
    assert len(found) == 1, f"expected one {kind} named {name_prefix}*, found {[o['metadata']['name'] for o in found]}"
    return found[0]


def model_config(objects: list[dict[str, Any]]) -> dict[str, str]:
    """The settings the init container applies to config.pbtxt (tandem-model-config's data)."""
    return find(objects, "ConfigMap", MODEL_CONFIG + "-")["data"]


def pod_spec(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return find(objects, "Deployment")["spec"]["template"]["spec"]


def container(objects: list[dict[str, Any]], name: str = SERVER_CONTAINER) -> dict[str, Any]:
    spec = pod_spec(objects)
    matches = [c for c in spec.get("containers", []) + spec.get("initContainers", []) if c["name"] == name]
    assert len(matches) == 1, f"expected one container {name}"
    return matches[0]


def config_pbtxt_parameter(key: str) -> str:
    """A parameter's value in model_repository/llm/config.pbtxt, the image's default."""
    text = (REPO_ROOT / "model_repository" / "llm" / "config.pbtxt").read_text()
    match = re.search(r'^parameters:\s*\{\s*key:\s*"' + re.escape(key) + r'",\s*value:\s*\{\s*string_value:\s*"([^"]*)"',
                      text, re.MULTILINE)
    assert match, f"config.pbtxt has no parameter {key}"
    return match.group(1)
