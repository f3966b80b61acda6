"""When drafting pays: which rows draft at a step and how many tokens, from each request's measured acceptance and
what drafted steps measurably gave at the step's batch size.

A drafted step costs more than a plain one: it runs eagerly, on the synchronous pipeline (the step before must be
read first), and every draft is a token of compute. So drafting is the exception that must earn its place:
- a row drafts while its acceptance (a moving average of the share of its drafts kept) stays at least
  MIN_ACCEPTANCE, and drafts only as many tokens as are likely to be kept (the i-th draft is kept with about
  acceptance^i); a row below it, or whose proposer had nothing, waits for a probe: steps that are multiples of its
  back-off (2, 4, ... MAX_BACKOFF), so rows that keep failing probe together and cost one drafted step in
  MAX_BACKOFF at most;
- a new request starts from what requests before it measured: where their acceptance is low it waits for a probe
  too, so a stream of arrivals that never draft well does not make every step a drafted one;
- per batch-size bucket, the tokens a second of drafted steps gave is compared with plain steps'; a bucket whose
  drafted steps give less stops drafting until its own probe step, with the same doubling back-off. Plain steps are
  measured only in runs (the first plain step after a drafted one emits nothing: its tokens are read a step later),
  and where a bucket that drafted has no plain figure yet (its rows drafted from their first step) or one older than
  STALE steps, its next CONTROL_RUN steps run plain to measure it."""
from __future__ import annotations

import math
from dataclasses import dataclass

MIN_ACCEPTANCE = 0.2  # a row drafts while at least this share of its drafts is kept
WORTH = 0.1  # a draft position is proposed while its chance to be kept is at least this
MAX_BACKOFF = 64  # steps between probes of a row (or bucket) that keeps failing
SMOOTHING = 0.3  # weight of the newest observation in the moving averages
FIRST_ACCEPTANCE = 0.5  # the acceptance assumed before any draft was checked
NEW_ROW_BACKOFF = 16  # a new request's back-off where the requests before it keep little of their drafts
STALE = 256  # steps after which a bucket's plain-step figure is renewed
CONTROL_RUN = 4  # plain steps in a row that renew it


@dataclass(slots=True)
class _RowState:
    acceptance: float = FIRST_ACCEPTANCE
    backoff: int = 1  # 1: drafts at every step; more: only at steps that are multiples of it


@dataclass(slots=True)
class _BucketRates:
    plain: float = 0.0  # tokens per second of plain steps (moving average; 0 before any)
    drafted: float = 0.0  # tokens per second of drafted steps
    backoff: int = 1
    plain_at: int = 0  # the step of the last plain figure
    control_until: int = -1  # steps before this one run plain, to renew the plain figure


class DraftPolicy:
    """Decides per step whether any row drafts, per row how many tokens, and learns from what steps gave."""

    def __init__(self, num_tokens: int) -> None:
        self.k = num_tokens
        self._rows: dict[object, _RowState] = {}
        self._buckets: dict[int, _BucketRates] = {}
        self._drafting = 0  # rows with back-off 1
        self._waiting: dict[int, int] = {}  # back-off -> rows waiting with it
        self._acceptance = FIRST_ACCEPTANCE  # over every request's checked drafts: where new requests start
        self._last_plain = False  # the step before was a plain one

    def due(self, step: int, num_rows: int, draftable_rows: int | None = None) -> bool:
        """Whether a step of num_rows decode rows (draftable_rows of them may draft; default all) may hold drafts
        (then the step before must be read first)."""
        draftable = num_rows if draftable_rows is None else draftable_rows
        if not draftable or not self._bucket_allows(step, num_rows):
            return False
        new_rows = len(self._rows) < draftable and (self._acceptance >= MIN_ACCEPTANCE or step % NEW_ROW_BACKOFF == 0)
        return new_rows or self._drafting > 0 or any(step % b == 0 for b in self._waiting)

    def draft_length(self, req: object, step: int, limit: int) -> int:
        """How many tokens req may draft at this step (0: none), at most limit."""
        state = self._row(req)
        if state.backoff > 1 and step % state.backoff:
            return 0
        useful = self.k if state.acceptance >= 1.0 else int(math.log(WORTH) / math.log(max(state.acceptance, 1e-6)))
        return max(1, min(self.k, limit, useful))

    def verified(self, req: object, proposed: int, kept: int) -> None:
        """req's drafts of a step were checked: proposed of them, kept leading ones accepted (proposed 0: its
        proposer had nothing, which counts as a miss)."""
        state = self._row(req)
        share = kept / proposed if proposed else 0.0
        state.acceptance += SMOOTHING * (share - state.acceptance)
        self._acceptance += SMOOTHING * (share - self._acceptance)
        if state.acceptance >= MIN_ACCEPTANCE and proposed:
            self._set_backoff(state, 1)
        else:
            self._set_backoff(state, min(2 * state.backoff, MAX_BACKOFF))

    def step_done(self, step: int, num_rows: int, drafted: bool, tokens: int, seconds: float) -> None:
        """Step step, of num_rows decode rows, emitted tokens in seconds (a drafted step's time includes reading
        the step before it, and its tokens that step's)."""
        steady, self._last_plain = self._last_plain, not drafted
        if seconds <= 0 or not num_rows or (not drafted and not steady):
            return
        rates = self._buckets.setdefault(_bucket(num_rows), _BucketRates())
        rate = tokens / seconds
        if drafted:
            rates.drafted = rate if not rates.drafted else rates.drafted + SMOOTHING * (rate - rates.drafted)
            if rates.plain:
                rates.backoff = 1 if rates.drafted >= rates.plain else min(2 * rates.backoff, MAX_BACKOFF)
        else:
            rates.plain = rate if not rates.plain else rates.plain + SMOOTHING * (rate - rates.plain)
            rates.plain_at = step

    def forget_all(self) -> None:
        """Every request forgotten (the engine recovered from a failed step); what steps gave is kept."""
        self._rows.clear()
        self._drafting = 0
        self._waiting.clear()

    def forget(self, req: object) -> None:
        state = self._rows.pop(req, None)
        if state is not None:
            self._count(state.backoff, -1)

    def _bucket_allows(self, step: int, num_rows: int) -> bool:
        rates = self._buckets.get(_bucket(num_rows))
        if rates is None:
            return True
        if step < rates.control_until:
            return False
        if rates.drafted and (not rates.plain or step - rates.plain_at > STALE):
            rates.control_until = step + CONTROL_RUN
            return False
        return rates.backoff == 1 or step % rates.backoff == 0

    def _row(self, req: object) -> _RowState:
        state = self._rows.get(req)
        if state is None:
            low = self._acceptance < MIN_ACCEPTANCE
            state = self._rows[req] = _RowState(self._acceptance, NEW_ROW_BACKOFF if low else 1)
            self._count(state.backoff, 1)
        return state

    def _set_backoff(self, state: _RowState, backoff: int) -> None:
        if backoff != state.backoff:
            self._count(state.backoff, -1)
            state.backoff = backoff
            self._count(backoff, 1)

    def _count(self, backoff: int, delta: int) -> None:
        if backoff == 1:
            self._drafting += delta
            return
        left = self._waiting.get(backoff, 0) + delta
        if left:
            self._waiting[backoff] = left
        else:
            self._waiting.pop(backoff, None)


def _bucket(num_rows: int) -> int:
    """Batch sizes 1, 2, 3-4, 5-8, ...: the power of two at or above num_rows."""
    return 1 << (num_rows - 1).bit_length()
