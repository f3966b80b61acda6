"""The engine's side of speculation: which decode rows of a scheduled step take drafted tokens (and the KV blocks
they need), which drafts the model kept once the step is read, and the counts for stats().

A row that feeds its last token and d drafts gets d + 1 positions of logits, each sampled as the row's token that
many steps later would be (verify.expand_rows). The row keeps the leading drafts its own samples equal, plus its
sample after them: e tokens emitted, its KV length advanced by exactly e, the blocks past them returned."""
from __future__ import annotations

from itertools import chain

import numpy as np

from backend.core.kv_cache import BlockManager
from backend.core.scheduler import ScheduledBatch
from backend.request import Request
from backend.speculative.draft_policy import DraftPolicy
from backend.speculative.proposer import Proposer
from backend.speculative.token_history import TokenHistory


class StepDrafts:
    """The drafts one step carries, per sampled row in the step's output-row order (decode rows first), and the
    arrays the launch and the settling read them through."""

    __slots__ = ("drafts", "num_drafted", "lengths", "start_array", "draft_rows", "draft_tokens", "draft_offsets")

    def __init__(self, drafts: list[list[int]]) -> None:
        self.drafts = drafts  # each sampled row's drafted tokens ([] for none; prefill rows never draft)
        self.lengths = np.fromiter(map(len, drafts), dtype=np.int64, count=len(drafts))  # (rows,) drafts a row
        self.num_drafted = int(self.lengths.sum())
        counts = self.lengths + 1
        self.start_array = np.cumsum(counts) - counts  # (rows,) each row's first position among the logits rows
        self.draft_rows = np.repeat(np.arange(len(drafts)), self.lengths)  # (D,) each draft's row
        self.draft_tokens = np.fromiter(chain.from_iterable(drafts), dtype=np.int64, count=self.num_drafted)
        # (D,) each draft's place in its row's span: 1 for the first draft (0 is the row's own token)
        self.draft_offsets = np.arange(self.num_drafted) - np.repeat(np.cumsum(self.lengths) - self.lengths,
                                                                     self.lengths) + 1

    @property
    def counts(self) -> list[int]:
        """Logits positions of each sampled row: its own token's and one per draft."""
        return (self.lengths + 1).tolist()

    def starts(self) -> list[int]:
        """Each sampled row's first position among the step's logits rows."""
        return self.start_array.tolist()

    def kept(self, tokens: np.ndarray) -> np.ndarray:
        """(rows,) each row's leading drafts equal to the tokens the step sampled at their positions (a draft at
        position i of a span is checked against the sample at i - 1: the model's token after the ones before it)."""
        rows, offsets = self.draft_rows, self.draft_offsets
        right = tokens[self.start_array[rows] + offsets - 1] == self.draft_tokens  # (D,)
        # a draft counts while every draft before it in its row is right: the first wrong one of a row ends it
        kept = self.lengths.copy()
        wrong = ~right
        if wrong.any():
            first_wrong = np.full(len(self.lengths), np.iinfo(np.int64).max)
            np.minimum.at(first_wrong, rows[wrong], offsets[wrong] - 1)
            kept = np.minimum(kept, first_wrong)
        return kept


class Speculator:
    """Proposes drafts for a step's decode rows within the step's token, row and KV-block room, settles each row's
    count and blocks once the step is read, and keeps each request's token history for its proposer."""

    def __init__(self, proposer: Proposer, num_tokens: int, block_manager: BlockManager, max_step_tokens: int,
                 max_step_rows: int, adaptive: bool = True) -> None:
        """adaptive: a DraftPolicy decides which steps and rows draft, and how much; else every row drafts k."""
        self.proposer = proposer
        self.k = num_tokens
        self.policy = DraftPolicy(num_tokens) if adaptive else None
        self.block_manager = block_manager
        self.max_step_tokens = max_step_tokens  # a slot's token buffers
        self.max_step_rows = max_step_rows  # a slot's logits and sampling rows: every drafted position takes one
        self._histories: dict[Request, TokenHistory] = {}
        # watching rows' unverified guesses: (outputs the row had when guessed, the guess), checked as tokens come
        self._guesses: dict[Request, tuple[int, list[int]]] = {}
        self.proposed = self.accepted = self.steps = self.drafts = 0  # drafts: rows' drafted spans verified
        self.accepted_per_position = [0] * num_tokens  # drafts kept at each position of a span

    def counts(self) -> dict:
        return {"spec_proposed_tokens": self.proposed, "spec_accepted_tokens": self.accepted,
                "spec_steps": self.steps, "spec_drafts": self.drafts,
                "spec_accepted_per_position": list(self.accepted_per_position)}

    def due(self, step: int, num_rows: int, draftable_rows: int) -> bool:
        """Whether step, of about num_rows decode rows of which draftable_rows may draft, holds drafts (then the
        step before it must be read first)."""
        if not draftable_rows:
            return False
        return self.policy is None or self.policy.due(step, num_rows, draftable_rows)

    def step_done(self, step: int, num_rows: int, drafted: bool, tokens: int, seconds: float) -> None:
        if self.policy is not None:
            self.policy.step_done(step, num_rows, drafted, tokens, seconds)

    def watch(self, rows: list[Request], draftable: int, step: int) -> None:
        """After a step's tokens were applied: check the watching rows' guesses against the tokens they made, and have
        the rows whose watch step this is guess again (the policy's; nothing is drafted or verified on the device).
        rows: the running decode rows, draftable of them may speculate."""
        if self.policy is None:
            return
        for req, (at, guess) in list(self._guesses.items()):
            made = req.output_token_ids[at:at + len(guess)]
            kept = 0
            while kept < len(made) and made[kept] == guess[kept]:
                kept += 1
            if kept < len(made) or len(made) == len(guess):  # a wrong token, or every guess checked
                del self._guesses[req]
                self.policy.verified(req, len(guess), kept)
        if not self.policy.watch_due(step, draftable):
            return
        asking = [req for req in rows if req.may_speculate and req not in self._guesses
                  and self.policy.watch_length(req, step)]
        if not asking:
            return
        histories = [self._history(req) for req in asking]
        if self.proposer.drafts_together:
            self.proposer.prepare(histories, [self.k] * len(asking))
        for req, history in zip(asking, histories):
            guess = self.proposer.propose(history, self.k)[:self.k]
            if guess:
                self._guesses[req] = (len(req.output_token_ids), guess)
            else:
                self.policy.verified(req, 0, 0)

    def propose(self, batch: ScheduledBatch, step: int = 0) -> StepDrafts | None:
        """Drafts for the step's decode rows (their blocks taken); None when no row drafts."""
        n = batch.num_rows
        if not n:
            return None
        prefill_sampled = sum(1 for s in batch.samples[n:] if s)
        rb = batch.rows
        # the step's room: a slot's token buffers, and its logits rows (every drafted position takes one)
        room = min(self.max_step_tokens - batch.num_tokens, self.max_step_rows - n - prefill_sampled)
        if room <= 0:
            return None
        caps = self._caps(rb)
        if self.proposer.drafts_together:
            self._prepare(batch, step, room, caps)
        bm = self.block_manager
        bs = bm.block_size
        computed, held = rb.computed.tolist(), rb.num_blocks.tolist()  # the fed token counted
        free = bm.num_free_blocks
        none: list[int] = []  # shared by every row without drafts (read only)
        drafts = [none] * (n + prefill_sampled)
        total = 0
        for row, req in enumerate(rb.requests):
            limit = min(caps[row], room)
            if limit <= 0:
                continue
            guess = self._guess(req, step, limit, held[row] * bs - computed[row] + free * bs)
            if not guess:
                continue
            need = -(-(computed[row] + len(guess)) // bs) - held[row]
            if need > 0:  # the drafts run past the row's last block (a few rows a step)
                bm.allocate_slots(req, len(guess))
                rb.add_draft_blocks(row, req.block_ids[held[row]:])
                free = bm.num_free_blocks
            drafts[row] = guess
            total += len(guess)
            room -= len(guess)
        if not total:
            return None
        return StepDrafts(drafts)

    def _prepare(self, batch: ScheduledBatch, step: int, room: int, caps: list[int]) -> None:
        """Tell the proposer every row that may ask at this step and its most drafts (the policy's length within the
        row's cap and the step's room; the asks that follow may take fewer)."""
        rb = batch.rows
        histories, ks = [], []
        for row, req in enumerate(rb.requests):
            k = min(caps[row], room)
            if k > 0 and self.policy is not None:
                k = self.policy.draft_length(req, step, k)
            if k > 0:
                histories.append(self._history(req))
                ks.append(k)
        self.proposer.prepare(histories, ks)

    def _caps(self, rb) -> list[int]:
        """The most drafts each row may take: k, and its cap (max_tokens, max_model_len: the drafts never outrun
        it); 0 for a request that does not speculate."""
        caps = np.minimum(rb.token_cap - rb.computed - 1, self.k)
        if rb.draftable_rows < len(rb.requests):
            caps[[not req.may_speculate for req in rb.requests]] = 0
        return caps.tolist()

    def _guess(self, req: Request, step: int, limit: int, kv_room: int) -> list[int]:
        """req's drafts at this step: as many as the policy allows (at most limit) and kv_room (the tokens its
        blocks and the free blocks hold past its fed token) allows."""
        k = limit if self.policy is None else self.policy.draft_length(req, step, limit)
        if not k:
            return []
        guess = self.proposer.propose(self._history(req), k)[:min(k, max(0, kv_room))]
        if not guess and self.policy is not None:
            self.policy.verified(req, 0, 0)  # nothing to propose: as a miss, so the row watches
        return guess

    def settle(self, batch: ScheduledBatch, drafts: StepDrafts, tokens: np.ndarray) -> np.ndarray:
        """The step's tokens (every position of every sampled row, as an array) read: each decode row keeps its
        leading drafts that equal its samples, its count and blocks follow (the rest returned); returns the tokens
        each sampled row emits from its first position (drafts.start_array): its kept drafts and the model's token
        after them."""
        kept = drafts.kept(tokens)
        self.steps += 1
        rows = drafts.lengths.nonzero()[0]  # decode rows that drafted (prefill rows never do)
        if rows.size:
            rb, bm, bs = batch.rows, self.block_manager, self.block_manager.block_size
            proposed, kept_rows = drafts.lengths[rows], kept[rows]
            self.drafts += len(rows)
            self.proposed += drafts.num_drafted
            self.accepted += int(kept_rows.sum())
            keeping = np.bincount(kept_rows, minlength=self.k + 1)[::-1].cumsum()[::-1]  # rows keeping >= i drafts
            for position in range(self.k):
                self.accepted_per_position[position] += int(keeping[position + 1])
            if self.policy is not None:
                for row, p, k in zip(rows.tolist(), proposed.tolist(), kept_rows.tolist()):
                    self.policy.verified(rb.requests[row], p, k)
            keep_blocks = -(-(rb.computed[rows] + kept_rows) // bs)
            shrink = keep_blocks < rb.num_blocks[rows]  # rows whose rejected drafts took blocks of their own
            for row, keep in zip(rows[shrink].tolist(), keep_blocks[shrink].tolist()):
                bm.release_tail(rb.requests[row], keep)
            rb.keep_drafts(rows, kept_rows)
        return kept + 1

    def finished(self, req: Request) -> None:
        """req ended: its history (prompt and outputs) goes to the proposer, and is forgotten here."""
        if self.policy is not None:
            self.policy.forget(req)
        self._guesses.pop(req, None)
        history = self._histories.pop(req, None)
        if history is None:
            if not req.output_token_ids:
                return
            history = TokenHistory(req.prompt_token_ids)
        self._catch_up(req, history)
        self.proposer.finished(history, req.num_prompt_tokens)

    def forget_all(self) -> None:
        self._histories.clear()
        self._guesses.clear()
        self.proposer.forget_all()
        if self.policy is not None:
            self.policy.forget_all()

    def release(self) -> None:
        """The loop stopped: the proposer (a draft model's weights and cache among them) goes."""
        self.forget_all()
        self.proposer = None

    def _history(self, req: Request) -> TokenHistory:
        history = self._histories.get(req)
        if history is None:
            history = self._histories[req] = TokenHistory(req.prompt_token_ids)
        self._catch_up(req, history)
        return history

    @staticmethod
    def _catch_up(req: Request, history: TokenHistory) -> None:
        """Append the outputs the history lacks (a preempted request's prompt is the same, so it stays right)."""
        have = len(history) - req.num_prompt_tokens
        if have < len(req.output_token_ids):
            history.extend(req.output_token_ids[have:])
