"""Fold a stream of chunks into one Result, timing the first token and the end."""
from __future__ import annotations

import time

from tandem_client.schema import Chunk, Result


class Collector:
    """Accumulates chunks as they arrive; `result()` gives the answer so far."""

    def __init__(self, start: float | None = None, clock=time.perf_counter):
        self._clock = clock
        self.start = clock() if start is None else start
        self._parts: list[str] = []
        self._result = Result()

    def add(self, chunk: Chunk) -> None:
        now = self._clock() - self.start
        r = self._result
        r.responses += 1
        tokens = chunk.tokens()
        if r.ttft_s is None and (tokens > 0 or chunk.text):
            r.ttft_s = now  # first response that carries output, not an empty header or final marker
        r.num_output_tokens += tokens
        self._parts.append(chunk.text)
        if chunk.finish_reason is not None:
            r.finish_reason = chunk.finish_reason
        if chunk.num_input_tokens is not None:
            r.num_input_tokens = chunk.num_input_tokens
        r.e2e_s = now

    def result(self) -> Result:
        self._result.text = "".join(self._parts)
        return self._result
