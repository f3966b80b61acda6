"""The Engine: a background loop thread that schedules, launches and reads steps one ahead of the GPU."""
from __future__ import annotations

import itertools
import logging
import queue
import sys
import threading
import time
from typing import Sequence

import torch

from backend.admission import Admission
from backend.config import EngineConfig
from backend.core.step_update import StepUpdater
from backend.engine_setup import EngineParts, build_engine_parts, device_scope
from backend.executor.packer import StepState
from backend.outputs.processor import OutputProcessor, RequestStream, StepEvent
from backend.request import FINISH_ABORT, FINISH_ERROR, FINISH_STOP, Request, RequestOutput, \
    RequestStatus, SamplingParams
from backend.runtime.gc_pauses import GcPauses, GcSettings
from backend.runtime.loop_gate import LoopGate

log = logging.getLogger("tandem.engine")


class EngineOverloaded(RuntimeError):
    """The waiting queue is full: retry later."""


class EngineDead(RuntimeError):
    """The engine loop has stopped; no new requests are accepted."""


_MAX_CONSECUTIVE_FAULTS = 3
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
        self.updates = StepUpdater(self.scheduler, self.block_manager, self.max_model_len)
        self.admission = Admission(self.tokenizer, self.spec.vocab_size, self.max_model_len, self.config,
                                   self.block_manager.num_usable_blocks * self.block_manager.block_size)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._requests: dict[str, Request] = {}  # engine thread only
        self._ids_lock = threading.Lock()
        # every live id → its caller's id: a request's own id, or for n > 1 the id of each sample and of the group
        self._active_ids: dict[str, str] = {}
        self._live_samples: dict[str, int] = {}  # n > 1: samples of each caller id not released yet
        self._samples_in_flight = 0  # for the bounded queue (under _ids_lock)
        self._groups: dict[str, list[Request]] = {}  # n > 1: the caller's id → its samples (engine thread only)
        self._id_counter = itertools.count()
        self._stopping = False
        self._shut_down = False
        self._healthy = True
        self._consecutive_faults = 0
        self._inflight: StepState | None = None
        self._steps = 0
        self._fault_every = self.config.test_fault_every_n_steps
        self._fault_clock = 0  # scheduled steps, counted for the fault hook
        self._stats_snapshot: dict = {}
        # why: the loop thread hands the GIL back and forth with the output and sender threads; a short switch
        # interval keeps it from waiting up to 5 ms (Python's default) to get the GIL back after each CUDA wait
        sys.setswitchinterval(min(sys.getswitchinterval(), _SWITCH_INTERVAL_S))
        # why: collections stall the loop; they need not walk the model's start-up objects (gc_freeze), and
        # per-token objects die young if the young generation is collected less often (gc_young_threshold)
        GcSettings.engine_started(self.config.gc_freeze, self.config.gc_young_threshold)
        self.gc_pauses = GcPauses()  # counted from here: the freeze's own collection is start-up
        self.gate = LoopGate(enabled=self.device.type == "cuda" and self.config.loop_gate)
        self.outputs = OutputProcessor(self.tokenizer, self._on_stop_string, self._release_id, self.gate)
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        self._thread.start()

    # ---- public API (any thread) -----------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self._healthy and self._thread.is_alive() and not self._stopping

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, sink=None, stream: bool = True) -> RequestStream | None:
        """Queue a request; returns a stream of its outputs, or None when a sink receives them.

        stream=False: only the final output is wanted; without stop strings or logprobs the loop then sends the
        output thread nothing per token (the final output carries first_token_time for latency figures)."""
        req, outputs = self._prepare(prompt, params, request_id, sink, stream_outputs=stream)
        self._inbox.put(("add", [req]))
        return outputs

    def _prepare(self, prompt, params, request_id, sink, stream_outputs: bool = True
                 ) -> tuple[Request, RequestStream | None]:
        """Validate and register a request (caller thread); the loop learns of it from the inbox. With n > 1 the
        request returned is the first sample; the others wait in its forks for its prompt's KV blocks."""
        if not self.healthy:
            raise EngineDead("the engine is not running")
        params = params or SamplingParams()
        token_ids = self.admission.prompt_ids(prompt, params)
        bad_words = self.admission.bad_word_ids(params.bad_words)
        request_id = str(request_id) if request_id is not None else f"req-{next(self._id_counter)}"
        n = params.n
        ids = [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]
        with self._ids_lock:
            taken = [i for i in {request_id, *ids} if i in self._active_ids]
            if taken:
                raise ValueError(f"request_id {taken[0]!r} is already in use")
            limit = self.config.max_waiting_requests + self.config.max_num_seqs
            if self._samples_in_flight + n > limit:
                raise EngineOverloaded(
                    f"{self._samples_in_flight} requests in flight (limit {self.config.max_waiting_requests} "
                    f"waiting + {self.config.max_num_seqs} running); retry later")
            self._active_ids.update({i: request_id for i in (request_id, *ids)})
            if n > 1:
                self._live_samples[request_id] = n
            self._samples_in_flight += n
        eos = frozenset(self.spec.eos_token_ids)
        samples = []
        for index, sample_id in enumerate(ids):
            if params.seed is not None:
                seed = params.seed + index  # samples of one seeded request differ, and repeat run to run
            else:
                seed = (self.config.seed * 1_000_003 + hash(sample_id)) & 0x7FFFFFFF
            req = Request(sample_id, token_ids, params, seed, eos, group_id=request_id, sample_index=index,
                          bad_word_ids=bad_words)
            req.final_only = not stream_outputs and not params.stop and params.logprobs is None
            self.block_manager.prepare_prompt(req, like=samples[0] if samples else None)  # here, not in the loop
            samples.append(req)
        samples[0].forks = samples[1:]
        stream = None
        if sink is None:
            stream = RequestStream(request_id, self, num_samples=n)
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
        self._inbox.put(("abort", str(request_id), FINISH_ABORT))

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
                reqs.append(self._prepare(prompt, p, f"gen-{next(self._id_counter)}", sink, stream_outputs=False)[0])
        except Exception:
            for req in reqs:
                for sample in (req, *req.forks):
                    self.outputs.discard(sample.request_id)
            raise
        self._inbox.put(("add", reqs))  # all at once: they start in the same step
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
        snap = dict(self._stats_snapshot)
        snap.update(self.gc_pauses.snapshot())  # here, not in the loop's per-step refresh: read every 0.5 s
        snap["healthy"] = self.healthy
        return snap

    def set_timeline(self, enabled: bool) -> None:
        self._inbox.put(("timeline", enabled, None))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop; every unfinished request gets a final output with finish_reason 'abort'.

        The model, KV cache and graphs are released, so another engine can take the device's memory.
        """
        if self._shut_down:
            return
        self._shut_down = True
        self._stopping = True
        self._inbox.put(("stop", None, None))
        self._thread.join(timeout)
        self.outputs.close()
        self.gc_pauses.close()
        # why: this engine's objects were frozen too; frozen cycles (and their tensors) never free
        GcSettings.engine_stopped(self.config.gc_freeze, self.config.gc_young_threshold)
        if not self._thread.is_alive():
            self.runner.release()
            self.parts.model = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    # ---- engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            with torch.inference_mode(), device_scope(self.device):
                while not self._stopping:
                    idle = not self.scheduler.has_work() and self._inflight is None
                    if idle:
                        self.gate.open()  # why: waiting for work, helpers may have the GIL
                    self._drain_inbox(block=idle)
                    self.gate.close()
                    if self._stopping:
                        break
                    try:
                        if self._step():  # an idle tick proves nothing: only a step that did work clears faults
                            self._consecutive_faults = 0
                    except Exception as exc:  # a failed step fails its requests, not the server
                        self._recover(exc)
                self._drain_inflight()
        except BaseException as exc:  # the loop itself broke: nothing can be served any more
            log.exception("engine loop died")
            self._fail_all(f"engine loop died: {exc}")  # why first: a consumer that sees us unhealthy flushes these
            self._healthy = False
        finally:
            self.gate.disable()
            self._fail_all("engine shut down", reason=FINISH_ABORT)

    def _step(self) -> bool:
        """Schedule, pack and launch the next step, and complete the one before; False when there was nothing."""
        tl = self.timeline
        started = tl.now()
        batch = self.scheduler.schedule()
        cur = None
        if batch is not None:
            # an idle poll (every half second while nothing runs) is no step: its span would stretch the window the
            # timeline's busy figures divide by, over all the idle time since the last step
            tl.cpu_span_since("schedule", started)
            self._fault_clock += 1
            if self._fault_every and self._fault_clock % self._fault_every == 0:
                raise RuntimeError(f"injected fault at step {self._fault_clock} (test hook)")
            with tl.cpu_span("pack"):
                cur = self.runner.pack(batch, self._inflight)
            with tl.cpu_span("launch"):
                self.runner.launch(cur, self._inflight)
            self._steps += 1
        prev = self._inflight
        self._inflight = cur
        if prev is not None:
            self._complete(prev, next_state=cur)
        if not self.async_pipeline and cur is not None:
            self._inflight = None
            self._complete(cur, next_state=None)
        if batch is None and prev is None:
            time.sleep(0.001)  # nothing could be scheduled (cannot happen with valid requests); don't spin
        tl.next_step()
        self._refresh_stats()
        return batch is not None or prev is not None

    def _complete(self, st: StepState, next_state: StepState | None) -> None:
        self.gate.open()  # why: blocked on the GPU next, helper threads may have the GIL meanwhile
        try:
            result = self.runner.read(st)  # the one blocking call of a step
        finally:
            self.gate.close()
        with self.timeline.cpu_span("update"):
            events = self.updates.apply(st, result, next_state, self._finish)
            if events:
                self.outputs.push(events)

    def _finish(self, req: Request, reason: str, next_state: StepState | None) -> None:
        """Finish req once (the step update's rule), and forget it here."""
        self.updates.finish(req, reason, next_state)
        self._requests.pop(req.request_id, None)
        group = self._groups.get(req.group_id)
        if group is not None and all(r.is_finished for r in group):
            del self._groups[req.group_id]

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, a, b = item if len(item) == 3 else (item[0], item[1], None)
            if kind == "add":
                for req in a:
                    for sample in (req, *req.forks):  # the forks join the scheduler with their first sample's KV
                        self._requests[sample.request_id] = sample
                    if req.forks:
                        self._groups[req.group_id] = [req, *req.forks]
                    self.scheduler.add(req)
            elif kind == "abort":  # a caller's id (every sample of it) or one sample's (its stop string)
                group = self._groups.get(a)
                for req in group if group is not None else [self._requests.get(a)]:
                    if req is not None and not req.is_finished:
                        self._finish(req, b, self._inflight)
                        self.outputs.push([StepEvent(req.request_id, None, None, b,
                                                     all_tokens=_tokens_if_final_only(req))])
            elif kind == "timeline":
                if a:
                    self.timeline.enable()
                else:
                    self.timeline.disable()
            elif kind == "stop":
                self._stopping = True
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _on_stop_string(self, request_id: str) -> None:
        """The output thread found a stop string: finish the request at the next schedule."""
        self._inbox.put(("abort", request_id, FINISH_STOP))

    def _release_id(self, request_id: str) -> None:
        """A request's (or one sample's) final output went out: its id is free again, and its caller's once every
        sample of it is done."""
        with self._ids_lock:
            group = self._active_ids.pop(request_id, None)
            if group is None:
                return
            self._samples_in_flight -= 1
            if group != request_id:
                left = self._live_samples[group] - 1
                if left:
                    self._live_samples[group] = left
                else:
                    del self._live_samples[group]
                    self._active_ids.pop(group, None)

    def _drain_inflight(self) -> None:
        """Read the step still on the device before stopping, so its blocks are returned."""
        if self._inflight is not None:
            st, self._inflight = self._inflight, None
            try:
                self._complete(st, None)
            except Exception:
                log.exception("failed to read the last step")

    def _recover(self, exc: Exception) -> None:
        """A step raised: every in-flight request gets an error; state is reset for new requests."""
        log.error("engine step failed: %s", exc)
        self._consecutive_faults += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # why: no queued step may still touch buffers we reset
        self._inflight = None
        self.runner.reset_slots()
        self._fail_all(f"engine step failed: {exc}")
        if self._consecutive_faults >= _MAX_CONSECUTIVE_FAULTS:
            self._healthy = False
            self._stopping = True

    def _fail_all(self, message: str, reason: str = FINISH_ERROR) -> None:
        """Finish every known request with reason (error or abort) and return all KV blocks."""
        # the inbox first: a caller told of its request's end below may add the next request at once, and that one
        # came after the failure, so it must be served, not failed with it
        queued = []
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item[0] == "add":
                queued += [s for r in item[1] for s in (r, *r.forks)]
        for req in list(self._requests.values()):
            req.status = RequestStatus.FINISHED
            req.finish_reason = reason
            self.block_manager.free(req)
            self.outputs.push([StepEvent(req.request_id, None, None, reason, message, _tokens_if_final_only(req))])
        self._requests.clear()
        self._groups.clear()
        self.scheduler.clear()
        if queued:  # requests that were in the inbox were accepted too: answer them
            self.outputs.push([StepEvent(s.request_id, None, None, reason, message) for s in queued])
        self._refresh_stats()

    def _refresh_stats(self) -> None:
        bm, sch = self.block_manager, self.scheduler
        snap = {
            "running": len(sch.running),
            "waiting": len(sch.waiting),
            "kv_blocks_used": bm.num_used_blocks,
            "kv_blocks_total": bm.num_usable_blocks,
            "kv_usage": bm.usage(),
            "prefix_cache_queries": bm.prefix_queries,
            "prefix_cache_hits": bm.prefix_hits,
            "prefix_cache_hit_rate": bm.hit_rate(),
            "preemptions": sch.num_preemptions,
            "steps": self._steps,
            "steady_steps": sch.num_steady_steps,
        }
        if self.timeline.enabled and self._steps % 256 == 0 and self._steps:
            # O(1): a summary over 256 steps' spans (and resolving their events at once) stalled the loop for ms
            snap["gpu_busy_fraction"] = self.timeline.recent_busy_fraction()  # exact spans: kernel time
            snap["gpu_busy_uncertain_fraction"] = self.timeline.recent_uncertain_fraction()  # same 256 steps
        elif "gpu_busy_fraction" in self._stats_snapshot:
            for key in ("gpu_busy_fraction", "gpu_busy_uncertain_fraction"):
                snap[key] = self._stats_snapshot[key]
        self._stats_snapshot = snap


def _tokens_if_final_only(req: Request) -> list[int] | None:
    """A final-only request's tokens so far, for a final event that ends it early (abort, error)."""
    return req.output_token_ids if req.final_only else None
