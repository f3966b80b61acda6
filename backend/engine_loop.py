"""The engine thread's loop: carry out the callers' commands, then schedule, pack and launch each step and complete
the one before it, one step ahead of the GPU; a step that raises fails its requests, not the server."""
from __future__ import annotations

import logging
import time

import torch

from backend.core.drafted_update import DraftedStepUpdater
from backend.core.scheduler import ScheduledBatch
from backend.core.step_update import StepUpdater
from backend.engine_inbox import EngineInbox
from backend.engine_setup import EngineParts, device_scope
from backend.engine_stats import EngineStats
from backend.executor.drafted_step import DraftedSteps
from backend.step_records import StepState
from backend.outputs.processor import OutputProcessor, StepEvent
from backend.request import FINISH_ABORT, FINISH_ERROR, Request, RequestStatus
from backend.request_registry import LiveRequests
from backend.runtime.loop_gate import LoopGate
from backend.speculative.speculator import Speculator, StepDrafts

log = logging.getLogger("tandem.engine")

_MAX_CONSECUTIVE_FAULTS = 3


class EngineLoop:
    """What the engine thread owns: the live requests, the step in flight, the fault count; engine thread only,
    except the stopping and healthy flags, which the front reads (and sets stopping to end the loop)."""

    def __init__(self, parts: EngineParts, fault_every: int, inbox: EngineInbox, outputs: OutputProcessor,
                 gate: LoopGate, stats: EngineStats, speculator: Speculator | None = None):
        self.scheduler, self.block_manager, self.runner = parts.scheduler, parts.block_manager, parts.runner
        self.timeline, self.device, self.async_pipeline = parts.timeline, parts.device, parts.async_pipeline
        self.updates = StepUpdater(self.scheduler, self.block_manager, parts.max_model_len)
        self.inbox, self.outputs, self.gate, self._stats = inbox, outputs, gate, stats
        self.live = LiveRequests()
        self.stopping = False
        self.healthy = True
        self.steps = 0
        self._inflight: StepState | None = None
        self._consecutive_faults = 0
        self._fault_every = fault_every
        self._fault_clock = 0  # scheduled steps, counted for the fault hook
        self.speculator = speculator
        self._watch_pending = False  # a drafted step's watching rows have yet to guess (Speculator.watch)
        if speculator is not None:
            self._drafted = DraftedSteps(self.runner)
            self._drafted_updates = DraftedStepUpdater(self.updates, speculator)

    def run(self) -> None:
        """The loop thread's body: until stopped, carry out commands and run steps; on the way out, fail what is left."""
        try:
            with torch.inference_mode(), device_scope(self.device):
                while not self.stopping:
                    idle = not self.scheduler.has_work() and self._inflight is None
                    if idle:
                        self.gate.open()  # why: waiting for work, helpers may have the GIL
                    self._drain_inbox(block=idle)
                    self.gate.close()
                    if self.stopping:
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
            self.healthy = False
        finally:
            self.gate.disable()
            self._fail_all("engine shut down", reason=FINISH_ABORT)

    def _step(self) -> bool:
        """Schedule, pack and launch the next step, and complete the one before; False when there was nothing."""
        rb = self.scheduler.batch
        if self.speculator is not None and self.speculator.due(self.steps, len(rb), rb.draftable_rows):
            return self._step_drafted()
        began = time.perf_counter()
        tl = self.timeline
        started = tl.now()
        batch = self.scheduler.schedule()
        cur = None
        if batch is not None:
            # an idle poll (every half second while nothing runs) is no step: its span would stretch the window the
            # timeline's busy figures divide by, over all the idle time since the last step
            tl.cpu_span_since("schedule", started)
            self._count_step_for_faults()
            with tl.cpu_span("pack"):
                cur = self.runner.pack(batch, self._inflight)
            with tl.cpu_span("launch"):
                self.runner.launch_forward(cur, self._inflight)
                if not cur.sample_after_previous:
                    self.runner.launch_sampling(cur)
            self.steps += 1
        prev, self._inflight, emitted = self._inflight, cur, 0
        if prev is not None:
            self._complete(prev, next_state=cur)
            emitted = len(prev.sampled)
        if cur is not None and cur.sample_after_previous:  # its per-row host work needed the step before's tokens
            with tl.cpu_span("launch"):
                self.runner.launch_sampling(cur, deferred=True)
        if not self.async_pipeline and cur is not None:
            self._inflight = None
            self._complete(cur, next_state=None)
            emitted += len(cur.sampled)
        if batch is None and prev is None:
            time.sleep(0.001)  # nothing could be scheduled (cannot happen with valid requests); don't spin
        elif self.speculator is not None and batch is not None:
            self._speculation_step_done(batch.num_rows, False, emitted, began)
        tl.next_step()
        self.refresh_stats()
        return batch is not None or prev is not None

    def _step_drafted(self) -> bool:
        """A step whose decode rows may carry drafts: the step in flight read first (a row's drafts follow its last
        token), then this one scheduled, drafted, packed, launched and read before the next is packed (a row's next
        input depends on the drafts it kept). Where no row had a draft after all, the step stays in flight and the
        next one carries over from it, as after any plain step."""
        began = time.perf_counter()
        prev, self._inflight, emitted = self._inflight, None, 0
        if prev is not None:
            self._complete(prev, next_state=None)
            emitted = len(prev.sampled)
        tl = self.timeline
        started = tl.now()
        batch = self.scheduler.schedule()
        if batch is None:
            if prev is None:
                time.sleep(0.001)
            tl.next_step()
            self.refresh_stats()
            return prev is not None
        tl.cpu_span_since("schedule", started)
        self._count_step_for_faults()
        cur, drafts = self._launch_drafted(batch)
        if self._watch_pending:  # the drafted step before's watching rows, while this one runs
            self._watch()
        if drafts is not None:
            emitted += self._complete_drafted(cur, drafts)
        elif self.async_pipeline:  # nothing drafted after all: a plain step, left in flight as any other
            self._inflight = cur
        else:
            self._complete(cur, next_state=None)
            emitted += len(cur.sampled)
        self._speculation_step_done(batch.num_rows, drafts is not None, emitted, began)
        tl.next_step()
        self.refresh_stats()
        return True

    def _launch_drafted(self, batch: ScheduledBatch) -> tuple[StepState, StepDrafts | None]:
        """Propose the scheduled step's drafts, pack it and queue it (widened by its drafts, or as a plain step where
        no row has any); the step and its drafts."""
        tl = self.timeline
        with tl.cpu_span("pack"):
            drafts = self.speculator.propose(batch, self.steps)
            cur = self.runner.pack(batch, None)
        with tl.cpu_span("launch"):
            if drafts is None:
                self.runner.launch_forward(cur, None)
                self.runner.launch_sampling(cur, deferred=cur.sample_after_previous)
            else:
                self._drafted.launch(cur, drafts)
        self.steps += 1
        return cur, drafts

    def _speculation_step_done(self, num_rows: int, drafted: bool, emitted: int, began: float) -> None:
        """A step's tokens applied: the draft policy hears what it gave, and the watching rows guess, their guesses
        checked (Speculator.watch). After a drafted step nothing runs on the GPU: they guess once the next step is
        queued, beside its GPU work."""
        self.speculator.step_done(self.steps, num_rows, drafted, emitted, time.perf_counter() - began)
        if drafted:
            self._watch_pending = True
        else:
            self._watch()

    def _watch(self) -> None:
        self._watch_pending = False
        rb = self.scheduler.batch
        self.speculator.watch(rb.requests, rb.draftable_rows, self.steps)

    def _count_step_for_faults(self) -> None:
        """The test hook: every fault_every-th scheduled step raises."""
        self._fault_clock += 1
        if self._fault_every and self._fault_clock % self._fault_every == 0:
            raise RuntimeError(f"injected fault at step {self._fault_clock} (test hook)")

    def _complete_drafted(self, st: StepState, drafts: StepDrafts) -> int:
        """Read and apply a drafted step; returns the tokens its rows emitted."""
        self.gate.open()  # why: blocked on the GPU next, helper threads may have the GIL meanwhile
        try:
            result = self._drafted.read(st, drafts)
        finally:
            self.gate.close()
        with self.timeline.cpu_span("update"):
            events, last, emitted = self._drafted_updates.apply(st, result, drafts, self._finish)
            self._drafted.leave_last_tokens(st, last)
            if events:
                self.outputs.push(events)
        return emitted

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
        self.live.forget(req)
        if self.speculator is not None:
            self.speculator.finished(req)

    def _drain_inbox(self, block: bool) -> None:
        """Carry out the callers' commands (waiting up to 0.5 s for one when block)."""
        for command in self.inbox.take(wait_s=0.5 if block else 0.0):
            if command.kind == "add":
                for req in command.requests:
                    self.live.add(req)
                    self.scheduler.add(req)  # the forks join the scheduler with their first sample's KV
            elif command.kind == "abort":  # a caller's id (every sample of it) or one sample's (its stop string)
                self._end_early(command.request_id, command.reason)
            elif command.kind == "timeline":
                if command.enabled:
                    self.timeline.enable()
                else:
                    self.timeline.disable()
            elif command.kind == "stop":
                self.stopping = True

    def _end_early(self, request_id: str, reason: str) -> None:
        for req in self.live.targets(request_id):
            self._finish(req, reason, self._inflight)
            self.outputs.push([StepEvent(req.request_id, None, None, reason, all_tokens=_tokens_if_final_only(req))])

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
            self.healthy = False
            self.stopping = True

    def _fail_all(self, message: str, reason: str = FINISH_ERROR) -> None:
        """Finish every known request with reason (error or abort) and return all KV blocks."""
        # the inbox first: a caller told of its request's end below may add the next request at once, and that one
        # came after the failure, so it must be served, not failed with it
        queued = [s for c in self.inbox.take() if c.kind == "add" for r in c.requests for s in (r, *r.forks)]
        for req in self.live.all():
            req.status = RequestStatus.FINISHED
            req.finish_reason = reason
            self.block_manager.free(req)
            self.outputs.push([StepEvent(req.request_id, None, None, reason, message, _tokens_if_final_only(req))])
        self.live.clear()
        self.scheduler.clear()
        if self.speculator is not None:
            self.speculator.forget_all()
        if queued:  # requests that were in the inbox were accepted too: answer them
            self.outputs.push([StepEvent(s.request_id, None, None, reason, message) for s in queued])
        self.refresh_stats()

    def refresh_stats(self) -> None:
        self._stats.refresh(self.steps)


def _tokens_if_final_only(req: Request) -> list[int] | None:
    """A final-only request's tokens so far, for a final event that ends it early (abort, error)."""
    return req.output_token_ids if req.final_only else None
