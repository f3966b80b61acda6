"""Teacher-forced perplexity of a loaded model over a token sequence, one window per prefill of its paged forward."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from backend.ops.torch.attention import AttentionMetadata

BLOCK_SIZE = 16


def window_cache(model, window: int, kv_dtype: torch.dtype) -> torch.Tensor:
    """A paged KV cache (L, 2, NB, BS, Hkv, D) holding one window; block 0 stays the null block, as in the engine."""
    spec = model.spec
    blocks = 1 + -(-window // BLOCK_SIZE)
    device = model.embed_tokens.device
    return torch.zeros(spec.num_layers, 2, blocks, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim, dtype=kv_dtype,
                       device=device)


def window_nll(model, ids: torch.Tensor, kv_cache: torch.Tensor) -> float:
    """Summed negative log-likelihood (nats) of ids[1:] (T,), each given the window's tokens before it."""
    n, device = ids.shape[0], ids.device
    positions = torch.arange(n, device=device)
    table = torch.arange(1, 1 + -(-n // BLOCK_SIZE), dtype=torch.int32, device=device)  # (nblk,) blocks 1..
    meta = AttentionMetadata(
        slot_mapping=table.long()[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE,
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        block_tables=table[None],
        max_query_len=n,
        max_seq_len=n,
    )
    hidden = model(ids, positions, kv_cache, meta)  # (T, H): one prefill gives every position's hidden state
    logits = model.compute_logits(hidden[:-1]).float()  # (T-1, V) in the model's dtype, as the sampler reads them
    return F.cross_entropy(logits, ids[1:], reduction="sum").item()


def perplexity(model, token_ids: list[int], window: int, kv_dtype: torch.dtype) -> dict:
    """exp(mean NLL) over consecutive non-overlapping windows of token_ids; each window starts without context."""
    kv_cache = window_cache(model, window, kv_dtype)
    device = kv_cache.device
    nll, predicted = 0.0, 0
    for start in range(0, len(token_ids), window):
        chunk = token_ids[start:start + window]
        if len(chunk) < 2:  # a lone last token has nothing to be predicted from
            break
        nll += window_nll(model, torch.tensor(chunk, dtype=torch.int64, device=device), kv_cache)
        predicted += len(chunk) - 1
    return dict(perplexity=math.exp(nll / predicted), nll=nll, tokens=predicted)
