"""Sampling in one Triton-language kernel: temperature, top-k, top-p, min-p, seeded noise, the pick and logprobs.

One program per row reads the row's logits (model dtype) a few times and never sorts them. The draw is a race:
the winner of z + G over the kept tokens, where z = x / T and G = -log(E), E ~ Exp(1), comes from a counter-based
hash of (seed, step, token) (the torch sampler's own hash: both draw the same noise), picks token i with
probability softmax(z)_i among them, and a row draws the same token whatever batch it shares.
- pass 1: the row's maximum and its first index (the greedy pick), with logprobs the sum of exp(x - max), and the
  race's winner over the whole vocabulary;
- top-k: its cutoff exactly, by a radix descent over the order-preserving 32-bit keys of z, 8 bits a pass: a
  histogram of the next byte among the keys that match the bytes decided (4 passes); if the winner is below it,
  the race is rerun among the top-k;
- top-p and min-p: the kept tokens are those with z at or above a cutoff, so a winner is kept or not by its own z:
  min-p by exp(z - max z) >= min_p, top-p by one pass summing the mass strictly above it against top_p of the
  mass top-k kept (transformers and vLLM renormalise top-k's tokens before top-p). A rejected winner has z below
  the cutoff, so rerunning the race above its z keeps every kept token in it: the first winner kept is the
  winner among the kept tokens, with no cutoff computed. With top-p 0.95 the first winner is kept 95% of the time;
- with logprobs, one more pass counts the tokens more likely than the pick (its rank).
A row with temperature 0 takes the first maximum, as torch.argmax does. Every setting is read per row from device
memory, so a captured graph serves any mix of settings.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # the dispatcher catches this and keeps the plain-torch path
    raise ImportError("backend.ops.triton.sampling needs the `triton` package") from exc

from backend.ops.triton.launch import allow_dependents, dependent_wait  # noqa: E402  (after the guarded import)

__all__ = ["sample_rows", "SAMPLE_BLOCK"]

SAMPLE_BLOCK = 1024  # logits per loop iteration of a program
# the torch sampler's hash constants (backend/executor/sampler.py): both draw the same noise
_MUL1 = 0x21F0AAAD
_MUL2 = 0x735A2D97
_SALT_SEED = 0x2545F491
_SALT_VOCAB = 0x68E31DA4


@triton.jit
def _mix32_tail(x, MUL1: tl.constexpr, MUL2: tl.constexpr):
    """The hash after its first shift-xor, on uint32 (products wrap mod 2**32 as the torch version's masks do)."""
    x = x * MUL1
    x = x ^ (x >> 15)
    x = x * MUL2
    return x ^ (x >> 15)


@triton.jit
def _mix32(x, MUL1: tl.constexpr, MUL2: tl.constexpr):
    return _mix32_tail(x ^ (x >> 16), MUL1, MUL2)


@triton.jit
def _order_key(z):
    """float32 → uint32 with the same order (negatives flipped whole, positives get the sign bit)."""
    bits = z.to(tl.uint32, bitcast=True)
    return bits ^ tl.where((bits >> 31) != 0, 0xFFFFFFFF, 0x80000000)


@triton.jit
def _key_value(key):
    """The float32 whose order key is key (inverse of _order_key)."""
    bits = key ^ tl.where((key >> 31) != 0, 0x80000000, 0xFFFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _scaled(base, offs, V, T):
    x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    return x / T


@triton.jit
def _gumbel(row_key, offs, MUL1: tl.constexpr, MUL2: tl.constexpr, SALT_VOCAB: tl.constexpr):
    """-log(E) for E ~ Exp(1) drawn from (the row's seed and step, token): z + this races to a draw of softmax(z)."""
    vocab = _mix32(offs.to(tl.uint32) ^ SALT_VOCAB, MUL1, MUL2)
    bits = _mix32_tail(row_key ^ (vocab ^ (vocab >> 16)), MUL1, MUL2)
    # 23 bits + 0.5: u in (0, 1) exactly, so E = -log(u) is finite and > 0
    u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    return -tl.log(-tl.log(u))


@triton.jit
def _top_k_floor(base, V, T, k, BLOCK: tl.constexpr):
    """The order key of the k-th largest z (ties included): a radix descent, 8 key bits a pass, each pass a
    histogram of the next byte among the keys that match the bytes decided so far."""
    lanes = tl.arange(0, BLOCK)
    prefix = tl.full([], 0, tl.uint32)
    for j in tl.static_range(4):
        shift = 24 - 8 * j
        hist = tl.zeros([256], tl.int32)
        above = tl.zeros([BLOCK], tl.int32)
        for start in range(0, V, BLOCK):
            offs = start + lanes
            valid = offs < V
            key = _order_key(_scaled(base, offs, V, T))
            if j == 0:
                match = valid
            else:
                high, decided = key >> (shift + 8), prefix >> (shift + 8)
                match = valid & (high == decided)
                above += (valid & (high > decided)).to(tl.int32)
            hist += tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=match)
        # tokens at or above each candidate byte d: those above the decided prefix, plus the bytes >= d
        at_least = tl.sum(above, axis=0) + tl.sum(hist, axis=0) - tl.cumsum(hist, 0) + hist  # (256,)
        d = tl.maximum(tl.sum((at_least >= k).to(tl.int32), axis=0) - 1, 0)
        prefix = prefix | (d.to(tl.uint32) << shift)
    return prefix


@triton.jit
def _race(base, V, T, row_key, pivot, floor_key, MUL1: tl.constexpr, MUL2: tl.constexpr,
          SALT_VOCAB: tl.constexpr, BLOCK: tl.constexpr):
    """The winner (first index on ties) of z + gumbel among tokens with z > pivot and key >= floor_key."""
    lanes = tl.arange(0, BLOCK)
    top_score = tl.full([BLOCK], float("-inf"), tl.float32)
    top_at = tl.zeros([BLOCK], tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + lanes
        z = _scaled(base, offs, V, T)
        score = tl.where((z > pivot) & (_order_key(z) >= floor_key) & (offs < V),
                         z + _gumbel(row_key, offs, MUL1, MUL2, SALT_VOCAB), float("-inf"))
        top_at = tl.where(score > top_score, offs, top_at)
        top_score = tl.maximum(top_score, score)
    best = tl.max(top_score, axis=0)
    return tl.min(tl.where(top_score == best, top_at, V), axis=0)


@triton.jit
def _in_nucleus(base, V, T, max_z, floor_key, z_c, top_p, BLOCK: tl.constexpr):
    """Whether z_c is at or above the top-p cutoff: the mass strictly above it, among the tokens top-k kept,
    is below top_p of their whole mass (so ties with the nucleus's last token are kept)."""
    lanes = tl.arange(0, BLOCK)
    above = tl.zeros([BLOCK], tl.float32)
    whole = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + lanes
        z = _scaled(base, offs, V, T)
        weight = tl.where((_order_key(z) >= floor_key) & (offs < V), tl.exp(z - max_z), 0.0)
        whole += weight
        above += tl.where(z > z_c, weight, 0.0)
    return tl.sum(above, axis=0) < top_p * tl.sum(whole, axis=0)


@triton.jit
def _sample_rows_kernel(logits_ptr, stride_l, V, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, step_ptr,
                        out_ptr, logprob_ptr, rank_ptr, lse_ptr,
                        BLOCK: tl.constexpr, LOGPROBS: tl.constexpr,
                        MUL1: tl.constexpr, MUL2: tl.constexpr, SALT_SEED: tl.constexpr, SALT_VOCAB: tl.constexpr,
                        PDL: tl.constexpr):
    allow_dependents(PDL)
    dependent_wait(PDL)
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_l
    lanes = tl.arange(0, BLOCK)
    T = tl.load(temp_ptr + row)
    sampled = T > 0
    T_safe = tl.where(sampled, T, 1.0)
    seed = tl.load(seed_ptr + row)
    step = tl.load(step_ptr + row)
    row_key = _mix32((seed & 0xFFFFFFFF).to(tl.uint32) ^ SALT_SEED, MUL1, MUL2)
    row_key = _mix32(row_key ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32), MUL1, MUL2)
    row_key = _mix32(row_key ^ (step & 0xFFFFFFFF).to(tl.uint32), MUL1, MUL2)
    row_key = _mix32(row_key ^ ((step >> 32) & 0xFFFFFFFF).to(tl.uint32), MUL1, MUL2)
    row_key = row_key ^ (row_key >> 16)

    # pass 1: the raw maximum (first index), with logprobs the online sum of exp(x - max), and for a sampled row
    # the race's winner over the whole vocabulary (the pick, unless a cutoff removes it)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_at = tl.zeros([BLOCK], tl.int32)
    sums = tl.zeros([BLOCK], tl.float32)
    top_score = tl.full([BLOCK], float("-inf"), tl.float32)
    top_at = tl.zeros([BLOCK], tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + lanes
        x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        best_at = tl.where(x > best, offs, best_at)
        if LOGPROBS:
            new = tl.maximum(best, x)
            safe = tl.where(new == float("-inf"), 0.0, new)
            sums = sums * tl.exp(best - safe) + tl.exp(x - safe)
            best = new
        else:
            best = tl.maximum(best, x)
        if sampled:
            score = tl.where(offs < V, x / T_safe + _gumbel(row_key, offs, MUL1, MUL2, SALT_VOCAB), float("-inf"))
            top_at = tl.where(score > top_score, offs, top_at)
            top_score = tl.maximum(top_score, score)
    x_max = tl.max(best, axis=0)
    token = tl.min(tl.where(best == x_max, best_at, V), axis=0)  # the first index of the row's maximum
    lse = x_max
    if LOGPROBS:
        lse = x_max + tl.log(tl.sum(sums * tl.exp(best - x_max), axis=0))

    if sampled:
        # the kept tokens are those with z >= the largest of the top-k, top-p and min-p cutoffs; the race's winner
        # among them is the pick. A winner below a cutoff is rejected and the race rerun above its z (which keeps
        # every kept token in it): the first winner kept is the winner among the kept tokens.
        max_z = x_max / T  # dividing by T > 0 keeps the order, so this is the largest z
        k = tl.load(top_k_ptr + row)
        top_p = tl.load(top_p_ptr + row)
        min_p = tl.load(min_p_ptr + row)
        best_score = tl.max(top_score, axis=0)
        token = tl.min(tl.where(top_score == best_score, top_at, V), axis=0)
        floor_key = tl.full([], 0, tl.uint32)
        if (k > 0) & (k < V):
            floor_key = _top_k_floor(base, V, T, k, BLOCK)
        z_c = tl.load(base + token).to(tl.float32) / T
        if _order_key(z_c) < floor_key:  # top-k removed the winner: race among the top-k
            token = _race(base, V, T, row_key, float("-inf"), floor_key, MUL1, MUL2, SALT_VOCAB, BLOCK)
            z_c = tl.load(base + token).to(tl.float32) / T
        kept = tl.exp(z_c - max_z) >= min_p  # min-p: p_i / p_max = exp(z_i - max z), whatever was renormalised
        if top_p < 1.0:
            kept = kept & _in_nucleus(base, V, T, max_z, floor_key, z_c, top_p, BLOCK)
        while not kept:
            token = _race(base, V, T, row_key, z_c, floor_key, MUL1, MUL2, SALT_VOCAB, BLOCK)
            z_c = tl.load(base + token).to(tl.float32) / T
            kept = tl.exp(z_c - max_z) >= min_p
            if top_p < 1.0:
                kept = kept & _in_nucleus(base, V, T, max_z, floor_key, z_c, top_p, BLOCK)
    tl.store(out_ptr + row, token.to(tl.int64))
    if LOGPROBS:
        x_tok = tl.load(base + token).to(tl.float32)
        above = tl.zeros([BLOCK], tl.int32)
        for start in range(0, V, BLOCK):
            offs = start + lanes
            x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            above += (x > x_tok).to(tl.int32)
        tl.store(logprob_ptr + row, x_tok - lse)
        tl.store(rank_ptr + row, (tl.sum(above, axis=0) + 1).to(tl.int64))
        tl.store(lse_ptr + row, lse)


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor, seeds: torch.Tensor, step_index: torch.Tensor, out: torch.Tensor, *,
                logprobs: torch.Tensor | None = None, ranks: torch.Tensor | None = None,
                lse: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """Sample one token per row of logits (B, V) into out (B,) int64; returns out.

    Per row (all (B,) device tensors): temperature f32 (0: greedy), top_k int32 (<= 0: off), top_p f32, min_p f32,
    seeds and step_index int64. With logprobs, ranks and lse (all three or none): the pick's log-probability under
    the raw logits (B,) f32, its 1-based rank (B,) int64 and the row's log-sum-exp (B,) f32."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be (B, V), got shape {tuple(logits.shape)}")
    rows, vocab = logits.shape
    if out.shape != (rows,) or out.dtype != torch.int64:
        raise ValueError(f"out must be ({rows},) int64, got {tuple(out.shape)} {out.dtype}")
    with_logprobs = logprobs is not None
    if with_logprobs != (ranks is not None) or with_logprobs != (lse is not None):
        raise ValueError("logprobs, ranks and lse go together")
    if rows == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    dummy = out
    _sample_rows_kernel[(rows,)](
        logits, logits.stride(0), vocab, temperature, top_k, top_p, min_p, seeds, step_index, out,
        logprobs if with_logprobs else dummy, ranks if with_logprobs else dummy, lse if with_logprobs else dummy,
        BLOCK=SAMPLE_BLOCK, LOGPROBS=with_logprobs, MUL1=_MUL1, MUL2=_MUL2,
        SALT_SEED=_SALT_SEED, SALT_VOCAB=_SALT_VOCAB, PDL=pdl, num_warps=8, launch_pdl=pdl)
    return out
