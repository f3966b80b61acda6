"""The commands callers send the engine loop (add, abort, timeline, stop), queued for it to carry out in order."""
from __future__ import annotations

import queue
from typing import Iterator, NamedTuple

from backend.request import Request


class Command(NamedTuple):
    """One command: its kind and what it carries (requests to add; an id and a finish reason; a timeline flag)."""

    kind: str  # "add", "abort", "timeline" or "stop"
    requests: list[Request] = []
    request_id: str = ""
    reason: str = ""
    enabled: bool = False


class EngineInbox:
    """A thread-safe queue of Commands: any thread puts, the loop thread takes."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

    def add(self, requests: list[Request]) -> None:
        self._queue.put(Command("add", requests=requests))  # together: they start in the same step

    def abort(self, request_id: str, reason: str) -> None:
        self._queue.put(Command("abort", request_id=request_id, reason=reason))

    def timeline(self, enabled: bool) -> None:
        self._queue.put(Command("timeline", enabled=enabled))

    def stop(self) -> None:
        self._queue.put(Command("stop"))

    def take(self, wait_s: float = 0.0) -> Iterator[Command]:
        """Every command queued now, in order; first waiting up to wait_s for one when none is."""
        try:
            command = self._queue.get(timeout=wait_s) if wait_s > 0 else self._queue.get_nowait()
        except queue.Empty:
            return
        while True:
            yield command
            try:
                command = self._queue.get_nowait()
            except queue.Empty:
                return
