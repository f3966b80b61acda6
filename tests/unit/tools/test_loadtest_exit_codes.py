"""Exit codes and fail-fast of the locustfile (run by Locust) and of loadtest.run, without a Triton server: a
stand-in HTTP server on this machine, or a port nothing listens on."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


class DroppingHandler(BaseHTTPRequestHandler):
    """Says the model is ready, then drops the connection of every generation request: a server gone away."""

    posts: list[str] = []

    def do_GET(self):
        self.send_response(200 if self.path.endswith("/ready") else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):
        DroppingHandler.posts.append(self.path)
        self.close_connection = True
        self.connection.shutdown(socket.SHUT_RDWR)

    def log_message(self, *args):  # keep the test output clean
        pass


@pytest.fixture
def dropping_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), DroppingHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    DroppingHandler.posts = []
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_loadtest_run_and_locust_exit_1_on_failures_and_back_off_from_a_lost_server(dropping_server, tmp_path):
    port, out = dropping_server, tmp_path / "out"
    proc = run("-m", "loadtest.run", "--host", f"http://127.0.0.1:{port}", "--users", "2", "--spawn-rate", "10",
               "--duration", "5", "--tokenizer", "chatml", "--out", str(out))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["protocol"] == "http"  # from the scheme alone: no --protocol given
    assert DroppingHandler.posts and all(p == "/v2/models/llm/generate_stream" for p in DroppingHandler.posts)
    assert summary["locust_exit_code"] == 1  # the locustfile exits with Locust's code, not a stale 0
    assert summary["failures"]["count"] > 0 and summary["passed"] is False
    message = next(iter(summary["failures"]["messages"]))
    assert f"cannot reach Triton over HTTP at 127.0.0.1:{port}" in message
    # from the per-request samples: Locust's CSV is written on a timer and, on a loaded machine, may not hold the
    # e2e row yet. 2 users backing off 0.5, 1, 2, 4 s: a handful of tries in 5 s, not thousands (5 s, not 3: on a
    # loaded machine Locust's users may not have sent anything 3 s after the start)
    failed = summary["failures"]["count"]
    assert 2 <= failed <= 12, failed


def test_locustfile_refuses_to_start_when_the_server_is_unreachable():
    port = closed_port()
    proc = run("-m", "locust", "-f", "loadtest/locustfile.py", "--headless", "-u", "1", "-t", "30s",
               "--host", f"127.0.0.1:{port}", "--only-summary", timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert f"cannot reach Triton over gRPC at 127.0.0.1:{port}: nothing listens on port {port}" in proc.stderr


def test_locustfile_refuses_a_protocol_that_contradicts_the_host():
    proc = run("-m", "locust", "-f", "loadtest/locustfile.py", "--headless", "-u", "1", "-t", "30s",
               "--host", "http://127.0.0.1:1", "--protocol", "grpc", "--only-summary", timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "protocol grpc contradicts the URL http://127.0.0.1:1" in proc.stderr
    assert "Traceback" not in proc.stderr  # users Locust spawned anyway wait quietly for the quit


def test_loadtest_run_exits_2_before_locust_when_the_server_is_unreachable(tmp_path, capsys):
    from loadtest.run import main  # in this process: loadtest.run never imports locust

    port = closed_port()
    assert main(["--host", f"http://127.0.0.1:{port}", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"cannot reach Triton over HTTP at 127.0.0.1:{port}: nothing listens on port {port}" in err
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit) as exit_:
        main(["--host", "grpc://127.0.0.1:1", "--protocol", "http"])
    assert exit_.value.code == 2 and "protocol http contradicts the URL grpc://127.0.0.1:1" in capsys.readouterr().err


def test_backoff_doubles_to_its_cap_and_starts_over_after_a_success():
    from loadtest.backoff import Backoff

    backoff = Backoff(0.5, 5.0)
    assert [backoff.failed() for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    backoff.succeeded()
    assert backoff.failed() == 0.5
    with pytest.raises(ValueError, match="first_s"):
        Backoff(0.0, 1.0)
