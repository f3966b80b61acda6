"""When drafting pays: which rows draft at a step and how many tokens, from each request's measured acceptance and
what drafted steps measurably gave at the step's batch size.

A drafted step costs more than a plain one: it runs on the synchronous pipeline (the step before must be read
first), and every draft is a token of compute. So drafting is the exception that must earn its place:
- a row drafts while its acceptance (a moving average of the share of its drafts kept; the first share measured
  replaces the starting guess) stays at least MIN_ACCEPTANCE, and drafts only as many tokens as are likely to be
  kept (the i-th draft is kept with about acceptance^i);
- a row below it, or whose proposer had nothing, watches instead: at steps that are multiples of its back-off (1,
  2, 4, ... MAX_WATCH, doubling with each miss) its proposer guesses k tokens that nothing verifies, and the tokens
  the row then makes say how many would have been kept (the same law as verifying them: a sampled token equals a
  one-hot draft with the draft's probability). A watching row costs no drafted step, so rows whose drafts never
  hold cost the GPU nothing; one whose guesses start to hold drafts again;
- a new request drafts where the requests before it kept at least MIN_ACCEPTANCE of their drafts, and watches first
  where they did not, or before any was checked;
- per batch-size bucket, the tokens a second of drafted steps are compared with plain steps'; a bucket whose
  drafted steps give less stops drafting until its probe step (multiples of its back-off, doubling to MAX_BACKOFF).
  Plain steps are measured only in runs (the first plain step after a drafted one emits nothing: its tokens are read
  a step later), and where a bucket that drafted has no plain figure yet (its rows drafted from their first step)
  or one older than STALE steps, its next CONTROL_RUN steps run plain to measure it."""
from __future__ import annotations

import math
from dataclasses import dataclass

MIN_ACCEPTANCE = 0.2  # a row drafts while at least this share of its drafts is kept
WORTH = 0.1  # a draft position is proposed while its chance to be kept is at least this
MAX_BACKOFF = 64  # steps between a bucket's probes while its drafted steps lose
MAX_WATCH = 16  # steps between a watching row's guesses while they fail (they cost only the host's proposing)
SMOOTHING = 0.3  # weight of the newest observation in the moving averages
FIRST_ACCEPTANCE = 0.5  # the acceptance assumed before any draft was checked
STALE = 256  # steps after which a bucket's plain-step figure is renewed
CONTROL_RUN = 4  # plain steps in a row that renew it


@dataclass(slots=True)
class _RowState:
    acceptance: float = FIRST_ACCEPTANCE
    drafting: bool = False  # False: watching, a guess checked against its tokens at multiples of backoff
    backoff: int = 1
    checked: bool = False  # some of its drafts or guesses were checked: acceptance is its own


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
        self._drafting = 0  # rows that draft
        self._watching: dict[int, int] = {}  # back-off -> rows watching with it
        self._acceptance = FIRST_ACCEPTANCE  # over every request's checked drafts: where new requests start
        self._any_checked = False  # some request's drafts or guesses were checked
        self._last_plain = False  # the step before was a plain one

    def due(self, step: int, num_rows: int, draftable_rows: int | None = None) -> bool:
        """Whether a step of num_rows decode rows (draftable_rows of them may draft; default all) may hold drafts
        (then the step before must be read first)."""
        draftable = num_rows if draftable_rows is None else draftable_rows
        return bool(draftable) and self._drafting > 0 and self._bucket_allows(step, num_rows)

    def draft_length(self, req: object, step: int, limit: int) -> int:
        """How many tokens req may draft at this step (0: none, it watches), at most limit."""
        state = self._row(req)
        if not state.drafting:
            return 0
        useful = self.k if state.acceptance >= 1.0 else int(math.log(WORTH) / math.log(max(state.acceptance, 1e-6)))
        return max(1, min(self.k, limit, useful))

    def watch_length(self, req: object, step: int) -> int:
        """How many tokens req's proposer guesses at this step for a check against the tokens req makes next (0:
        none: it drafts, or its next guess is at a later step)."""
        state = self._row(req)
        return 0 if state.drafting or step % state.backoff else self.k

    def verified(self, req: object, proposed: int, kept: int) -> None:
        """req's drafts of a step, or its guess, were checked: proposed of them, kept leading ones right (proposed 0:
        its proposer had nothing, which counts as a miss)."""
        state = self._row(req)
        share = kept / proposed if proposed else 0.0
        if state.checked:
            state.acceptance += SMOOTHING * (share - state.acceptance)
        elif proposed:
            state.acceptance, state.checked = share, True
        self._acceptance += SMOOTHING * (share - self._acceptance)
        self._any_checked = True
        if state.acceptance >= MIN_ACCEPTANCE and proposed:
            self._set_state(state, True, 1)
        else:
            self._set_state(state, False, 1 if state.drafting else min(2 * state.backoff, MAX_WATCH))

    def watch_due(self, step: int, draftable_rows: int) -> bool:
        """Whether some row may guess at this step: a watching row's back-off divides it, or some of the
        draftable_rows running rows that may speculate may be new here."""
        return len(self._rows) < draftable_rows or any(step % b == 0 for b in self._watching)

    def step_done(self, step: int, num_rows: int, drafted: bool, tokens: int, seconds: float) -> None:
        """Step step, of num_rows decode rows, emitted tokens in seconds (a drafted step's time includes reading
        the step before it, and its tokens that step's)."""
        # plain steps count only in runs: the first after a drafted one emits nothing (its tokens are read a step later)
        after_plain, self._last_plain = self._last_plain, not drafted
        if seconds <= 0 or not num_rows or (not drafted and not after_plain):
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
        self._watching.clear()

    def forget(self, req: object) -> None:
        state = self._rows.pop(req, None)
        if state is not None:
            self._count(state, -1)

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
            known_good = self._any_checked and self._acceptance >= MIN_ACCEPTANCE
            state = self._rows[req] = _RowState(self._acceptance, known_good)
            self._count(state, 1)
        return state

    def _set_state(self, state: _RowState, drafting: bool, backoff: int) -> None:
        self._count(state, -1)
        state.drafting, state.backoff = drafting, backoff
        self._count(state, 1)

    def _count(self, state: _RowState, delta: int) -> None:
        if state.drafting:
            self._drafting += delta
            return
        left = self._watching.get(state.backoff, 0) + delta
        if left:
            self._watching[state.backoff] = left
        else:
            self._watching.pop(state.backoff, None)


def _bucket(num_rows: int) -> int:
    """Batch sizes 1, 2, 3-4, 5-8, ...: the power of two at or above num_rows."""
    return 1 << (num_rows - 1).bit_length()
