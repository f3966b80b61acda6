"""The update of a step whose rows carried drafts: each row's kept tokens accepted as if they had come one step at
a time. A row none of whose tokens may end it (no stop token among them, far from its length limit, no grammar to
advance, no logprobs to report) appends them all at once; the others take them one by one through the step update's
one rule for a token (StepUpdater.accept_at: stop tokens, min_tokens, lengths, grammar, logprobs, final-only
requests)."""
from __future__ import annotations

from typing import Callable

import numpy as np

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
        tokens = np.asarray(result.token_ids, dtype=np.int64)
        # counts and blocks first, every row at its packed place: a request that finishes below leaves the rows
        counts = self.speculator.settle(st.batch, drafts, tokens)
        starts, ends = drafts.start_array, drafts.start_array + counts
        checked = self._rows_to_check(st, result, tokens, starts, ends)
        starts, ends = starts.tolist(), ends.tolist()
        token_ids, requests = result.token_ids, result.requests
        events: list = []
        emitted = 0
        for i in (~checked).nonzero()[0].tolist():
            req = requests[i]
            if req.is_finished:  # cannot happen: the step before was read before this one was packed
                continue
            span = token_ids[starts[i]:ends[i]]
            req.output_token_ids.extend(span)
            emitted += len(span)
            if not req.final_only:
                rid = req.request_id
                events.extend([(rid, tok) for tok in span])
        for i in checked.nonzero()[0].tolist():
            req = requests[i]
            if req.is_finished:
                continue
            for pos in range(starts[i], ends[i]):
                emitted += 1
                if self.updater.accept_at(req, result, pos, None, events, finish, exact_length=True) is not None:
                    break  # the tokens after a stop are dropped
        self.updater.settle_blocks(st.batch)
        return events, [token_ids[end - 1] for end in ends], emitted

    @staticmethod
    def _rows_to_check(st: StepState, result: StepResult, tokens: np.ndarray, starts: np.ndarray,
                       ends: np.ndarray) -> np.ndarray:
        """(sampled rows,) the rows whose tokens go one by one: prefill rows (a first token), rows whose tokens hold
        one of the rows' stop tokens, rows near their length limit, rows with a grammar; all when logprobs are read."""
        n, rb = st.batch.num_rows, st.batch.rows
        checked = np.ones(len(starts), dtype=bool)
        if result.logprobs is not None:
            return checked
        checked[:n] = rb.computed[:n] + 2 >= rb.token_cap[:n]  # a row's tokens after the step: computed + 1
        stop_ids = rb.stop_ids
        if stop_ids and not stop_ids.isdisjoint(result.token_ids):
            seen = np.concatenate(([0], np.cumsum(np.isin(tokens, np.fromiter(stop_ids, dtype=np.int64)))))
            checked |= seen[ends] > seen[starts]
        if rb.any_constrained:
            checked[:n] |= [req.matcher is not None or req.grammar is not None for req in rb.requests[:n]]
        return checked
