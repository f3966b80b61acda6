"""scripts/server_stop.py on stand-in processes: a "tritonserver" (a Python process leading its own process group)
with a "stub" (a Python process whose command line reads like a python-backend stub's). Once a drain was asked for,
a server whose every stub wrote its held marker is ended at once (its stubs' shared memory removed) and the stop is
0; a server whose stubs all exited is ended after UNLOADED_GRACE_S; otherwise the server's own exit status counts."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from scripts import server_stop

# the stand-in server: starts its stub (argv[0] and argv[2] as a real stub's: its path, then its shared memory
# region), prints the stub's pid, then lives for its first argument's seconds and exits 3
SERVER = ("import subprocess, sys, time\n"
          "stub = subprocess.Popen([sys.argv[2], sys.argv[3], sys.argv[4]], executable=sys.executable)\n"
          "print(stub.pid, flush=True)\n"
          "time.sleep(float(sys.argv[1]))\n"
          "sys.exit(3)\n")


@pytest.fixture
def stand_in(tmp_path):
    """start(server_s, stub_s) → (server process with drain_file set, stub pid, its shm region path)."""
    started: list[subprocess.Popen] = []

    def start(server_s: float, stub_s: float):
        stub_code = tmp_path / "model.py"
        stub_code.write_text(f"import time\ntime.sleep({stub_s})\n")
        region = f"tandem-test-region-{uuid.uuid4().hex}"
        shm = Path("/dev/shm", region)
        shm.write_bytes(b"\0" * 16)
        proc = subprocess.Popen([sys.executable, "-c", SERVER, str(server_s), str(tmp_path / server_stop.STUB_NAME),
                                 str(stub_code), region], stdout=subprocess.PIPE, text=True, start_new_session=True)
        started.append(proc)
        proc.drain_file = tmp_path / "drain"
        stub_pid = int(proc.stdout.readline())
        deadline = time.monotonic() + 10
        while server_stop.group_stubs(proc.pid) != {stub_pid: region} and time.monotonic() < deadline:
            time.sleep(0.02)  # until the stub has exec'd: before, its command line is still the server's
        assert server_stop.group_stubs(proc.pid) == {stub_pid: region}
        return proc, stub_pid, shm

    yield start
    for proc in started:  # the server and its stub (which may outlive it)
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
        proc.wait()


def test_every_stub_held_ends_the_server_at_once_with_a_clean_status(stand_in):
    proc, stub_pid, shm = stand_in(60, 60)
    proc.drain_file.touch()
    Path(f"{proc.drain_file}{server_stop.HELD_MARKER}{stub_pid}").touch()
    started = time.monotonic()
    assert server_stop.wait_for_exit(proc, timeout=10) == 0
    assert time.monotonic() - started < 1.0
    assert proc.returncode == -9 and not shm.exists()
    assert not list(proc.drain_file.parent.glob("drain*"))  # the drain file and markers are cleared


def test_a_server_left_without_stubs_is_ended_after_the_grace(stand_in):
    proc, _, shm = stand_in(60, 0.2)
    proc.drain_file.touch()
    started = time.monotonic()
    assert server_stop.wait_for_exit(proc, timeout=10) == 0
    assert server_stop.UNLOADED_GRACE_S <= time.monotonic() - started < server_stop.UNLOADED_GRACE_S + 1.0
    assert proc.returncode == -9
    shm.unlink()  # a stub that exited removed nothing here: the stand-in's region stays for the test to remove


def test_without_a_drain_or_markers_the_servers_own_status_counts(stand_in):
    proc, _, shm = stand_in(0.5, 60)
    assert server_stop.wait_for_exit(proc, timeout=10) == 3  # no drain asked for: held markers are not looked at
    proc2, _, shm2 = stand_in(60, 60)
    proc2.drain_file.touch()  # a drain, but no stub reported its model held: Triton's own exit is waited for
    assert server_stop.wait_for_exit(proc2, timeout=1.0) is None and proc2.poll() is None
    for path in (shm, shm2):
        path.unlink()
