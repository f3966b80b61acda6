"""The update of a step whose rows carried drafts: each row's kept tokens accepted one by one through the step
update's one rule for a token (StepUpdater.accept_at: stop tokens, min_tokens, lengths, grammar, logprobs,
final-only requests), as if they had come one step at a time."""
from __future__ import annotations

from typing import Callable

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
        spans = self.speculator.settle(st.batch, drafts, result.token_ids)
        events: list = []
        emitted = 0
        for req, (start, count) in zip(result.requests, spans):
            if req.is_finished:  # cannot happen: the step before was read before this one was packed
                continue
            for pos in range(start, start + count):
                emitted += 1
                if self.updater.accept_at(req, result, pos, None, events, finish, exact_length=True) is not None:
                    break  # the tokens after a stop are dropped
        self.updater.settle_blocks(st.batch)
        return events, [result.token_ids[start + count - 1] for start, count in spans], emitted
