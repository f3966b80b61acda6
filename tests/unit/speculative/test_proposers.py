"""Speculative proposers: the token history's suffix matches, n-gram lookup against a brute-force reference, and
suffix decoding's frequency walk over a request's own tokens and other requests' outputs."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.speculative.ngram import NgramProposer
from backend.speculative.proposer import make_proposer
from backend.speculative.suffix import SuffixProposer
from backend.speculative.token_history import TokenHistory


def test_matches_finds_the_longest_earlier_suffix_and_its_occurrences():
    h = TokenHistory([1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 6, 7, 1, 2, 3])
    length, ends = h.matches(h.tokens, 8)
    assert length == 3 and ends.tolist() == [2, 8]  # [7, 1, 2, 3] never occurred before; [1, 2, 3] twice
    assert h.matches(h.tokens, 2)[0] == 2
    assert h.matches(np.array([42]), 4)[0] == 0  # a token never seen
    assert h.matches(np.array([3]), 4, end=3)[1].tolist() == []  # within the first 3 tokens, 3 has no follower


def test_a_separator_ends_every_match():
    h = TokenHistory([5, 6, TokenHistory.SEPARATOR, 6, 7])
    length, ends = h.matches(np.array([5, 6]), 4)
    assert length == 2 and ends.tolist() == [1]


def test_ngram_proposes_what_followed_the_latest_occurrence():
    h = TokenHistory([1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 6, 7, 1, 2, 3])
    assert NgramProposer(min_n=2, max_n=4).propose(h, 3) == [4, 6, 7]
    assert NgramProposer(min_n=2, max_n=4).propose(h, 1) == [4]
    assert NgramProposer(min_n=4, max_n=4).propose(h, 3) == []  # only 3 tokens match
    assert NgramProposer().propose(TokenHistory([1, 2, 3]), 4) == []
    assert NgramProposer().propose(h, 0) == []
    with pytest.raises(ValueError):
        NgramProposer(min_n=3, max_n=2)


def _ngram_reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Brute force: for n from max_n down to min_n, the latest earlier end position of the last n tokens."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n:]
        for end in range(size - 2, n - 2, -1):
            if tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1:end + 1 + k]
    return []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=60), st.integers(1, 6), st.integers(1, 3),
       st.integers(0, 3))
def test_ngram_equals_a_brute_force_search(tokens, k, min_n, extra):
    max_n = min_n + extra
    assert NgramProposer(min_n, max_n).propose(TokenHistory(tokens), k) == _ngram_reference(tokens, k, min_n, max_n)


def test_suffix_follows_the_most_frequent_continuation():
    # [9, 1, 2] (the longest match: 7 or nothing came before it, 6 comes now) was followed by 3, 8, 3: the walk
    # takes 3 (2 of 3), then 4 and 0; after 0 came 7 once and 5 once: a tie goes to the latest, 5 (path 1/3)
    h = TokenHistory([9, 1, 2, 3, 4, 0, 7, 9, 1, 2, 8, 7, 9, 1, 2, 3, 4, 0, 5, 6, 9, 1, 2])
    assert SuffixProposer(max_spec_factor=4.0).propose(h, 4) == [3, 4, 0, 5]
    assert SuffixProposer(max_spec_factor=1.0).propose(h, 4) == [3, 4, 0]  # a 3-token match earns 3 tokens
    assert SuffixProposer(min_probability=0.5, max_spec_factor=4.0).propose(h, 4) == [3, 4, 0]
    assert SuffixProposer(min_probability=0.7, max_spec_factor=4.0).propose(h, 4) == []


def test_suffix_learns_from_finished_requests_outputs():
    proposer = SuffixProposer(max_spec_factor=8.0)
    prompt = [50, 51, 52]
    first = TokenHistory(prompt + [10, 11, 12, 13, 14, 15])
    proposer.finished(first, len(prompt))
    second = TokenHistory([60, 61, 10, 11])  # another prompt, an output starting as the first one's did
    assert proposer.propose(second, 4) == [12, 13, 14, 15]
    assert NgramProposer().propose(second, 4) == []  # n-gram lookup sees only the request's own tokens
    # nothing runs past the end of a kept output into the next one
    proposer.finished(TokenHistory([1, 20, 21]), 1)
    assert proposer.propose(TokenHistory([9, 14, 15]), 4) == []


def test_suffix_keeps_a_bounded_share_of_recent_outputs():
    proposer = SuffixProposer(shared_tokens=40, max_spec_factor=8.0)
    for i in range(10):
        proposer.finished(TokenHistory([0] + [100 + i, 200 + i, 300 + i, 400 + i, 500 + i]), 1)
    assert proposer.propose(TokenHistory([7, 109, 209]), 2) == [309, 409]  # the newest are kept
    assert proposer.propose(TokenHistory([7, 100, 200]), 2) == []  # the oldest are forgotten
    assert len(proposer._shared) <= 40


def test_make_proposer_names_the_methods():
    assert make_proposer("ngram").name == "ngram" and make_proposer("suffix").name == "suffix"
    with pytest.raises(ValueError, match="speculative_method must be one of ngram, suffix"):
        make_proposer("eagle")


def test_matches_start_from_the_latest_occurrences_of_the_last_token():
    """[8, 9] occurred long ago (ending at 1); 9 alone occurred since at 4, 7 and 10. Starting from every occurrence
    the longest match is the old one; starting from the latest two, it is 9 alone at those two."""
    tokens = [8, 9, 0, 5, 9, 1, 6, 9, 2, 7, 9, 3, 8, 9]
    length, ends = TokenHistory(tokens).matches(np.array(tokens), 4)
    assert length == 2 and ends.tolist() == [1]
    length, ends = TokenHistory(tokens, max_candidates=2).matches(np.array(tokens), 4)
    assert length == 1 and ends.tolist() == [7, 10]
    with pytest.raises(ValueError, match="max_candidates"):
        TokenHistory(tokens, max_candidates=0)


def test_suffix_makes_its_kept_half_anew_a_chunk_at_a_time():
    """Past shared_tokens, the newer half is indexed anew at most rebuild_chunk tokens (one output at least) per
    finished request; meanwhile proposals still see every output, and once it is done the oldest are forgotten."""
    proposer = SuffixProposer(shared_tokens=60, rebuild_chunk=13, max_spec_factor=8.0)
    outputs = [[100 + i, 200 + i, 300 + i, 400 + i, 500 + i] for i in range(14)]  # 6 tokens each with the separator
    indexed = []
    for i, output in enumerate(outputs):
        before = len(proposer._successor) if proposer._successor is not None else 0
        proposer.finished(TokenHistory([0] + output), 1)
        if proposer._successor is not None:
            indexed.append(len(proposer._successor) - before)
            assert proposer.propose(TokenHistory([7, 100, 200]), 2) == [300, 400]  # the oldest still matched
        assert proposer.propose(TokenHistory([7, 100 + i, 200 + i]), 2) == [300 + i, 400 + i]  # the newest too
    assert indexed and max(indexed) <= 13  # two 6-token outputs a call at most
    assert proposer._successor is None  # done: the kept half is the shared history
    assert proposer.propose(TokenHistory([7, 100, 200]), 2) == []  # the oldest are forgotten
    assert len(proposer._shared) <= 60
    with pytest.raises(ValueError, match="rebuild_chunk"):
        SuffixProposer(rebuild_chunk=0)


def test_a_history_lets_its_index_go_a_part_at_a_time():
    history = TokenHistory([1, 2, 1, 3, 1, 4, 5, 6])
    assert not history.release(3)  # 1's three positions, say, or a few tokens' one each
    while not history.release(3):
        pass
    assert history.matches(np.array([1]), 4)[0] == 0 and len(history) == 0 and len(history.tokens) == 0
