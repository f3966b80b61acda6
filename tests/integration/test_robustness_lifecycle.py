"""The server's end of life, against the real tritonserver: a drained shutdown answers every stream and exits 0; a
killed tritonserver leaves no stub behind; the liveness probe sees a dead stub that Triton still calls ready."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from scripts.tritonserver_env import REPO_ROOT, stop_server
from tests.integration.conftest import CPU_PARAMETERS, close_server, launch_server
from tests.integration.test_triton_serving import GrpcStream, grpc_inputs, wait_for

pytestmark = pytest.mark.integration

LONG = {"max_tokens": 900, "temperature": 0, "ignore_eos": True}


def _probe(server) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scripts.health", "--url", server.http_url, "--timeout", "20"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)


def _start_long_streams(server, count: int) -> GrpcStream:
    grpc = GrpcStream(server)
    for i in range(count):
        grpc.send(f"long-{i}", grpc_inputs("Count to a thousand:", stream=True, sampling=LONG))
    while not all(c.responses for c in grpc.results.values()):  # every stream has begun
        grpc.next_event(60)
    return grpc


def test_drain_deadline_answers_every_stream_and_exits_zero(tmp_path_factory):
    """SIGTERM through stop_server (drain file first): streams that outlive drain_timeout_s (2 s here) each get one
    final response saying the server is shutting down; then the process exits 0, without a segfault."""
    server = launch_server(tmp_path_factory.mktemp("drain"), {**CPU_PARAMETERS, "drain_timeout_s": "2"})
    try:
        grpc = _start_long_streams(server, 3)
        started = time.monotonic()
        stopper = threading.Thread(target=lambda: codes.append(stop_server(server.process)))
        codes: list = []
        stopper.start()
        while any(c.finals == 0 for c in grpc.results.values()):  # the finals come while Triton waits for them
            grpc.next_event(30)
        answered = time.monotonic() - started
        grpc.close()  # a client that got its answers leaves; Triton then exits
        stopper.join(60)
        elapsed = time.monotonic() - started
        results = grpc.results
        code = codes[0] if codes else None
        print(f"answered after {answered:.1f} s, exited after {elapsed:.1f} s")
    finally:
        if server.process.poll() is None:
            close_server(server)
    assert code == 0, server.log_tail()
    assert 2 <= answered < 15 and elapsed < 30, (answered, elapsed)
    for rid, got in results.items():
        assert got.finals == 1, rid
        assert len(got.errors) == 1 and "the server is shutting down" in got.errors[0].message(), (rid, got.errors)
    log = server.log_path.read_text(errors="replace")
    assert "Signal (11)" not in log and "Exit timeout expired" not in log
    assert not server.stub_pids()


def test_killed_tritonserver_leaves_no_stub(tmp_path_factory):
    """kill -9 of tritonserver alone (not its process group) while streams run: the stub is re-parented, and its
    own watch or its reaper process ends it within seconds."""
    server = launch_server(tmp_path_factory.mktemp("orphan"), CPU_PARAMETERS)
    try:
        grpc = _start_long_streams(server, 2)
        assert server.stub_pids()
        os.kill(server.process.pid, signal.SIGKILL)
        server.process.wait(timeout=10)
        # the reaper checks every 0.2 s (25 tries of these steps on a loaded 2-core machine: at most 0.25 s)
        wait_for(lambda: not server.stub_pids(), 10, "the orphaned stub to exit")
        grpc.close()
    finally:
        stop_server(server.process)


def test_liveness_probe_sees_a_dead_stub(tmp_path_factory):
    """scripts.health answers 0 while the model serves; once the stub is killed, Triton's readiness still says 200
    but the probe exits 1."""
    # Triton's shutdown would wait its whole exit timeout for the dead stub's model to unload
    server = launch_server(tmp_path_factory.mktemp("probe"), CPU_PARAMETERS, exit_timeout_s=5)
    try:
        healthy = _probe(server)
        assert healthy.returncode == 0 and healthy.stdout.strip() == "healthy", healthy.stderr
        for pid in server.stub_pids():
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not server.stub_pids(), 10, "the stub to die")
        ready = urllib.request.urlopen(f"http://{server.http_url}/v2/models/{server.model_name}/ready", timeout=5)
        assert ready.status == 200  # what a readiness probe alone would believe
        dead = _probe(server)
        assert dead.returncode == 1 and dead.stderr.startswith("unhealthy:"), (dead.stdout, dead.stderr)
    finally:
        stop_server(server.process)
