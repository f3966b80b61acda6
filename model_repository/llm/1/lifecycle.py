"""The stub's own watch over its life: it stops when tritonserver is gone, and drains when asked to.

A Python-backend stub is a child process of tritonserver. When tritonserver dies (OOM killer, a crash in a native
library, kill -9), nothing tells the stub, which would keep its engine and, on a GPU host, the GPU's memory. The
watch notices that the stub's parent changed (it was re-parented) and ends the process.

Triton gives a model no notice of a shutdown: after SIGTERM it waits up to --exit-timeout-secs for in-flight
requests, then exits under their feet. A launcher that knows (scripts/serve.py, the container's entrypoint) creates
the file named by TANDEM_DRAIN_FILE first; the watch sees it, and the model stops taking requests and gives the
streams still running after drain_timeout_s their final response, before Triton's own timeout cuts them.
"""
from __future__ import annotations

import os
import threading
from typing import Callable

DRAIN_FILE_ENV = "TANDEM_DRAIN_FILE"
_POLL_S = 0.5


class LifeWatch:
    """A daemon thread that calls on_orphaned() once the parent process is gone and on_drain() once the drain
    file exists."""

    def __init__(self, on_orphaned: Callable[[], None], on_drain: Callable[[], None]) -> None:
        self._parent = os.getppid()
        self._drain_file = os.environ.get(DRAIN_FILE_ENV) or None
        self._on_orphaned, self._on_drain = on_orphaned, on_drain
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tandem-lifewatch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        drained = False
        while not self._stop.wait(_POLL_S):
            if os.getppid() != self._parent:
                self._on_orphaned()
                return
            if not drained and self._drain_file is not None and os.path.exists(self._drain_file):
                drained = True
                self._on_drain()
