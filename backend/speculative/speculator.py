"""The engine's side of speculation: which decode rows of a scheduled step take drafted tokens (and the KV blocks
they need), which drafts the model kept once the step is read, and the counts for stats().

A row that feeds its last token and d drafts gets d + 1 positions of logits, each sampled as the row's token that
many steps later would be (verify.expand_rows). The row keeps the leading drafts its own samples equal, plus its
sample after them: e tokens emitted, its KV length advanced by exactly e, the blocks past them returned."""
from __future__ import annotations

from itertools import accumulate

from backend.core.kv_cache import BlockManager
from backend.core.scheduler import ScheduledBatch
from backend.request import Request
from backend.speculative.draft_policy import DraftPolicy
from backend.speculative.proposer import Proposer
from backend.speculative.token_history import TokenHistory


PROMPT_INDEX_BUDGET = 8192  # prompt tokens a proposing pass indexes for new rows (32,000 at once took 6 ms)


class StepDrafts:
    """The drafts one step carries, per sampled row in the step's output-row order (decode rows first), and each
    row's span among the step's logits rows."""

    __slots__ = ("drafts", "counts", "num_drafted", "_starts")

    def __init__(self, drafts: list[list[int]]) -> None:
        self.drafts = drafts  # each sampled row's drafted tokens ([] for none; prefill rows never draft)
        self.counts = [1 + len(d) for d in drafts]  # logits positions of each row: its own token's and one per draft
        self.num_drafted = sum(self.counts) - len(drafts)
        self._starts = list(accumulate(self.counts, initial=0))[:-1]

    def starts(self) -> list[int]:
        """Each sampled row's first position among the step's logits rows (the caller must not change it)."""
        return self._starts

    def kept(self, tokens: list[int]) -> list[int]:
        """Each row's leading drafts equal to the tokens the step sampled at their positions (draft j of a row is
        checked against the row's j-th sample: the model's token after the ones before it)."""
        kept = []
        for start, guess in zip(self._starts, self.drafts):
            k = 0
            while k < len(guess) and guess[k] == tokens[start + k]:
                k += 1
            kept.append(k)
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
        self._histories: dict[Request, TokenHistory] = {}  # a row's prompt (indexed a budget a pass) and outputs
        self._index_budget = PROMPT_INDEX_BUDGET  # prompt tokens this pass may still index
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
        self._index_budget = PROMPT_INDEX_BUDGET
        asking = [req for req in rows if req.may_speculate and req not in self._guesses
                  and self.policy.watch_length(req, step)]
        histories = [self._history(req) for req in asking]
        ready = [i for i, h in enumerate(histories) if h is not None]  # rows whose prompt is all indexed
        asking, histories = [asking[i] for i in ready], [histories[i] for i in ready]
        if not asking:
            return
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
        self._index_budget = PROMPT_INDEX_BUDGET
        sampled = [req for req, s in zip(batch.requests[n:], batch.samples[n:]) if s]
        rb = batch.rows
        tokens_left = self.max_step_tokens - batch.num_tokens
        rows_left = self.max_step_rows - n - len(sampled)
        bm = self.block_manager
        drafts: list[list[int]] = [[] for _ in range(n + len(sampled))]
        total = 0
        if self.proposer.drafts_together:
            self._prepare(batch, step, min(tokens_left, rows_left))
        for row, req in enumerate(rb.requests):
            k = self._limit(rb, row, min(tokens_left, rows_left))
            guess = self._guess(req, step, k) if k > 0 else []
            if not guess:
                continue
            held = len(req.block_ids)
            bm.allocate_slots(req, len(guess))
            if len(req.block_ids) > held:
                rb.add_draft_blocks(row, req.block_ids[held:])
            drafts[row] = guess
            total += len(guess)
            tokens_left -= len(guess)
            rows_left -= len(guess)
        if not total:
            return None
        return StepDrafts(drafts)

    def _prepare(self, batch: ScheduledBatch, step: int, room: int) -> None:
        """Tell the proposer every row that may ask at this step and its most drafts (the policy's length within the
        row's cap and the step's room; the asks that follow may take fewer)."""
        rb = batch.rows
        histories, ks = [], []
        for row, req in enumerate(rb.requests):
            k = self._limit(rb, row, room)
            if k > 0 and self.policy is not None:
                k = self.policy.draft_length(req, step, k)
            history = self._history(req) if k > 0 else None
            if history is not None:
                histories.append(history)
                ks.append(k)
        self.proposer.prepare(histories, ks)

    def _limit(self, rb, row: int, room: int) -> int:
        """The most drafts row may take: k, the step's room, and its cap (max_tokens, max_model_len: the drafts
        never outrun it); 0 for a request that does not speculate."""
        if not rb.requests[row].may_speculate:
            return 0
        return min(self.k, room, int(rb.token_cap[row] - rb.computed[row]) - 1)

    def _guess(self, req: Request, step: int, limit: int) -> list[int]:
        """req's drafts at this step: as many as the policy allows (at most limit) and its KV blocks can hold."""
        k = limit if self.policy is None else self.policy.draft_length(req, step, limit)
        history = self._history(req) if k else None
        if history is None:  # no drafts allowed, or its prompt is not all indexed yet
            return []
        guess = self.proposer.propose(history, k)[:k]
        bs = self.block_manager.block_size
        room = len(req.block_ids) * bs - req.num_computed_tokens + self.block_manager.num_free_blocks * bs
        guess = guess[:max(0, room)]
        if not guess and self.policy is not None:
            self.policy.verified(req, 0, 0)  # nothing to propose: as a miss, so the row watches
        return guess

    def settle(self, batch: ScheduledBatch, drafts: StepDrafts, tokens: list[int]) -> list[int]:
        """The step's tokens (every position of every sampled row) read: each decode row keeps its leading drafts
        that equal its samples, its count and blocks follow (the rest returned); returns the tokens each sampled row
        emits from its first position (drafts.starts()): its kept drafts and the model's token after them."""
        rb, bm, bs = batch.rows, self.block_manager, self.block_manager.block_size
        kept_rows = drafts.kept(tokens)
        self.steps += 1
        for row, (guess, kept) in enumerate(zip(drafts.drafts, kept_rows)):
            if not guess:
                continue
            self.drafts += 1
            self.proposed += len(guess)
            self.accepted += kept
            for position in range(kept):
                self.accepted_per_position[position] += 1
            req = rb.requests[row]
            if self.policy is not None:
                self.policy.verified(req, len(guess), kept)
            bm.release_tail(req, -(-(req.num_computed_tokens + kept) // bs))
            rb.keep_drafts(row, kept)
        return [kept + 1 for kept in kept_rows]

    def finished(self, req: Request) -> None:
        """req ended: its history (prompt and outputs) goes to the proposer, and is forgotten here."""
        if self.policy is not None:
            self.policy.forget(req)
        self._guesses.pop(req, None)
        history = self._histories.pop(req, None)
        if history is None or len(history) < req.num_prompt_tokens:  # never proposed for, or its prompt half indexed
            if req.output_token_ids:  # its outputs alone: a proposer learns from outputs (no prompt indexed for it)
                self.proposer.finished(TokenHistory(req.output_token_ids), 0)
            return
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

    def _history(self, req: Request) -> TokenHistory | None:
        """req's history, caught up with its outputs; None while its prompt is still being indexed: a pass indexes at
        most PROMPT_INDEX_BUDGET prompt tokens, so a long prompt (or a wave of new rows) takes a few steps, not one
        long pause."""
        history = self._histories.get(req)
        if history is None:
            history = self._histories[req] = TokenHistory()
        missing = req.num_prompt_tokens - len(history)
        if missing > 0:
            if self._index_budget <= 0:
                return None
            take = min(missing, self._index_budget)
            history.extend(req.prompt_token_ids[len(history):len(history) + take])
            self._index_budget -= take
            if take < missing:
                return None
        self._catch_up(req, history)
        return history

    @staticmethod
    def _catch_up(req: Request, history: TokenHistory) -> None:
        """Append the outputs the history lacks (a preempted request's prompt is the same, so it stays right)."""
        have = len(history) - req.num_prompt_tokens
        if have < len(req.output_token_ids):
            history.extend(req.output_token_ids[have:])
