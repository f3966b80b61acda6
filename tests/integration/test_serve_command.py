"""`python -m scripts.serve` (what `make serve` runs): serves, prints how to call it, applies --param, stops on SIGTERM."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from scripts.tritonserver_env import REPO_ROOT, free_ports, stub_pids


def _wait_for(proc: subprocess.Popen, lines: list[str], needle: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"scripts.serve ended (code {proc.poll()}) before {needle!r}:\n" + "".join(lines))
        lines.append(line)
        if needle in line:
            return
    raise AssertionError(f"no {needle!r} within {timeout} s:\n" + "".join(lines))


def test_serve_answers_the_printed_curl_and_stops_on_sigterm(tmp_path):
    http, grpc, metrics = free_ports(3)
    cmd = [sys.executable, "-m", "scripts.serve", "--http-port", str(http), "--grpc-port", str(grpc),
           "--metrics-port", str(metrics), "--param", "device=cpu", "--param", "max_num_seqs=3",
           "--param", "num_kv_blocks=128", "--", "--log-verbose=0"]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    try:
        _wait_for(proc, lines, "model repository:", 60)
        repo = lines[-1].split("model repository:", 1)[1].split(" (", 1)[0].strip()
        _wait_for(proc, lines, "Ctrl-C stops the server", 240)
        printed = "".join(lines)
        assert f"http://localhost:{http}" in printed and f"localhost:{http}/v2/models/llm/generate" in printed

        with urllib.request.urlopen(f"http://localhost:{http}/v2/models/llm/config", timeout=10) as r:
            params = json.load(r)["parameters"]
        assert params["max_num_seqs"]["string_value"] == "3"  # --param reached the served config
        assert (Path(repo) / "llm" / "config.pbtxt").exists() and Path(repo) != REPO_ROOT / "model_repository"

        body = json.dumps({"text_input": "The capital of France is",
                           "parameters": {"max_tokens": 5, "temperature": 0, "ignore_eos": True}}).encode()
        req = urllib.request.Request(f"http://localhost:{http}/v2/models/llm/generate", data=body)
        with urllib.request.urlopen(req, timeout=60) as r:
            answer = json.load(r)
        assert isinstance(answer["text_output"], str) and answer["text_output"]

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, "".join(lines) + proc.stdout.read()
        assert not stub_pids(repo), "python-backend stubs left after SIGTERM"
    finally:
        if proc.poll() is None:  # a failed check: let serve.py stop its tritonserver, then make sure
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGTERM)  # the second one kills the server's process group
                proc.kill()
                proc.wait()
