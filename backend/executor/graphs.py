"""CUDA graphs for steps: one per bucket and slot, all drawing on one memory pool.

A decode graph holds carry-over + forward + logits + the greedy pick for a bucket of one-token rows. A mixed graph
holds carry-over + forward + logits for a bucket of up to 8,192 tokens: prefill chunks beside decode rows, every
sequence slot of the layout present (the ones the step leaves empty have no tokens), so the step's token count picks
the graph and nothing else. Its attention kernel finds each program's sequence on the device, so the varying query lengths of a
mixed step need no host value at capture time. Where a step's rows may take drafted tokens (speculation: more logits rows
than sequences), a verify graph holds the same body for each token bucket above the sequence limit with logits at
every token, up to the layout's rows: a drafted step replays the mixed graph of its token count when that graph's
logits cover its rows, else this one. Where the ops have a fused sampler, each decode bucket also has two
sampler graphs, replayed after the decode or mixed graph by steps that sample: one with top-k's passes, one without
for steps in which no row has top-k.

Graphs read their slot's device inputs and the other slot's sampled tokens at fixed addresses, and write logits (model
dtype) into one buffer outside the pool, so each graph's intermediates can be freed back to the shared pool after
capture: N and N+1 never run at once, so the two slots' graphs cost about one graph's memory.

Without CUDA the same object runs each "replay" eagerly (graphs as no-ops), with one decode bucket per batch size so
no padding rows are computed: CI exercises the decode-graph step (carry-over inside the body, the greedy pick as the
final token) on the CPU, and with the Triton ops under the interpreter also the mixed body with its padding tokens.
"""
from __future__ import annotations

import bisect
from typing import Callable

import torch

from backend.executor.graph_idle import Replay, measure_graph_idle
from backend.models.spec import ModelSpec

# (slot, previous slot, bucket, block-table width, longest context, logits buffer or None) → logits (bucket, V)
DecodeForward = Callable[..., torch.Tensor]
# (slot, previous slot, token bucket, logits rows, logits buffer or None) → logits (rows, V)
MixedForward = Callable[..., torch.Tensor]
# (slot, bucket, logits (bucket, V), top-k passes or not): sample every row into the slot's outputs, settings read
# from its buffers
SampleBody = Callable[..., None]

_BUCKETS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512]
# token buckets of mixed steps, up to the 8,192 tokens a step may hold. An eager step, even one whose GPU time is
# milliseconds, leaves the GPU idle while Python launches its kernels (the 1B mix lost 0.36-0.42 of its wall there);
# padding a step up to the next of these buckets cost the 8B mix nothing measurable (docs/benchmarks.md)
_TOKEN_BUCKETS = [16, 32, 64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1536, 2048, 3072, 4096, 6144,
                  8192]


class DecodeGraphs:
    """Captured step graphs keyed by (slot, bucket): decode, mixed (by tokens) and the sampler's."""

    def __init__(self, forward: DecodeForward, pipeline, device: torch.device, layout, block_size: int,
                 spec: ModelSpec, max_graph_batch: int, sample: SampleBody | None = None,
                 mixed: MixedForward | None = None) -> None:
        self.forward = forward
        self.sample = sample
        self.mixed = mixed
        self.block_size = block_size
        self.pipeline = pipeline
        self.device = device
        self.layout = layout
        self.eager = device.type != "cuda"
        limit = min(max_graph_batch, layout.max_seqs, layout.max_tokens)
        self.buckets = list(range(1, limit + 1)) if self.eager else [b for b in _BUCKETS if b <= limit]
        if not self.buckets or self.buckets[-1] < limit:
            self.buckets.append(limit)
        self.token_buckets: list[int] = []
        if mixed is not None:
            top = min(layout.max_tokens, _TOKEN_BUCKETS[-1])
            self.token_buckets = [b for b in _TOKEN_BUCKETS if b < top] + [top]
        # token buckets whose mixed graph computes fewer logits rows than a drafted step of that many tokens may need
        self.verify_buckets = self._verify_buckets(layout) if mixed is not None else []
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.verify_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.mixed_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.sampler_graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}  # (slot, bucket, top-k)
        self.samples = sample is not None and not self.eager  # sampled steps replay a sampler graph
        self.memory: dict[str, int] = {}
        # seconds of idle inside one replay of each graph, by graph_idle.py's keys; None: not measured
        self.idle: dict[tuple, float] | None = None
        if self.eager:
            return
        self.pool = torch.cuda.graph_pool_handle()
        # the LM head writes here, outside the pool, in the model's dtype: read by the sampler
        rows = max([self.buckets[-1]] + [self.logits_rows(t) for t in self.token_buckets]
                   + [self.verify_rows(t) for t in self.verify_buckets])
        self.logits = torch.empty(rows, spec.vocab_size, dtype=spec.dtype, device=device)

    def bucket_for(self, batch_size: int) -> int | None:
        i = bisect.bisect_left(self.buckets, batch_size)
        return self.buckets[i] if i < len(self.buckets) else None

    def token_bucket_for(self, num_tokens: int) -> int | None:
        """The mixed graph for a step of num_tokens tokens; None: no mixed graphs, or too many tokens."""
        i = bisect.bisect_left(self.token_buckets, num_tokens)
        return self.token_buckets[i] if i < len(self.token_buckets) else None

    def logits_rows(self, token_bucket: int) -> int:
        """Rows a mixed graph computes logits for: every sampled row of any step of that many tokens."""
        return min(token_bucket, self.layout.max_seqs)

    def verify_rows(self, token_bucket: int) -> int:
        """Rows a verify graph computes logits for: every token, up to the layout's rows."""
        return min(token_bucket, self.layout.max_rows)

    def _verify_buckets(self, layout) -> list[int]:
        """Token buckets above the sequence limit, up to the first that holds the layout's rows: a drafted step of
        more tokens has prefill chunks among them and runs eagerly."""
        if layout.max_rows <= layout.max_seqs:
            return []
        top = self.token_bucket_for(layout.max_rows)
        return [t for t in self.token_buckets if layout.max_seqs < t <= (top or self.token_buckets[-1])]

    def verify_bucket_for(self, num_tokens: int, num_rows: int) -> tuple[str, int] | None:
        """The graph for a drafted step of num_tokens tokens and num_rows logits rows: ("mixed", bucket) or
        ("verify", bucket); None: no graph holds it (it runs eagerly)."""
        tokens = self.token_bucket_for(num_tokens)
        if tokens is None:
            return None
        if num_rows <= self.logits_rows(tokens):
            return "mixed", tokens
        return ("verify", tokens) if tokens in self.verify_buckets and num_rows <= self.verify_rows(tokens) else None

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
            for tokens in reversed(self.token_buckets):
                self._capture_mixed(slot, pipe.other(slot), tokens)
            for tokens in reversed(self.verify_buckets):
                self._capture_verify(slot, pipe.other(slot), tokens)
            self._prepare(slot)
            for bucket in reversed(self.buckets):
                self._capture(slot, pipe.other(slot), bucket)
            # why: the pool's size after each slot is read once that slot's captures are all done
            torch.cuda.synchronize(self.device)
            self.memory[f"after_slot{slot.index}"] = torch.cuda.memory_reserved(self.device) - base

    def measure_idle(self) -> None:
        """Measure each graph's idle time once (graph_idle.py), replaying slot 0's graphs on harmless inputs: both
        slots' graphs of a key are the same kernels."""
        if self.eager:
            return
        slot = self.pipeline.slots[0]
        decode = lambda: self._prepare(slot)  # noqa: E731 - the decode and sampler graphs' inputs
        replays: list[Replay] = []
        for bucket in self.buckets:
            replays.append((("decode", bucket), decode, self.graphs[(0, bucket)].replay))
            if self.samples:
                for top_k in (True, False):
                    replays.append((("sampler", bucket, top_k), decode,
                                    self.sampler_graphs[(0, bucket, top_k)].replay))
        for tokens in self.token_buckets:
            replays.append((("mixed", tokens), lambda t=tokens: self._prepare(slot, t),
                            self.mixed_graphs[(0, tokens)].replay))
        for tokens in self.verify_buckets:
            replays.append((("verify", tokens), lambda t=tokens: self._prepare(slot, t),
                            self.verify_graphs[(0, tokens)].replay))
        self.idle = measure_graph_idle(replays, self.pipeline.compute_stream)
        self._prepare(slot)

    def idle_of(self, key: tuple) -> float | None:
        """Idle seconds inside one replay of the graph key names; None when not measured."""
        return None if self.idle is None else self.idle.get(key)

    def _prepare(self, slot, num_tokens: int | None = None) -> None:
        """Harmless inputs for warm-up and capture: one-token sequences in the null block (with num_tokens, a mixed
        bucket's: the sequences past its tokens are empty)."""
        d = slot.dev
        d["input_ids"].zero_()
        d["positions"].zero_()
        d["slot_mapping"].zero_()
        d["carry_src"].fill_(-1)
        d["seq_lens"].fill_(1)
        d["block_tables"].zero_()
        starts = torch.arange(d["query_start_loc"].numel(), dtype=torch.int32)
        d["query_start_loc"].copy_(starts if num_tokens is None else starts.clamp(max=num_tokens))
        d["logits_idx"].copy_(torch.arange(d["logits_idx"].numel()))

    def _body(self, slot, prev_slot, bucket: int, width: int | None = None, max_len: int | None = None
              ) -> torch.Tensor:
        """Carry-over, forward, logits, greedy pick; fixed shapes (the whole block table) unless given."""
        width = width or self.layout.max_blocks
        return self.forward(slot, prev_slot, bucket, width, max_len or width * self.block_size,
                            None if self.eager else self.logits[:bucket])

    def _mixed_body(self, slot, prev_slot, tokens: int, rows: int | None = None) -> torch.Tensor:
        rows = rows or self.logits_rows(tokens)
        return self.mixed(slot, prev_slot, tokens, rows, None if self.eager else self.logits[:rows])

    def _record(self, body: Callable[[], object]) -> torch.cuda.CUDAGraph:
        """Warm body up on the compute stream (kernels compiled and autotuned), then capture it."""
        stream = self.pipeline.compute_stream
        with torch.cuda.stream(stream):
            body()
        # why: capture must start from a quiet stream so no earlier work is recorded into the graph
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            body()
        return graph

    def _capture(self, slot, prev_slot, bucket: int) -> None:
        self.graphs[(slot.index, bucket)] = self._record(lambda: self._body(slot, prev_slot, bucket))
        if self.samples:
            # the fused sampler over this bucket's logits as its own small graph: a greedy step replays the decode
            # graph alone, a sampled one this graph after it (top-k's four radix passes only where a row has top-k)
            for top_k in (True, False):
                self.sampler_graphs[(slot.index, bucket, top_k)] = self._record(
                    lambda: self.sample(slot, bucket, self.logits[:bucket], top_k))

    def _capture_mixed(self, slot, prev_slot, tokens: int) -> None:
        self._prepare(slot, tokens)
        self.mixed_graphs[(slot.index, tokens)] = self._record(lambda: self._mixed_body(slot, prev_slot, tokens))

    def _capture_verify(self, slot, prev_slot, tokens: int) -> None:
        self._prepare(slot, tokens)
        rows = self.verify_rows(tokens)
        self.verify_graphs[(slot.index, tokens)] = self._record(
            lambda: self._mixed_body(slot, prev_slot, tokens, rows))

    def has_sampler(self, slot, bucket: int) -> bool:
        return (slot.index, bucket, True) in self.sampler_graphs

    def replay_sampler(self, slot, bucket: int, top_k: bool) -> None:
        """Replay the sampler graph of (slot, bucket) on the current (compute) stream, after the step's graph;
        top_k=False: the one without top-k's passes, for steps where no row has top-k."""
        self.sampler_graphs[(slot.index, bucket, top_k)].replay()

    def replay(self, slot, bucket: int, width: int, max_len: int) -> torch.Tensor:
        """Replay on the current (compute) stream; returns the (bucket, V) logits.

        A captured graph reads the whole block table; the eager body on the CPU only `width` columns."""
        if self.eager:
            return self._body(slot, self.pipeline.other(slot), bucket, width, max_len)
        self.graphs[(slot.index, bucket)].replay()
        return self.logits[:bucket]

    def replay_mixed(self, slot, tokens: int) -> torch.Tensor:
        """Replay the mixed graph of (slot, token bucket); returns the (logits_rows(tokens), V) logits."""
        if self.eager:
            return self._mixed_body(slot, self.pipeline.other(slot), tokens)
        self.mixed_graphs[(slot.index, tokens)].replay()
        return self.logits[:self.logits_rows(tokens)]

    def verify_logits_rows(self, graph: tuple[str, int]) -> int:
        """Logits rows the graph verify_bucket_for chose computes."""
        kind, tokens = graph
        return self.logits_rows(tokens) if kind == "mixed" else self.verify_rows(tokens)

    def replay_verify(self, slot, graph: tuple[str, int]) -> torch.Tensor:
        """Replay the graph verify_bucket_for chose for (slot, its token bucket); returns its logits (rows, V)."""
        kind, tokens = graph
        if kind == "mixed":
            return self.replay_mixed(slot, tokens)
        rows = self.verify_logits_rows(graph)
        if self.eager:
            return self._mixed_body(slot, self.pipeline.other(slot), tokens, rows)
        self.verify_graphs[(slot.index, tokens)].replay()
        return self.logits[:rows]
