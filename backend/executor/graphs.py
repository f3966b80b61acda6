"""CUDA graphs for decode steps: one per batch-size bucket and slot, all drawing on one memory pool.

A graph holds carry-over + forward + logits + the greedy pick. It reads its slot's device inputs and the other slot's
sampled tokens at fixed addresses, and writes logits (model dtype) into one buffer outside the pool, so each graph's
intermediates can be freed back to the shared pool after capture: N and N+1 never run at once, so the
two slots' graphs cost about one graph's memory. Prefill and mixed steps run eagerly: their token counts
and query lengths vary every step, and they are a small share of a long generation's steps.

Without CUDA the same object runs each "replay" eagerly (graphs as no-ops), with one bucket per batch size so no
padding rows are computed: CI exercises the decode-graph step (carry-over inside the body, the greedy pick as the
final token) on the CPU.
"""
from __future__ import annotations

import bisect
from typing import Callable

import torch

from backend.models.spec import ModelSpec

# (slot, previous slot, bucket, block-table width, longest context, logits buffer or None) → logits (bucket, V)
DecodeForward = Callable[..., torch.Tensor]

_BUCKETS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512]


class DecodeGraphs:
    """Captured decode graphs keyed by (slot, bucket)."""

    def __init__(self, forward: DecodeForward, pipeline, device: torch.device, layout, block_size: int,
                 spec: ModelSpec, max_graph_batch: int) -> None:
        self.forward = forward
        self.block_size = block_size
        self.pipeline = pipeline
        self.device = device
        self.layout = layout
        self.eager = device.type != "cuda"
        limit = min(max_graph_batch, layout.max_seqs, layout.max_tokens)
        self.buckets = list(range(1, limit + 1)) if self.eager else [b for b in _BUCKETS if b <= limit]
        if not self.buckets or self.buckets[-1] < limit:
            self.buckets.append(limit)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.memory: dict[str, int] = {}
        if self.eager:
            return
        self.pool = torch.cuda.graph_pool_handle()
        # the LM head writes here, outside the pool, in the model's dtype: read by the eager sampler when one runs
        self.logits = torch.empty(self.buckets[-1], spec.vocab_size, dtype=spec.dtype, device=device)

    def bucket_for(self, batch_size: int) -> int | None:
        i = bisect.bisect_left(self.buckets, batch_size)
        return self.buckets[i] if i < len(self.buckets) else None

    def capture_all(self) -> None:
        """Capture every bucket for both slots, largest first so smaller graphs reuse its pool memory."""
        if self.eager:
            return
        pipe = self.pipeline
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_reserved(self.device)
        for slot in pipe.slots:
            self._prepare(slot)
        for slot in pipe.slots:
            for bucket in reversed(self.buckets):
                self._capture(slot, pipe.other(slot), bucket)
            # why: the pool's size after each slot is read once that slot's captures are all done
            torch.cuda.synchronize(self.device)
            self.memory[f"after_slot{slot.index}"] = torch.cuda.memory_reserved(self.device) - base

    def _prepare(self, slot) -> None:
        """Harmless inputs for warm-up and capture: every row a one-token sequence in the null block."""
        d = slot.dev
        d["input_ids"].zero_()
        d["positions"].zero_()
        d["slot_mapping"].zero_()
        d["carry_src"].fill_(-1)
        d["seq_lens"].fill_(1)
        d["block_tables"].zero_()
        d["query_start_loc"].copy_(torch.arange(d["query_start_loc"].numel(), dtype=torch.int32))
        d["logits_idx"].copy_(torch.arange(d["logits_idx"].numel()))

    def _body(self, slot, prev_slot, bucket: int, width: int | None = None, max_len: int | None = None
              ) -> torch.Tensor:
        """Carry-over, forward, logits, greedy pick; fixed shapes (the whole block table) unless given."""
        width = width or self.layout.max_blocks
        return self.forward(slot, prev_slot, bucket, width, max_len or width * self.block_size,
                            None if self.eager else self.logits[:bucket])

    def _capture(self, slot, prev_slot, bucket: int) -> None:
        stream = self.pipeline.compute_stream
        with torch.cuda.stream(stream):
            self._body(slot, prev_slot, bucket)  # warm-up: kernels compiled and autotuned before capture
        # why: capture must start from a quiet stream so no earlier work is recorded into the graph
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            self._body(slot, prev_slot, bucket)
        self.graphs[(slot.index, bucket)] = graph

    def replay(self, slot, bucket: int, width: int, max_len: int) -> torch.Tensor:
        """Replay on the current (compute) stream; returns the (bucket, V) logits.

        A captured graph reads the whole block table; the eager body on the CPU only `width` columns."""
        if self.eager:
            return self._body(slot, self.pipeline.other(slot), bucket, width, max_len)
        self.graphs[(slot.index, bucket)].replay()
        return self.logits[:bucket]
