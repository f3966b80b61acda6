"""Turns the engine loop's token events into RequestOutputs, off the loop: detokenization, stop strings, sinks."""
from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from backend.outputs.detokenizer import IncrementalDetokenizer
from backend.runtime.loop_gate import LoopGate
from backend.request import FINISH_STOP, Request, RequestOutput

log = logging.getLogger("tandem.outputs")

_REQUESTS_PER_PASS = 8  # requests handled between two passes of the loop gate


@dataclass(slots=True)
class StepEvent:
    """One request's news from one step: a token, and/or the end of the request."""

    request_id: str
    token: int | None
    logprob: tuple[float, int, list[tuple[int, float]] | None] | None  # (logprob, rank, top-n pairs)
    finish_reason: str | None
    error: str | None = None
    all_tokens: list[int] | None = None  # a final-only request's final event: every output token
    invalid_request: bool = False  # the error is the request's own (its settings conflict), not the engine's


@dataclass(slots=True)
class _OutputState:
    """What the output thread keeps per live request."""

    request: Request
    sink: Any
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] | None = None
    text: str = ""
    final_only: bool = False  # the caller wants the final output only: decode once, at the end
    released: bool = False  # its final output went out


_PLAIN = StepEvent("", None, None, None)  # the last event of a group of plain tokens: not finished, no error


@dataclass(slots=True)
class _Staged:
    """A request's events of one batch, staged: where its new tokens and logprobs start, and its last event."""

    state: _OutputState
    last: StepEvent
    first_token: int
    first_logprob: int
    has_tokens: bool = False
    needs: bool = False  # there is new text to decode


def _by_request(events: list[StepEvent]) -> dict[str, list]:
    """A batch's events grouped by request, in arrival order; plain tokens stay (request_id, token) tuples (no
    StepEvent per token)."""
    groups: dict[str, list] = {}
    for ev in events:
        rid = ev[0] if type(ev) is tuple else ev.request_id
        group = groups.get(rid)
        if group is None:
            groups[rid] = [ev]
        else:
            group.append(ev)
    return groups


class OutputProcessor:
    """A worker thread that detokenizes, applies stop strings and delivers outputs to each request's sink."""

    def __init__(self, tokenizer, on_stop_string: Callable[[str], None], on_released: Callable[[str], None],
                 gate: LoopGate | None = None):
        self.tokenizer = tokenizer
        self._gate = gate or LoopGate(enabled=False)
        self._on_stop_string = on_stop_string
        self._on_released = on_released
        self._states: dict[str, _OutputState] = {}
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="tandem-outputs", daemon=True)
        self._thread.start()

    def register(self, req: Request, sink, stream: bool = True) -> None:
        """stream=False: only the final output is delivered, so (without stop strings) nothing is decoded per step."""
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.params)
        state = _OutputState(req, sink, detok, logprobs=[] if req.params.logprobs is not None else None,
                             final_only=not stream and not req.params.stop)
        with self._lock:
            self._states[req.request_id] = state

    def discard(self, request_id: str) -> None:
        """Forget a registered request that never reached the engine."""
        self._release(request_id)

    def push(self, events: list) -> None:
        """A step's StepEvents, or (request_id, token) pairs for plain tokens (no logprobs, not the last)."""
        self._queue.put(events)

    def close(self, timeout: float = 10.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every event pushed before this call has reached its sink; False on timeout."""
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            try:  # take every step that is already waiting: one batched decode for all of them
                while True:
                    batch.append(self._queue.get_nowait())
            except queue.Empty:
                pass
            events: list = []
            for item in batch:
                if item is not None and not isinstance(item, threading.Event):
                    events += item
                    continue
                if events:  # a close or flush marker: what came before it is delivered first
                    self._process(events)
                    events = []
                if item is None:
                    return
                item.set()  # a flush marker
            if events:
                self._process(events)

    def _process(self, events: list[StepEvent]) -> None:
        """One output per request for all of its events in this batch (a lagging consumer gets bigger deltas,
        not more of them), decoded once; requests with stop strings go token by token, so the stop ends the
        request at the token that completed it whatever the batch holds."""
        staged: list[_Staged] = []
        for n, (request_id, group) in enumerate(_by_request(events).items()):
            if n % _REQUESTS_PER_PASS == 0:
                self._gate.yield_to_loop()  # the engine loop's CPU work goes first
            try:
                item = self._stage_group(request_id, group)
                if item is not None:
                    staged.append(item)
            except Exception:  # one request's bad output must not stop the others
                log.exception("output processing failed for %s", request_id)
                self._deliver_final(request_id, "error", "output processing failed")
        decoded = iter(self._decode_batch([item.state.detok for item in staged if item.needs]))
        for n, item in enumerate(staged):
            if n % _REQUESTS_PER_PASS == 0:
                self._gate.yield_to_loop()
            try:
                self._emit(item, next(decoded) if item.needs else None)
            except Exception:
                log.exception("output processing failed for %s", item.state.request.request_id)
                self._deliver_final(item.state.request.request_id, "error", "output processing failed")

    def _stage_group(self, request_id: str, group: list) -> _Staged | None:
        """One request's events of this batch staged for the batched decode; None when there is nothing left to
        stage: the request finished already, or it has stop strings and its events were emitted one by one."""
        with self._lock:
            state = self._states.get(request_id)
        if state is None:
            return None  # already finished (e.g. by a stop string): later tokens are dropped
        if state.detok.has_stop_strings and not state.final_only:
            for ev in group:
                item = self._stage(state, [ev])
                self._emit(item, state.detok.decode_windows() if item.needs else None)
                if state.released:
                    break
            return None
        return self._stage(state, group)

    def _decode_batch(self, detoks: list[IncrementalDetokenizer]) -> list[tuple[str, str]]:
        """Both windows of every request in one call per skip flag; the Rust batch decode runs without the GIL,
        so the engine thread keeps running meanwhile."""
        if not detoks:
            return []
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return [d.decode_windows() for d in detoks]
        out: list[tuple[str, str] | None] = [None] * len(detoks)
        for flag in (True, False):
            idx = [i for i, d in enumerate(detoks) if d.skip_special_tokens is flag]
            if not idx:
                continue
            flat = [w for i in idx for w in detoks[i].windows()]
            texts = backend.decode_batch(flat, skip_special_tokens=flag)
            for j, i in enumerate(idx):
                out[i] = (texts[2 * j], texts[2 * j + 1])
        return out

    def _stage(self, state: _OutputState, group: list) -> "_Staged":
        """Take a request's consecutive events (StepEvents, or (request_id, token) tuples for plain tokens):
        tokens and logprobs appended, text staged but not decoded."""
        last = group[-1]
        item = _Staged(state, _PLAIN if type(last) is tuple else last, len(state.token_ids), len(state.logprobs or ()))
        if item.last.all_tokens is not None:  # a final-only request's one event carries all of its tokens
            state.token_ids[:] = item.last.all_tokens
            item.has_tokens = bool(state.token_ids)
        else:
            for ev in group:
                if type(ev) is tuple:
                    item.has_tokens = True
                    state.token_ids.append(ev[1])
                    continue
                if ev.token is None:
                    continue
                item.has_tokens = True
                state.token_ids.append(ev.token)
                if ev.logprob is not None and state.logprobs is not None:
                    state.logprobs.append(_logprob_entry(ev.token, ev.logprob))
        last = item.last
        # the token that stopped the request (EOS / a stop id) is in token_ids but not in the text; a token that
        # completed the request's grammar is text like any other
        hidden = (last.finish_reason == FINISH_STOP and last.token is not None
                  and last.token in state.request.stop_ids)
        if state.final_only:
            if last.finish_reason is not None:
                ids = state.token_ids
                item.needs = state.detok.stage(ids[:-1] if hidden else ids)
                if hidden:
                    state.detok.stage(ids[-1:], exclude_from_text=True)
            return item
        new = state.token_ids[item.first_token:]
        if hidden:
            item.needs = state.detok.stage(new[:-1])
            state.detok.stage(new[-1:], exclude_from_text=True)
        else:
            item.needs = state.detok.stage(new)
        return item

    def _emit(self, item: "_Staged", decoded: tuple[str, str] | None) -> None:
        state, ev = item.state, item.last
        if state.final_only and ev.finish_reason is None:
            return  # nothing is delivered before the end
        req, reason = state.request, ev.finish_reason
        if state.final_only:
            delta_ids, delta_lp = list(state.token_ids), state.logprobs
        else:
            delta_ids = state.token_ids[item.first_token:]
            delta_lp = (state.logprobs[item.first_logprob:] or None) if state.logprobs is not None else None
        delta_text = state.detok.apply(*decoded, final=state.final_only) if decoded is not None else ""
        if item.has_tokens and state.detok.stopped and reason is None:
            reason = FINISH_STOP
            self._on_stop_string(req.request_id)
        if reason is not None and not state.detok.stopped:
            delta_text += state.detok.finish()
        state.text += delta_text
        if not delta_ids and not delta_text and reason is None:
            return
        out = RequestOutput(
            request_id=req.group_id, index=req.sample_index, all_token_ids=state.token_ids, num_tokens=len(state.token_ids),
            text=state.text, delta_token_ids=delta_ids, delta_text=delta_text, finished=reason is not None,
            finish_reason=reason, num_prompt_tokens=req.num_prompt_tokens,
            logprobs=state.logprobs, delta_logprobs=delta_lp, error=ev.error, invalid_request=ev.invalid_request,
            num_cached_tokens=req.num_cached_tokens,
            first_token_time=req.first_token_time if reason is not None else None)
        if reason is not None:
            state.released = True
            self._release(req.request_id)
        state.sink.put(out)

    def _deliver_final(self, request_id: str, reason: str, message: str) -> None:
        with self._lock:
            state = self._states.get(request_id)
        if state is None:
            return
        state.released = True
        self._release(request_id)
        req = state.request
        state.sink.put(RequestOutput(req.group_id, state.token_ids, state.text, [], "", True, reason,
                                     req.num_prompt_tokens, len(state.token_ids), error=message,
                                     index=req.sample_index))

    def _release(self, request_id: str) -> None:
        with self._lock:
            self._states.pop(request_id, None)
        self._on_released(request_id)


def coalesce_outputs(items: list) -> list:
    """Outputs of one request (one sample of it) waiting together for a slow consumer become one: the later one,
    carrying the joined deltas. Other items (a consumer's own markers) keep their places; nothing of their request
    (of any request, for a marker without a request_id) is joined across them."""
    merged: list = []
    newest: dict[tuple[str, int], int] = {}  # (request_id, sample) → index in merged of its newest unfinished output
    for item in items:
        rid = getattr(item, "request_id", None)
        if not isinstance(item, RequestOutput):
            if rid is None:
                newest.clear()
            else:
                for key in [k for k in newest if k[0] == rid]:
                    del newest[key]
            merged.append(item)
            continue
        key = (rid, item.index)
        j = newest.pop(key, None)
        if j is not None:
            earlier, merged[j] = merged[j], None
            item.delta_token_ids = earlier.delta_token_ids + item.delta_token_ids
            item.delta_text = earlier.delta_text + item.delta_text
            if earlier.delta_logprobs or item.delta_logprobs:
                item.delta_logprobs = (earlier.delta_logprobs or []) + (item.delta_logprobs or [])
        merged.append(item)
        if not item.finished:
            newest[key] = len(merged) - 1
    return [m for m in merged if m is not None]


def _logprob_entry(token: int, logprob) -> dict:
    value, rank, top = logprob
    entry = {"token_id": token, "logprob": value, "rank": rank}
    if top is not None:  # in order: rank 1 first
        entry["top_logprobs"] = [{"token_id": t, "logprob": lp, "rank": r} for r, (t, lp) in enumerate(top, 1)]
    return entry


class RequestStream:
    """Iterator over one request's outputs (of each of its n samples); stops after the final ones. Closing it
    aborts the request."""

    def __init__(self, request_id: str, engine, num_samples: int = 1) -> None:
        self.request_id = request_id
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self._engine = engine
        self._samples_left = num_samples
        self._finals: dict[int, RequestOutput] = {}
        self._done = False

    def __iter__(self):
        return self

    def __next__(self) -> RequestOutput:
        if self._done:
            raise StopIteration
        out = self.queue.get()
        if out.finished:
            self._finals[out.index] = out
            self._samples_left -= 1
            self._done = self._samples_left == 0
        return out

    def result(self) -> RequestOutput:
        """Wait for the final output (of the first sample, with n > 1: see results)."""
        return self.results()[0]

    def results(self) -> list[RequestOutput]:
        """Wait for every sample's final output; in sample order."""
        for _ in self:
            pass
        return [self._finals[i] for i in sorted(self._finals)]

    def cancel(self) -> None:
        if not self._done:
            self._engine.abort(self.request_id)
