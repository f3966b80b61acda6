"""The Engine: a background loop thread that schedules, launches and reads steps one ahead of the GPU."""
from __future__ import annotations

import queue
import sys
import threading
from typing import Sequence

import torch

from backend.config import EngineConfig
from backend.engine_inbox import EngineInbox
from backend.engine_loop import EngineLoop
from backend.engine_setup import EngineParts, build_engine_parts
from backend.engine_stats import EngineStats
from backend.outputs.processor import OutputProcessor, RequestStream
from backend.request import FINISH_ABORT, FINISH_STOP, Request, RequestOutput, SamplingParams
from backend.request_intake import RequestIntake
from backend.request_registry import EngineOverloaded
from backend.runtime.gc_pauses import GcPauses, GcSettings
from backend.runtime.loop_gate import LoopGate
from backend.speculative.proposer import make_proposer
from backend.speculative.speculator import Speculator


__all__ = ["Engine", "EngineDead", "EngineOverloaded"]


class EngineDead(RuntimeError):
    """The engine loop has stopped; no new requests are accepted."""


# 1B served at 64 streams: 22.9k tok/s at 0.5 ms, 27.7k at 0.1 ms (docs/history/2026-11-29.md, 5aeec4e)
_SWITCH_INTERVAL_S = 0.0001


class Engine:
    """Continuous-batching LLM engine; thread-safe front, one background loop thread."""

    def __init__(self, config: EngineConfig | None = None, model=None, tokenizer=None) -> None:
        self.config = (config or EngineConfig()).validate()
        parts: EngineParts = build_engine_parts(self.config, model, tokenizer)
        self.parts = parts
        self.tokenizer = parts.tokenizer
        self.device = parts.device
        self.spec = parts.model.spec
        self.max_model_len = parts.max_model_len
        self.async_pipeline = parts.async_pipeline
        self.timeline = parts.timeline
        self.block_manager = parts.block_manager
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.intake = RequestIntake(self.config, self.tokenizer, self.spec, self.max_model_len, self.block_manager)
        if self.config.grammar_warmup:
            self.intake.prepare_grammars()
        self._inbox = EngineInbox()
        self._shut_down = False
        self.speculator = _speculator(self.config, parts)
        self._stats = EngineStats(self.scheduler, self.block_manager, self.timeline, self.speculator)
        # why: the loop thread hands the GIL back and forth with the output and sender threads; a short switch
        # interval keeps it from waiting up to 5 ms (Python's default) to get the GIL back after each CUDA wait
        sys.setswitchinterval(min(sys.getswitchinterval(), _SWITCH_INTERVAL_S))
        # why: collections stall the loop; they need not walk the model's start-up objects (gc_freeze), and
        # per-token objects die young if the young generation is collected less often (gc_young_threshold)
        GcSettings.engine_started(self.config.gc_freeze, self.config.gc_young_threshold)
        self.gc_pauses = GcPauses()  # counted from here: the freeze's own collection is start-up
        self.gate = LoopGate(enabled=self.device.type == "cuda" and self.config.loop_gate)
        self.outputs = OutputProcessor(self.tokenizer, self._on_stop_string, self.intake.ids.release, self.gate)
        self.loop = EngineLoop(parts, self.config.test_fault_every_n_steps, self._inbox, self.outputs, self.gate,
                               self._stats, self.speculator)
        self.updates = self.loop.updates
        self._thread = threading.Thread(target=self.loop.run, name="tandem-engine", daemon=True)
        self._thread.start()

    # ---- public API (any thread) -----------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self.loop.healthy and self._thread.is_alive() and not self.loop.stopping

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, sink=None, stream: bool = True) -> RequestStream | None:
        """Queue a request; returns a stream of its outputs, or None when a sink receives them.

        stream=False: only the final output is wanted; without stop strings or logprobs the loop then sends the
        output thread nothing per token (the final output carries first_token_time for latency figures)."""
        req, outputs = self._prepare(prompt, params, request_id, sink, stream_outputs=stream)
        self._inbox.add([req])
        return outputs

    def _prepare(self, prompt, params, request_id, sink, stream_outputs: bool = True
                 ) -> tuple[Request, RequestStream | None]:
        """Validate and register a request (caller thread); the loop learns of it from the inbox. With n > 1 the
        request returned is the first sample; the others wait in its forks for its prompt's KV blocks."""
        if not self.healthy:
            raise EngineDead("the engine is not running")
        params = params or SamplingParams()
        request_id = str(request_id) if request_id is not None else self.intake.new_id("req")
        samples = self.intake.samples(prompt, params, request_id, stream_outputs)
        stream = None
        if sink is None:
            stream = RequestStream(request_id, self, num_samples=params.n)
            sink = stream.queue
        for req in samples:
            self.outputs.register(req, sink, stream=stream_outputs)
        return samples[0], stream

    def yield_to_loop(self) -> None:
        """For a thread that answers the engine's outputs (e.g. a server's sender): let the loop's CPU work for the
        next step go first when it is waiting for the interpreter (a no-op without CUDA)."""
        self.gate.yield_to_loop()

    def flush_outputs(self, timeout: float = 5.0) -> bool:
        """Wait until every output the engine has produced so far has reached its request's sink."""
        return self.outputs.flush(timeout)

    def abort(self, request_id: str) -> None:
        """Stop a request; it gets a final output with finish_reason 'abort' (no-op if already done)."""
        self._inbox.abort(str(request_id), FINISH_ABORT)

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts to completion; outputs in the prompts' order (n > 1: the prompt's n samples in turn)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise ValueError("prompts must be a list of strings or a list of token-id lists")
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} sampling params for {len(prompts)} prompts")
        sink: queue.SimpleQueue = queue.SimpleQueue()
        reqs: list[Request] = []
        try:
            for prompt, p in zip(prompts, plist):
                # final outputs only: text is decoded once per request, not once per token
                reqs.append(self._prepare(prompt, p, self.intake.new_id("gen"), sink, stream_outputs=False)[0])
        except Exception:
            for req in reqs:
                for sample in (req, *req.forks):
                    self.outputs.discard(sample.request_id)
            raise
        self._inbox.add(reqs)  # all at once: they start in the same step
        # one final output per sample: n of them per prompt, in sample order
        keys = [(r.group_id, i) for r in reqs for i in range(r.params.n)]
        finals: dict[tuple[str, int], RequestOutput] = {}
        while len(finals) < len(keys):
            out = sink.get()
            if out.finished:
                finals[(out.request_id, out.index)] = out
        return [finals[key] for key in keys]

    def stats(self) -> dict:
        """Figures for metrics: queue sizes, KV usage, prefix hits, preemptions, busy fraction."""
        snap = self._stats.snapshot()
        snap.update(self.gc_pauses.snapshot())  # here, not in the loop's per-step refresh: read every 0.5 s
        snap["healthy"] = self.healthy
        return snap

    def set_timeline(self, enabled: bool) -> None:
        self._inbox.timeline(enabled)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop; every unfinished request gets a final output with finish_reason 'abort'.

        The model, KV cache and graphs are released, so another engine can take the device's memory.
        """
        if self._shut_down:
            return
        self._shut_down = True
        self.loop.stopping = True
        self._inbox.stop()
        self._thread.join(timeout)
        self.outputs.close()
        self.gc_pauses.close()
        # why: this engine's objects were frozen too; frozen cycles (and their tensors) never free
        GcSettings.engine_stopped(self.config.gc_freeze, self.config.gc_young_threshold)
        if not self._thread.is_alive():
            self.runner.release()
            self.parts.model = self.parts.draft = None
            if self.speculator is not None:
                self.speculator.release()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def _on_stop_string(self, request_id: str) -> None:
        """The output thread found a stop string: finish the request at the next schedule."""
        self._inbox.abort(request_id, FINISH_STOP)


def _speculator(config: EngineConfig, parts: EngineParts) -> Speculator | None:
    """The drafting side of speculative decoding where the config turns it on (its steps fit a slot's buffers)."""
    if not config.speculative_method:
        return None
    return Speculator(make_proposer(config.speculative_method, parts.draft), config.num_speculative_tokens,
                      parts.block_manager, config.max_num_batched_tokens, parts.runner.layout.max_rows,
                      config.speculative_adaptive)
