"""The interface every proposer of draft tokens offers, and the engine setting that picks one."""
from __future__ import annotations

from abc import ABC, abstractmethod

from backend.speculative.token_history import TokenHistory

METHODS = ("ngram", "suffix")


class Proposer(ABC):
    """Guesses a row's next tokens from its tokens so far; the model then checks them all in one step."""

    name = ""

    @abstractmethod
    def propose(self, history: TokenHistory, k: int) -> list[int]:
        """At most k tokens that may come next after history (a prompt and its output so far); [] for no guess."""

    def finished(self, history: TokenHistory, prompt_length: int) -> None:
        """A request ended with history (its prompt's first prompt_length tokens, then its output): a proposer that
        learns from other requests' outputs keeps it."""


def make_proposer(method: str) -> Proposer:
    """The proposer an engine setting names; ValueError for an unknown one."""
    if method == "ngram":
        from backend.speculative.ngram import NgramProposer

        return NgramProposer()
    if method == "suffix":
        from backend.speculative.suffix import SuffixProposer

        return SuffixProposer()
    raise ValueError(f"speculative_method must be one of {', '.join(METHODS)}, got {method!r}")
