"""Suffix-decoding proposals: the most frequent continuation of the row's longest matching suffix, found in its own
prompt and output and in other requests' recent outputs (SuffixDecoding, Oliaro et al. 2024)."""
from __future__ import annotations

import math
from collections import deque

import numpy as np

from backend.speculative.proposer import Proposer
from backend.speculative.token_history import TokenHistory


class SuffixProposer(Proposer):
    """Matches the row's last tokens (up to max_depth) against its own history and against the outputs of requests
    that ended recently (at most shared_tokens of them), then walks the matches forward: each next token is the one
    that most often followed, kept while the path's frequency stays at least min_probability. Up to
    max_spec_factor x the match's length tokens are proposed (a longer match earns a longer guess); of the two
    sources, the path with the higher summed frequency wins."""

    name = "suffix"

    def __init__(self, max_depth: int = 24, min_probability: float = 0.1, max_spec_factor: float = 1.0,
                 shared_tokens: int = 1 << 20) -> None:
        if max_depth < 1 or not 0.0 <= min_probability <= 1.0 or max_spec_factor <= 0 or shared_tokens < 0:
            raise ValueError("suffix proposer needs max_depth >= 1, 0 <= min_probability <= 1, "
                             "max_spec_factor > 0 and shared_tokens >= 0")
        self.max_depth, self.min_probability, self.max_spec_factor = max_depth, min_probability, max_spec_factor
        self.shared_tokens = shared_tokens
        self._outputs: deque[list[int]] = deque()  # the recent outputs, oldest first
        self._shared = TokenHistory()  # those outputs, each ended by TokenHistory.SEPARATOR

    def propose(self, history: TokenHistory, k: int) -> list[int]:
        context = history.tokens
        best: tuple[float, list[int]] = (0.0, [])
        for source in (history, self._shared):
            length, occurrences = source.matches(context, self.max_depth)
            if length == 0:
                continue
            limit = min(k, math.ceil(self.max_spec_factor * length))
            score, tokens = self._walk(source.tokens, occurrences, limit)
            if score > best[0]:
                best = (score, tokens)
        return best[1]

    def finished(self, history: TokenHistory, prompt_length: int) -> None:
        output = [int(t) for t in history.tokens[prompt_length:]]
        if not output or self.shared_tokens == 0:
            return
        self._outputs.append(output)
        self._shared.extend(output + [TokenHistory.SEPARATOR])
        if len(self._shared) > self.shared_tokens:  # forget the oldest half: rebuilt rarely, never grown unbounded
            kept = len(self._shared)
            while kept > self.shared_tokens // 2:
                kept -= len(self._outputs.popleft()) + 1
            self._shared = TokenHistory(t for o in self._outputs for t in o + [TokenHistory.SEPARATOR])

    def _walk(self, tokens: np.ndarray, occurrences: np.ndarray, limit: int) -> tuple[float, list[int]]:
        """Follow the occurrences forward, most frequent next token first, while the path's frequency holds."""
        path: list[int] = []
        score, probability, ends = 0.0, 1.0, occurrences
        while len(path) < limit and len(ends):
            following = ends + 1
            following = following[following < len(tokens)]
            if len(following) == 0:
                break
            values = tokens[following]
            real = values[values != TokenHistory.SEPARATOR]
            if len(real) == 0:
                break
            choices, counts = np.unique(real, return_counts=True)
            tied = choices[counts == counts.max()]
            token = int(tied[0]) if len(tied) == 1 else int(values[np.isin(values, tied)][-1])  # tie: the latest
            probability *= counts.max() / len(ends)  # an occurrence followed by nothing counts against the path
            if probability < self.min_probability:
                break
            path.append(token)
            score += probability
            ends = following[values == token]
        return score, path
