"""Continuous batching: which requests run in the next step, with how many tokens, in which KV blocks."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from backend.core.kv_cache import BlockManager
from backend.request import Request, RequestStatus
from backend.core.steady_batch import SteadyBatch


@dataclass(slots=True)
class ScheduledBatch:
    """One step's work: requests in order, tokens each feeds, and whether its last token is sampled."""

    step_id: int
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)  # this step samples the request's next token
    num_tokens: int = 0
    is_decode_only: bool = True  # every request feeds exactly one token
    free_after: list[Request] = field(default_factory=list)  # finished while this step was queued
    steady: SteadyBatch | None = None  # set when the step was scheduled from a steady decode batch
    num_steady_rows: int = 0  # with steady: requests[:num_steady_rows] are its rows, the rest are joiners

    def __len__(self) -> int:
        return len(self.requests)


class Scheduler:
    """FIFO continuous batching with a token budget, chunked prefill and preemption by recompute."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, steady_decode: bool = True) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_manager.block_size)  # block-table width
        self.steady_decode = steady_decode
        self.waiting: deque[Request] = deque()
        # in admission order (oldest first); a dict as an ordered set: a finishing request leaves in O(1)
        self.running: dict[Request, None] = {}
        self.num_preemptions = 0
        self.num_steady_steps = 0  # steps scheduled from a steady batch (a figure for tests and stats)
        self.steady: SteadyBatch | None = None  # the running requests as arrays, while they stay the same
        self._last_requests: list[Request] = []  # the previous general step's requests
        self._next_step_id = 0
        # samples (n > 1) that took their first sample's prompt blocks while scheduling the last step: they queue
        # at the next schedule, so no step reads KV that the same step writes
        self._forked: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._forked)

    def remove(self, req: Request) -> None:
        """Drop a finished or aborted request from the queues (its blocks are freed by the engine)."""
        if req in self.running:
            del self.running[req]
            if self.steady is not None:
                self.steady.remove(req)
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
        self._end_steady()
        self._last_requests = []

    def _end_steady(self) -> None:
        """The steady run ends (rows changed beyond its rules, blocks ran out, a preemption): its rows' requests are
        brought up to date."""
        if self.steady is not None:
            self.steady.release_rows()
            self.steady = None

    def schedule(self) -> ScheduledBatch | None:
        """Pick the next step: running requests first (oldest first), then waiting ones in arrival order."""
        if self._forked:  # first in line: they arrived with the sample that just finished its prompt
            self.waiting.extendleft(reversed(self._forked))
            self._forked.clear()
        if self.steady is not None:
            batch = self._schedule_steady(self.steady)
            if batch is not None:
                return batch
            self._end_steady()
        batch = self._schedule_general()
        if batch is not None and self.steady_decode:
            self._maybe_start_steady(batch)
        return batch

    def _schedule_steady(self, sb: SteadyBatch) -> ScheduledBatch | None:
        """The steady rows each feed their one pending token: joiners whose prompt is done become rows, and rows at
        a length limit leave the run first. Joiners still in prefill, then waiting requests, follow by the
        general rules. None: KV blocks ran out, so the general path (which preempts) must decide."""
        sb.take_joiners()
        sb.retire_rows_at_length_limit()  # after: a joiner that sampled its last token leaves at once
        if not len(sb):
            return None
        if not self._give_rows_blocks(sb):
            return None
        chunks = self._joiner_chunks(sb, self.max_num_batched_tokens - len(sb))
        if chunks is None:
            return None
        tail, budget = chunks
        step_id = self._next_step_id
        self._next_step_id += 1
        sb.advance(step_id)
        n = len(sb)
        batch = ScheduledBatch(step_id, requests=list(sb.requests), num_new_tokens=[1] * n, samples=[True] * n,
                               num_tokens=n, is_decode_only=True, steady=sb, num_steady_rows=n)
        for req, k in tail:
            self._add_to_batch(batch, req, k)
        self._admit_waiting(batch, budget)  # admitted requests become joiners of the run
        self.num_steady_steps += 1
        return batch

    def _give_rows_blocks(self, sb: SteadyBatch) -> bool:
        """A new KV block for each row whose next token starts one; False when too few are free (the rows that
        could take one keep it, and the general path, which preempts, must decide)."""
        bm = self.block_manager
        needing = sb.rows_needing_block()
        if not needing.size:
            return True
        requests = sb.requests
        blocks = bm.append_one_block_each([requests[row] for row in needing.tolist()])
        if blocks is not None:
            sb.add_blocks(needing, blocks)
            return True
        for row in needing.tolist():  # too few free at once: one by one, as many rows as can take one
            sb.sync(requests[row])  # allocate_slots reads its token count
            if not bm.allocate_slots(requests[row], 1):
                return False  # blocks taken so far stay with their requests
            sb.add_block(row, requests[row].block_ids[-1])
        return True

    def _joiner_chunks(self, sb: SteadyBatch, budget: int) -> tuple[list[tuple[Request, int]], int] | None:
        """The joiners' prefill chunks that fit the token budget, each given its KV blocks before anything is
        counted, and the budget they leave; None when blocks ran out."""
        bm, bs = self.block_manager, self.block_manager.block_size
        tail: list[tuple[Request, int]] = []
        for req in sb.joiners:
            n = self._tokens_to_feed(req, budget)
            if not n:
                continue
            if req.num_computed_tokens + n > len(req.block_ids) * bs and not bm.allocate_slots(req, n):
                return None
            tail.append((req, n))
            budget -= n
        return tail, budget

    def _maybe_start_steady(self, batch: ScheduledBatch) -> None:
        """Two general steps in a row fed one token to every running request, each sampled: keep them as arrays."""
        same = batch.requests == self._last_requests
        self._last_requests = batch.requests
        if (same and batch.is_decode_only and len(batch.requests) == len(self.running)
                and batch.requests == list(self.running) and all(batch.samples)
                and all(map(SteadyBatch.eligible, batch.requests))):
            self.steady = SteadyBatch(batch.requests, self.block_manager.block_size, self.max_model_len,
                                      self.max_blocks)

    def _schedule_general(self) -> ScheduledBatch | None:
        batch = ScheduledBatch(step_id=self._next_step_id)
        budget = self.max_num_batched_tokens
        bm, bs = self.block_manager, self.block_manager.block_size
        preempted = False
        order = list(self.running)  # preemption takes the newest first: from the end
        i = 0
        while i < len(order) and budget > 0:
            req = order[i]
            n = self._tokens_to_feed(req, budget)
            if not n:
                i += 1
                continue
            fits = req.num_computed_tokens + n <= len(req.block_ids) * bs  # the common decode case
            while not fits and not bm.allocate_slots(req, n):
                victim = order.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                self._add_to_batch(batch, req, n)
                budget -= n
                i += 1
        if not preempted:
            self._admit_waiting(batch, budget)
        if not batch.requests:
            return None
        self._next_step_id += 1
        return batch

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
            if self.steady is not None:
                self.steady.joiners.append(req)
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
        self._end_steady()
        self.block_manager.register_full_blocks(req, req.num_computed_tokens)
        self.block_manager.free(req)
        req.blocks_freed = False
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
