"""DraftPolicy: rows draft while their drafts are kept, as many tokens as are likely kept; rows whose drafts fail
(and new requests, where those before them failed or nothing was checked yet) watch instead, their guesses checked
against the tokens they make, so they cost no drafted step; a batch size whose drafted steps give fewer tokens a
second than plain ones stops drafting, and its plain figure is renewed when stale."""
from __future__ import annotations

from backend.speculative.draft_policy import CONTROL_RUN, MAX_BACKOFF, MAX_WATCH, STALE, DraftPolicy


def _run(policy: DraftPolicy, rows: list[str], steps: range, keep: float) -> tuple[list[int], list[int]]:
    """Runs steps where every row that may draft proposes its length and every row whose watch step it is guesses;
    each keeps round(keep * n) of n (a guess checked at once). Returns (the steps that drafted, those that guessed)."""
    drafted, guessed = [], []
    for step in steps:
        lengths = [policy.draft_length(r, step, 4) for r in rows] if policy.due(step, len(rows)) else [0] * len(rows)
        if any(lengths):
            drafted.append(step)
        for r, k in zip(rows, lengths):
            if k:
                policy.verified(r, k, round(keep * k))
        watching = [(r, policy.watch_length(r, step)) for r in rows]
        if any(k for _, k in watching):
            guessed.append(step)
        for r, k in watching:
            if k:
                policy.verified(r, k, round(keep * k))
    return drafted, guessed


def test_rows_whose_drafts_always_fail_never_draft_and_guess_once_in_max_watch_steps():
    policy = DraftPolicy(4)
    rows = [f"r{i}" for i in range(32)]
    drafted, guessed = _run(policy, rows, range(1, 4097), keep=0.0)
    assert drafted == []  # nothing was ever kept: no step drafted
    assert [s for s in guessed if s > 64] == [s for s in range(65, 4097) if s % MAX_WATCH == 0]  # aligned
    # the engine asks the rows only where one may guess: a watch step, or more draftable rows than it knows
    assert not policy.watch_due(MAX_WATCH * 300 + 1, 32)
    assert policy.watch_due(MAX_WATCH * 300, 32) and policy.watch_due(MAX_WATCH * 300 + 1, 33)


def test_rows_whose_guesses_hold_draft_from_the_next_step_as_far_as_worth():
    policy = DraftPolicy(8)
    assert policy.draft_length("new", 1, 8) == 0 and policy.watch_length("new", 1) == 8  # nothing checked: watch
    assert not policy.due(1, 1)
    policy.verified("new", 8, 8)  # its guess held: the share measured replaces the starting guess
    assert policy.due(2, 1) and policy.draft_length("new", 2, 8) == 8 and policy.watch_length("new", 2) == 0
    for step in range(1, 30):
        policy.verified("good", 8, 8)
    assert policy.draft_length("good", 31, 8) == 8 and policy.draft_length("good", 31, 2) == 2
    for step in range(1, 30):
        policy.verified("half", 4, 2)
    assert policy.draft_length("half", 31, 8) == 3  # a 4th draft is kept 1 time in 16
    assert policy.due(31, 2)


def test_a_row_recovers_once_its_guesses_hold_again():
    policy = DraftPolicy(4)
    for _ in range(8):
        policy.verified("r", 4, 0)
    assert policy.draft_length("r", 3, 4) == 0 and not policy.due(3, 1)
    assert policy.watch_length("r", MAX_WATCH + 1) == 0 and policy.watch_length("r", MAX_WATCH * 5) == 4
    for _ in range(6):
        policy.verified("r", 4, 4)
    assert policy.draft_length("r", 7, 4) == 4 and policy.due(7, 1)


def test_a_drafting_row_that_misses_watches_from_the_next_step():
    policy = DraftPolicy(4)
    policy.verified("r", 4, 4)
    assert policy.due(1, 1)
    for _ in range(5):
        policy.verified("r", 4, 0)
    assert not policy.due(2, 1) and policy.watch_length("r", 3) == 4


def test_a_proposer_with_nothing_counts_as_a_miss():
    policy = DraftPolicy(4)
    policy.verified("r", 4, 4)
    for _ in range(3):
        policy.verified("r", 0, 0)
    assert policy.draft_length("r", 9, 4) == 0


def test_new_requests_draft_at_once_where_requests_before_kept_their_drafts_and_watch_where_not():
    good, bad = DraftPolicy(4), DraftPolicy(4)
    for i in range(20):
        good.verified(f"old{i}", 4, 3)
        good.forget(f"old{i}")
        bad.verified(f"old{i}", 4, 0)
        bad.forget(f"old{i}")
    assert good.draft_length("new", 1, 4) >= 1 and good.due(1, 1)
    assert bad.draft_length("new", 1, 4) == 0 and not bad.due(1, 1) and bad.watch_length("new", 1) == 4


def test_a_batch_size_where_drafted_steps_lose_stops_drafting_and_renews_its_plain_figure():
    policy = DraftPolicy(4)
    for _ in range(20):
        policy.verified("r", 4, 4)
    # batch 64: plain steps 64 tokens in 10 ms; drafted ones 100 tokens in 25 ms (4,000 tok/s against 6,400)
    step = 1
    for step in range(1, 4):
        policy.step_done(step, 64, False, 64, 0.010)
    assert policy.due(4, 64)
    for step in range(4, 8):
        policy.step_done(step, 64, True, 100, 0.025)
    allowed = [s for s in range(8, 8 + 4 * MAX_BACKOFF) if policy.due(s, 64)]
    assert len(allowed) < 4 * MAX_BACKOFF // 4  # mostly plain now
    assert policy.due(8, 8)  # another batch size is judged apart
    # plain figure stale: the next CONTROL_RUN steps run plain, even at a probe step
    later = 3 + STALE + MAX_BACKOFF - (3 + STALE) % MAX_BACKOFF
    assert [policy.due(s, 64) for s in range(later, later + CONTROL_RUN)] == [False] * CONTROL_RUN


def test_a_batch_size_that_drafted_from_its_first_step_measures_plain_steps_then_stops():
    """Rows that keep their drafts draft from their first step, so no plain figure exists; the bucket runs
    CONTROL_RUN plain steps after its first drafted one, and then, its drafted steps being slower, mostly plain."""
    policy = DraftPolicy(4)
    for _ in range(20):
        policy.verified("r", 4, 4)
    assert policy.due(1, 32)
    policy.step_done(1, 32, True, 99, 0.025)  # 3,960 tok/s
    assert [policy.due(s, 32) for s in range(2, 2 + CONTROL_RUN)] == [False] * CONTROL_RUN
    for s in range(2, 2 + CONTROL_RUN):
        policy.step_done(s, 32, False, 32, 0.0063)  # 5,080 tok/s (the first one not measured)
    step = 2 + CONTROL_RUN
    assert policy.due(step, 32)
    policy.step_done(step, 32, True, 99, 0.025)
    allowed = [s for s in range(step + 1, step + 1 + 2 * MAX_BACKOFF) if policy.due(s, 32)]
    assert len(allowed) <= 2 * MAX_BACKOFF // 2  # the bucket backs off


def test_the_first_plain_step_after_a_drafted_one_is_not_measured():
    policy = DraftPolicy(4)
    policy.verified("r", 4, 4)  # a row that drafts
    policy.step_done(1, 16, True, 40, 0.010)  # 4,000 tok/s
    policy.step_done(2, 16, False, 16, 0.0001)  # right after a drafted step (the pipeline refilling): no figure
    policy.step_done(3, 16, False, 16, 0.010)  # steady: 1,600 tok/s
    policy.step_done(4, 16, True, 40, 0.010)
    assert policy.due(5, 16)  # drafted steps give more: drafting stays on
