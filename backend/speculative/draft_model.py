"""Draft-model proposals: a smaller model with the target's tokenizer guesses each row's next tokens greedily, all of
a step's drafting rows together, over its own paged KV cache (the same model code and attention ops as the target).

A step's drafting is one fixed-shape body, a CUDA graph per batch bucket (speculative/draft_graphs.py): each row feeds
its history's last FEED tokens (at most that many are new to the draft cache after a drafted step: the last draft
kept and the token after it; an older one fed again is written over with its own entry), the greedy pick after them
is the first draft, and k - 1 one-token forwards feed each pick in turn. A row further behind (new, or drafting
again after watching under the draft policy) first has the rest fed by one eager forward. The drafts reach the host
once, at the end."""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from backend.ops.attention_metadata import AttentionMetadata
from backend.speculative.draft_cache import DraftCache
from backend.speculative.draft_graphs import DraftGraphs
from backend.speculative.proposer import Proposer
from backend.speculative.token_history import TokenHistory

FEED = 2


class DraftModelProposer(Proposer):
    """Proposes each row's greedy continuation under a smaller model; `prepare` drafts a whole step's rows at once,
    `propose` then hands each row its part."""

    name = "draft"
    drafts_together = True

    def __init__(self, model, kv_cache: torch.Tensor, block_size: int, vocab_size: int, num_tokens: int,
                 max_rows: int) -> None:
        """model: a LlamaFamilyModel; kv_cache: its own (L, 2, NB, BS, Hkv, D) tensor; vocab_size: the target's
        (a draft whose head is wider never proposes a token the target lacks); every step drafts num_tokens a row
        (one asking for fewer gets the first ones) for at most max_rows rows."""
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.cache = DraftCache(kv_cache.shape[2], block_size)
        self.vocab_size = min(vocab_size, model.spec.vocab_size)
        self.max_len = model.spec.max_position_embeddings
        self.k = num_tokens
        self._ready: dict[TokenHistory, list[int]] = {}  # this step's drafts, from prepare
        self.catch_ups = 0
        columns = -(-self.max_len // block_size)
        self._inputs = _StepInputs(max_rows, columns, num_tokens, self.device)
        self.graphs = DraftGraphs(self._body, self.device, max_rows, columns, block_size)
        self.graphs.capture_all()

    def prepare(self, histories: list[TokenHistory], ks: list[int]) -> None:
        self._ready = {}
        rows = [h for h, k in zip(histories, ks) if k > 0 and FEED <= len(h) and len(h) + self.k <= self.max_len]
        starts = [self.cache.reconcile(h) for h in rows]
        got = self.cache.reserve(rows, [len(h) + self.k - 1 for h in rows])
        kept = [(h, s) for h, s, ok in zip(rows, starts, got) if ok]
        if not kept:
            return
        with self._stream():
            behind = [(h, s) for h, s in kept if s < len(h) - FEED]
            if behind:
                self._catch_up(behind)
            drafts = self._fixed_shape_step([h for h, _ in kept])
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

    def _stream(self):
        """The draft's own stream on CUDA: its work never queues behind the engine's steps or into their streams."""
        return torch.cuda.stream(self.graphs.stream) if self.graphs.stream is not None else contextlib.nullcontext()

    @torch.inference_mode()
    def _catch_up(self, rows: list[tuple[TokenHistory, int]]) -> None:
        """One eager forward feeding each row's history from what the cache holds up to its last FEED tokens."""
        self.catch_ups += 1
        bs, dev = self.cache.block_size, self.device
        fed = [h.tokens[s:len(h) - FEED] for h, s in rows]
        positions = np.concatenate([np.arange(s, len(h) - FEED) for h, s in rows])
        tables = _block_tables([self.cache.blocks(h) for h, _ in rows])
        owner = np.repeat(np.arange(len(rows)), [len(f) for f in fed])
        slots = tables[owner, positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = np.array([len(h) - FEED for h, _ in rows], dtype=np.int32)
        query_start = np.concatenate([[0], np.cumsum([len(f) for f in fed])]).astype(np.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            query_start_loc=torch.from_numpy(query_start).to(dev),
            seq_lens=torch.from_numpy(seq_lens).to(dev),
            block_tables=torch.from_numpy(tables).to(dev),
            max_query_len=max(len(f) for f in fed),
            max_seq_len=int(seq_lens.max()),
        )
        ids = torch.from_numpy(np.concatenate(fed).astype(np.int64)).to(dev)
        self.model(ids, torch.from_numpy(positions.astype(np.int64)).to(dev), self.kv_cache, meta)

    def _fixed_shape_step(self, histories: list[TokenHistory]) -> list[list[int]]:
        """The fixed-shape step over every row (the graph of its bucket on CUDA); each row's k drafts."""
        n = len(histories)
        bucket = self.graphs.bucket_for(n)
        # rows past n: harmless, in the null block
        tables = _block_tables([self.cache.blocks(h) for h in histories] + [[]] * (bucket - n))
        columns = tables.shape[1]
        tokens = np.zeros((bucket, FEED), dtype=np.int64)
        lengths = np.full(bucket, FEED, dtype=np.int64)
        for row, history in enumerate(histories):
            tokens[row] = history.tokens[-FEED:]
            lengths[row] = len(history)
        self._inputs.fill(tokens, lengths, tables)
        self.graphs.run(n, columns, int(lengths.max()) + self.k - 1)
        return self._inputs.drafts[:n].tolist()  # why: the one wait of a step's drafting: the host needs them now

    @torch.inference_mode()
    def _body(self, rows: int, columns: int, max_len: int) -> None:
        """What a graph holds: FEED tokens a row, then k - 1 one-token forwards, each row's picks into drafts."""
        x = self._inputs
        lengths, tables = x.lengths[:rows], x.block_tables[:rows, :columns]
        positions = (lengths.unsqueeze(1) - FEED + x.feed_offsets).reshape(-1)  # (rows * FEED,)
        token = self._pick(x.tokens[:rows].reshape(-1), positions, x.feed_owner[:rows * FEED], tables,
                           x.feed_starts[:rows + 1], lengths, FEED, max_len)
        x.drafts[:rows, 0] = token
        for step in range(1, self.k):
            token = self._pick(token, lengths + step - 1, x.row_ids[:rows], tables, x.row_starts[:rows + 1],
                               lengths + step, 1, max_len)
            x.drafts[:rows, step] = token

    def _pick(self, ids: torch.Tensor, positions: torch.Tensor, owner: torch.Tensor, tables: torch.Tensor,
              query_start: torch.Tensor, seq_lens: torch.Tensor, per_row: int, max_len: int) -> torch.Tensor:
        """One forward, every row feeding per_row tokens; each row's greedy token after its last."""
        bs = self.cache.block_size
        slots = tables[owner, positions // bs].to(torch.int64) * bs + positions % bs
        meta = AttentionMetadata(slot_mapping=slots, query_start_loc=query_start,
                                 seq_lens=seq_lens.to(torch.int32), block_tables=tables, max_query_len=per_row,
                                 max_seq_len=max_len)
        hidden = self.model(ids, positions, self.kv_cache, meta)
        logits = self.model.compute_logits(hidden[per_row - 1::per_row])
        return logits[:, :self.vocab_size].argmax(dim=-1)


class _StepInputs:
    """The fixed-shape step's device buffers at fixed addresses (what its graphs read and write), and index tables."""

    def __init__(self, max_rows: int, columns: int, k: int, device: torch.device) -> None:
        def rows_of(*shape, dtype=torch.int64):
            return torch.zeros(max_rows, *shape, dtype=dtype, device=device)

        self.tokens, self.drafts = rows_of(FEED), rows_of(k)
        self.lengths = torch.full((max_rows,), FEED, dtype=torch.int64, device=device)
        self.block_tables = rows_of(columns, dtype=torch.int32)
        self.feed_offsets = torch.arange(FEED, device=device)
        self.row_ids = torch.arange(max_rows, device=device)
        self.feed_owner = self.row_ids.repeat_interleave(FEED)
        self.feed_starts = torch.arange(max_rows + 1, dtype=torch.int32, device=device) * FEED
        self.row_starts = torch.arange(max_rows + 1, dtype=torch.int32, device=device)

    def fill(self, tokens: np.ndarray, lengths: np.ndarray, tables: np.ndarray) -> None:
        """The first len(tokens) rows' inputs (the rows past a step's own already harmless); the block tables' first
        columns only: a row's attention and writes never reach past its own blocks."""
        n, columns = tables.shape
        self.tokens[:n].copy_(torch.from_numpy(tokens))
        self.lengths[:n].copy_(torch.from_numpy(lengths))
        self.block_tables[:n, :columns].copy_(torch.from_numpy(tables))


def _block_tables(blocks: list[list[int]]) -> np.ndarray:
    """(rows, most blocks) int32, unused entries 0."""
    tables = np.zeros((len(blocks), max(len(b) for b in blocks)), dtype=np.int32)
    for row, b in enumerate(blocks):
        tables[row, :len(b)] = b
    return tables
