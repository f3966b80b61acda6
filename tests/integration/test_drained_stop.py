"""`python -m scripts.serve` (what `make serve` runs) stopped with SIGTERM, as a container runtime stops it: an idle
server stops in under 5 s with exit 0, six times in a row (each kind of idle client twice), while a client stays
connected as long-lived clients do (Triton 24.10 alone then waits out its 30 s exit timeout and exits 1: it waits
for open HTTP keep-alive connections before it unloads anything, a gRPC stream that carried a request keeps the
model loaded, and one that carried none keeps its gRPC endpoint open); a stream running at the stop still finishes.
The model is the stand-in (instant weights), so a cycle costs the server's start, not a model's load."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from scripts.tritonserver_env import REPO_ROOT, free_ports, make_model_repository, stub_pids
from tandem_client import Client
from tests.integration.test_triton_serving import GrpcStream, grpc_inputs, wait_for

pytestmark = pytest.mark.integration

STAND_IN = {"model": "stand-in", "device": "cpu", "num_kv_blocks": "512", "max_num_seqs": "8",
            "max_model_len": "4096", "stats_interval_s": "0.2"}
STOP_LIMIT_S = 5.0
LONG = {"max_tokens": 3000, "ignore_eos": True}  # ~3 s of the stand-in's tokens on a 2-core CPU


class Served:
    """One `python -m scripts.serve` on free ports, its log in a file."""

    def __init__(self, repo: Path, log_path: Path) -> None:
        self.http, grpc, metrics = free_ports(3)
        self.log_path = log_path
        self.client_target = SimpleNamespace(grpc_url=f"localhost:{grpc}", model_name="llm")
        cmd = [sys.executable, "-m", "scripts.serve", "--model-repository", str(repo), "--http-port", str(self.http),
               "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--", "--log-verbose=0"]
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + 120
        while "Ctrl-C stops the server" not in self.log():
            assert self.proc.poll() is None, f"scripts.serve exited {self.proc.returncode}:\n{self.log()}"
            assert time.monotonic() < deadline, f"not serving within 120 s:\n{self.log()}"
            time.sleep(0.1)
        self.repo = repo
        self.stubs = stub_pids(str(repo))
        self.regions = [Path("/proc", str(pid), "cmdline").read_bytes().split(b"\0")[2].decode() for pid in self.stubs]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def generate(self, prompt: str) -> str:
        body = json.dumps({"text_input": prompt, "parameters": {"max_tokens": 8, "ignore_eos": True}}).encode()
        req = urllib.request.Request(f"http://localhost:{self.http}/v2/models/llm/generate", data=body)
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.load(r)["text_output"]

    def stop(self) -> tuple[int | None, float]:
        """SIGTERM to scripts.serve; its exit status (None: still running 20 s later) and the seconds it took."""
        started = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            code = None
        return code, time.monotonic() - started

    def kill(self) -> None:
        if self.proc.poll() is None:  # a failed check: the second SIGTERM kills the server's process group
            self.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=30)
            for region in self.regions:  # what the killed server's python backend would have removed
                Path("/dev/shm", region).unlink(missing_ok=True)


def _stream(target, request_id: str, grpc: GrpcStream | None = None, sampling: dict | None = None) -> GrpcStream:
    """A streamed request to its end, on `grpc` (left open) or on a stream of its own (closed)."""
    own = grpc is None
    grpc = grpc or GrpcStream(target)
    grpc.send(request_id, grpc_inputs("Tell me a story", stream=True, sampling=sampling or {"max_tokens": 16},
                                      return_num_output_tokens=True, return_finish_reason=True))
    got = grpc.wait_all(timeout=60)[request_id]
    assert got.finals == 1 and not got.errors, got.errors
    if own:
        grpc.close()
    return grpc


def _cancelled_stream(target) -> None:
    grpc = GrpcStream(target)
    grpc.send("cancelled", grpc_inputs("Tell me a long story", stream=True, sampling=LONG))
    grpc.next_event(timeout=60)  # it runs
    grpc.close(cancel=True)


def _assert_clean(served: Served, code: int | None, elapsed: float, what: str) -> None:
    log = served.log()
    assert code == 0, f"{what}: scripts.serve exited {code} after {elapsed:.1f} s\n{log[-5000:]}"
    assert "drain over after" in log and "Exit timeout expired" not in log, log[-5000:]
    wait_for(lambda: not stub_pids(str(served.repo)), 5, "no stub left after the stop")  # killed ones: reaped
    assert served.regions and not [r for r in served.regions if Path("/dev/shm", r).exists()], "shared memory left"


def _use_over_http(served: Served) -> Client:
    """The project's HTTP client (a keep-alive session, as pooled HTTP clients keep): a cancelled stream, a stream,
    a unary request. Returned open, its connection idle in the pool: Triton 24.10 waits for it before it unloads
    anything."""
    client = Client(f"http://localhost:{served.http}")
    for _ in client.stream("Tell me a long story", **LONG):
        break  # leaving the loop closes its connection: Triton cancels the request
    assert client.generate("Tell me a story", max_tokens=16, ignore_eos=True).text
    assert client.generate("Hello", max_tokens=8, ignore_eos=True, stream=False).text
    return client


def _use_over_grpc(served: Served, carried: bool) -> GrpcStream:
    """A unary request, a stream and a cancelled stream. Returned open: a gRPC client's stream, which carried the
    stream (Triton 24.10 then keeps the model loaded) or nothing (Triton then waits for it to close its endpoint)."""
    kept = GrpcStream(served.client_target)
    assert served.generate("Hello")
    _stream(served.client_target, "s", grpc=kept if carried else None)
    _cancelled_stream(served.client_target)
    return kept


IDLE_CLIENTS = ("http keep-alive", "grpc stream that carried a request", "grpc stream that carried none")


def test_an_idle_server_stops_in_under_5_s_with_exit_0_six_times(tmp_path):
    """Each cycle: a unary request, a stream, a cancelled stream, idle, SIGTERM, while a client stays connected as
    long-lived clients do; the cycles take turns with the three kinds of idle client (IDLE_CLIENTS)."""
    repo = make_model_repository(tmp_path, STAND_IN)
    timings = []
    for cycle in range(6):
        kind = IDLE_CLIENTS[cycle % 3]
        served = Served(repo, tmp_path / f"serve-{cycle}.log")
        kept = None
        try:
            kept = _use_over_http(served) if kind.startswith("http") else _use_over_grpc(served, "a request" in kind)
            time.sleep(0.5)  # idle
            code, elapsed = served.stop()
        finally:
            served.kill()
            if kept is not None:
                kept.close()
        timings.append(f"{elapsed:.2f}")
        _assert_clean(served, code, elapsed, f"cycle {cycle} ({kind})")
        assert elapsed < STOP_LIMIT_S, f"cycle {cycle} ({kind}): the stop took {elapsed:.1f} s\n{served.log()[-5000:]}"
    print(f"stop seconds: {', '.join(timings)}")


def _long_stream_over_grpc(served: Served, began: threading.Event, kept: list) -> tuple[int, list[str], list]:
    """A long stream on a gRPC stream that the client keeps open after it: (tokens, finish reasons, errors)."""
    grpc = GrpcStream(served.client_target)
    kept.append(grpc)
    grpc.send("long", grpc_inputs("Tell me a long story", stream=True, sampling=LONG,
                                  return_num_output_tokens=True, return_finish_reason=True))
    grpc.next_event(timeout=60)
    began.set()
    got = grpc.wait_all(timeout=60)["long"]
    reasons = [r.decode() for r in got.output("finish_reason") if r != b"None"]
    return sum(got.output("num_output_tokens")), reasons, got.errors + [f"{got.finals} finals"] * (got.finals != 1)


def _long_stream_over_http(served: Served, began: threading.Event, kept: list) -> tuple[int, list[str], list]:
    """A long stream from the project's HTTP client, whose keep-alive connection stays open after it."""
    client = Client(f"http://localhost:{served.http}")
    kept.append(client)
    tokens, reasons = 0, []
    for chunk in client.stream("Tell me a long story", **LONG):
        began.set()
        tokens += chunk.tokens()
        reasons += [chunk.finish_reason] if chunk.finish_reason else []
    return tokens, reasons, []


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_stream_running_at_the_stop_finishes_and_the_stop_is_clean(tmp_path, protocol):
    """SIGTERM while a stream runs: it gets every token and its normal end; the server then stops in under 5 s
    more with exit 0, though the client stays connected."""
    served = Served(make_model_repository(tmp_path, STAND_IN), tmp_path / "serve.log")
    began, result, kept = threading.Event(), [], []
    run = _long_stream_over_grpc if protocol == "grpc" else _long_stream_over_http

    def client() -> None:
        try:
            result.append(run(served, began, kept))
        except Exception as err:  # the assertions below report it
            result.append((0, [], [repr(err)]))
            began.set()

    thread = threading.Thread(target=client)
    try:
        thread.start()
        assert began.wait(60), served.log()[-5000:]  # it runs
        signalled = time.monotonic()
        served.proc.send_signal(signal.SIGTERM)
        thread.join(60)
        answered = time.monotonic() - signalled
        try:
            code = served.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            code = None
        elapsed = time.monotonic() - signalled
    finally:
        served.kill()
        thread.join(10)
        for connection in kept:
            connection.close()
    tokens, reasons, errors = result[0]
    assert not errors and tokens == LONG["max_tokens"] and reasons == ["length"], (tokens, reasons, errors)
    assert answered > 0.5  # the stream was still running when the stop began
    _assert_clean(served, code, elapsed, f"a stop with a {protocol} stream running")
    assert elapsed - answered < STOP_LIMIT_S, (answered, elapsed)
