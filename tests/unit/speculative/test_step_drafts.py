"""A step's drafts (StepDrafts): each row's span among the logits rows and how many of its drafts the step's samples
keep, against a plain reference for any drafts and samples."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from backend.speculative.speculator import StepDrafts

VOCAB = 5  # few tokens: drafts are often right, so every kept length occurs

rows_of_drafts = st.lists(st.lists(st.integers(0, VOCAB - 1), max_size=4), min_size=1, max_size=8)


def _reference_kept(drafts: list[list[int]], tokens: list[int]) -> list[int]:
    """Each row's leading drafts equal to the samples: the row's tokens, split off in turn, compared position by
    position (draft j against the row's j-th sample) up to the first difference."""
    kept, rest = [], list(tokens)
    for guess in drafts:
        mine, rest = rest[:1 + len(guess)], rest[1 + len(guess):]
        same = [d == t for d, t in zip(guess, mine)] + [False]
        kept.append(same.index(False))
    return kept


@settings(max_examples=300, deadline=None)
@given(data=st.data(), drafts=rows_of_drafts)
def test_kept_counts_the_leading_drafts_each_row_sampled(data, drafts):
    positions = sum(1 + len(d) for d in drafts)
    tokens = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=positions, max_size=positions))
    step = StepDrafts(drafts)
    assert step.kept(tokens) == _reference_kept(drafts, tokens)


@settings(max_examples=100, deadline=None)
@given(drafts=rows_of_drafts)
def test_spans_follow_the_rows_in_order(drafts):
    step = StepDrafts(drafts)
    counts = [1 + len(d) for d in drafts]
    assert step.counts == counts
    assert step.starts() == [sum(counts[:i]) for i in range(len(drafts))]
    assert step.num_drafted == sum(map(len, drafts))


def test_every_draft_right_keeps_them_all_and_a_wrong_first_keeps_none():
    step = StepDrafts([[3, 4, 1], [], [2, 2]])
    # row 0 samples 3, 4, 1 and its own next 0; row 1 its one token; row 2 samples 0 where 2 was drafted
    assert step.kept([3, 4, 1, 0, 4, 0, 2, 2]) == [3, 0, 0]
