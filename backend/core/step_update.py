"""The per-step update rules: a step's tokens are accepted, stop and length limits end requests, full KV blocks
are hashed for prefix caching, and finished requests' blocks return (after the step that still writes them).

A prompt's full blocks are registered as its chunks are computed (their hashes were made with the request, off the
loop), so requests running beside it share them; a request's output blocks are hashed once, when it finishes (and
when it is preempted, so its recompute finds them): only a later prompt can repeat an output, and a caller sends
that prompt once it has the output. Hashing them as they fill cost a call a step for every sixteenth row."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from backend.core.kv_cache import BlockManager
from backend.core.scheduler import Scheduler
from backend.core.steady_batch import PackedRows, accept_pending, mask_without
from backend.outputs.processor import StepEvent
from backend.request import FINISH_LENGTH, FINISH_STOP, Request, RequestStatus

if TYPE_CHECKING:
    from backend.step_records import StepResult, StepState


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
        sb, first, risky = st.batch.steady, 0, []
        events: list[StepEvent | tuple[str, int]] = []
        if sb is not None and sb is self.scheduler.steady:
            if st.steady_version == sb.version:
                steady = self._update_steady(st, result)
            else:  # rows left or joined since the step was packed: its rows as packed
                steady = self._update_packed_rows(st, result, sb.packed_rows.get(st.steady_version))
            if steady is not None:  # the steady rows are done but the risky ones; joiners follow the general rules
                (events, risky), first = steady, st.batch.num_steady_rows
        rows = [*risky, *range(first, len(result.requests))]
        current = self.scheduler.steady
        if current is not None:  # rows of the current steady run (the risky ones, joiners since) read their counts
            requests = result.requests
            for i in rows:
                current.sync(requests[i])
        self._update_rows(result, rows, next_state, events, finish)
        bm = self.block_manager
        if bm.enable_prefix_caching:
            bs = bm.block_size
            # prompt blocks that just filled up, for prefix hits of requests arriving meanwhile: every request of the
            # step but the steady rows (they decode), whether or not its chunk sampled
            for req in st.batch.requests[st.batch.num_steady_rows if sb is not None else 0:]:
                computed_prompt = min(req.num_computed_tokens, req.num_prompt_tokens)
                if computed_prompt >= (len(req.block_hashes) + 1) * bs and not req.is_finished:
                    bm.register_full_blocks(req, computed_prompt)
        for req in st.batch.free_after:
            self.block_manager.free(req)
        return events

    def _update_rows(self, result: StepResult, rows: list[int], next_state: StepState | None,
                     events: list[StepEvent | tuple[str, int]], finish) -> None:
        """Each of these sampled rows: accept its token, check its stops, append its event."""
        lps = result.logprobs
        requests, tokens = result.requests, result.token_ids
        for i in rows:
            req, tok = requests[i], tokens[i]
            if req.is_finished:
                req.drop_pending()  # finished while this step was queued: its token is dropped
                continue
            req.accept_token(tok)
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            reason = self._stop_reason(req, tok)
            if req.final_only:  # no per-step event: the output thread hears of it once, at the end
                if reason is None:
                    continue
                event = StepEvent(req.request_id, tok, None, reason, all_tokens=req.output_token_ids)
            else:
                lp = None
                if lps is not None:
                    top = None
                    if result.top_ids is not None and req.params.logprobs:
                        k = req.params.logprobs
                        top = list(zip(result.top_ids[i][:k], result.top_logprobs[i][:k]))
                    lp = (lps[i], result.ranks[i], top)
                if lp is None and reason is None:
                    events.append((req.request_id, tok))  # the common case: a bare pair, made an event off the loop
                    continue
                event = StepEvent(req.request_id, tok, lp, reason)
            events.append(event)
            if reason is not None:
                finish(req, reason, next_state)

    def _update_steady(self, st: StepState, result: StepResult
                       ) -> tuple[list[tuple[str, int]], list[int]] | None:
        """The steady rows' tokens: those that end no request appended with one short loop, no per-row checks; the
        rows this step may end (a stop token, or near a length limit) returned for the general update.

        None: so many rows may end that the general update looks at all of them. The steady batch is still the
        scheduler's and no row left or joined it since the step was packed, so its rows are the step's first rows,
        in order."""
        sb = st.batch.steady
        tokens = result.token_ids[:len(sb)]
        risky = sb.rows_that_may_end(tokens).tolist()
        if len(risky) > len(sb) // 4:
            return None
        keep = mask_without(len(sb), risky) if risky else None
        sb.accept(tokens, keep)
        return sb.events(tokens, keep), risky

    def _update_packed_rows(self, st: StepState, result: StepResult, packed: PackedRows | None
                            ) -> tuple[list[tuple[str, int]], list[int]] | None:
        """_update_steady for a step whose rows changed after it was packed: each row's token appended, or dropped
        where the request finished meanwhile; the rows it may end returned for the general update. None: the
        general update."""
        if packed is None:
            return None
        n = len(packed.computed)
        tokens, requests = result.token_ids[:n], result.requests[:n]
        risky = packed.rows_that_may_end(tokens).tolist()
        if len(risky) > n // 4:
            return None
        kept = mask_without(n, risky)
        # only a request that left the rows since the step was packed may have finished meanwhile
        gone = st.batch.steady.rows_gone_since(st.steady_version, n)
        for i in range(n) if gone is None else gone:
            req = requests[i]
            if kept[i] and req.is_finished:  # finished while this step was queued: its token is dropped, no event
                req.drop_pending()
                kept[i] = False
        accept_pending(packed.appends, tokens, kept)
        events = [(rid, tokens[i]) for rid, i in zip(packed.streamed_ids, packed.streamed_rows) if kept[i]]
        return events, risky

    def _stop_reason(self, req: Request, tok: int) -> str | None:
        p = req.params
        n_out = len(req.output_token_ids)
        if tok in req.stop_ids and n_out > p.min_tokens:  # an EOS before min_tokens does not end the request
            return FINISH_STOP
        if n_out >= p.max_tokens or req.num_tokens >= self.max_model_len:
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
