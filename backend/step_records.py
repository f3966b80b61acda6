"""The records a step leaves between the loop's phases: what was launched (StepState) and what was read back
(StepResult); shared by the executor, which makes them, and the step update and engine loop, which read them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from backend.request import Request

if TYPE_CHECKING:  # types only: the records hold these, made by the scheduler, the runner and the pipeline
    from backend.core.scheduler import ScheduledBatch
    from backend.executor.launch_plan import LaunchPlan
    from backend.executor.pipeline import Slot


@dataclass(slots=True)
class StepState:
    """A launched step: what it holds and where its results land."""

    batch: ScheduledBatch
    slot: Slot
    sampled: list[Request] = field(default_factory=list)  # requests in output-row order
    read_logprobs: bool = False
    num_top: int = 0
    max_len: int = 0  # longest context after this step of the batch's requests but its decode rows
    rows_version: int = -1  # the running batch's version when this step was packed from it
    plan: LaunchPlan | None = None  # how it runs on the device (ModelRunner.plan), set when its forward is queued
    logits: Any = None  # the forward's logits (a device tensor), which the step's sampling launch reads
    # the step's sampling waits for per-row host work that needs the step before's tokens (a grammar's token mask):
    # the loop queues the forward, reads and updates the step before, and only then queues this sampling
    sample_after_previous: bool = False
    _row_of: dict[int, int] | None = None

    def longest_context(self) -> int:
        """Longest context of the batch after this step. The decode rows' part is read from their counts when asked,
        in the step's launch (the counts move at the next schedule): a step that replays a graph never asks."""
        if not self.batch.num_rows:
            return self.max_len
        return max(self.max_len, int(self.batch.rows.computed.max()))

    @property
    def row_of(self) -> dict[int, int]:
        """id(request) → output row, made when first asked (after packing): most steps are never asked."""
        if self._row_of is None:
            self._row_of = dict(zip(map(id, self.sampled), range(len(self.sampled))))
        return self._row_of


@dataclass(slots=True)
class StepResult:
    """Tokens (and logprobs) read back for each sampled request of a step."""

    requests: list[Request]
    token_ids: list[int]
    logprobs: list[float] | None = None
    ranks: list[int] | None = None  # the sampled token's rank in its row, with logprobs
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
