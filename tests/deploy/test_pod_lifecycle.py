"""The Tandem pod of every overlay: probes as the README documents them and as the image can run them, Triton's
ports, a shutdown that lets the drain finish, and GPUs that match the engines."""
import http.server
import re
import shutil
import subprocess
import sys
import threading

import pytest

from tests.deploy.manifests import (REPO_ROOT, SERVING_KUSTOMIZATIONS, config_pbtxt_parameter, container, find,
                                    model_config, pod_spec, rendered)

README = (REPO_ROOT / "README.md").read_text()
DOCKERFILE = (REPO_ROOT / "Dockerfile").read_text()
ENTRYPOINT = (REPO_ROOT / "scripts" / "docker-entrypoint.sh").read_text()
MODEL = "llm"
TRITON_EXIT_TIMEOUT_DEFAULT_S = 30  # tritonserver's --exit-timeout-secs when not given
DRAIN_MARGIN_S = 5  # README: keep --exit-timeout-secs above drain_timeout_s + 5


def documented_health_args():
    """The arguments of `python -m scripts.health ...` wherever the README shows it; they must all agree."""
    found = {tuple(args.split()) for args in re.findall(r"python3? -m scripts\.health ([^`\n]*)`", README)}
    assert len(found) == 1, f"the README shows the health check with different arguments: {found}"
    return list(found.pop())


def dockerfile_workdir():
    return re.findall(r"^WORKDIR\s+(\S+)", DOCKERFILE, re.MULTILINE)[-1]


def arg_value(args, flag, default=None):
    values = [arg.split("=", 1)[1] for arg in args if arg.startswith(flag + "=")]
    return values[-1] if values else default


def container_port(objects, name):
    return {p["name"]: p["containerPort"] for p in container(objects)["ports"]}[name]


def shutdown_problems(objects):
    """Why SIGTERM would cut streams before the drain is over; empty when the budget holds."""
    drain = float(model_config(objects).get("drain_timeout_s", config_pbtxt_parameter("drain_timeout_s")))
    triton = container(objects)
    exit_timeout = float(arg_value(triton.get("args", []), "--exit-timeout-secs", TRITON_EXIT_TIMEOUT_DEFAULT_S))
    pre_stop = triton.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    pause = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
    grace = pod_spec(objects).get("terminationGracePeriodSeconds", 30)
    problems = []
    if exit_timeout <= drain + DRAIN_MARGIN_S:
        problems.append(f"--exit-timeout-secs {exit_timeout:g} is not above drain_timeout_s {drain:g} + 5")
    if grace <= pause + drain:
        problems.append(f"terminationGracePeriodSeconds {grace} is not above the preStop pause {pause:g} s + "
                        f"drain_timeout_s {drain:g}")
    if grace <= pause + exit_timeout:
        problems.append(f"terminationGracePeriodSeconds {grace} is not above the preStop pause {pause:g} s + "
                        f"--exit-timeout-secs {exit_timeout:g}")
    return problems


@pytest.mark.parametrize("name", SERVING_KUSTOMIZATIONS)
def test_liveness_probe_is_the_documented_health_check(name):
    probe = container(rendered(name))["livenessProbe"]
    command = probe["exec"]["command"]
    assert command[:3] == ["python3", "-m", "scripts.health"]
    assert command[3:] == documented_health_args()
    periods = re.search(r"liveness probe \(periodSeconds (\d+), timeoutSeconds (\d+)\)", README)
    assert periods, "the README no longer gives the liveness probe's periods"
    assert (probe["periodSeconds"], probe["timeoutSeconds"]) == (int(periods.group(1)), int(periods.group(2)))
    assert probe["timeoutSeconds"] > float(command[command.index("--timeout") + 1])


@pytest.mark.parametrize("name", SERVING_KUSTOMIZATIONS)
def test_readiness_and_startup_probe_the_models_ready_endpoint(name):
    objects = rendered(name)
    triton = container(objects)
    assert (REPO_ROOT / "model_repository" / MODEL / "config.pbtxt").is_file()
    assert f"`/v2/models/{MODEL}/ready`" in README
    for probe in ("readinessProbe", "startupProbe"):
        get = triton[probe]["httpGet"]
        assert get["path"] == f"/v2/models/{MODEL}/ready"
        assert container_port(objects, get["port"]) == 8000
    assert "--model-control-mode=explicit" in triton["args"]  # a dead engine unloads its model: 503
    assert f"--load-model={MODEL}" in triton["args"]


def test_the_image_holds_the_health_module():
    assert re.search(r"^COPY scripts/__init__.py scripts/health.py \./scripts/$", DOCKERFILE, re.MULTILINE)
    assert (REPO_ROOT / "scripts" / "health.py").is_file() and (REPO_ROOT / "scripts" / "__init__.py").is_file()
    assert "RUN python3 " in DOCKERFILE  # the image's interpreter is python3
    for name in SERVING_KUSTOMIZATIONS:
        assert container(rendered(name))["workingDir"] == dockerfile_workdir()


class _FakeTriton(http.server.BaseHTTPRequestHandler):
    """Answers /v2/models/llm/generate as a healthy model does, or 503 as an unloaded one."""

    status = 200

    def do_POST(self):  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        body = b'{"text_output": "pong"}' if self.status == 200 else b'{"error": "model not ready"}'
        self.send_response(self.status if self.path == f"/v2/models/{MODEL}/generate" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("status, exit_code", [(200, 0), (503, 1)])
def test_the_probe_runs_from_what_the_image_copies(tmp_path, status, exit_code):
    (tmp_path / "scripts").mkdir()
    for module in ("__init__.py", "health.py"):
        shutil.copy(REPO_ROOT / "scripts" / module, tmp_path / "scripts" / module)
    handler = type("Handler", (_FakeTriton,), {"status": status})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        command = list(container(rendered("base"))["livenessProbe"]["exec"]["command"])
        command[0] = sys.executable
        command[command.index("--url") + 1] = f"127.0.0.1:{server.server_address[1]}"
        result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=30)
    finally:
        server.shutdown()
        server.server_close()
    assert result.returncode == exit_code, result.stderr


@pytest.mark.parametrize("name", SERVING_KUSTOMIZATIONS)
def test_ports_are_the_ones_triton_serves(name):
    objects = rendered(name)
    ports = {p["name"]: p["containerPort"] for p in container(objects)["ports"]}
    assert ports == {"http": 8000, "grpc": 8001, "metrics": 8002}
    assert set(re.search(r"^EXPOSE (.*)$", DOCKERFILE, re.MULTILINE).group(1).split()) == {"8000", "8001", "8002"}
    assert not re.search(r"--(http|grpc|metrics)-port", ENTRYPOINT + " ".join(container(objects)["args"]))
    service = find(objects, "Service")
    assert {p["name"]: p["targetPort"] for p in service["spec"]["ports"]} == {n: n for n in ports}


@pytest.mark.parametrize("name", SERVING_KUSTOMIZATIONS)
def test_the_grace_period_outlasts_the_drain(name):
    assert shutdown_problems(rendered(name)) == []


def test_a_longer_drain_without_a_longer_grace_period_is_caught():
    objects = rendered("base")
    model_config(objects)["drain_timeout_s"] = "60"
    assert shutdown_problems(objects) == [
        "--exit-timeout-secs 35 is not above drain_timeout_s 60 + 5",
        "terminationGracePeriodSeconds 60 is not above the preStop pause 5 s + drain_timeout_s 60"]
    objects = rendered("base")
    pod_spec(objects)["terminationGracePeriodSeconds"] = 40
    assert shutdown_problems(objects) == ["terminationGracePeriodSeconds 40 is not above the preStop pause 5 s + "
                                          "--exit-timeout-secs 35"]


@pytest.mark.parametrize("name", SERVING_KUSTOMIZATIONS)
def test_sigterm_reaches_the_drain(name):
    assert "command" not in container(rendered(name))  # the image's entrypoint stays PID 1
    assert 'ENTRYPOINT ["/usr/local/bin/tandem-entrypoint"]' in DOCKERFILE
    assert "COPY scripts/docker-entrypoint.sh /usr/local/bin/tandem-entrypoint" in DOCKERFILE
    assert re.search(r"^trap drain TERM", ENTRYPOINT, re.MULTILINE)
    assert re.search(r'^repo=/opt/tandem/model_repository$', ENTRYPOINT, re.MULTILINE)


@pytest.mark.parametrize("name", SERVING_KUSTOMIZATIONS)
def test_each_engine_has_its_gpu(name):
    objects = rendered(name)
    resources = container(objects)["resources"]
    gpus = resources["limits"]["nvidia.com/gpu"]
    assert resources["requests"]["nvidia.com/gpu"] == gpus
    group = model_config(objects).get("instance_group")
    if group is None:
        assert gpus == 1  # config.pbtxt's KIND_MODEL: one engine on the pod's GPU
        return
    match = re.fullmatch(r"\[ \{ kind: KIND_GPU, count: 1, gpus: \[ ([0-9, ]+) \] \} \]", group)
    assert match, group
    assert [int(i) for i in match.group(1).split(",")] == list(range(gpus))
