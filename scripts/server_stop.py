"""Waiting for a tritonserver to stop, and ending it once its model's drain is over but Triton cannot finish.

Triton 24.10 (the nvidia-pytriton wheel's) waits at shutdown for clients that merely stay connected: for every open
HTTP connection (an idle keep-alive one too) before it unloads anything, and for a gRPC stream's request, which it
keeps until the client ends the stream and which keeps the model loaded. It then waits out --exit-timeout-secs with
nothing in flight and exits 1 (at times crashing in its exit, or hanging while the client stays). A gRPC stream
that carried no request does not hold the model, but Triton then hangs closing its gRPC endpoint until the client
leaves. The model's drain (model_repository/llm/1/drain.py) reports a held model per stub with a marker once every
request is answered and its engine is stopped; the launcher then ends the server (SIGKILL to its process group, and
the python backend's shared memory removed), as it does a server still running UNLOADED_GRACE_S after its stubs
exited, and reports a clean stop: 0.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

STUB_NAME = "triton_python_backend_stub"
HELD_MARKER = ".held."  # <drain file>.held.<stub pid>, written by model_repository/llm/1/drain.py
UNLOADED_GRACE_S = 1.5  # Triton exits within ~1 s of its last stub's exit (it checks its models once a second)
_POLL_S = 0.1


def group_stubs(pgid: int) -> dict[int, str]:
    """Live python-backend stubs in process group pgid (a server started by start_server leads its own group):
    pid → the shared-memory region named on its command line."""
    stubs = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # stat after the command name: state, ppid, pgrp, ...
        if fields[0] != "Z" and int(fields[2]) == pgid and argv and argv[0].endswith(STUB_NAME.encode()):
            stubs[int(entry.name)] = argv[2].decode(errors="replace") if len(argv) > 2 else ""
    return stubs


def held_markers(drain_file: Path) -> set[int]:
    """Stub pids whose drain reported a model Triton keeps loaded."""
    pids = set()
    for path in drain_file.parent.glob(drain_file.name + HELD_MARKER + "*"):
        suffix = path.name[len(drain_file.name + HELD_MARKER):]
        if suffix.isdigit():
            pids.add(int(suffix))
    return pids


def clear_drain_files(drain_file: Path) -> None:
    for path in [drain_file, *drain_file.parent.glob(drain_file.name + HELD_MARKER + "*")]:
        path.unlink(missing_ok=True)


def wait_for_exit(proc: subprocess.Popen, timeout: float | None = None) -> int | None:
    """proc's exit status; 0 once it was ended because, after a drain (request_drain), every one of its stubs
    reported its model held, or its stubs had all exited UNLOADED_GRACE_S earlier; None when timeout passes first."""
    drain_file = getattr(proc, "drain_file", None)
    deadline = None if timeout is None else time.monotonic() + timeout
    unloaded_since = None
    seen_stubs = False
    try:
        while True:
            try:
                return proc.wait(timeout=_POLL_S)
            except subprocess.TimeoutExpired:
                pass
            if deadline is not None and time.monotonic() >= deadline:
                return None
            if drain_file is None or not Path(drain_file).exists():
                continue  # no drain asked for: Triton's own stop (or none yet)
            stubs = group_stubs(proc.pid)
            seen_stubs = seen_stubs or bool(stubs)
            if stubs and set(stubs) <= held_markers(Path(drain_file)):
                _end(proc, stubs, "every request was answered and the model's engine stopped, but Triton keeps the "
                                  "model loaded while clients stay connected (HTTP keep-alive or gRPC streams)")
                return 0
            if stubs or not seen_stubs:
                unloaded_since = None
                continue
            unloaded_since = unloaded_since or time.monotonic()
            if time.monotonic() - unloaded_since >= UNLOADED_GRACE_S:
                _end(proc, {}, f"the model unloaded in order, but Triton has not exited {UNLOADED_GRACE_S:g} s later "
                               "(its gRPC endpoint waits for a client's open stream)")
                return 0
    finally:
        if drain_file is not None and proc.poll() is not None:
            clear_drain_files(Path(drain_file))


def _end(proc: subprocess.Popen, stubs: dict[int, str], why: str) -> None:
    """SIGKILL the server's process group, then remove the shared memory its python backend would have removed."""
    print(f"tandem: {why}: ending tritonserver (pid {proc.pid})", file=sys.stderr, flush=True)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    for region in stubs.values():
        if region and "/" not in region:
            Path("/dev/shm", region).unlink(missing_ok=True)
