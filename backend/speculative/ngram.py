"""N-gram (prompt lookup) proposals: what followed the latest earlier occurrence of the row's last n tokens."""
from __future__ import annotations

from backend.speculative.proposer import Proposer
from backend.speculative.token_history import TokenHistory


class NgramProposer(Proposer):
    """Finds the longest n in [min_n, max_n] whose last-n tokens occurred earlier in the prompt or output, and
    proposes the tokens that followed their latest occurrence (as vLLM's ngram method and prompt lookup do)."""

    name = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, history: TokenHistory, k: int) -> list[int]:
        length, occurrences = history.matches(history.tokens, self.max_n)
        if length < self.min_n or k < 1:
            return []
        start = int(occurrences[-1]) + 1
        return [int(t) for t in history.tokens[start:start + k]]
