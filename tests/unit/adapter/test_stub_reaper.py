"""The stub's reaper process (model_repository/llm/1/lifecycle.py), on stand-in processes: it kills its "stub" with
SIGKILL once the stub's parent is gone, and ends by itself, killing nothing, when the stub ends first."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "model_repository" / "llm" / "1"))
from lifecycle import start_reaper  # noqa: E402

# a stand-in for tritonserver: starts a long sleep (the stand-in stub) and prints its pid
PARENT = ("import subprocess, sys, time\n"
          "stub = subprocess.Popen(['sleep', '60'])\n"
          "print(stub.pid, flush=True)\n"
          "time.sleep(60)\n")


def _state(pid: int) -> str | None:
    """The process's state letter (Z for a zombie), or None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _alive(pid: int) -> bool:
    return _state(pid) not in (None, "Z")


def test_reaper_kills_the_stub_once_its_parent_is_gone():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    stub_pid = int(parent.stdout.readline())
    reaper = start_reaper(stub_pid, parent.pid)
    try:
        time.sleep(0.6)  # several of the reaper's polls: a parent that lives keeps its stub
        assert _alive(stub_pid) and reaper.poll() is None
        parent.kill()  # like kill -9 of tritonserver alone: the stub is re-parented
        parent.wait()
        assert _wait_until(lambda: not _alive(stub_pid), 5), "the reaper did not kill the orphaned stub"
        assert reaper.wait(5) == 0
    finally:
        if _alive(stub_pid):
            os.kill(stub_pid, signal.SIGKILL)
        parent.kill()
        reaper.kill()


def test_reaper_ends_by_itself_when_the_stub_ends_first():
    stub = subprocess.Popen(["sleep", "60"])
    bystander = subprocess.Popen(["sleep", "60"])
    reaper = start_reaper(stub.pid, os.getpid())
    try:
        time.sleep(0.3)
        assert reaper.poll() is None  # the stub lives and its parent is this process: the reaper waits
        stub.kill()
        stub.wait()  # reaped: its /proc entry is gone
        assert reaper.wait(5) == 0
        assert _alive(bystander.pid)
    finally:
        for proc in (stub, bystander, reaper):
            proc.kill()
            proc.wait()


def test_reaper_of_a_pid_that_does_not_exist_ends_at_once():
    stub = subprocess.Popen(["true"])
    stub.wait()
    reaper = start_reaper(stub.pid, os.getpid())
    assert reaper.wait(5) == 0
