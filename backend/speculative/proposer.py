"""The interface every proposer of draft tokens offers, and the engine setting that picks one."""
from __future__ import annotations

from abc import ABC, abstractmethod

from backend.speculative.token_history import TokenHistory

METHODS = ("ngram", "suffix", "draft")


class Proposer(ABC):
    """Guesses a row's next tokens from its tokens so far; the model then checks them all in one step."""

    name = ""
    drafts_together = False  # True: `prepare` drafts a step's rows at once, before they ask

    @abstractmethod
    def propose(self, history: TokenHistory, k: int) -> list[int]:
        """At most k tokens that may come next after history (a prompt and its output so far); [] for no guess."""

    def prepare(self, histories: list[TokenHistory], ks: list[int]) -> None:
        """A step is about to ask for at most ks[i] tokens after each of histories: a proposer that drafts every row
        at once (a draft model) does its work here, and `propose` hands out the results."""

    def finished(self, history: TokenHistory, prompt_length: int) -> None:
        """A request ended with history (its prompt's first prompt_length tokens, then its output): a proposer that
        learns from other requests' outputs keeps it, one that holds state for it lets that go."""

    def forget_all(self) -> None:
        """Every request was dropped (the engine recovered from a failed step): state held for them goes."""


def make_proposer(method: str, draft=None) -> Proposer:
    """The proposer an engine setting names; ValueError for an unknown one. draft: the loaded draft model's parts
    (DraftParts) for method draft."""
    if method == "ngram":
        from backend.speculative.ngram import NgramProposer

        return NgramProposer()
    if method == "suffix":
        from backend.speculative.suffix import SuffixProposer

        return SuffixProposer()
    if method == "draft":
        from backend.speculative.draft_model import DraftModelProposer

        if draft is None:
            raise ValueError("speculative_method draft needs speculative_draft_model: the draft checkpoint")
        return DraftModelProposer(draft.model, draft.kv_cache, draft.block_size, draft.target_vocab_size,
                                  draft.num_tokens, draft.max_rows)
    raise ValueError(f"speculative_method must be one of {', '.join(METHODS)}, got {method!r}")
