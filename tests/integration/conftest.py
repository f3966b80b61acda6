"""`triton_server`: one real tritonserver per test session, serving model_repository/llm with CPU-sized settings."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
import subprocess

import pytest

from scripts.tritonserver_env import (
    free_ports, make_model_repository, start_server, stop_server, stub_pids, wait_until_ready,
)

MODEL_NAME = "llm"
READY_TIMEOUT_S = 180.0
# Small enough for 2 CPU cores, large enough for 64 concurrent short requests.
CPU_PARAMETERS = {
    "device": "cpu",
    "num_kv_blocks": "512",
    "max_num_seqs": "64",
    "max_num_batched_tokens": "1024",
    "max_model_len": "1024",
    "stats_interval_s": "0.2",
}


@dataclass(slots=True)
class TritonServer:
    """Where the test server listens, and its log."""

    grpc_url: str  # "localhost:PORT"
    http_url: str  # "localhost:PORT"
    metrics_url: str  # "http://localhost:PORT/metrics"
    model_name: str
    log_path: Path
    model_repository: Path
    process: subprocess.Popen

    def log_tail(self, chars: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def stub_pids(self) -> list[int]:
        """Python-backend stubs serving this server's model repository (not other servers on the machine)."""
        return stub_pids(str(self.model_repository))


def launch_server(root: Path, parameters: dict[str, str], extra_args: list[str] | None = None,
                  exit_timeout_s: int = 30) -> TritonServer:
    """Start a tritonserver on free ports serving our model with `parameters`; wait until the model is ready.

    config.pbtxt is complete, so Triton's auto-complete is off here: each load then starts one python-backend stub
    (the instance's), not first a second one that only imports model.py. The servers started as in production
    (scripts.serve, and start_server in test_clean_shutdown.py and bench.serve_bench) keep it.
    exit_timeout_s: how long a SIGTERM waits for the model to unload (it never does once its stub was killed)."""
    repo = make_model_repository(root, parameters)
    log_path = root / "tritonserver.log"
    http, grpc, metrics = free_ports(3)
    args = ["--model-control-mode=explicit", f"--load-model={MODEL_NAME}", f"--exit-timeout-secs={exit_timeout_s}",
            "--disable-auto-complete-config"]
    proc = start_server(repo, http, grpc, metrics, args + list(extra_args or []), log_path=log_path)
    server = TritonServer(f"localhost:{grpc}", f"localhost:{http}", f"http://localhost:{metrics}/metrics",
                          MODEL_NAME, log_path, repo, proc)
    try:
        wait_until_ready(proc, http, timeout=READY_TIMEOUT_S, model_name=MODEL_NAME)
    except RuntimeError as err:
        stop_server(proc)
        pytest.fail(f"{err}\n--- tritonserver log ---\n{server.log_tail()}", pytrace=False)
    return server


def close_server(server: TritonServer) -> None:
    """Stop the server; no python-backend stub of it may be left behind."""
    stop_server(server.process)
    assert server.process.returncode is not None
    left = server.stub_pids()
    assert not left, f"triton_python_backend_stub processes left after shutdown: {left}"


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory: pytest.TempPathFactory):
    server = launch_server(tmp_path_factory.mktemp("triton"), CPU_PARAMETERS)
    yield server
    close_server(server)
