"""A stopped server's Python-backend stub exits cleanly (it once segfaulted in teardown, with our metrics alive)."""
from __future__ import annotations

import subprocess
import time

import pytest

from scripts.tritonserver_env import free_ports, make_model_repository, start_server, stop_server, wait_until_ready


def _stub_segfaults() -> int | None:
    """Kernel-logged segfaults of triton_python_backend_stub processes, or None where dmesg is not readable."""
    try:
        out = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return sum("segfault" in line and "triton_python_b" in line for line in out.stdout.splitlines())


def test_stub_exits_without_a_segfault(tmp_path):
    before = _stub_segfaults()
    if before is None:
        pytest.skip("dmesg is not readable here")
    repo = make_model_repository(tmp_path, {"device": "cpu", "num_kv_blocks": "64", "max_num_seqs": "8",
                                            "max_model_len": "512"})
    http, grpc, metrics = free_ports(3)
    proc = start_server(repo, http, grpc, metrics, log_path=tmp_path / "tritonserver.log")
    try:
        wait_until_ready(proc, http, timeout=180, model_name="llm")
    finally:
        code = stop_server(proc)
    time.sleep(1)  # the kernel logs a crash as the process dies
    assert _stub_segfaults() == before
    assert code == 0
