"""The stub's own watch over its life: it stops when tritonserver is gone, and drains when asked to.

A Python-backend stub is a child process of tritonserver. When tritonserver dies (OOM killer, a crash in a native
library, kill -9), nothing tells the stub, which would keep its engine and, on a GPU host, the GPU's memory. The
watch notices that the stub's parent changed (it was re-parented) and ends the process. It does so twice over:
- a thread here calls os._exit() at once, when it can run;
- a small shell process beside the stub (the reaper) kills it with SIGKILL. The python backend's own parent check
  (a C++ thread of the stub) tears the stub's objects down while our threads still run, and sometimes deadlocks there
  with every thread waiting on a lock, the thread here included (2 of 20 kill -9s of a streaming server on a loaded
  2-core machine, 2026-12-02 at c178c4a, the steps of test_killed_tritonserver_leaves_no_stub in a loop). A process
  outside the stub needs none of its locks.

Triton gives a model no notice of a shutdown: after SIGTERM it waits up to --exit-timeout-secs for in-flight
requests, then exits under their feet. A launcher that knows (scripts/serve.py, the container's entrypoint) creates
the file named by TANDEM_DRAIN_FILE first; the watch sees it, and the model stops taking requests and gives the
streams still running after drain_timeout_s their final response, before Triton's own timeout cuts them.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Callable

DRAIN_FILE_ENV = "TANDEM_DRAIN_FILE"
_POLL_S = 0.1  # a stop waits on the drain that this poll starts; two cheap checks per poll

# $1: the stub's pid, $2: its parent's (tritonserver's). /proc/<pid>/stat after the command name's ") ": field 3
# (state) is $1, field 4 (parent pid) is $2, field 22 (start time) is ${20}. A start time that changed means the stub
# is gone and another process has its pid: then nothing is killed.
REAPER_SCRIPT = r"""
stub=$1 parent=$2
read -r stat 2>/dev/null </proc/$stub/stat || exit 0
set -- ${stat##*) }
born=${20}
while :; do
  read -r stat 2>/dev/null </proc/$stub/stat || exit 0
  set -- ${stat##*) }
  [ "${20}" = "$born" ] || exit 0
  [ "$2" = "$parent" ] || break
  sleep 0.2
done
echo "tandem: tritonserver is gone; the reaper kills the model's stub (pid $stub)" >&2
kill -KILL $stub
"""


def start_reaper(stub_pid: int, parent_pid: int) -> subprocess.Popen | None:
    """A process that kills stub_pid with SIGKILL once it no longer has parent_pid as its parent; it ends by itself
    when the stub does. None where no /bin/sh can be started (the in-process watch still runs)."""
    try:
        return subprocess.Popen(["/bin/sh", "-c", REAPER_SCRIPT, "tandem-reaper", str(stub_pid), str(parent_pid)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, close_fds=True)
    except OSError as err:
        print(f"tandem: no reaper process for the stub ({err}); only its own thread watches for a lost server",
              file=sys.stderr, flush=True)
        return None


class LifeWatch:
    """A daemon thread that calls on_orphaned() once the parent process is gone and on_drain() once the drain
    file exists, and a reaper process that kills the stub should that thread be stuck."""

    def __init__(self, on_orphaned: Callable[[], None], on_drain: Callable[[], None]) -> None:
        self._parent = os.getppid()
        self._drain_file = os.environ.get(DRAIN_FILE_ENV) or None
        self._on_orphaned, self._on_drain = on_orphaned, on_drain
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tandem-lifewatch", daemon=True)
        self._reaper: subprocess.Popen | None = None

    def start(self) -> None:
        self._reaper = start_reaper(os.getpid(), self._parent)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._reaper is not None:  # an orderly unload: the stub's end is Triton's to make
            self._reaper.kill()
            self._reaper.wait()
            self._reaper = None

    def _run(self) -> None:
        drained = False
        while not self._stop.wait(_POLL_S):
            if os.getppid() != self._parent:
                self._on_orphaned()
                return
            if not drained and self._drain_file is not None and os.path.exists(self._drain_file):
                drained = True
                self._on_drain()
