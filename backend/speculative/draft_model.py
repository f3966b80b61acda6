"""Draft-model proposals: a smaller model with the target's tokenizer guesses each row's next tokens greedily, all of
a step's drafting rows together, over its own paged KV cache (the same model code and attention ops as the target).

A step's drafts take k forwards of the draft model: the first feeds each row whatever of its history the draft cache
lacks (the whole prompt the first time; after that the tokens the last step emitted, as a short prefill), the rest
feed the row's previous draft, one token a row. The drafts stay on the device between those forwards and reach the
host once, at the end."""
from __future__ import annotations

import numpy as np
import torch

from backend.ops.attention_metadata import AttentionMetadata
from backend.speculative.draft_cache import DraftCache
from backend.speculative.proposer import Proposer
from backend.speculative.token_history import TokenHistory


class DraftModelProposer(Proposer):
    """Proposes each row's greedy continuation under a smaller model; `prepare` drafts a whole step's rows at once,
    `propose` then hands each row its part."""

    name = "draft"
    drafts_together = True

    def __init__(self, model, kv_cache: torch.Tensor, block_size: int, vocab_size: int) -> None:
        """model: a LlamaFamilyModel; kv_cache: its own (L, 2, NB, BS, Hkv, D) tensor; vocab_size: the target's
        (a draft whose head is wider never proposes a token the target lacks)."""
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.cache = DraftCache(kv_cache.shape[2], block_size)
        self.vocab_size = min(vocab_size, model.spec.vocab_size)
        self.max_len = model.spec.max_position_embeddings
        self._ready: dict[TokenHistory, list[int]] = {}  # this step's drafts, from prepare
        self.forwards = 0

    def prepare(self, histories: list[TokenHistory], ks: list[int]) -> None:
        self._ready = {}
        rows = [(h, k) for h, k in zip(histories, ks) if k > 0 and len(h) + k <= self.max_len]
        if not rows:
            return
        steps = max(k for _, k in rows)
        starts = [self.cache.held(h) for h, _ in rows]
        got = self.cache.reserve([h for h, _ in rows], [len(h) + steps - 1 for h, _ in rows])
        kept = [(h, s) for (h, _), s, ok in zip(rows, starts, got) if ok]
        if not kept:
            return
        drafts = self._draft([h for h, _ in kept], [s for _, s in kept], steps)
        for (history, _), row in zip(kept, drafts):
            self.cache.written(history, row[:-1])
            self._ready[history] = row

    def propose(self, history: TokenHistory, k: int) -> list[int]:
        return self._ready.get(history, [])[:k]

    def finished(self, history: TokenHistory, prompt_length: int) -> None:
        self.cache.free(history)

    def forget_all(self) -> None:
        self._ready = {}
        self.cache.clear()

    @torch.inference_mode()
    def _draft(self, histories: list[TokenHistory], starts: list[int], steps: int) -> list[list[int]]:
        """`steps` greedy tokens after each history, whose first starts[i] tokens the cache already holds."""
        lengths = np.array([len(h) for h in histories], dtype=np.int64)
        tables = self._block_tables(histories)
        fed = [h.tokens[s:] for h, s in zip(histories, starts)]
        positions = np.concatenate([np.arange(s, n) for s, n in zip(starts, lengths)])
        query_ends = np.cumsum([len(f) for f in fed])
        token = self._forward(np.concatenate(fed), positions, tables, np.concatenate([[0], query_ends]), lengths,
                              query_ends - 1, int(max(len(f) for f in fed)))
        out = [token]
        batch_starts = np.arange(len(histories) + 1)
        for step in range(1, steps):
            token = self._forward(token, lengths + step - 1, tables, batch_starts, lengths + step, None, 1)
            out.append(token)
        return torch.stack(out, dim=1).tolist()  # why: the one wait of a step's drafting: the host needs them now

    def _forward(self, ids, positions: np.ndarray, tables: np.ndarray, query_start: np.ndarray,
                 seq_lens: np.ndarray, last: np.ndarray | None, max_query: int) -> torch.Tensor:
        """One forward of the draft model; each sequence's greedy token after its last fed token, on the device."""
        bs, dev = self.cache.block_size, self.device
        slots = tables[np.repeat(np.arange(len(seq_lens)), np.diff(query_start)), positions // bs] * bs + positions % bs
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots.astype(np.int64)).to(dev),
            query_start_loc=torch.from_numpy(query_start.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(tables).to(dev),
            max_query_len=max_query,
            max_seq_len=int(seq_lens.max()),
        )
        if not isinstance(ids, torch.Tensor):
            ids = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)).to(dev)
        hidden = self.model(ids, torch.from_numpy(positions.astype(np.int64)).to(dev), self.kv_cache, meta)
        if last is not None:
            hidden = hidden[torch.from_numpy(last).to(dev)]
        self.forwards += 1
        logits = self.model.compute_logits(hidden)
        return logits[:, :self.vocab_size].argmax(dim=-1)

    def _block_tables(self, histories: list[TokenHistory]) -> np.ndarray:
        """(rows, most blocks) int32, unused entries 0."""
        blocks = [self.cache.blocks(h) for h in histories]
        tables = np.zeros((len(blocks), max(len(b) for b in blocks)), dtype=np.int32)
        for row, b in enumerate(blocks):
            tables[row, :len(b)] = b
        return tables
