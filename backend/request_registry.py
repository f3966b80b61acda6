"""Which requests exist: the callers' ids and the bound on requests in flight (any thread), and the live requests
with their n > 1 groups (the engine thread)."""
from __future__ import annotations

import threading

from backend.request import Request


class EngineOverloaded(RuntimeError):
    """The waiting queue is full: retry later."""


class RequestIds:
    """Ids in use, from a request's acceptance until its final output went out; thread-safe.

    Every live id maps to its caller's id: a request's own, or for n > 1 the id of each sample (`id#i`) and of the
    group. The count of samples in flight bounds the queue."""

    def __init__(self, limit: int, describe_limit: str):
        self._limit = limit
        self._describe_limit = describe_limit  # how the limit is made up, for the overload message
        self._lock = threading.Lock()
        self._active: dict[str, str] = {}
        self._live_samples: dict[str, int] = {}  # n > 1: samples of each caller id not released yet
        self._in_flight = 0

    @staticmethod
    def sample_ids(request_id: str, n: int) -> list[str]:
        return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]

    def reserve(self, request_id: str, n: int) -> list[str]:
        """Take request_id and its samples' ids; ValueError when one is in use, EngineOverloaded when full."""
        ids = self.sample_ids(request_id, n)
        with self._lock:
            taken = [i for i in {request_id, *ids} if i in self._active]
            if taken:
                raise ValueError(f"request_id {taken[0]!r} is already in use")
            if self._in_flight + n > self._limit:
                raise EngineOverloaded(f"{self._in_flight} requests in flight (limit {self._describe_limit}); "
                                       "retry later")
            self._active.update({i: request_id for i in (request_id, *ids)})
            if n > 1:
                self._live_samples[request_id] = n
            self._in_flight += n
        return ids

    def release(self, sample_id: str) -> None:
        """A sample's final output went out: its id is free, and its caller's once every sample of it is."""
        with self._lock:
            group = self._active.pop(sample_id, None)
            if group is None:
                return
            self._in_flight -= 1
            if group != sample_id:
                left = self._live_samples[group] - 1
                if left:
                    self._live_samples[group] = left
                else:
                    del self._live_samples[group]
                    self._active.pop(group, None)


class LiveRequests:
    """The requests the engine loop knows, by sample id, and each n > 1 group's samples; engine thread only."""

    def __init__(self) -> None:
        self._by_id: dict[str, Request] = {}
        self._groups: dict[str, list[Request]] = {}

    def add(self, req: Request) -> None:
        """A request and its forks (the other samples of its group, which share its prompt's KV blocks)."""
        for sample in (req, *req.forks):
            self._by_id[sample.request_id] = sample
        if req.forks:
            self._groups[req.group_id] = [req, *req.forks]

    def targets(self, request_id: str) -> list[Request]:
        """The unfinished requests an abort of request_id ends: a caller's id (every sample) or one sample's."""
        group = self._groups.get(request_id)
        found = group if group is not None else [self._by_id.get(request_id)]
        return [req for req in found if req is not None and not req.is_finished]

    def forget(self, req: Request) -> None:
        """req finished; its group goes with its last sample."""
        self._by_id.pop(req.request_id, None)
        group = self._groups.get(req.group_id)
        if group is not None and all(r.is_finished for r in group):
            del self._groups[req.group_id]

    def all(self) -> list[Request]:
        return list(self._by_id.values())

    def clear(self) -> None:
        self._by_id.clear()
        self._groups.clear()
