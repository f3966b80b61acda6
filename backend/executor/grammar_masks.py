"""The token masks of a step's constrained rows (structured outputs): each row's grammar matcher says which tokens
may come next; the masked-out logits become -inf before the sampler reads them.

A mask for step N + 1 needs step N's token, which the matcher takes when the step update accepts it. So a step
with a constrained row samples in a second launch (StepState.sample_after_previous): the loop queues its forward,
reads and updates step N, and only then fills the masks here and queues the sampling."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from backend.request import Request


class GrammarMasks:
    """Fills and applies the next-token masks of a step's sampled rows that follow a grammar."""

    def __init__(self, vocab_size: int, pinned: bool) -> None:
        self.vocab_size = vocab_size
        self.pinned = pinned
        # the grammar library's batched fillers, one per pipeline slot, made for the first constrained step: a
        # slot's pinned bitmask is filled again only once that slot's step before has been read back, so its
        # asynchronous copy to the device has run by then
        self._maskers: dict[int, object] = {}

    def apply(self, logits: torch.Tensor, sampled: list[Request], slot_index: int) -> None:
        """Set to -inf, in place, the logits of the tokens each constrained row's grammar does not allow next
        (rows of logits in the order of sampled; other rows, and finished requests' rows, are left alone)."""
        from backend.structured.grammar import apply_token_bitmask

        apply_token_bitmask(logits, self._masker(slot_index).fill(_matchers(sampled)))

    def apply_drafted(self, logits: torch.Tensor, sampled: list[Request], drafts: list[list[int]],
                      slot_index: int) -> None:
        """As apply, for a step whose rows carry drafts: logits hold each sampled row's positions in turn (its own
        token's, then one after each draft), and each position gets the mask of the row's grammar after the
        drafts before it."""
        from backend.structured.grammar import apply_token_bitmask

        apply_token_bitmask(logits, self._masker(slot_index).fill_drafted(_matchers(sampled), drafts))

    def _masker(self, slot_index: int):
        from backend.structured.grammar import TokenMasker

        masker = self._maskers.get(slot_index)
        if masker is None:
            masker = self._maskers[slot_index] = TokenMasker(self.vocab_size, pinned=self.pinned)
        return masker


def _matchers(sampled: list[Request]) -> list:
    """Each sampled row's grammar matcher (made at its first masked token), None where it follows none or has
    finished (its token is dropped: the request ended while this step was queued)."""
    out = []
    for req in sampled:
        if req.grammar is None or req.is_finished:
            out.append(None)
            continue
        if req.matcher is None:
            req.matcher = req.grammar.matcher()
        out.append(req.matcher)
    return out
