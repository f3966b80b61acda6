"""Paged attention for CUDA, written in the Triton language: KV-cache write, split-K decode, chunked prefill."""
from __future__ import annotations


import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # the dispatcher catches this and keeps the plain-torch path
    raise ImportError("backend.ops.triton.attention needs the `triton` package") from exc

from backend.ops.triton import buffers  # noqa: E402

from backend.ops.triton.launch import allow_dependents, dependent_wait  # noqa: E402  (after the guarded import)
from backend.ops.triton.layers import (is_fp8_cache, load_summed, rope_cos_sin, rope_rotate,  # noqa: E402
                                       rope_write_kv, to_cache, unpack_qkv)

__all__ = ["paged_attention", "rope_paged_attention", "write_kv_cache", "decode_attention", "rope_decode_attention",
           "prefill_attention", "choose_num_splits"]

_LOG2E = 1.4426950408889634

# Decode launch defaults (tuned on one H200; KERNELS.md has the sweep).
DECODE_TILE_ELEMS = 8192  # K (and V) values per tile: 16 KB of bf16 in flight a step; 64 tokens at D 128, 128 at D 64
DECODE_NUM_WARPS = 4
DECODE_NUM_STAGES = 3     # cp.async pipelining of the K/V tile loads
DECODE_PROGRAMS_PER_SM = 4  # splits are chosen so the grid has about this many programs per SM
DECODE_MIN_SPLIT_TOKENS = 256  # below this a split's fixed cost (q load, partial write, reduce) dominates
DECODE_MAX_SPLITS = 64
ORDER_BLOCK = 64  # sequences one program of _longest_first_kernel ranks

PREFILL_BLOCK_M = 64      # rows of one program: (query token, query head of the KV group) pairs
PREFILL_BLOCK_N = 64
PREFILL_NUM_WARPS = 4
PREFILL_NUM_STAGES = 2




def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 dots would run as tf32 (1e-3 error) by default; "ieee" keeps fp32 exact to ~1e-6.
    return "ieee" if dtype == torch.float32 else "tf32"


def _stages(stages: int, dtype: torch.dtype) -> int:
    # fp32 tiles are twice as large: two stages of K and V (64 x 128 x 4 B each) already take 128 KB of shared memory
    return min(stages, 2) if dtype == torch.float32 else stages


def decode_block_n(d_pad: int, kv_fp8: bool = False) -> int:
    """KV tokens per decode tile: a fixed tile size in bytes, not in tokens. On the H200, batch 64 at D 64 read
    the cache at 2.96 / 3.05 / 3.37 TB/s with 128-token tiles against 2.47 / 2.88 / 3.14 with 64 (context 384 /
    768 / 1152); at D 128, 64 tokens was the best of the sweep in KERNELS.md. An FP8 cache's tiles take twice the
    tokens, the same 16 KB: on the H100 at D 128, batch 32 / 64 / 256 at context 2048 / 4096 / 2048 decoded in
    81 / 285 / 491 us with 128-token tiles against 94 / 322 / 535 with 64 (bf16 cache: 98 / 360 / 710)."""
    return max(16, min(128, DECODE_TILE_ELEMS * (2 if kv_fp8 else 1) // d_pad))


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Number of context splits for decode from host ints only, so a captured graph never reads the device."""
    base = max(1, batch * num_kv_heads)
    # Rounded to nearest, not up: on the H200 batch 32 x 8 KV heads ran at 4.0 TB/s with 2 splits (512 programs,
    # ~4 per SM) but 3.6 with 3 (768: a second, partial wave of programs).
    want = (DECODE_PROGRAMS_PER_SM * num_sms + base // 2) // base
    by_len = triton.cdiv(max(1, max_seq_len), DECODE_MIN_SPLIT_TOKENS)
    return max(1, min(want, by_len, DECODE_MAX_SPLITS))


# --------------------------------------------------------------------------------------------------------
# KV-cache write (reshape_and_cache)
# --------------------------------------------------------------------------------------------------------
@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr, kv_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ckv, stride_cb, stride_cs, stride_ch,
    H: tl.constexpr, D: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr,
    PDL: tl.constexpr, KV_FP8: tl.constexpr,
):
    # KV_FP8: an e4m3 cache, which stores k / kv_scale[0] and v / kv_scale[1] (to_cache)
    allow_dependents(PDL)
    dependent_wait(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # a negative slot means "do not cache" (never produced by the runner, but cheap to honour)
        return
    blk = slot // BS
    off = slot % BS
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_h < H)[:, None] & (offs_d < D)[None, :]
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    dst = cache_ptr + blk * stride_cb + off * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    tl.store(dst, to_cache(k, cache_ptr.dtype.element_ty, kv_scale_ptr, KV_FP8), mask=mask)
    tl.store(dst + stride_ckv, to_cache(v, cache_ptr.dtype.element_ty, kv_scale_ptr + 1, KV_FP8), mask=mask)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache_layer: torch.Tensor, slot_mapping: torch.Tensor, *,
                   pdl: bool = False, kv_scale: torch.Tensor | None = None):
    """Write k, v (T, Hkv, D) into kv_cache_layer (2, NB, BS, Hkv, D) at the flat slots of slot_mapping (T,).

    kv_scale: an FP8 cache's (2,) float32 [k_scale, v_scale]; it stores fp8.quantize_kv(k, k_scale) and of v."""
    T, H, D = k.shape
    kv_fp8 = is_fp8_cache(kv_cache_layer, kv_scale)
    if T == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    c = kv_cache_layer
    _write_kv_kernel[(T,)](
        k, v, c, slot_mapping, kv_scale if kv_fp8 else c,  # c: unused without KV_FP8
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        c.stride(0), c.stride(1), c.stride(2), c.stride(3),
        H=H, D=D, H_PAD=triton.next_power_of_2(H), D_PAD=triton.next_power_of_2(D), BS=c.shape[2],
        PDL=pdl, KV_FP8=kv_fp8, num_warps=4 if H * D >= 1024 else 1, launch_pdl=pdl,
    )


# --------------------------------------------------------------------------------------------------------
# Decode: one query token per sequence; one program = (sequence, KV head, context split)
# --------------------------------------------------------------------------------------------------------
@triton.jit
def _attend_tile(q, k_ptrs, stride_ckv, kv_mask, score_mask, qk_scale, m_i, l_i, acc, DOT_PREC: tl.constexpr,
                 KV_FP8: tl.constexpr):
    """One KV tile of the online softmax: scores of q (rows, D) against the tile's keys at k_ptrs (BLOCK_N, D; the
    values sit stride_ckv further), masked by score_mask (rows, BLOCK_N), folded into the running max m_i, sum l_i
    and weighted values acc. Returns the new (m_i, l_i, acc).

    KV_FP8: the tiles are e4m3, converted to q's dtype (exact) so the dots stay q-dtype tensor-core dots; the
    caller has folded k_scale into qk_scale and multiplies the output by v_scale."""
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0)  # (BLOCK_N, D_PAD)
    if KV_FP8:
        k = k.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # (rows, BLOCK_N)
    s = tl.where(score_mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # Masked V rows must load as 0, not as whatever the cache holds: 0 * NaN would still poison acc.
    v = tl.load(k_ptrs + stride_ckv, mask=kv_mask, other=0.0)
    if KV_FP8:
        v = v.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["num_splits"])  # one binary for every split count: no recompiles
def _decode_kernel(
    q_ptr, cache_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    qk_scale,  # softmax scale * log2(e): the softmax runs in base 2 (exp2 is one instruction)
    num_splits, stride_qt, stride_qh, stride_ckv, stride_cb, stride_cs, stride_ch, stride_bt, stride_ot, stride_oh,
    k_ptr, v_ptr, pos_ptr, cos_sin_ptr, slot_ptr, q_rot_ptr, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos,
    stride_part, order_ptr, kv_scale_ptr,
    HQ: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BS: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr,
    ROPE: tl.constexpr, PARTS: tl.constexpr, SINGLE_ONLY: tl.constexpr, ORDERED: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    # DIRECT: a single split writes the normalised output itself and no reduce kernel runs.
    # ORDERED: order_ptr holds the sequence ids longest context first (_longest_first_kernel); programs take them in
    # that order, all KV heads of a sequence together.
    # SINGLE_ONLY: a mixed step's sequences; only those that feed one query token are this kernel's (the prefill
    # kernel takes the rest), read from the query start locations on the device.
    # ROPE: q, k and v are this step's unrotated projections (PARTS > 0: split-K partials, stride_part apart); the
    # program rotates them and writes the new K/V itself (rope_write_kv fused in front). q_rot_ptr: a (T, HQ, D)
    # buffer with the output's strides for the rotated q.
    # KV_FP8: the cache is e4m3 with kv_scale_ptr's [k_scale, v_scale]: written as to_cache stores, read as
    # _attend_tile's KV_FP8 says (k_scale folded into qk_scale, v_scale applied to acc before it is stored).
    allow_dependents(PDL)
    dependent_wait(PDL)
    if ORDERED:  # grid (KV heads, sequences by rank, splits): the longest contexts start first
        kvh = tl.program_id(0)
        b = tl.load(order_ptr + tl.program_id(1))
    else:
        b = tl.program_id(0)
        kvh = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + b)
    row = tl.load(qsl_ptr + b).to(tl.int64)
    if SINGLE_ONLY:
        if tl.load(qsl_ptr + b + 1) - row != 1:
            return

    # All G query heads of this KV head share every K/V tile: the cache is read once per KV head.
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    g_mask = offs_g < G
    d_mask = offs_d < D
    heads = kvh * G + offs_g

    # Each sequence splits its own length (not the batch maximum) evenly, in whole tiles.
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)

    if ROPE:
        # rope_write_kv's work for this token and KV head, with its code: q's G heads rotated into q_rot_ptr (also
        # by every other split of the sequence: the same bits), k and v into their cache slot by the split that
        # holds the new token. Then the loop below runs unchanged, reading them back.
        HALF: tl.constexpr = D // 2
        HALF_PAD: tl.constexpr = D_PAD // 2
        cos, sin, offs_j, j_mask = rope_cos_sin(cos_sin_ptr, pos_ptr, row, stride_cos, HALF, HALF_PAD)
        rope_rotate(q_ptr + kvh * G * stride_qh, q_rot_ptr + kvh * G * stride_oh, row, stride_qt, stride_qh,
                    stride_ot, stride_oh, cos, sin, offs_j, j_mask, G, G_PAD, HALF, stride_part, PARTS,
                    q_rot_ptr.dtype.element_ty, q_rot_ptr, False)
        last = seq_len - 1  # the new token's position
        slot = tl.load(slot_ptr + row).to(tl.int64)
        if (start <= last) & (last < end) & (slot >= 0):  # a negative slot means "do not cache"
            dst = cache_ptr + (slot // BS) * stride_cb + (slot % BS) * stride_cs + kvh * stride_ch
            ty = q_rot_ptr.dtype.element_ty  # the model's dtype
            rope_rotate(k_ptr + kvh * stride_kh, dst, row, stride_kt, 0, 0, 0, cos, sin, offs_j, j_mask, 1, 1, HALF,
                        stride_part, PARTS, ty, kv_scale_ptr, KV_FP8)
            v = load_summed(v_ptr + row * stride_vt + kvh * stride_vh + offs_d, d_mask, stride_part, PARTS, ty)
            tl.store(dst + stride_ckv + offs_d, to_cache(v, cache_ptr.dtype.element_ty, kv_scale_ptr + 1, KV_FP8),
                     mask=d_mask)
        # why: the stores above are read back below by other threads of this program; a CTA barrier makes a
        # thread's global writes visible to the whole CTA
        tl.debug_barrier()
        q = tl.load(q_rot_ptr + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # (G_PAD, D_PAD)
    else:
        q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # (G_PAD, D_PAD)

    if KV_FP8:
        qk_scale = qk_scale * tl.load(kv_scale_ptr)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    kv_base = cache_ptr + kvh * stride_ch
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        n_mask = pos < end
        blk = tl.load(bt_row + pos // BS, mask=n_mask, other=0).to(tl.int64)
        tok_off = blk * stride_cb + (pos % BS) * stride_cs  # (BLOCK_N,) rows of the paged cache
        m_i, l_i, acc = _attend_tile(q, kv_base + tok_off[:, None] + offs_d[None, :], stride_ckv,
                                     n_mask[:, None] & d_mask[None, :], n_mask[None, :], qk_scale, m_i, l_i, acc,
                                     DOT_PREC, KV_FP8)
    if KV_FP8:  # the partials carry it too: the reduce's weighted sum is linear in acc
        acc = acc * tl.load(kv_scale_ptr + 1)

    out_mask = g_mask[:, None] & d_mask[None, :]
    if DIRECT:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Partials are written even for an empty split (m = -inf, l = 0, acc = 0) so the reduce reads no garbage.
        part = (b.to(tl.int64) * HQ + heads) * num_splits + split  # (G_PAD,) index into (B, HQ, num_splits)
        tl.store(part_m_ptr + part, m_i, mask=g_mask)
        tl.store(part_l_ptr + part, l_i, mask=g_mask)
        tl.store(part_acc_ptr + part[:, None] * D + offs_d[None, :], acc, mask=out_mask)


@triton.jit(do_not_specialize=["num_seqs"])
def _longest_first_kernel(seq_lens_ptr, order_ptr, num_seqs, BLOCK: tl.constexpr):
    """order[rank] = sequence id, ranked by context length, longest first (ties: lower id first). Each program ranks
    BLOCK sequences by counting, over all of them, those that come before: a permutation, no sort needed."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    i_mask = i < num_seqs
    len_i = tl.load(seq_lens_ptr + i, mask=i_mask, other=0)
    rank = tl.zeros([BLOCK], tl.int32)
    for j0 in range(0, num_seqs, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        len_j = tl.load(seq_lens_ptr + j, mask=j < num_seqs, other=-1)  # -1: before no real sequence
        before = (len_j[None, :] > len_i[:, None]) | ((len_j[None, :] == len_i[:, None]) & (j[None, :] < i[:, None]))
        rank += tl.sum(before.to(tl.int32), 1)
    tl.store(order_ptr + rank, i, mask=i_mask)


def longest_first(meta) -> torch.Tensor:
    """meta.seq_order, computed on the device by the step's first call (its other layers reuse it)."""
    if meta.seq_order is None:
        n = meta.seq_lens.shape[0]
        order = buffers.alloc((n,), torch.int32, meta.seq_lens.device)
        # A plain launch, not a programmatic dependent: the decode kernel after it must see every rank written,
        # and this kernel never lets a dependent start early.
        _longest_first_kernel[(triton.cdiv(n, ORDER_BLOCK),)](meta.seq_lens, order, n, BLOCK=ORDER_BLOCK,
                                                              num_warps=4)
        meta.seq_order = order
    return meta.seq_order


def _ordered(batch: int, num_kv_heads: int, device: torch.device) -> bool:
    """Whether decode programs take the sequences longest first: only when the programs before splitting fill more
    than one wave (about DECODE_PROGRAMS_PER_SM an SM). Then the
    SMs hand out programs as earlier ones finish, and a long context started last runs alone at the end (on the
    H200, 256 rows of the realistic mix in one unordered launch read the cache at 3.15 TB/s, against 4.0 for
    equal lengths)."""
    return batch * num_kv_heads > DECODE_PROGRAMS_PER_SM * buffers.sm_count(device)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    part_acc_ptr, part_m_ptr, part_l_ptr, qsl_ptr, out_ptr, num_splits, stride_ot, stride_oh,
    HQ: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr, PDL: tl.constexpr,
    SINGLE_ONLY: tl.constexpr,
):
    allow_dependents(PDL)
    dependent_wait(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(qsl_ptr + b).to(tl.int64)
    if SINGLE_ONLY:  # as the decode kernel: another kernel writes the rows of longer queries
        if tl.load(qsl_ptr + b + 1) - row != 1:
            return
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_mask = offs_s < num_splits
    d_mask = offs_d < D
    base = (b.to(tl.int64) * HQ + h) * num_splits
    m = tl.load(part_m_ptr + base + offs_s, mask=s_mask, other=float("-inf"))
    l = tl.load(part_l_ptr + base + offs_s, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(m > float("-inf"), tl.exp2(m - m_max), 0.0)  # empty splits weigh 0
    acc = tl.load(part_acc_ptr + (base + offs_s)[:, None] * D + offs_d[None, :],
                  mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    num = tl.sum(acc * w[:, None], 0)
    den = tl.sum(l * w, 0)
    den = tl.where(den > 0.0, den, 1.0)
    tl.store(out_ptr + row * stride_ot + h * stride_oh + offs_d, (num / den).to(out_ptr.dtype.element_ty),
             mask=d_mask)


def decode_attention(q, kv_cache_layer, meta, scale, out=None, *, num_splits=None, block_n=None,
                     num_warps=None, num_stages=None, pdl: bool = False, single_only: bool = False, kv_scale=None):
    """Paged decode attention (one query token per sequence) over the cache; split-K with a reduce kernel.

    single_only: the sequences may feed any number of query tokens (a mixed step); only the rows of those that feed
    exactly one are computed and written, the others are left as they are in out.
    kv_scale: an FP8 cache's (2,) float32 [k_scale, v_scale] (a cached value times its scale is the real value)."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    return _decode(q, kv_cache_layer, meta, scale, out, None, num_splits, block_n, num_warps, num_stages, pdl,
                   single_only, kv_scale)


def rope_decode_attention(q, k, v, positions, cos_sin_cache, kv_cache_layer, meta, scale, *, num_splits=None,
                          block_n=None, num_warps=None, num_stages=None, pdl: bool = False, kv_scale=None):
    """rope_write_kv followed by decode_attention, in one kernel: the same output and cache bits.

    q (T, Hq, D), k and v (T, Hkv, D) unrotated, or all three views of one split-K qkv GEMM's partials
    (PartialSums). Each program first does rope_write_kv's work for its sequence and KV head, with the same code:
    q's heads of the group rotated into a scratch buffer, and by the split that holds the new token the rotated k
    and v into their cache slot; then, after a CTA barrier, decode_attention's loop reads them back."""
    (q, k, v), dtype, parts, stride_part = unpack_qkv(q, k, v, kv_cache_layer.dtype)
    cs = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    out = buffers.alloc(tuple(q.shape), dtype, q.device)
    q_rot = buffers.alloc(tuple(q.shape), dtype, q.device)  # strides equal out's: the kernel indexes both alike
    rope = (k, v, positions, cs, meta.slot_mapping, q_rot, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cs.stride(0), stride_part, parts)
    return _decode(q, kv_cache_layer, meta, scale, out, rope, num_splits, block_n, num_warps, num_stages, pdl, False,
                   kv_scale)


def _shapes(q, kv_cache_layer, meta) -> tuple[int, int, int, int, int, int, int]:
    """(tokens, query heads, head dim, block size, KV heads, sequences, query heads per KV head)."""
    T, HQ, D = q.shape
    _, _, BS, HKV, _ = kv_cache_layer.shape
    return T, HQ, D, BS, HKV, meta.seq_lens.shape[0], HQ // HKV


def _decode(q, kv_cache_layer, meta, scale, out, rope, num_splits, block_n, num_warps, num_stages, pdl, single_only,
            kv_scale):
    """Launch the decode kernel (and the reduce when it splits); rope: the fused rotary + KV-write inputs or None."""
    T, HQ, D, BS, HKV, B, G = _shapes(q, kv_cache_layer, meta)
    kv_fp8 = is_fp8_cache(kv_cache_layer, kv_scale)
    if out is None:
        out = buffers.alloc((T, HQ, D), q.dtype, q.device)
    if B == 0:
        return out
    if num_splits is None:
        num_splits = choose_num_splits(B, HKV, int(meta.max_seq_len), buffers.sm_count(q.device))
    D_PAD = max(16, triton.next_power_of_2(D))
    block_n = block_n or decode_block_n(D_PAD, kv_fp8)
    c = kv_cache_layer
    bt = meta.block_tables
    if num_splits > 1:
        part_acc = buffers.alloc((B, HQ, num_splits, D), torch.float32, q.device)
        part_m = buffers.alloc((B, HQ, num_splits), torch.float32, q.device)
        part_l = buffers.alloc((B, HQ, num_splits), torch.float32, q.device)
    else:
        part_acc = part_m = part_l = out  # unused: the kernel writes the output directly
    fused = rope is not None
    *rope_args, parts = rope if fused else (q, q, q, q, q, q, 0, 0, 0, 0, 0, 0, 0)  # unused without ROPE
    ordered = _ordered(B, HKV, q.device)
    order = longest_first(meta) if ordered else meta.seq_lens  # unused unless ordered
    _decode_kernel[(HKV, B, num_splits) if ordered else (B, HKV, num_splits)](
        q, c, bt, meta.seq_lens, meta.query_start_loc, out, part_acc, part_m, part_l,
        scale * _LOG2E, num_splits,
        q.stride(0), q.stride(1), c.stride(0), c.stride(1), c.stride(2), c.stride(3), bt.stride(0),
        out.stride(0), out.stride(1), *rope_args, order, kv_scale if kv_fp8 else c,  # c: unused without KV_FP8
        HQ=HQ, G=G, G_PAD=max(16, triton.next_power_of_2(G)), D=D, D_PAD=D_PAD, BS=BS, BLOCK_N=block_n,
        # the output's dtype is the model's (q may be a view of fp32 partials, the cache FP8)
        DIRECT=num_splits == 1, DOT_PREC=_dot_precision(out.dtype), PDL=pdl, ROPE=fused,
        PARTS=parts, SINGLE_ONLY=single_only, ORDERED=ordered, KV_FP8=kv_fp8, num_warps=num_warps or DECODE_NUM_WARPS,
        num_stages=num_stages or _stages(DECODE_NUM_STAGES, c.dtype), launch_pdl=pdl,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(B, HQ)](
            part_acc, part_m, part_l, meta.query_start_loc, out, num_splits, out.stride(0), out.stride(1),
            HQ=HQ, D=D, D_PAD=D_PAD, S_PAD=max(2, triton.next_power_of_2(num_splits)), PDL=pdl,
            SINGLE_ONLY=single_only, num_warps=4, launch_pdl=pdl,
        )
    return out


# --------------------------------------------------------------------------------------------------------
# Prefill / chunked prefill / mixed batches: variable query lengths, causal, all keys read from the cache
# --------------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["num_seqs"])  # a batch of one must not turn the search bound into a constant
def _prefill_kernel(
    q_ptr, cache_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr, qk_scale, num_seqs, kv_scale_ptr,
    stride_qt, stride_qh, stride_ckv, stride_cb, stride_cs, stride_ch, stride_bt, stride_ot, stride_oh,
    G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
    PDL: tl.constexpr, SKIP_SINGLE: tl.constexpr, KV_FP8: tl.constexpr,
):
    # KV_FP8: an e4m3 cache with kv_scale_ptr's [k_scale, v_scale], read as in the decode kernel
    allow_dependents(PDL)
    dependent_wait(PDL)
    pid = tl.program_id(0)
    kvh = tl.program_id(1)

    # Sequence b owns programs [qsl[b] // BLOCK_Q + b, qsl[b+1] // BLOCK_Q + b + 1): find b by binary search
    # on device, so the grid size (T // BLOCK_Q + B) needs host ints only.
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if first <= pid:
            lo = mid + 1
        else:
            hi = mid
    b = lo - 1
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    q_block = pid - (q_start // BLOCK_Q + b)
    if q_block * BLOCK_Q >= q_len:
        return
    if SKIP_SINGLE:  # one-token queries are the decode kernel's in this step (paged_attention runs both)
        if q_len == 1:
            return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx_len = seq_len - q_len  # tokens cached by earlier steps

    # Rows pack (query token, query head of this KV head): token-major, so KV is read once per KV head.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < D
    tok = q_block * BLOCK_Q + offs_m // G
    head = kvh * G + offs_m % G
    row_mask = (offs_m < BLOCK_Q * G) & (tok < q_len)
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)  # (BLOCK_M, D_PAD)
    q_pos = ctx_len + tok  # context position of each row's token

    # Causal: nothing past the last query token of this block is needed.
    kv_end = tl.minimum(seq_len, ctx_len + (q_block + 1) * BLOCK_Q)
    if KV_FP8:
        qk_scale = qk_scale * tl.load(kv_scale_ptr)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    kv_base = cache_ptr + kvh * stride_ch
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(0, kv_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        n_mask = pos < kv_end
        blk = tl.load(bt_row + pos // BS, mask=n_mask, other=0).to(tl.int64)
        tok_off = blk * stride_cb + (pos % BS) * stride_cs
        # Every row sees position 0 in the first tile, so its running max is finite from then on.
        causal = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
        m_i, l_i, acc = _attend_tile(q, kv_base + tok_off[:, None] + offs_d[None, :], stride_ckv,
                                     n_mask[:, None] & d_mask[None, :], causal, qk_scale, m_i, l_i, acc, DOT_PREC,
                                     KV_FP8)
    if KV_FP8:
        acc = acc * tl.load(kv_scale_ptr + 1)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def prefill_attention(q, kv_cache_layer, meta, scale, out=None, *, block_m=None, block_n=None,
                      num_warps=None, num_stages=None, pdl: bool = False, skip_single: bool = False, kv_scale=None):
    """Paged causal attention for variable query lengths (prefill, chunked prefill, mixed batches).

    skip_single: the rows of sequences that feed one query token are left as they are in out (the decode kernel
    computes them: see paged_attention). kv_scale: an FP8 cache's (2,) float32 [k_scale, v_scale]."""
    T, HQ, D, BS, HKV, B, G = _shapes(q, kv_cache_layer, meta)
    kv_fp8 = is_fp8_cache(kv_cache_layer, kv_scale)
    if out is None:
        out = buffers.alloc((T, HQ, D), q.dtype, q.device)
    if B == 0 or T == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    block_m = max(block_m or PREFILL_BLOCK_M, triton.next_power_of_2(G))
    block_q = block_m // G
    c = kv_cache_layer
    bt = meta.block_tables
    grid = (T // block_q + B, HKV)
    _prefill_kernel[grid](
        q, c, bt, meta.seq_lens, meta.query_start_loc, out, scale * _LOG2E, B,
        kv_scale if kv_fp8 else c,  # c: unused without KV_FP8
        q.stride(0), q.stride(1), c.stride(0), c.stride(1), c.stride(2), c.stride(3), bt.stride(0),
        out.stride(0), out.stride(1),
        G=G, D=D, D_PAD=max(16, triton.next_power_of_2(D)), BS=BS,
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n or PREFILL_BLOCK_N, DOT_PREC=_dot_precision(q.dtype),
        PDL=pdl, SKIP_SINGLE=skip_single, KV_FP8=kv_fp8, num_warps=num_warps or PREFILL_NUM_WARPS,
        num_stages=num_stages or _stages(PREFILL_NUM_STAGES, q.dtype), launch_pdl=pdl,
    )
    return out


def rope_paged_attention(q, k, v, positions, cos_sin_cache, kv_cache_layer, meta, scale, *, pdl: bool = False,
                         kv_scale=None):
    """rope_write_kv, then paged_attention of the rotated q over the cache; returns (T, Hq, D).

    q, k, v as rope_write_kv takes them (tensors, or views of one GEMM's partial sums). A decode step runs both in
    one kernel (rope_decode_attention) while its grid is one wave of programs; other steps run the two kernels.
    kv_scale: an FP8 cache's (2,) float32 [k_scale, v_scale] on the device (stored = value / scale); ignored by a
    cache in the model's dtype, as on the torch path."""
    _check_heads(q, kv_cache_layer)
    # the cache's device, not q's: q may be a view of parked partial sums (PartialSums), which has none
    if int(meta.max_query_len) == 1 and _rope_fuses(meta.seq_lens.shape[0], kv_cache_layer.shape[3],
                                                    kv_cache_layer.device):
        return rope_decode_attention(q, k, v, positions, cos_sin_cache, kv_cache_layer, meta, scale, pdl=pdl,
                                     kv_scale=kv_scale)
    q = rope_write_kv(q, k, v, positions, cos_sin_cache, kv_cache_layer, meta.slot_mapping, pdl=pdl,
                      kv_scale=kv_scale)
    return paged_attention(q, None, None, kv_cache_layer, meta, scale, pdl=pdl, kv_scale=kv_scale)


def _rope_fuses(batch: int, num_kv_heads: int, device: torch.device) -> bool:
    """Whether a decode step takes the fused rope + attention kernel: only while the programs before splitting fit
    one wave. Each program pays the rotary prologue's latency, so every wave pays it again: on the H200 the fused
    kernel gained at 32 and 64 sequences × 8 KV heads and lost at 256."""
    return not _ordered(batch, num_kv_heads, device)


def _check_heads(q, kv_cache_layer) -> None:
    if q.shape[1] % kv_cache_layer.shape[3]:
        raise ValueError(f"num_heads ({q.shape[1]}) must be a multiple of num_kv_heads ({kv_cache_layer.shape[3]})")


def paged_attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, kv_cache_layer: torch.Tensor,
                    meta, scale: float, *, pdl: bool = False, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Write k/v (T, Hkv, D) into the paged cache, then attend q (T, Hq, D) causally; returns (T, Hq, D).

    k and v None: this step's K/V are already in the cache (rope_write_kv put them there). kv_scale: an FP8
    cache's (2,) float32 [k_scale, v_scale]."""
    _check_heads(q, kv_cache_layer)
    if k is not None:
        write_kv_cache(k, v, kv_cache_layer, meta.slot_mapping, pdl=pdl, kv_scale=kv_scale)
    if int(meta.max_query_len) == 1:
        return decode_attention(q, kv_cache_layer, meta, scale, pdl=pdl, kv_scale=kv_scale)
    # A mixed step: its one-token rows (decoding requests) read their context with the decode kernel, which splits
    # long contexts; the prefill kernel, which tiles query tokens, takes the longer queries. Why: with every row in
    # the prefill kernel, mix-8b spent 3.7 s of its 26 s of kernel time there, where its prompts' attention is about
    # 47 TFLOP (a tenth of a second): the decode rows, one unsplit program each, took the rest.
    out = decode_attention(q, kv_cache_layer, meta, scale, pdl=pdl, single_only=True, kv_scale=kv_scale)
    return prefill_attention(q, kv_cache_layer, meta, scale, out, pdl=pdl, skip_single=True, kv_scale=kv_scale)
