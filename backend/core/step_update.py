"""The per-step update rules: a step's tokens are accepted, stop and length limits end requests, full KV blocks
are hashed for prefix caching, and finished requests' blocks return (after the step that still writes them).

A prompt's full blocks are registered as its chunks are computed (their hashes were made with the request, off the
loop), so requests running beside it share them; a request's output blocks are hashed once, when it finishes (and
when it is preempted, so its recompute finds them): only a later prompt can repeat an output, and a caller sends
that prompt once it has the output. Hashing them as they fill cost a call a step for every sixteenth row."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable

from backend.core.kv_cache import BlockManager
from backend.core.scheduler import ScheduledBatch, Scheduler
from backend.core.running_batch import mask_without
from backend.outputs.processor import StepEvent
from backend.request import FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, Request, RequestStatus

if TYPE_CHECKING:
    from backend.step_records import StepResult, StepState

log = logging.getLogger(__name__)


class StepUpdater:
    """Applies each step's results to its requests; runs on the engine thread."""

    def __init__(self, scheduler: Scheduler, block_manager: BlockManager, max_model_len: int) -> None:
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.max_model_len = max_model_len

    def apply(self, st: StepState, result: StepResult, next_state: StepState | None,
              finish: Callable[[Request, str, StepState | None], None]) -> list[StepEvent | tuple[str, int]]:
        """A step's tokens arrived: update its requests and return the events for the output thread. finish(req,
        reason, next_state) ends a request (the engine's, which calls finish() below and forgets the request)."""
        batch = st.batch
        first, risky = 0, []
        events: list[StepEvent | tuple[str, int]] = []
        if batch.num_rows and batch.rows is self.scheduler.batch:
            decoded = self._update_decode_rows(st, result)
            if decoded is not None:  # the rows are done but those to check one by one; prefill rows follow
                (events, risky), first = decoded, batch.num_rows
        self._update_rows(result, [*risky, *range(first, len(result.requests))], next_state, events, finish)
        self.settle_blocks(batch)
        return events

    def settle_blocks(self, batch: ScheduledBatch) -> None:
        """After a step's update: its prompt blocks that filled up are registered, and the blocks of requests that
        finished while it was queued return."""
        bm = self.block_manager
        if bm.enable_prefix_caching:
            bs = bm.block_size
            # prompt blocks that just filled up, for prefix hits of requests arriving meanwhile: every request of the
            # step but the decode rows, whether or not its chunk sampled
            for req in batch.requests[batch.num_rows:]:
                computed_prompt = min(req.num_computed_tokens, req.num_prompt_tokens)
                if computed_prompt >= (len(req.block_hashes) + 1) * bs and not req.is_finished:
                    bm.register_full_blocks(req, computed_prompt)
        for req in batch.free_after:
            self.block_manager.free(req)

    def _update_rows(self, result: StepResult, rows: list[int], next_state: StepState | None,
                     events: list[StepEvent | tuple[str, int]], finish) -> None:
        """Each of these sampled rows: accept its token, check its stops, append its event."""
        requests = result.requests
        for i in rows:
            req = requests[i]
            if req.is_finished:
                req.drop_pending()  # finished while this step was queued: its token is dropped
                continue
            self.accept_at(req, result, i, next_state, events, finish)

    def accept_at(self, req: Request, result: StepResult, pos: int, next_state: StepState | None,
                  events: list[StepEvent | tuple[str, int]], finish, exact_length: bool = False) -> str | None:
        """The one rule for a sampled token: req (not finished) accepts the token at position pos of the step's
        results, its stops are checked (stop tokens after min_tokens, lengths, its grammar), its event appended, and
        it is finished where a stop says so; returns that stop's reason, or None. exact_length: the length limit
        reads the prompt and the outputs so far (a row that took several tokens in one step has counted them all
        already), not the row's count."""
        tok = result.token_ids[pos]
        req.accept_token(tok)
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        length = req.num_prompt_tokens + len(req.output_token_ids) if exact_length else req.num_tokens
        reason = self._stop_reason(req, tok, length)
        if reason is None and req.matcher is not None:
            reason = _grammar_stop(req, tok)
            if reason == FINISH_ERROR:
                events.append(_grammar_conflict(req, tok))
                finish(req, reason, next_state)
                return reason
        if req.final_only:  # no per-step event: the output thread hears of it once, at the end
            if reason is None:
                return None
            event = StepEvent(req.request_id, tok, None, reason, all_tokens=req.output_token_ids)
        else:
            lp = None
            if result.logprobs is not None:
                top = None
                if result.top_ids is not None and req.params.logprobs:
                    k = req.params.logprobs
                    top = list(zip(result.top_ids[pos][:k], result.top_logprobs[pos][:k]))
                lp = (result.logprobs[pos], result.ranks[pos], top)
            if lp is None and reason is None:
                events.append((req.request_id, tok))  # the common case: a bare pair, made an event off the loop
                return None
            event = StepEvent(req.request_id, tok, lp, reason)
        events.append(event)
        if reason is not None:
            finish(req, reason, next_state)
        return reason

    def _update_decode_rows(self, st: StepState, result: StepResult
                            ) -> tuple[list[tuple[str, int]], list[int]] | None:
        """The decode rows' tokens, as the rows stood when the step was packed: those that end no request appended
        with one short loop, no per-row checks, or dropped where the request finished meanwhile; the rows to check
        one by one (a stop token, near a length limit, logprobs to report) returned for the per-row update. None:
        so many rows need checking, or the step's rows are no longer known, that the per-row update takes all."""
        packed = st.batch.rows.packed_rows.get(st.rows_version)
        if packed is None:
            return None
        n = len(packed.computed)
        tokens = result.token_ids[:n]
        risky = packed.rows_that_may_end(tokens).tolist()
        if len(risky) > n // 4:
            return None
        kept = mask_without(n, risky) if risky else None
        # only a request that left the rows since the step was packed may have finished meanwhile
        gone = st.batch.rows.rows_gone_since(st.rows_version, n)
        requests = result.requests
        for i in range(n) if gone is None else gone:
            req = requests[i]
            if req.is_finished and (kept is None or kept[i]):  # finished while this step was queued: token dropped
                req.drop_pending()
                if kept is None:
                    kept = [True] * n
                kept[i] = False
        packed.accept(tokens, kept)
        return packed.events(tokens, kept), risky

    def _stop_reason(self, req: Request, tok: int, length: int) -> str | None:
        p = req.params
        n_out = len(req.output_token_ids)
        if tok in req.stop_ids and n_out > p.min_tokens:  # an EOS before min_tokens does not end the request
            return FINISH_STOP
        if n_out >= p.max_tokens or length >= self.max_model_len:
            return FINISH_LENGTH
        return None

    def finish(self, req: Request, reason: str, next_state: StepState | None) -> None:
        """Mark req finished once; its full blocks are hashed for later prompts that repeat it, and return now, or
        after the queued step that still writes them (that step runs before any step of a later request)."""
        if req.is_finished:
            return
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.scheduler.remove(req)
        self.block_manager.register_full_blocks(req, req.num_computed_tokens)
        if next_state is not None and req.last_step_id == next_state.batch.step_id:
            next_state.batch.free_after.append(req)
        else:
            self.block_manager.free(req)


def _grammar_stop(req: Request, tok: int) -> str | None:
    """Advance req's grammar by its new token: "stop" where the grammar is complete and can take no more, an error
    where the token breaks it (the mask allowed no token: see _grammar_conflict), else None."""
    if not req.matcher.accept(tok):
        return FINISH_ERROR
    return FINISH_STOP if req.matcher.is_stopped else None


def _grammar_conflict(req: Request, tok: int) -> StepEvent:
    """The final event of a row whose grammar refused its token. The mask lets through only tokens the grammar
    allows, so that happens only where the request's bans left none of them: its own constraints conflict, which
    the request can fix (its error says so); without such bans it is the engine's fault."""
    p = req.params
    rules = [name for name, on in (("bad_words", p.bad_words), ("allowed_token_ids", p.allowed_token_ids)) if on]
    kept = req.output_token_ids[:-1]  # the refused token is not part of the output
    tokens = kept if req.final_only else None
    if not rules:
        log.error("request %s: token %d breaks its grammar", req.request_id, tok)
        return StepEvent(req.request_id, None, None, FINISH_ERROR, f"token {tok} breaks the request's grammar", tokens)
    message = (f"no token may follow the first {len(kept)} output tokens: its {' and '.join(rules)} ban every token "
               "its structured output allows there; loosen one of them")
    return StepEvent(req.request_id, None, None, FINISH_ERROR, message, tokens, invalid_request=True)
