"""The update of a step whose rows carried drafts: each row's kept tokens accepted one by one under the rules a step
of one token applies (stop tokens, min_tokens, max_tokens, max_model_len, logprobs, final-only requests), as if
they had come one step at a time."""
from __future__ import annotations

import time
from typing import Callable

from backend.core.step_update import StepUpdater
from backend.outputs.processor import StepEvent
from backend.request import FINISH_LENGTH, FINISH_STOP, Request
from backend.speculative.speculator import Speculator, StepDrafts
from backend.step_records import StepResult, StepState


class DraftedStepUpdater:
    """Settles a drafted step's rows (Speculator.settle), then accepts their tokens and ends requests."""

    def __init__(self, updater: StepUpdater, speculator: Speculator) -> None:
        self.updater = updater
        self.speculator = speculator
        self.max_model_len = updater.max_model_len

    def apply(self, st: StepState, result: StepResult, drafts: StepDrafts,
              finish: Callable[[Request, str, None], None]) -> tuple[list, list[int]]:
        """The step's events for the output thread, and each sampled row's last emitted token."""
        # counts and blocks first, every row at its packed place: a request that finishes below leaves the rows
        spans = self.speculator.settle(st.batch, drafts, result.token_ids)
        tokens, lps = result.token_ids, result.logprobs
        events: list = []
        for req, (start, count) in zip(result.requests, spans):
            if req.is_finished:  # cannot happen on the synchronous pipeline; kept as the one-token update does
                continue
            for pos in range(start, start + count):
                tok = tokens[pos]
                req.accept_token(tok)
                if req.first_token_time is None:
                    req.first_token_time = time.monotonic()
                reason = self._stop_reason(req, tok)
                if req.final_only:
                    if reason is not None:
                        events.append(StepEvent(req.request_id, tok, None, reason, all_tokens=req.output_token_ids))
                elif lps is None and reason is None:
                    events.append((req.request_id, tok))
                else:
                    lp = None
                    if lps is not None:
                        top = None
                        if result.top_ids is not None and req.params.logprobs:
                            k = req.params.logprobs
                            top = list(zip(result.top_ids[pos][:k], result.top_logprobs[pos][:k]))
                        lp = (lps[pos], result.ranks[pos], top)
                    events.append(StepEvent(req.request_id, tok, lp, reason))
                if reason is not None:
                    finish(req, reason, None)
                    break  # the tokens after a stop are dropped
        self.updater.settle_blocks(st.batch)
        return events, [tokens[start + count - 1] for start, count in spans]

    def _stop_reason(self, req: Request, tok: int) -> str | None:
        """StepUpdater's rule with the token count of the outputs so far (the row's count already holds them all)."""
        p = req.params
        n_out = len(req.output_token_ids)
        if tok in req.stop_ids and n_out > p.min_tokens:
            return FINISH_STOP
        if n_out >= p.max_tokens or req.num_prompt_tokens + n_out >= self.max_model_len:
            return FINISH_LENGTH
        return None
