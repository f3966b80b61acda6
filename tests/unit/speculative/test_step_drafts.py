"""A step's drafts as arrays (StepDrafts): each row's span among the logits rows, where its drafts sit, and how many
of them the step's samples keep, against a plain per-row reference for any drafts and samples."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.speculative.speculator import StepDrafts

VOCAB = 5  # few tokens: drafts are often right, so every kept length occurs

rows_of_drafts = st.lists(st.lists(st.integers(0, VOCAB - 1), max_size=4), min_size=1, max_size=8)


def _reference_kept(drafts: list[list[int]], tokens: list[int]) -> list[int]:
    """Each row's leading drafts equal to the samples: a row's draft j is checked against its j-th sample."""
    kept, start = [], 0
    for guess in drafts:
        k = 0
        while k < len(guess) and guess[k] == tokens[start + k]:
            k += 1
        kept.append(k)
        start += 1 + len(guess)
    return kept


@settings(max_examples=300, deadline=None)
@given(data=st.data(), drafts=rows_of_drafts)
def test_kept_counts_the_leading_drafts_each_row_sampled(data, drafts):
    positions = sum(1 + len(d) for d in drafts)
    tokens = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=positions, max_size=positions))
    step = StepDrafts(drafts)
    assert step.kept(np.asarray(tokens, dtype=np.int64)).tolist() == _reference_kept(drafts, tokens)


@settings(max_examples=100, deadline=None)
@given(drafts=rows_of_drafts)
def test_spans_and_draft_places_follow_the_rows_in_order(drafts):
    step = StepDrafts(drafts)
    starts = np.cumsum([0] + [1 + len(d) for d in drafts])[:-1].tolist()
    assert step.starts() == starts
    assert step.counts == [1 + len(d) for d in drafts]
    assert step.num_drafted == sum(map(len, drafts))
    widened = np.full(sum(step.counts), -1)
    widened[step.start_array[step.draft_rows] + step.draft_offsets] = step.draft_tokens
    want = [t for d in drafts for t in [-1, *d]]  # each row's own token (not a draft), then its drafts
    assert widened.tolist() == want


def test_every_draft_right_keeps_them_all_and_a_wrong_first_keeps_none():
    step = StepDrafts([[3, 4, 1], [], [2, 2]])
    # row 0 samples 3, 4, 1 and its own next 0; row 1 its one token; row 2 samples 0 where 2 was drafted
    tokens = np.array([3, 4, 1, 0, 4, 0, 2, 2])
    assert step.kept(tokens).tolist() == [3, 0, 0]
