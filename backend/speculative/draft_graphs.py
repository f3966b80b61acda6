"""CUDA graphs of the draft model's fixed-shape step (backend/speculative/draft_model.py), one per batch bucket, in a
memory pool of their own and on a stream of their own; without CUDA the same body runs eagerly, so CI runs what the
graphs hold."""
from __future__ import annotations

import bisect
from typing import Callable

import torch

_BUCKETS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512]

# (rows, block-table columns, longest context): runs the step over the first `rows` rows of the static inputs
DraftBody = Callable[[int, int, int], None]


class DraftGraphs:
    """Replays the captured step of the smallest bucket that holds a step's rows (the inputs past them harmless)."""

    def __init__(self, body: DraftBody, device: torch.device, max_rows: int, max_columns: int,
                 block_size: int) -> None:
        self.body = body
        self.eager = device.type != "cuda"
        self.buckets = [b for b in _BUCKETS if b < max_rows] + [max_rows]
        self.max_columns, self.block_size = max_columns, block_size
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.stream = None if self.eager else torch.cuda.Stream(device)
        self.pool = None if self.eager else torch.cuda.graph_pool_handle()

    def bucket_for(self, rows: int) -> int:
        """The rows the step is run for: its own count without CUDA, else its bucket's."""
        return rows if self.eager else self.buckets[bisect.bisect_left(self.buckets, rows)]

    def capture_all(self) -> None:
        """Capture every bucket, largest first so the smaller ones reuse its pool memory; the inputs must be
        harmless (every row in the null block)."""
        if self.eager:
            return
        for bucket in reversed(self.buckets):
            with torch.cuda.stream(self.stream):
                self._run_body(bucket)  # warm-up: kernels compiled and tuned outside the capture
            # why: capture must start from a quiet stream so no earlier work is recorded into the graph
            self.stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                self._run_body(bucket)
            self.graphs[bucket] = graph

    def run(self, rows: int, columns: int, max_len: int) -> None:
        """The step over the first `rows` rows (their bucket's, padded); columns and max_len bound the eager body."""
        if self.eager:
            self.body(rows, columns, max_len)
        else:
            self.graphs[self.bucket_for(rows)].replay()

    def _run_body(self, bucket: int) -> None:
        self.body(bucket, self.max_columns, self.max_columns * self.block_size)
