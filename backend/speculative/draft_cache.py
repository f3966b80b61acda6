"""The draft model's own paged KV cache: the blocks each drafting request holds and which of its tokens they hold, so
a step feeds the draft model only what its cache lacks, and entries past a rejected draft are simply written over."""
from __future__ import annotations

from dataclasses import dataclass, field

from backend.speculative.token_history import TokenHistory


@dataclass(slots=True)
class DraftSequence:
    """One request in the draft cache: its history's first `synced` tokens, then `drafts` (its last proposal, whose
    entries stay until the history shows which of them were kept)."""

    blocks: list[int] = field(default_factory=list)
    synced: int = 0
    drafts: list[int] = field(default_factory=list)
    last_used: int = 0  # the step that last fed it: the least recently fed sequence is evicted first


class DraftCache:
    """Lends the draft KV tensor's blocks to requests (keyed by their TokenHistory) and takes them back. Block 0 is
    never lent: padding and unused block-table entries point at it."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"the draft KV cache needs at least 2 blocks, got {num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))  # popped from the end: low ids first
        self._sequences: dict[TokenHistory, DraftSequence] = {}
        self._clock = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def __len__(self) -> int:
        return len(self._sequences)

    def reconcile(self, history: TokenHistory) -> int:
        """Leading tokens of history the cache holds, its entry brought up to date: at most len(history) - 1, so a
        step always feeds at least the last token (its logits give the first draft); the drafts it held past them
        are dropped."""
        seq = self._sequences.get(history)
        if seq is None:
            return 0
        tokens, n = history.tokens, seq.synced
        for draft in seq.drafts:
            if n >= len(tokens) or tokens[n] != draft:
                break
            n += 1
        seq.synced, seq.drafts = min(n, len(tokens) - 1), []
        return seq.synced

    def reserve(self, histories: list[TokenHistory], lengths: list[int]) -> list[bool]:
        """Blocks for the first lengths[i] positions of each history (taken from sequences outside this step when
        short); whether each got them, in order (one that did not keeps what it had)."""
        self._clock += 1
        for history in histories:
            self._sequences.setdefault(history, DraftSequence()).last_used = self._clock
        got = []
        for history, length in zip(histories, lengths):
            seq = self._sequences[history]
            need = -(-length // self.block_size) - len(seq.blocks)
            if need > len(self._free):
                self._evict(need - len(self._free))
            if need > len(self._free):
                got.append(False)
                continue
            seq.blocks.extend(self._free.pop() for _ in range(max(need, 0)))
            got.append(True)
        return got

    def blocks(self, history: TokenHistory) -> list[int]:
        return self._sequences[history].blocks

    def written(self, history: TokenHistory, drafts: list[int]) -> None:
        """The draft model wrote history's entries and then drafts' (the proposal's tokens but its last)."""
        seq = self._sequences[history]
        seq.synced, seq.drafts = len(history), list(drafts)

    def free(self, history: TokenHistory) -> None:
        seq = self._sequences.pop(history, None)
        if seq is not None:
            self._free.extend(reversed(seq.blocks))

    def clear(self) -> None:
        for history in list(self._sequences):
            self.free(history)

    def _evict(self, blocks: int) -> None:
        """Free sequences not fed at this step, least recently fed first, until `blocks` more are free (they start
        over when they next draft)."""
        idle = sorted((s.last_used, id(h), h) for h, s in self._sequences.items() if s.last_used < self._clock)
        for _, _, history in idle:
            if blocks <= 0:
                return
            blocks -= len(self._sequences[history].blocks)
            self.free(history)
