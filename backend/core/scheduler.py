"""Continuous batching: which requests run in the next step, with how many tokens, in which KV blocks."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from backend.core.kv_cache import BlockManager
from backend.core.running_batch import RunningBatch
from backend.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledBatch:
    """One step's work: the running batch's decode rows (one token each), then prefill chunks, and whether each
    request's last token is sampled."""

    step_id: int
    rows: RunningBatch  # requests[:num_rows] are its decode rows, as they stood when the step was scheduled
    num_rows: int = 0
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)  # this step samples the request's next token
    num_tokens: int = 0
    is_decode_only: bool = True  # every request feeds exactly one token
    free_after: list[Request] = field(default_factory=list)  # finished while this step was queued

    def __len__(self) -> int:
        return len(self.requests)


class Scheduler:
    """FIFO continuous batching with a token budget, chunked prefill and preemption by recompute.

    Every step takes the same path: prefilled requests become decode rows, rows at a length limit leave, each row
    gets the KV block its next token needs (the newest running requests are preempted when blocks run out), every
    row feeds its one pending token, the prefilling requests' chunks follow within the token budget, and waiting
    requests are admitted into what is left."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_manager.block_size)  # block-table width
        self.waiting: deque[Request] = deque()
        # in admission order (oldest first); a dict as an ordered set: a finishing request leaves in O(1)
        self.running: dict[Request, None] = {}
        self.num_preemptions = 0
        self.batch = self._new_batch()  # the running requests: prefilling, and decode rows as arrays
        self._next_step_id = 0
        # samples (n > 1) that took their first sample's prompt blocks while scheduling the last step: they queue
        # at the next schedule, so no step reads KV that the same step writes
        self._forked: list[Request] = []

    def _new_batch(self) -> RunningBatch:
        return RunningBatch(self.block_manager.block_size, self.max_model_len, self.max_blocks)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._forked)

    def remove(self, req: Request) -> None:
        """Drop a finished or aborted request from the queues (its blocks are freed by the engine)."""
        if req in self.running:
            del self.running[req]
            self.batch.remove(req)
        elif req in self._forked:
            self._forked.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass

    def clear(self) -> None:
        """Forget every request (the engine failed or stopped them all)."""
        self.waiting.clear()
        self.running.clear()
        self._forked.clear()
        self.batch.release_all()
        self.batch = self._new_batch()

    def schedule(self) -> ScheduledBatch | None:
        """Pick the next step: the running requests first (rows, then prefill chunks in admission order), then
        waiting ones in arrival order; None when nothing can run."""
        if self._forked:  # first in line: they arrived with the sample that just finished its prompt
            self.waiting.extendleft(reversed(self._forked))
            self._forked.clear()
        rb = self.batch
        rb.promote_prefilled()
        rb.retire_rows_at_length_limit()  # after: a request that sampled its last token leaves at once
        preempted = self._give_rows_blocks(rb)
        chunks, budget, more = self._prefill_chunks(rb, self.max_num_batched_tokens - len(rb))
        preempted = preempted or more
        batch = ScheduledBatch(self._next_step_id, rb)
        if len(rb):
            rb.advance(batch.step_id)
            n = batch.num_rows = len(rb)
            batch.requests, batch.num_new_tokens, batch.samples = list(rb.requests), [1] * n, [True] * n
            batch.num_tokens = n
        for req, k in chunks:
            self._add_to_batch(batch, req, k)
        if not preempted:
            self._admit_waiting(batch, budget)  # admitted requests prefill from this step on
        if not batch.requests:
            return None
        self._next_step_id += 1
        return batch

    def _give_rows_blocks(self, rb: RunningBatch) -> bool:
        """A new KV block for each row whose next token starts one, preempting the newest running requests while too
        few are free; whether any request was preempted."""
        bm = self.block_manager
        needing = rb.rows_needing_block()
        if not needing.size:
            return False
        requests = rb.requests
        blocks = bm.append_one_block_each([requests[row] for row in needing.tolist()])
        if blocks is not None:
            rb.add_blocks(needing, blocks)
            return False
        # too few free at once: one by one, oldest first, preempting the newest running requests for them (a row
        # that is preempted itself needs none; rows move as others leave, so each is found by its request)
        preempted = False
        rank = {req: i for i, req in enumerate(self.running)}
        for req in sorted((requests[row] for row in needing.tolist()), key=rank.__getitem__):
            while req.row_batch is rb and not bm.allocate_slots(req, 1):
                self._preempt(self._newest_running())
                preempted = True
            if req.row_batch is rb:
                rb.add_blocks(np.array([rb.requests.index(req)]), [req.block_ids[-1]])
        return preempted

    def _newest_running(self) -> Request:
        return next(reversed(self.running))

    def _prefill_chunks(self, rb: RunningBatch, budget: int) -> tuple[list[tuple[Request, int]], int, bool]:
        """The prefilling requests' chunks that fit the token budget, each given its KV blocks (the newest running
        requests preempted while too few are free), the budget they leave, and whether any request was preempted."""
        bm, bs = self.block_manager, self.block_manager.block_size
        chunks: list[tuple[Request, int]] = []
        preempted = False
        for req in list(rb.prefilling):
            if req not in self.running:  # preempted for an older one's blocks
                continue
            n = self._tokens_to_feed(req, budget)
            if not n:
                continue
            fits = req.num_computed_tokens + n <= len(req.block_ids) * bs
            while not fits and not bm.allocate_slots(req, n):
                victim = self._newest_running()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                chunks.append((req, n))
                budget -= n
        return chunks, budget, preempted

    def _tokens_to_feed(self, req: Request, budget: int) -> int:
        """Tokens a running request feeds this step within budget; 0 for none. A request at a length limit feeds
        nothing: it only waits for its last token to finish it."""
        if req.num_output_tokens >= req.params.max_tokens or req.num_tokens >= self.max_model_len:
            return 0
        return max(0, min(req.num_tokens - req.num_computed_tokens, budget))

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.num_pending:  # preempted while a step held it: its last token is not read yet
                break
            if not req.block_ids:
                req.num_computed_tokens = bm.match_prefix(req)
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not bm.allocate_slots(req, n):
                # a waiting request holds no blocks, so running ones can always make progress
                bm.free(req)
                req.blocks_freed = False
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running[req] = None
            self.batch.admit(req)
            self._add_to_batch(batch, req, n)
            budget -= n

    def _add_to_batch(self, batch: ScheduledBatch, req: Request, n: int) -> None:
        req.num_computed_tokens += n
        samples = req.num_computed_tokens == req.num_tokens
        if samples:
            req.add_pending()  # the step samples a token the host will only see later
        req.last_step_id = batch.step_id
        batch.requests.append(req)
        batch.num_new_tokens.append(n)
        batch.samples.append(samples)
        batch.num_tokens += n
        if n != 1:
            batch.is_decode_only = False
        if req.forks and req.num_computed_tokens >= req.num_prompt_tokens:
            live = [sample for sample in req.forks if not sample.is_finished]
            for sample in live:
                self.block_manager.share_prompt(req, sample)
            self._forked += live
            req.forks = []

    def _preempt(self, req: Request) -> None:
        """Free req's blocks and requeue it first in line; it recomputes its tokens when readmitted, from the cached
        blocks it still finds (its full blocks are hashed first)."""
        del self.running[req]
        self.batch.remove(req)  # a row's counts are its own again
        self.block_manager.register_full_blocks(req, req.num_computed_tokens)
        self.block_manager.free(req)
        req.blocks_freed = False
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
