"""The shutdown drain: over as soon as no request is in flight (at drain_timeout_s the rest are stopped), then a
report to the launcher when Triton still keeps the model loaded.

Triton 24.10 waits at shutdown for clients that merely stay connected: its HTTP frontend waits for every open
connection (an idle keep-alive one too) before it unloads anything, and its gRPC frontend keeps a stream's request,
which refers to the model, until the client ends the stream. So a pooled HTTP client or a gRPC client that keeps
its stream open holds the model loaded with nothing in flight; Triton then waits out --exit-timeout-secs and exits
1 (at times crashing in its exit, or hanging while the client stays). An unheld model is finalized about a second
after its last request ends (the python backend checks the stub's health for 1 s first), so a drained model that
has not been finalized FINALIZE_WAIT_S later is held: the drain stops the engine in order and writes
<drain file>.held.<stub pid>, and the launcher (scripts/server_stop.py), once every stub of the server wrote one,
ends tritonserver itself.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Callable

HELD_MARKER = ".held."  # <drain file>.held.<stub pid>; scripts/server_stop.py reads the same name
FINALIZE_WAIT_S = 2.0  # after the drain; an unheld model is finalized ~1 s after its last request ends
ABORTED_ANSWER_WAIT_S = 5.0  # the stopped requests' final responses go out on the sender thread within ~0.2 s
_POLL_S = 0.05


def held_marker(drain_file: str, pid: int) -> str:
    return f"{drain_file}{HELD_MARKER}{pid}"


class Drain:
    """A thread that ends the drain once no request is in flight (stopping the rest at the deadline), then stops the
    engine and writes the held marker if Triton has not begun to finalize the model FINALIZE_WAIT_S later."""

    def __init__(self, in_flight: Callable[[], int], abort_all: Callable[[str], int],
                 stop_engine: Callable[[], bool], timeout_s: float, marker: str | None,
                 log: Callable[[str], None], finalize_wait_s: float = FINALIZE_WAIT_S) -> None:
        self._in_flight, self._abort_all, self._stop_engine = in_flight, abort_all, stop_engine
        self._timeout_s, self._marker, self._log, self._finalize_wait_s = timeout_s, marker, log, finalize_wait_s
        self._finalizing = threading.Event()
        self._over = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tandem-drain", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def finalizing(self) -> None:
        """Triton began to finalize the model: it is not held."""
        self._finalizing.set()

    def wait_over(self, timeout: float) -> bool:
        """True once no request is in flight (for tests)."""
        return self._over.wait(timeout)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        started = time.monotonic()
        deadline = started + self._timeout_s
        while self._in_flight() and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        if self._in_flight():
            stopped = self._abort_all("the server is shutting down: the request was stopped (finish_reason abort) "
                                      f"after the {self._timeout_s:g} s drain; retry on another replica")
            self._log(f"tandem: drain time over: {stopped} request(s) stopped")
            answered_by = time.monotonic() + ABORTED_ANSWER_WAIT_S
            while self._in_flight() and time.monotonic() < answered_by:
                time.sleep(_POLL_S)
        left = self._in_flight()
        self._log(f"tandem: drain over after {time.monotonic() - started:.2f} s: "
                  + (f"{left} request(s) still unanswered" if left else "no request in flight"))
        self._over.set()
        if self._finalizing.wait(self._finalize_wait_s) or self._marker is None:
            return
        # Triton keeps the model loaded (see the module docstring): stop the engine in order, then tell the launcher
        if not self._stop_engine():
            return  # finalize got there first
        try:
            with open(self._marker, "w") as f:
                f.write(f"{os.getpid()}\n")
        except OSError as err:
            self._log(f"tandem: could not write the held marker {self._marker} ({err}); Triton's exit timeout "
                      "will end the server")
            return
        self._log(f"tandem: Triton still keeps the model loaded {self._finalize_wait_s:g} s after the drain (clients "
                  "stay connected: HTTP keep-alive connections or gRPC streams): the engine is stopped; the launcher "
                  "ends the server")
