"""A growing token sequence indexed by token, to find where its latest tokens occurred before."""
from __future__ import annotations

from typing import Iterable

import numpy as np


MAX_CANDIDATES = 1024  # occurrences of the last token a match starts from: its latest ones


class TokenHistory:
    """Tokens in order (a prompt, then its output; or many outputs, each ended by SEPARATOR), with the positions of
    every token, so the earlier occurrences of a suffix are found without scanning the whole sequence."""

    SEPARATOR = -1  # ends one sequence in a shared history: no match runs across it

    def __init__(self, tokens: Iterable[int] = (), max_candidates: int = MAX_CANDIDATES) -> None:
        """max_candidates: matches() starts from this many of the last token's latest occurrences (in a history of
        a million tokens a common token occurs a hundred thousand times: all of them cost milliseconds a match)."""
        if max_candidates < 1:
            raise ValueError(f"max_candidates must be positive, got {max_candidates}")
        self._buffer = np.empty(256, dtype=np.int64)
        self._length = 0
        self._positions: dict[int, list[int]] = {}
        self.max_candidates = max_candidates
        self.extend(tokens)

    def __len__(self) -> int:
        return self._length

    @property
    def tokens(self) -> np.ndarray:
        return self._buffer[:self._length]

    def extend(self, tokens: Iterable[int]) -> None:
        if not isinstance(tokens, list):
            tokens = list(tokens)
        need = self._length + len(tokens)
        if need > len(self._buffer):
            grown = np.empty(max(need, 2 * len(self._buffer)), dtype=np.int64)
            grown[:self._length] = self._buffer[:self._length]
            self._buffer = grown
        self._buffer[self._length:need] = tokens
        for offset, token in enumerate(tokens):
            if token != self.SEPARATOR:
                self._positions.setdefault(token, []).append(self._length + offset)
        self._length = need

    def matches(self, context: np.ndarray, max_length: int, end: int | None = None) -> tuple[int, np.ndarray]:
        """The longest m <= max_length such that context's last m tokens occur in this history ending before `end`
        (default: anywhere), with m >= 1 and at least one token after them; returns m and the positions of the
        occurrences' last tokens (ascending). (0, empty) when context's last token never occurred. Only occurrences
        that end at one of the last token's latest max_candidates + 1 occurrences are found (the one more: where the
        context is this history, its own last token is the latest)."""
        end = self._length if end is None else end
        if len(context) == 0:
            return 0, np.empty(0, dtype=np.int64)
        found = self._positions.get(int(context[-1]))
        if not found:
            return 0, np.empty(0, dtype=np.int64)
        candidates = np.asarray(found[-self.max_candidates - 1:], dtype=np.int64)  # + 1: the last may be excluded
        candidates = candidates[candidates < end - 1]  # a token must follow the occurrence, inside the history
        length = 1 if len(candidates) else 0
        buffer = self._buffer
        while length and length < min(max_length, len(context)):
            before = candidates - length
            kept = candidates[(before >= 0) & (buffer[np.maximum(before, 0)] == context[-1 - length])]
            if len(kept) == 0:
                break
            candidates, length = kept, length + 1
        return length, candidates

    def release(self, budget: int) -> bool:
        """Drop up to about `budget` positions of the index (a history no longer read, let go a part at a time: the
        index of a million tokens costs tens of ms to free at once); True once nothing is left."""
        positions = self._positions
        while positions and budget > 0:
            budget -= len(positions.popitem()[1])
        if not positions:
            self._buffer, self._length = self._buffer[:0], 0
        return not positions
