"""Paged attention in plain torch: writes this step's K/V into the block cache, then attends over it."""
from __future__ import annotations

import torch

from backend.ops import fp8
from backend.ops.attention_metadata import AttentionMetadata


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache_layer: torch.Tensor, slot_mapping: torch.Tensor, *,
             kv_scale: torch.Tensor | None = None) -> None:
    """Scatter k, v (T, Hkv, D) into the layer's cache (2, NB, BS, Hkv, D) at the flat slots; an FP8 cache stores
    k / kv_scale[0] and v / kv_scale[1]."""
    _, nb, bs, hkv, d = kv_cache_layer.shape
    k_flat = kv_cache_layer[0].view(nb * bs, hkv, d)  # (NB*BS, Hkv, D), a view: writes land in the cache
    v_flat = kv_cache_layer[1].view(nb * bs, hkv, d)
    if fp8.is_fp8(kv_cache_layer):
        if kv_scale is None:
            raise ValueError("an FP8 KV cache needs its kv_scale")
        k, v = fp8.quantize_kv(k, kv_scale[0]), fp8.quantize_kv(v, kv_scale[1])
        # the e4m3 bits copied as bytes: index_copy_ has no e4m3 kernel on the CPU
        k, v, k_flat, v_flat = (t.view(torch.uint8) for t in (k, v, k_flat, v_flat))
    k_flat.index_copy_(0, slot_mapping, k.to(k_flat.dtype))
    v_flat.index_copy_(0, slot_mapping, v.to(v_flat.dtype))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    kv_cache_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal GQA attention of q (T, Hq, D) over each sequence's paged context -> (T, Hq, D).

    Vectorised over the batch: queries are scattered into a padded (B, Qmax) grid and the context blocks are
    gathered into a padded (B, L) view. Only device ops and host ints from `meta`, so decode steps can be
    captured in a CUDA graph (shapes are static given B, Qmax and the block-table width).
    k and v None: this step's K/V are already in the cache (rope_write_kv put them there).
    kv_scale: an FP8 cache's (2,) [k_scale, v_scale]; its values are dequantized to q's dtype as they are gathered.
    """
    if k is not None:
        write_kv(k, v, kv_cache_layer, meta.slot_mapping, kv_scale=kv_scale)
    num_tokens, hq, d = q.shape
    _, _, bs, hkv, _ = kv_cache_layer.shape
    if hq % hkv:
        raise ValueError(f"num_heads ({hq}) must be a multiple of num_kv_heads ({hkv})")
    bsz = meta.block_tables.shape[0]
    qmax = meta.max_query_len

    seq_idx, row = _token_rows(meta.query_start_loc, num_tokens)  # (T,), (T,)
    q_pad = q.new_zeros(bsz, qmax, hq, d)  # (B, Qmax, Hq, D)
    q_pad[seq_idx, row] = q
    k_ctx, v_ctx, key_pos = _gather_context(kv_cache_layer, meta.block_tables, meta.max_seq_len, bs)
    if fp8.is_fp8(kv_cache_layer):
        k_ctx = fp8.dequantize_kv(k_ctx, kv_scale[0], q.dtype)
        v_ctx = fp8.dequantize_kv(v_ctx, kv_scale[1], q.dtype)

    allowed, v_ctx = _causal_mask(meta, key_pos, qmax, v_ctx)
    out = _grouped_attention(q_pad, k_ctx, v_ctx, allowed, scale, hkv)  # (B, Qmax, Hq, D)
    return out[seq_idx, row]  # (T, Hq, D)


def _causal_mask(meta: AttentionMetadata, key_pos: torch.Tensor, qmax: int,
                 v_ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Which context keys each padded query row may see (B, Qmax, L): causal, inside its sequence; and v_ctx with
    the values past each sequence's end zeroed."""
    seq_lens = meta.seq_lens.long()  # (B,)
    q_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).long()  # (B,)
    q_pos = (seq_lens - q_lens)[:, None] + torch.arange(qmax, device=key_pos.device)  # (B, Qmax)
    # causal, inside the sequence; a padded query row still sees position 0, so no row is fully masked
    allowed = (key_pos[None, None, :] <= q_pos[:, :, None]) & (key_pos[None, None, :] < seq_lens[:, None, None])
    # blocks past seq_len may hold garbage (even NaN from torch.empty); 0 * NaN would leak through the PV product
    in_seq = (key_pos[None, :] < seq_lens[:, None])[:, :, None, None]  # (B, L, 1, 1)
    v_ctx = torch.where(in_seq, v_ctx, torch.zeros((), dtype=v_ctx.dtype, device=v_ctx.device))
    return allowed, v_ctx


def _grouped_attention(q_pad: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, allowed: torch.Tensor,
                       scale: float, hkv: int) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v for padded queries (B, Qmax, Hq, D) over gathered keys and values
    (B, L, Hkv, D), each KV head serving its group of query heads: (B, Qmax, Hq, D)."""
    bsz, qmax, hq, d = q_pad.shape
    qg = q_pad.view(bsz, qmax, hkv, hq // hkv, d).permute(0, 2, 3, 1, 4)  # (B, Hkv, G, Qmax, D)
    kg = k_ctx.permute(0, 2, 3, 1).unsqueeze(2)  # (B, Hkv, 1, D, L)
    scores = torch.matmul(qg, kg) * scale  # (B, Hkv, G, Qmax, L)
    scores = scores.float().masked_fill(~allowed[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q_pad.dtype)  # float32 softmax, as HF's eager attention
    vg = v_ctx.permute(0, 2, 1, 3).unsqueeze(2)  # (B, Hkv, 1, L, D)
    out = torch.matmul(probs, vg)  # (B, Hkv, G, Qmax, D)
    return out.permute(0, 3, 1, 2, 4).reshape(bsz, qmax, hq, d)


def _token_rows(query_start_loc: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each token: its sequence index and its row among that sequence's queries."""
    qsl = query_start_loc.long()  # (B+1,)
    tokens = torch.arange(num_tokens, device=qsl.device)  # (T,)
    seq_idx = torch.searchsorted(qsl[1:], tokens, right=True)  # (T,); needs qsl[B] == T
    return seq_idx, tokens - qsl[seq_idx]


def _gather_context(
    kv_cache_layer: torch.Tensor, block_tables: torch.Tensor, max_seq_len: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gather the first ceil(max_seq_len / BS) blocks of each sequence -> K, V (B, L, Hkv, D), positions (L,)."""
    num_blocks = min(block_tables.shape[1], -(-max_seq_len // block_size))
    tables = block_tables[:, :num_blocks].long()  # (B, nblk)
    bsz = tables.shape[0]
    _, _, _, hkv, d = kv_cache_layer.shape
    k_ctx = kv_cache_layer[0][tables].view(bsz, num_blocks * block_size, hkv, d)  # (B, L, Hkv, D)
    v_ctx = kv_cache_layer[1][tables].view(bsz, num_blocks * block_size, hkv, d)  # (B, L, Hkv, D)
    key_pos = torch.arange(num_blocks * block_size, device=kv_cache_layer.device)  # (L,)
    return k_ctx, v_ctx, key_pos
