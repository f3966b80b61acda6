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
                 shared_tokens: int = 1 << 20, rebuild_chunk: int = 8192) -> None:
        """shared_tokens: the recent outputs kept (the oldest half forgotten when passed); rebuild_chunk: tokens of
        the kept half indexed anew per finished request (never the whole half at once: 175 ms for half a million)."""
        if (max_depth < 1 or not 0.0 <= min_probability <= 1.0 or max_spec_factor <= 0 or shared_tokens < 0
                or rebuild_chunk < 1):
            raise ValueError("suffix proposer needs max_depth >= 1, 0 <= min_probability <= 1, "
                             "max_spec_factor > 0, shared_tokens >= 0 and rebuild_chunk >= 1")
        self.max_depth, self.min_probability, self.max_spec_factor = max_depth, min_probability, max_spec_factor
        self.shared_tokens = shared_tokens
        self.rebuild_chunk = rebuild_chunk
        self._outputs: deque[list[int]] = deque()  # the recent outputs, oldest first
        self._shared = TokenHistory()  # those outputs, each ended by TokenHistory.SEPARATOR
        # the newer half made anew a chunk at a time (the matches still read _shared meanwhile), and the outputs it
        # has yet to take; it replaces _shared once it holds them all
        self._successor: TokenHistory | None = None
        self._pending: deque[list[int]] = deque()
        self._retired: TokenHistory | None = None  # the shared history replaced, its index freed a chunk at a time

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
        output = history.tokens[prompt_length:].tolist()
        if not output or self.shared_tokens == 0:
            return
        self._outputs.append(output)
        self._shared.extend(output + [TokenHistory.SEPARATOR])
        if self._successor is not None:
            self._pending.append(output)
        elif len(self._shared) > self.shared_tokens:  # forget the oldest half: never grown unbounded
            kept = len(self._shared)
            while kept > self.shared_tokens // 2:
                kept -= len(self._outputs.popleft()) + 1
            self._successor, self._pending = TokenHistory(), deque(self._outputs)
        if self._successor is not None:
            self._index_successor()
        elif self._retired is not None and self._retired.release(self.rebuild_chunk):
            self._retired = None

    def _index_successor(self) -> None:
        """The successor takes pending outputs, rebuild_chunk tokens at most (at least one output); once it holds
        every kept output it becomes the shared history, and the one it replaces is let go over the next calls."""
        taken = 0
        while self._pending and (taken == 0 or taken + len(self._pending[0]) < self.rebuild_chunk):
            output = self._pending.popleft()
            self._successor.extend(output + [TokenHistory.SEPARATOR])
            taken += len(output) + 1
        if not self._pending:
            self._retired, self._shared, self._successor = self._shared, self._successor, None

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
