"""Teacher-forced perplexity of a loaded model over windows of tokens, each window one sequence of a prefill through
the model's own paged forward."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from backend.ops.attention_metadata import AttentionMetadata

BLOCK_SIZE = 16


def _blocks(n: int) -> int:
    return -(-n // BLOCK_SIZE)


def batch_nll(model, windows: list[list[int]], kv_cache: torch.Tensor) -> float:
    """Summed negative log-likelihood (nats) of each window's tokens after its first, each given the tokens of its own
    window before it: one prefill, one sequence per window, over kv_cache (L, 2, NB, BS, Hkv, D)."""
    device = kv_cache.device
    lens = [len(w) for w in windows]
    ids = torch.tensor([t for w in windows for t in w], dtype=torch.int64, device=device)  # (T,)
    positions = torch.cat([torch.arange(n, device=device) for n in lens])  # (T,)
    # sequence b owns blocks first[b] .. first[b] + blocks(len) - 1; block 0 stays the null block, as in the engine
    first = [1 + sum(_blocks(n) for n in lens[:b]) for b in range(len(lens))]
    width = max(_blocks(n) for n in lens)
    tables = torch.zeros(len(lens), width, dtype=torch.int32, device=device)  # (B, width)
    for b, n in enumerate(lens):
        tables[b, :_blocks(n)] = torch.arange(first[b], first[b] + _blocks(n), dtype=torch.int32)
    seq = torch.repeat_interleave(torch.arange(len(lens), device=device), torch.tensor(lens, device=device))  # (T,)
    qsl = torch.tensor([0] + lens, dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)  # (B+1,)
    meta = AttentionMetadata(
        slot_mapping=tables[seq, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE,
        query_start_loc=qsl,
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=tables,
        max_query_len=max(lens),
        max_seq_len=max(lens),
    )
    hidden = model(ids, positions, kv_cache, meta)  # (T, H): every position's hidden state
    nll = 0.0
    for b in range(len(lens)):  # one window's logits at a time: (n - 1, V) in the model's dtype, as sampled from
        rows = slice(int(qsl[b]), int(qsl[b + 1]))
        logits = model.compute_logits(hidden[rows][:-1]).float()
        nll += F.cross_entropy(logits, ids[rows][1:], reduction="sum").item()
    return nll


def perplexity(model, windows: list[list[int]], kv_dtype: torch.dtype, batch_tokens: int = 2048) -> dict:
    """exp(mean NLL) over the windows' predicted tokens (all but each window's first), batched into prefills of at
    most batch_tokens tokens (a window longer than that goes alone)."""
    windows = [w for w in windows if len(w) >= 2]  # a lone token has nothing to be predicted from
    batches: list[list[list[int]]] = []
    for w in windows:
        if batches and sum(map(len, batches[-1])) + len(w) <= batch_tokens:
            batches[-1].append(w)
        else:
            batches.append([w])
    spec = model.spec
    blocks = 1 + max(sum(_blocks(len(w)) for w in batch) for batch in batches)
    kv_cache = torch.zeros(spec.num_layers, 2, blocks, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim, dtype=kv_dtype,
                           device=model.embed_tokens.device)  # (L, 2, NB, BS, Hkv, D), reused by every batch
    nll = sum(batch_nll(model, batch, kv_cache) for batch in batches)
    predicted = sum(len(w) - 1 for w in windows)
    return dict(perplexity=math.exp(nll / predicted), nll=nll, tokens=predicted)
