"""The one sender thread: engine updates → Triton responses, cancellation checks, gauge refreshes."""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import triton_python_backend_utils as pb_utils

from backend import coalesce_outputs
from backend.outputs.token_text import TokenTexts
from protocol import ParsedRequest, response_arrays

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
CANCEL_CHECK_INTERVAL_S = 0.1  # is_cancelled() is an IPC round trip: sweep, don't ask per token
_STOP = object()
_RESPONSES_PER_PASS = 2  # responses sent between two passes of the engine's loop gate (a send is an IPC)


@dataclass
class _Failure:
    """A registered request that could not start: the sender thread sends its error."""

    request_id: str
    message: str
    code: Any


@dataclass(slots=True, eq=False)
class ActiveRequest:
    """Adapter-side state of one accepted request."""

    request_id: str
    sender: Any  # pb_utils response sender
    req: ParsedRequest
    prefix: str  # prepended to a non-streaming text_output
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    cancelled: bool = False
    # each sample's newest output (n > 1: a response carries one entry per sample), and how many have finished
    latest: list[Any] = field(default_factory=list)
    num_finished: int = 0
    # running sums of each sample's output logprobs, and how many entries they cover (kept, not re-added each time)
    logprob_sums: list[float] = field(default_factory=list)
    logprobs_summed: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = self.req.params.n
        self.latest, self.logprob_sums, self.logprobs_summed = [None] * n, [0.0] * n, [0] * n

    def cumulative_logprobs(self) -> list[float]:
        """Each sample's sum of output logprobs so far (cumulative_logprob)."""
        for i, out in enumerate(self.latest):
            entries = out.logprobs if out is not None and out.logprobs else ()
            for entry in entries[self.logprobs_summed[i]:]:
                self.logprob_sums[i] += entry["logprob"]
            self.logprobs_summed[i] = max(self.logprobs_summed[i], len(entries))
        return self.logprob_sums

    def take(self, out: Any) -> bool:
        """Keep a sample's newest output; True once the request is over (every sample finished, or one failed)."""
        if self.latest[out.index] is None or not self.latest[out.index].finished:
            self.latest[out.index] = out
            self.num_finished += out.finished
        return out.finished and (self.num_finished == len(self.latest) or out.finish_reason in ("error", "abort"))


def error_response(message: str, code: Any) -> Any:
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


class ResponseLoop:
    """Owns every accepted request until its one final response is sent."""

    def __init__(self, engine: Any, metrics: Any, stats_interval_s: float = 0.5,
                 on_engine_dead: Callable[[], None] | None = None):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()  # the engine's sink for every request (C put and get)
        self._engine, self._metrics, self._stats_interval = engine, metrics, stats_interval_s
        self._token_texts = TokenTexts(engine.tokenizer)  # a token id's text, for the logprobs output
        self._on_engine_dead = on_engine_dead  # called once, from this thread, when the engine stops by itself
        self._dead_reported = False
        self._active: dict[str, ActiveRequest] = {}
        self._thread = threading.Thread(target=self._run, name="tandem-sender", daemon=True)
        self._next_cancel_check = self._next_stats = 0.0
        self.closing = False  # set by finalize: the engine stops on purpose, its abort outputs answer everyone
        self._abort_message: str | None = None  # set by abort_all: what the aborted requests' final responses say

    def start(self) -> None:
        self._thread.start()

    def register(self, stream: ActiveRequest) -> None:
        self._active[stream.request_id] = stream

    def claim(self, request_id: str) -> ActiveRequest | None:
        """Take a request out of the loop; whoever claims it sends its final response (dict.pop is atomic)."""
        return self._active.pop(request_id, None)

    def in_flight(self) -> int:
        """Accepted requests whose final response is not sent yet (any thread)."""
        return len(self._active)

    def abort_all(self, message: str) -> int:
        """Stop every request in flight (any thread); their final responses say `message`. Returns how many."""
        self._abort_message = message
        ids = list(self._active)
        for request_id in ids:
            self._engine.abort(request_id)
        return len(ids)

    def fail(self, request_id: str, message: str, code: Any) -> None:
        """Answer a registered request with an error, from the sender thread (any thread may call this)."""
        self.queue.put(_Failure(request_id, message, code))

    def error_sent(self, code: Any) -> None:
        """Count a final error response sent outside this loop: a refusal in execute() (any thread)."""
        self._metrics.request_error(code)

    def stop(self, timeout: float = 30.0) -> None:
        """Call after engine.shutdown(): its final outputs are queued ahead of the stop marker."""
        self.queue.put(_STOP)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            try:
                items = [self.queue.get(timeout=0.05)]
            except queue.Empty:
                items = []
            items += self._drain()  # what is already there: one pass per burst of engine outputs
            for n, item in enumerate(coalesce_outputs(items)):  # a request's updates waiting together: one response
                if n % _RESPONSES_PER_PASS == 0:
                    self._engine.yield_to_loop()  # the engine loop's CPU work goes first
                if item is not _STOP:
                    self._safe_handle(item)
            if any(item is _STOP for item in items):
                break
            self._housekeeping(time.monotonic())
        self._fail_all("request aborted: the model is unloading", pb_utils.TritonError.UNAVAILABLE)
        self._flush_metrics()

    def _drain(self) -> list:
        """Everything already in the queue, without waiting."""
        items = []
        while True:
            try:
                items.append(self.queue.get_nowait())
            except queue.Empty:
                return items

    def _flush_metrics(self) -> None:
        try:
            self._metrics.flush()
        except Exception as err:  # a metrics IPC failure must not stop the responses
            pb_utils.Logger.log_warn(f"tandem: metrics flush failed: {err!r}")

    def _safe_handle(self, out: Any) -> None:
        if isinstance(out, _Failure):
            stream = self.claim(out.request_id)
            if stream is not None:
                self._send(stream, error_response(out.message, out.code), FINAL, error=out.code)
            return
        try:
            self._handle(out)
        except Exception as err:  # never let one bad update kill the thread that answers everyone
            pb_utils.Logger.log_error(f"tandem: response for request {out.request_id} failed: {err!r}")
            stream = self.claim(out.request_id)
            if stream is not None:
                self._engine.abort(out.request_id)
                code = pb_utils.TritonError.INTERNAL
                self._send(stream, error_response(f"internal error: {err}", code), FINAL, error=code)

    def _handle(self, out: Any) -> None:
        stream = self._active.get(out.request_id)
        if stream is None:
            return  # already answered (error, cancel or shutdown)
        self._observe(stream, out, time.monotonic())
        if stream.take(out):
            if self.claim(out.request_id) is not None:
                self._finish(stream, out)
        elif (stream.req.stream and not stream.cancelled
              and (self._worth_sending(stream.req, out) or out.finished)):  # a sample's end: its finish_reason
            arrays = response_arrays(stream.req, stream.latest, "", self._decode_token(stream), new=out.index,
                                     cumulative=self._cumulative(stream))
            tensors = [pb_utils.Tensor(k, v) for k, v in arrays.items()]
            self._send(stream, pb_utils.InferenceResponse(output_tensors=tensors), 0)

    def _decode_token(self, stream: ActiveRequest) -> Callable[[int], str]:
        """decoded_token's text for this request: special tokens left out as its text leaves them out."""
        return self._token_texts.decoder(stream.req.params.skip_special_tokens)

    @staticmethod
    def _cumulative(stream: ActiveRequest) -> list[float] | None:
        return stream.cumulative_logprobs() if stream.req.return_cumulative_logprob else None

    @staticmethod
    def _worth_sending(req: ParsedRequest, out: Any) -> bool:
        # A token whose text the detokenizer still holds back matters only to token-level clients.
        token_level = req.return_output_ids or req.return_num_output_tokens or req.return_logprobs
        return bool(out.delta_text) or (token_level and bool(out.delta_token_ids))

    def _finish(self, stream: ActiveRequest, out: Any) -> None:
        """The request's one final response: for n > 1 after its last sample (or a failed one: the rest stop)."""
        if len(stream.latest) > 1 and out.finish_reason in ("error", "abort"):
            self._engine.abort(stream.request_id)
        code = None  # the error code of an error response
        if stream.cancelled:
            response = None  # the client is gone: only close the stream
        elif out.finish_reason == "error" and out.invalid_request:  # the request's own settings conflict
            code = pb_utils.TritonError.INVALID_ARG
            response = error_response(out.error, code)
        elif out.finish_reason == "error":
            code = pb_utils.TritonError.INTERNAL
            response = error_response(f"engine error: {out.error or 'unknown'}", code)
        elif out.finish_reason == "abort":
            msg = (self._abort_message
                   or f"request aborted after {len(out.token_ids)} tokens: the model is unloading or the engine stopped")
            code = pb_utils.TritonError.UNAVAILABLE
            response = error_response(msg, code)
        else:
            arrays = response_arrays(stream.req, stream.latest, stream.prefix, self._decode_token(stream),
                                     new=out.index, cumulative=self._cumulative(stream))
            response = pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in arrays.items()])
        self._send(stream, response, FINAL, error=code)
        self._metrics.e2e.observe(time.monotonic() - stream.arrival)
        generated = sum(len(sample.token_ids) for sample in stream.latest if sample is not None)
        self._metrics.request_finished(out.finish_reason, out.num_prompt_tokens, generated, len(stream.latest))

    def _observe(self, stream: ActiveRequest, out: Any, now: float) -> None:
        n = len(out.delta_token_ids)
        if not n:
            return
        self._metrics.generation_tokens.increment(n)
        if stream.first_token is None:
            # a final-only request's tokens all come at its end; the engine says when the first one was read
            first = out.first_token_time or now
            stream.first_token = first
            self._metrics.ttft.observe(first - stream.arrival)
            if n > 1:  # the tokens after the first, spread over the time since it (0 when they came with it)
                self._metrics.itl.observe((now - first) / (n - 1), count=n - 1)
        else:
            self._metrics.itl.observe((now - stream.last_token) / n, count=n)
        stream.last_token = now

    def _send(self, stream: ActiveRequest, response: Any, flags: int, error: Any = None) -> None:
        """error: the code of an error response, counted in tandem_request_errors_total once sent (a cancelled
        request's client gets no error: it is not counted, nor is a send that failed)."""
        counted = error is not None and response is not None and not stream.cancelled
        try:
            if response is None:
                stream.sender.send(flags=flags)
            else:
                stream.sender.send(response, flags=flags)
        except Exception as err:  # client disconnected or request already cancelled
            if not stream.cancelled:
                pb_utils.Logger.log_verbose(f"tandem: request {stream.request_id}: send failed ({err}); aborting")
                stream.cancelled = True
                if flags != FINAL:
                    self._engine.abort(stream.request_id)
        else:
            if counted:
                self._metrics.request_error(error)

    def _housekeeping(self, now: float) -> None:
        if now >= self._next_cancel_check:
            self._next_cancel_check = now + CANCEL_CHECK_INTERVAL_S
            self._check_cancelled()
            self._flush_metrics()
            if not self.closing and not self._engine.healthy:
                # the engine's last outputs (the error of the step that stopped it) answer their requests first;
                # only requests they leave open get the generic message (once: later ticks find nothing pending)
                if not self._dead_reported:
                    self._deliver_pending()
                self._fail_all("engine stopped; see the server log", pb_utils.TritonError.INTERNAL)
                self._report_dead()
        if now >= self._next_stats:
            self._next_stats = now + self._stats_interval
            try:
                self._metrics.update_engine(self._engine.stats())
            except Exception as err:
                pb_utils.Logger.log_warn(f"tandem: engine stats unavailable: {err!r}")

    def _deliver_pending(self) -> None:
        """Handle everything the stopped engine still had on its way here (its output thread, then this queue)."""
        try:
            self._engine.flush_outputs()
        except Exception as err:  # a broken output thread must not keep the other requests waiting
            pb_utils.Logger.log_warn(f"tandem: engine outputs not flushed: {err!r}")
        items = self._drain()
        for item in coalesce_outputs([i for i in items if i is not _STOP]):
            self._safe_handle(item)
        if any(i is _STOP for i in items):
            self.queue.put(_STOP)  # finalize's stop marker stays for the main loop

    def _report_dead(self) -> None:
        if self._dead_reported:
            return
        self._dead_reported = True
        self._metrics.update_engine(self._engine.stats())  # why: the healthy gauge must drop now, not next tick
        if self._on_engine_dead is not None:
            try:
                self._on_engine_dead()
            except Exception as err:
                pb_utils.Logger.log_warn(f"tandem: engine-dead handler failed: {err!r}")

    def _check_cancelled(self) -> None:
        for stream in list(self._active.values()):
            if stream.cancelled:
                continue
            try:
                cancelled = stream.sender.is_cancelled()
            except Exception:
                cancelled = True  # the request is gone on the server side
            if cancelled:
                stream.cancelled = True
                self._engine.abort(stream.request_id)  # its final "abort" output closes the stream

    def _fail_all(self, message: str, code: Any) -> None:
        for request_id in list(self._active):
            stream = self.claim(request_id)
            if stream is not None:
                self._send(stream, None if stream.cancelled else error_response(message, code), FINAL, error=code)
