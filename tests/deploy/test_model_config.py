"""The init container's configure_model_repository.py turns each overlay's tandem-model-config into the config.pbtxt
the engine then loads: the settings land as `--param` would set them and the engine accepts them."""
import ast
import importlib.util
import os
import re

import pytest

from backend import EngineConfig
from scripts.tritonserver_env import set_parameters
from tests.deploy.manifests import (KUBERNETES_DIR, REPO_ROOT, SERVING_KUSTOMIZATIONS, container, find, model_config,
                                    pod_spec, rendered)

SCRIPT = KUBERNETES_DIR / "base" / "configure_model_repository.py"
IMAGE_REPOSITORY = "/opt/tandem/model_repository"  # where the Dockerfile copies model_repository/
_spec = importlib.util.spec_from_file_location("configure_model_repository", SCRIPT)
configure_model_repository = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(configure_model_repository)


def adapter_settings():
    """model.py's ADAPTER_SETTINGS: the parameters the model keeps for itself and does not pass to the engine."""
    tree = ast.parse((REPO_ROOT / "model_repository" / "llm" / "1" / "model.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == [
                "ADAPTER_SETTINGS"]:
            return ast.literal_eval(node.value)
    raise AssertionError("model.py no longer defines ADAPTER_SETTINGS")


def mount_config_map(folder, data):
    """Lay data out as the kubelet mounts a ConfigMap: ..data -> a timestamped folder, each key a link into it."""
    stamped = folder / "..2026_01_01_00_00_00.000000001"
    stamped.mkdir(parents=True)
    for key, value in data.items():
        (stamped / key).write_text(value)
    os.symlink(stamped.name, folder / "..data")
    for key in data:
        os.symlink(f"..data/{key}", folder / key)
    return folder


def parameters(config_text):
    return dict(re.findall(r'^parameters:\s*\{\s*key:\s*"([^"]+)",\s*value:\s*\{\s*string_value:\s*"([^"]*)"',
                           config_text, re.MULTILINE))


@pytest.mark.parametrize("name", SERVING_KUSTOMIZATIONS)
def test_settings_reach_config_pbtxt_and_the_engine_accepts_them(name, tmp_path):
    settings = model_config(rendered(name))
    folder = mount_config_map(tmp_path / "settings", settings)
    code = configure_model_repository.main([str(REPO_ROOT / "model_repository"), str(tmp_path / "repo"), str(folder)])
    assert code == 0
    text = (tmp_path / "repo" / "llm" / "config.pbtxt").read_text()
    values = parameters(text)
    for key, value in settings.items():
        if key == "instance_group":
            assert re.search(r"^instance_group " + re.escape(value) + "$", text, re.MULTILINE)
        else:
            assert values[key] == value
    engine_settings = {k: v for k, v in values.items() if k not in adapter_settings()}
    EngineConfig.from_dict(engine_settings).validate()
    assert (tmp_path / "repo" / "llm" / "1" / "model.py").is_file()


def test_parameters_are_set_as_make_serve_param_sets_them():
    text = (REPO_ROOT / "model_repository" / "llm" / "config.pbtxt").read_text()
    settings = model_config(rendered("overlays/fp8"))
    assert configure_model_repository.apply_settings(text, settings) == set_parameters(text, settings)


def test_fp8_overlay_asks_for_fp8_weights_and_kv_cache():
    assert {k: model_config(rendered("overlays/fp8"))[k] for k in ("quantization", "kv_cache_dtype")} == {
        "quantization": "fp8", "kv_cache_dtype": "fp8"}


@pytest.mark.parametrize("key, value, message", [
    ("model", 'a"b', "quotes"),
    ("instance_group", "{ kind: KIND_GPU }", "expected one line"),
    ("bad key", "1", "not a parameter name"),
])
def test_values_config_pbtxt_cannot_hold_are_refused(tmp_path, capsys, key, value, message):
    folder = mount_config_map(tmp_path / "settings", {key: value})
    code = configure_model_repository.main([str(REPO_ROOT / "model_repository"), str(tmp_path / "repo"), str(folder)])
    assert code == 1
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("name", SERVING_KUSTOMIZATIONS)
def test_the_init_container_runs_this_script_into_the_servers_repository(name):
    objects = rendered(name)
    spec = pod_spec(objects)
    init = container(objects, "model-config")
    mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    script, source, target, settings = init["command"][1:]
    assert init["command"][0] == "python3" and init["image"] == container(objects)["image"]
    assert script == f"{mounts['setup']}/{SCRIPT.name}"
    setup = find(objects, "ConfigMap", "tandem-setup-")
    assert volumes["setup"]["configMap"]["name"] == setup["metadata"]["name"]
    assert setup["data"][SCRIPT.name] == SCRIPT.read_text()
    assert source == IMAGE_REPOSITORY and "COPY model_repository ./model_repository" in (
        REPO_ROOT / "Dockerfile").read_text()
    assert settings == mounts["model-config"]
    assert volumes["model-config"]["configMap"]["name"] == find(objects, "ConfigMap", "tandem-model-config-")[
        "metadata"]["name"]
    # the server reads the written copy where the image's entrypoint looks for its repository
    assert target == mounts["model-repository"] and "emptyDir" in volumes["model-repository"]
    server_mounts = {m["name"]: m["mountPath"] for m in container(objects)["volumeMounts"]}
    assert server_mounts["model-repository"] == IMAGE_REPOSITORY


@pytest.mark.parametrize("name", SERVING_KUSTOMIZATIONS)
def test_the_model_is_read_from_the_models_volume(name):
    objects = rendered(name)
    mounts = {m["name"]: m for m in container(objects)["volumeMounts"]}
    assert mounts["models"]["readOnly"] is True
    assert model_config(objects)["model"].startswith(mounts["models"]["mountPath"] + "/")
    claim = {v["name"]: v for v in pod_spec(objects)["volumes"]}["models"]["persistentVolumeClaim"]
    assert claim["claimName"] == find(objects, "PersistentVolumeClaim")["metadata"]["name"]
