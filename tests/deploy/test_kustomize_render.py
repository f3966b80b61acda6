"""The Python kustomize renderer prints what kubectl kustomize prints, and refuses what it does not handle."""
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.kustomize_render import KustomizeError, config_map_hash, render
from tests.deploy.manifests import KUBERNETES_DIR, KUSTOMIZATIONS

KUBECTL = shutil.which("kubectl")


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed; the renderer's own checks still run")
@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_renders_as_kubectl_kustomize(name):
    out = subprocess.run([KUBECTL, "kustomize", str(KUBERNETES_DIR / name)], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    theirs = sorted((doc for doc in yaml.safe_load_all(out) if doc), key=lambda o: (o["kind"], o["metadata"]["name"]))
    assert render(KUBERNETES_DIR / name) == theirs


def test_every_manifest_belongs_to_a_kustomization():
    listed = set()
    for name in KUSTOMIZATIONS:
        spec = yaml.safe_load((KUBERNETES_DIR / name / "kustomization.yaml").read_text())
        listed |= {(KUBERNETES_DIR / name / entry).resolve() for entry in spec.get("resources", [])}
    manifests = {path.resolve() for path in KUBERNETES_DIR.rglob("*.yaml") if path.name != "kustomization.yaml"}
    assert manifests - listed == set(), "manifests no kustomization applies"


def test_config_map_hash_is_kustomizes():
    # the suffixes kubectl kustomize gives generated ConfigMaps with these literals (Go's JSON escapes <, > and &)
    assert config_map_hash({"metadata": {"name": "x"}, "data": {"one": ""}}) == "9g67k2htb6"
    assert config_map_hash({"metadata": {"name": "z"}, "data": {"a": "x <y> & z", "b": "2"}}) == "522dkdm8gd"


def _kustomization(tmp_path: Path, text: str) -> Path:
    (tmp_path / "kustomization.yaml").write_text(text)
    (tmp_path / "cm.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\ndata: {a: b}\n")
    return tmp_path


def test_refuses_a_field_it_does_not_handle(tmp_path):
    folder = _kustomization(tmp_path, "resources: [cm.yaml]\nnamePrefix: dev-\n")
    with pytest.raises(KustomizeError, match="namePrefix"):
        render(folder)


PATCH = """resources: [cm.yaml]
patches:
  - target: {{kind: {kind}, name: x}}
    patch: |-
      - op: {op}
        path: {path}
        value: {value}
"""


@pytest.mark.parametrize("kind,op,path,value,error", [
    ("ConfigMap", "replace", "/data/missing", "c", "/data/missing does not exist"),  # a path that is not there
    ("Deployment", "add", "/spec", "{}", "matches nothing"),  # a target no resource is
])
def test_refuses_a_patch_it_cannot_apply(tmp_path, kind, op, path, value, error):
    folder = _kustomization(tmp_path, PATCH.format(kind=kind, op=op, path=path, value=value))
    with pytest.raises(KustomizeError, match=error):
        render(folder)
