"""The update of a step whose rows carried drafts: each row's kept tokens accepted as if they had come one step at
a time. A row none of whose tokens may end it (no stop token among them, far from its length limit, no grammar to
advance, no logprobs to report) appends them all at once; the others take them one by one through the step update's
one rule for a token (StepUpdater.accept_at: stop tokens, min_tokens, lengths, grammar, logprobs, final-only
requests)."""
from __future__ import annotations

from typing import Callable

from backend.core.running_batch import LENGTH_MARGIN
from backend.core.step_update import StepUpdater
from backend.request import Request
from backend.speculative.speculator import Speculator, StepDrafts
from backend.step_records import StepResult, StepState


class DraftedStepUpdater:
    """Settles a drafted step's rows (Speculator.settle), then accepts their tokens and ends requests."""

    def __init__(self, updater: StepUpdater, speculator: Speculator) -> None:
        self.updater = updater
        self.speculator = speculator

    def apply(self, st: StepState, result: StepResult, drafts: StepDrafts,
              finish: Callable[[Request, str, None], None]) -> tuple[list, list[int], int]:
        """The step's events for the output thread, each sampled row's last emitted token, and the tokens the
        rows emitted."""
        # counts and blocks first, every row at its packed place: a request that finishes below leaves the rows
        counts = self.speculator.settle(st.batch, drafts, result.token_ids)
        rb, n = st.batch.rows, st.batch.num_rows
        token_ids = result.token_ids
        # rows' room to their length caps, read before any request finishes and leaves the rows (None: every row
        # takes the one-token rule, as logprobs are reported); no step runs ahead of a drafted one: they are current
        room = None if result.logprobs is not None else (rb.token_cap[:n] - rb.computed[:n]).tolist()
        stop_ids = rb.stop_ids
        events: list = []
        last: list[int] = []
        emitted = 0
        for row, (req, start, count) in enumerate(zip(result.requests, drafts.starts(), counts)):
            end = start + count
            last.append(token_ids[end - 1])
            if req.is_finished:  # cannot happen: the step before was read before this one was packed
                continue
            span = token_ids[start:end]
            if (row < n and room is not None and room[row] > LENGTH_MARGIN and req.grammar is None
                    and stop_ids.isdisjoint(span)):  # nothing in its tokens can end it: all of them at once
                req.output_token_ids.extend(span)
                emitted += count
                if not req.final_only:
                    rid = req.request_id
                    events.extend([(rid, tok) for tok in span])
                continue
            for pos in range(start, end):
                emitted += 1
                if self.updater.accept_at(req, result, pos, None, events, finish, exact_length=True) is not None:
                    break  # the tokens after a stop are dropped
        self.updater.settle_blocks(st.batch)
        return events, last, emitted
