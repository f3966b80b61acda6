"""Sampling in a few Triton-language kernels: temperature, top-k, top-p, min-p, seeded noise, the pick and logprobs.

The logits (model dtype) are read a few times and never sorted. The draw is a race: the winner of z + G over the kept
tokens, where z = x / T and G = -log(E), E ~ Exp(1), comes from a counter-based hash of (seed, step, token) (the torch
sampler's own hash: both draw the same noise bits; G's outer log is a fast one here, so the two may order a near-tie
apart), picks token i with probability softmax(z)_i among them, and a row draws
the same token whatever batch it shares.
- pass 1: the row's maximum and its first index (the greedy pick), with logprobs the sum of exp(x - max), and the
  race's winner over the whole vocabulary;
- top-p and min-p: the kept tokens are those with z at or above a cutoff, so a winner is kept or not by its own z:
  min-p by exp(z - max z) >= min_p, top-p by one pass summing the mass strictly above it against top_p of the
  mass top-k kept (transformers and vLLM renormalise top-k's tokens before top-p). A rejected winner has z below
  the cutoff, so rerunning the race above its z keeps every kept token in it: the first winner kept is the
  winner among the kept tokens, with no cutoff computed. With top-p 0.95 the first winner is kept 95% of the time;
- top-k: its cutoff exactly, by a radix descent over the order-preserving 32-bit keys of z, 8 bits a pass: a
  histogram of the next byte among the keys that match the bytes decided (4 passes; the first rides in pass 1, and a
  block of keys none of which matches skips its histogram); a winner below it is rejected like one below the other
  cutoffs (every top-k token lies above it);
- with logprobs, one more pass counts the tokens more likely than the pick (its rank).
A row with temperature 0 takes the first maximum, as torch.argmax does. Every setting is read per row from device
memory, so a captured graph serves any mix of settings.

Split passes. One program walking a row of 128K logits takes tens of microseconds a pass, and a batch waits for its
slowest row: at 256 rows one row or more nearly always needs a rerun, so every sampled step paid four passes one
after another. So pass 1, the top-p pass and the reruns are split: each row's vocabulary is cut into chunks of
SAMPLE_CHUNK logits, one program a chunk, and the next kernel's programs combine the chunks' partial results
(a race's winner is the best of the chunks' winners, first index on ties, so the split draws exactly the token one
program would; the masses are sums of the chunks'). The top-k histograms are split the same way (their chunks need not be the
sampling chunks: the cutoff is exact whatever the split): each program adds its histogram into the row's with
atomics, and the next pass's programs read the row's histograms so far and decide the cutoff's bytes themselves. A row's state (open or done, its candidate, its top-k cutoff) travels between the kernels in
a small buffer; the rare row still open after the split reruns finishes in one program at the end. The chunks depend on the vocabulary alone, so a row's draw still ignores the
batch around it.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # the dispatcher catches this and keeps the plain-torch path
    raise ImportError("backend.ops.triton.sampling needs the `triton` package") from exc

from backend.ops.triton.fast_math import fast_log  # noqa: E402  (after the guarded import)
from backend.ops.triton.launch import allow_dependents, dependent_wait  # noqa: E402

__all__ = ["sample_rows", "vocab_part", "SAMPLE_BLOCK", "SAMPLE_CHUNK"]

SAMPLE_BLOCK = 1024  # logits per loop iteration of a program
SAMPLE_CHUNK = 8 * SAMPLE_BLOCK  # logits per program of the split passes: 16 programs a row of a 128K vocabulary
SPLIT_RERUNS = 2  # race reruns in split form; a row still open after them finishes in one program
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
def _scaled(base, offs, V, T):
    x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    return x / T


@triton.jit
def _gumbel(row_key, vocab_ptr, offs, mask, MUL1: tl.constexpr, MUL2: tl.constexpr):
    """-log(E) for E ~ Exp(1) drawn from (the row's seed and step, token): z + this races to a draw of softmax(z).
    The token's half of the hash is the same for every row, so it is read from a table (vocab_part) made once."""
    vocab = tl.load(vocab_ptr + offs, mask=mask, other=0).to(tl.uint32, bitcast=True)
    bits = _mix32_tail(row_key ^ vocab, MUL1, MUL2)
    # 23 bits + 0.5: u in (0, 1) exactly, so E = -log(u) is finite and > 0
    u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    # E's own log stays exact: for u near 1, E is as small as 6e-8, where a fast log's absolute error would swamp it
    # (and those E make the largest noise). The outer log may be fast: E lies in [6e-8, 16.7], where its error
    # (under 2e-7 absolute) is below the rounding of z + noise, so it reorders near-ties only
    return -fast_log(-tl.log(u))


@triton.jit
def _race(base, vocab_ptr, V, T, row_key, pivot, floor_key, MUL1: tl.constexpr, MUL2: tl.constexpr,
          BLOCK: tl.constexpr):
    """The winner (first index on ties) of z + gumbel among tokens with z > pivot and key >= floor_key."""
    lanes = tl.arange(0, BLOCK)
    top_score = tl.full([BLOCK], float("-inf"), tl.float32)
    top_at = tl.zeros([BLOCK], tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + lanes
        z = _scaled(base, offs, V, T)
        score = tl.where((z > pivot) & (_order_key(z) >= floor_key) & (offs < V),
                         z + _gumbel(row_key, vocab_ptr, offs, offs < V, MUL1, MUL2), float("-inf"))
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


# a row's state between the kernels: (status, candidate token, top-k cutoff as an order key's bits)
_NS = 3
_OPEN = 0  # its candidate not decided yet
_DONE = 1  # its token is final
# per-chunk partial results: float fields of (rows, chunks, _NF), int fields of (rows, chunks, _NI)
_NF, _X_MAX, _X_SUM, _RACE, _ABOVE, _MASS = 5, 0, 1, 2, 3, 4
_NI, _X_AT, _RACE_AT = 2, 0, 1


@triton.jit
def _row_key(seed_ptr, step_ptr, row, MUL1: tl.constexpr, MUL2: tl.constexpr, SALT_SEED: tl.constexpr):
    """The row's noise key from its seed and step index (the torch sampler's key, before its last shift-xor)."""
    seed = tl.load(seed_ptr + row)
    step = tl.load(step_ptr + row)
    key = _mix32((seed & 0xFFFFFFFF).to(tl.uint32) ^ SALT_SEED, MUL1, MUL2)
    key = _mix32(key ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32), MUL1, MUL2)
    key = _mix32(key ^ (step & 0xFFFFFFFF).to(tl.uint32), MUL1, MUL2)
    key = _mix32(key ^ ((step >> 32) & 0xFFFFFFFF).to(tl.uint32), MUL1, MUL2)
    return key ^ (key >> 16)


@triton.jit
def _best_of_chunks(pf_ptr, pi_ptr, row, S, F: tl.constexpr, I: tl.constexpr, V, NF: tl.constexpr,
                    NI: tl.constexpr, SP: tl.constexpr):
    """(best value, its first index) over the row's S chunks of float field F and int field I."""
    c = tl.arange(0, SP)
    slot = row.to(tl.int64) * S + c
    valid = c < S
    value = tl.load(pf_ptr + slot * NF + F, mask=valid, other=float("-inf"))
    at = tl.load(pi_ptr + slot * NI + I, mask=valid, other=V)
    best = tl.max(value, axis=0)
    return best, tl.min(tl.where(value == best, at, V), axis=0)


@triton.jit
def _sum_of_chunks(pf_ptr, row, S, F: tl.constexpr, NF: tl.constexpr, SP: tl.constexpr):
    c = tl.arange(0, SP)
    return tl.sum(tl.load(pf_ptr + (row.to(tl.int64) * S + c) * NF + F, mask=c < S, other=0.0), axis=0)


@triton.jit
def _kept(pf_ptr, row, S, z_c, max_z, floor_key, top_p, min_p, NF: tl.constexpr, ABOVE: tl.constexpr,
          MASS: tl.constexpr, SP: tl.constexpr):
    """Whether the candidate z_c passes top-k, min-p and, from the chunks' masses, top-p (as _in_nucleus decides)."""
    kept = (_order_key(z_c) >= floor_key) & (tl.exp(z_c - max_z) >= min_p)
    if kept & (top_p < 1.0):
        kept = _sum_of_chunks(pf_ptr, row, S, ABOVE, NF, SP) < top_p * _sum_of_chunks(pf_ptr, row, S, MASS, NF, SP)
    return kept


@triton.jit
def _first_pass_kernel(logits_ptr, stride_l, V, S, temp_ptr, top_k_ptr, seed_ptr, step_ptr, vocab_ptr, pf_ptr, pi_ptr,
                       state_ptr, hist_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, LOGPROBS: tl.constexpr,
                       TOP_K: tl.constexpr, NF: tl.constexpr, NI: tl.constexpr, NS: tl.constexpr, MUL1: tl.constexpr,
                       MUL2: tl.constexpr, SALT_SEED: tl.constexpr, PDL: tl.constexpr):
    """Pass 1 over one chunk of one row: its maximum and first index, with logprobs the sum of exp(x - max), and
    for a sampled row the race's winner in the chunk; for a top-k row, top-k's first histogram (the keys' top byte)
    added into the row's."""
    allow_dependents(PDL)
    dependent_wait(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    base = logits_ptr + row.to(tl.int64) * stride_l
    lanes = tl.arange(0, BLOCK)
    T = tl.load(temp_ptr + row)
    sampled = T > 0
    T_safe = tl.where(sampled, T, 1.0)
    with_top_k = False
    if TOP_K:
        k = tl.load(top_k_ptr + row)
        with_top_k = sampled & (k > 0) & (k < V)
    row_key = _row_key(seed_ptr, step_ptr, row, MUL1, MUL2, SALT_SEED)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_at = tl.zeros([BLOCK], tl.int32)
    sums = tl.zeros([BLOCK], tl.float32)
    top_score = tl.full([BLOCK], float("-inf"), tl.float32)
    top_at = tl.zeros([BLOCK], tl.int32)
    hist = tl.zeros([256], tl.int32)
    lo = chunk * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    for start in range(lo, hi, BLOCK):
        offs = start + lanes
        valid = offs < hi
        x = tl.load(base + offs, mask=valid, other=float("-inf")).to(tl.float32)
        best_at = tl.where(x > best, offs, best_at)
        if LOGPROBS:
            new = tl.maximum(best, x)
            safe = tl.where(new == float("-inf"), 0.0, new)
            sums = sums * tl.exp(best - safe) + tl.exp(x - safe)
            best = new
        else:
            best = tl.maximum(best, x)
        if sampled:
            z = x / T_safe
            score = tl.where(valid, z + _gumbel(row_key, vocab_ptr, offs, valid, MUL1, MUL2), float("-inf"))
            top_at = tl.where(score > top_score, offs, top_at)
            top_score = tl.maximum(top_score, score)
            if with_top_k:
                hist += tl.histogram((_order_key(z) >> 24).to(tl.int32), 256, mask=valid)
    slot = row.to(tl.int64) * S + chunk
    x_max = tl.max(best, axis=0)
    tl.store(pf_ptr + slot * NF + 0, x_max)
    tl.store(pi_ptr + slot * NI + 0, tl.min(tl.where(best == x_max, best_at, V), axis=0))
    if LOGPROBS:
        safe_max = tl.where(x_max == float("-inf"), 0.0, x_max)
        tl.store(pf_ptr + slot * NF + 1, tl.sum(sums * tl.exp(best - safe_max), axis=0))
    race = tl.max(top_score, axis=0)
    tl.store(pf_ptr + slot * NF + 2, race)
    tl.store(pi_ptr + slot * NI + 1, tl.min(tl.where(top_score == race, top_at, V), axis=0))
    if with_top_k:
        bins = tl.arange(0, 256)
        tl.atomic_add(hist_ptr + row.to(tl.int64) * 4 * 256 + bins, hist, mask=hist > 0)
    if chunk == 0:
        tl.store(state_ptr + row * NS, 0)  # _OPEN
        tl.store(state_ptr + row * NS + 2, 0)  # no top-k cutoff yet


@triton.jit
def _vocab_part_kernel(out_ptr, V, MUL1: tl.constexpr, MUL2: tl.constexpr, SALT_VOCAB: tl.constexpr,
                       BLOCK: tl.constexpr):
    """The token's half of the noise hash (the torch sampler's vocab_hash, shift-xored), as int32 bits."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    vocab = _mix32(offs.to(tl.uint32) ^ SALT_VOCAB, MUL1, MUL2)
    tl.store(out_ptr + offs, (vocab ^ (vocab >> 16)).to(tl.int32, bitcast=True), mask=offs < V)


@triton.jit
def _top_k_prefix(hist_ptr, row, k, PASSES: tl.constexpr):
    """The top-k cutoff's key bytes that the row's first PASSES histograms decide (top byte first), the others 0.
    Pass p's histogram counts the next byte of the keys whose higher bytes are the ones decided before it."""
    bins = tl.arange(0, 256)
    prefix = (k - k).to(tl.uint32)  # scalar zeros of the loop's types
    above = k - k  # keys whose decided bytes are larger than the cutoff's
    for p in tl.static_range(PASSES):
        hist = tl.load(hist_ptr + (row.to(tl.int64) * 4 + p) * 256 + bins)
        # keys at or above each candidate byte d: those above the bytes decided, plus the matching ones >= d
        at_least = above + tl.sum(hist, axis=0) - tl.cumsum(hist, 0) + hist
        d = tl.maximum(tl.sum((at_least >= k).to(tl.int32), axis=0) - 1, 0)
        prefix = prefix | (d.to(tl.uint32) << (24 - 8 * p))
        above += tl.sum(tl.where(bins > d, hist, 0), axis=0)
    return prefix


@triton.jit
def _top_k_hist_kernel(logits_ptr, stride_l, V, temp_ptr, top_k_ptr, hist_ptr, PASS: tl.constexpr,
                       SHIFT: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Pass PASS (1-3) of top-k's radix descent over one chunk of a top-k row: the histogram of the key byte at SHIFT
    among the keys whose higher bytes are the ones the earlier passes decided, added into the row's."""
    allow_dependents(PDL)
    dependent_wait(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    T = tl.load(temp_ptr + row)
    k = tl.load(top_k_ptr + row)
    if (T <= 0) | (k <= 0) | (k >= V):
        return
    base = logits_ptr + row.to(tl.int64) * stride_l
    decided = _top_k_prefix(hist_ptr, row, k, PASS) >> (SHIFT + 8)
    lanes = tl.arange(0, BLOCK)
    hist = tl.zeros([256], tl.int32)
    lo = chunk * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    for start in range(lo, hi, BLOCK):
        offs = start + lanes
        key = _order_key(_scaled(base, offs, hi, T))
        match = (offs < hi) & ((key >> (SHIFT + 8)) == decided)
        if tl.max(match.to(tl.int32), axis=0) > 0:  # after the top byte, most blocks hold no matching key
            hist += tl.histogram(((key >> SHIFT) & 255).to(tl.int32), 256, mask=match)
    bins = tl.arange(0, 256)
    tl.atomic_add(hist_ptr + (row.to(tl.int64) * 4 + PASS) * 256 + bins, hist, mask=hist > 0)


@triton.jit
def _nucleus_kernel(logits_ptr, stride_l, V, S, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, pf_ptr, pi_ptr, state_ptr,
                    hist_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, NF: tl.constexpr, NI: tl.constexpr,
                    NS: tl.constexpr, SP: tl.constexpr, TOP_K_CUTOFF: tl.constexpr, PDL: tl.constexpr):
    """An open row's candidate is the best of the chunks' race winners; with top-p, one chunk's masses among the
    tokens top-k keeps: all of them, and the part strictly above the candidate. Greedy rows, and candidates that
    top-k and min-p alone keep, are done here. With TOP_K_CUTOFF (the first call after top-k's passes) a top-k row's
    cutoff comes from its four histograms, and chunk 0 keeps it in the row's state for the kernels after."""
    allow_dependents(PDL)
    dependent_wait(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    if tl.load(state_ptr + row * NS) != 0:  # not _OPEN
        return
    T = tl.load(temp_ptr + row)
    x_max, x_at = _best_of_chunks(pf_ptr, pi_ptr, row, S, 0, 0, V, NF, NI, SP)
    if T <= 0:  # greedy: the first maximum
        if chunk == 0:
            tl.store(state_ptr + row * NS + 1, x_at)
            tl.store(state_ptr + row * NS, 1)  # _DONE
        return
    _, token = _best_of_chunks(pf_ptr, pi_ptr, row, S, 2, 1, V, NF, NI, SP)
    token = tl.minimum(token, V - 1)  # in range even for a row of NaN logits, which no race wins
    if chunk == 0:
        tl.store(state_ptr + row * NS + 1, token)
    base = logits_ptr + row.to(tl.int64) * stride_l
    max_z = x_max / T  # dividing by T > 0 keeps the order, so this is the largest z
    z_c = tl.load(base + token).to(tl.float32) / T
    floor_key = tl.load(state_ptr + row * NS + 2).to(tl.uint32, bitcast=True)
    if TOP_K_CUTOFF:
        k = tl.load(top_k_ptr + row)
        if (k > 0) & (k < V):
            floor_key = _top_k_prefix(hist_ptr, row, k, 4)
        if chunk == 0:
            tl.store(state_ptr + row * NS + 2, floor_key.to(tl.int32, bitcast=True))
    top_p = tl.load(top_p_ptr + row)
    cut_ok = (_order_key(z_c) >= floor_key) & (tl.exp(z_c - max_z) >= tl.load(min_p_ptr + row))
    if top_p >= 1.0:
        if (chunk == 0) & cut_ok:
            tl.store(state_ptr + row * NS, 1)  # _DONE
        return
    if cut_ok:  # else the next kernel reruns the race without the masses
        lanes = tl.arange(0, BLOCK)
        above = tl.zeros([BLOCK], tl.float32)
        whole = tl.zeros([BLOCK], tl.float32)
        lo = chunk * CHUNK
        hi = tl.minimum(lo + CHUNK, V)
        for start in range(lo, hi, BLOCK):
            offs = start + lanes
            z = _scaled(base, offs, hi, T)
            weight = tl.where((_order_key(z) >= floor_key) & (offs < hi), tl.exp(z - max_z), 0.0)
            whole += weight
            above += tl.where(z > z_c, weight, 0.0)
        slot = row.to(tl.int64) * S + chunk
        tl.store(pf_ptr + slot * NF + 3, tl.sum(above, axis=0))
        tl.store(pf_ptr + slot * NF + 4, tl.sum(whole, axis=0))


@triton.jit
def _rerun_kernel(logits_ptr, stride_l, V, S, temp_ptr, top_p_ptr, min_p_ptr, seed_ptr, step_ptr, vocab_ptr, pf_ptr,
                  pi_ptr, state_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, NF: tl.constexpr, NI: tl.constexpr,
                  NS: tl.constexpr, SP: tl.constexpr, MUL1: tl.constexpr, MUL2: tl.constexpr, SALT_SEED: tl.constexpr,
                  PDL: tl.constexpr):
    """An open row whose candidate the cutoffs keep is done; otherwise the race is rerun in this chunk above the
    candidate's z, among the tokens top-k keeps (the next nucleus kernel combines the chunks' winners)."""
    allow_dependents(PDL)
    dependent_wait(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    if tl.load(state_ptr + row * NS) != 0:  # not _OPEN
        return
    T = tl.load(temp_ptr + row)
    x_max, _ = _best_of_chunks(pf_ptr, pi_ptr, row, S, 0, 0, V, NF, NI, SP)
    base = logits_ptr + row.to(tl.int64) * stride_l
    z_c = tl.load(base + tl.load(state_ptr + row * NS + 1)).to(tl.float32) / T
    floor_key = tl.load(state_ptr + row * NS + 2).to(tl.uint32, bitcast=True)
    if _kept(pf_ptr, row, S, z_c, x_max / T, floor_key, tl.load(top_p_ptr + row), tl.load(min_p_ptr + row), NF, 3, 4,
             SP):
        if chunk == 0:
            tl.store(state_ptr + row * NS, 1)  # _DONE
        return
    row_key = _row_key(seed_ptr, step_ptr, row, MUL1, MUL2, SALT_SEED)
    lanes = tl.arange(0, BLOCK)
    top_score = tl.full([BLOCK], float("-inf"), tl.float32)
    top_at = tl.zeros([BLOCK], tl.int32)
    lo = chunk * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    for start in range(lo, hi, BLOCK):
        offs = start + lanes
        z = _scaled(base, offs, hi, T)
        inside = (z > z_c) & (_order_key(z) >= floor_key) & (offs < hi)
        score = tl.where(inside, z + _gumbel(row_key, vocab_ptr, offs, offs < hi, MUL1, MUL2), float("-inf"))
        top_at = tl.where(score > top_score, offs, top_at)
        top_score = tl.maximum(top_score, score)
    slot = row.to(tl.int64) * S + chunk
    race = tl.max(top_score, axis=0)
    tl.store(pf_ptr + slot * NF + 2, race)
    tl.store(pi_ptr + slot * NI + 1, tl.min(tl.where(top_score == race, top_at, V), axis=0))


@triton.jit
def _final_kernel(logits_ptr, stride_l, V, S, temp_ptr, top_p_ptr, min_p_ptr, seed_ptr, step_ptr, vocab_ptr, pf_ptr,
                  pi_ptr, state_ptr, out_ptr, logprob_ptr, rank_ptr, lse_ptr,
                  BLOCK: tl.constexpr, LOGPROBS: tl.constexpr, NF: tl.constexpr, NI: tl.constexpr, NS: tl.constexpr,
                  SP: tl.constexpr, MUL1: tl.constexpr, MUL2: tl.constexpr, SALT_SEED: tl.constexpr,
                  PDL: tl.constexpr):
    """One program a row: a done row's token is written; a row still open after the split reruns is finished here
    (the whole row, pass after pass); with logprobs, the pick's log-probability and the row's log-sum-exp, its rank
    set to 1 (the rank kernel adds the tokens above it)."""
    allow_dependents(PDL)
    dependent_wait(PDL)
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_l
    token = tl.load(state_ptr + row * NS + 1)
    if tl.load(state_ptr + row * NS) != 1:  # still _OPEN: its last candidate, with the masses last summed
        T = tl.load(temp_ptr + row)
        x_max, _ = _best_of_chunks(pf_ptr, pi_ptr, row, S, 0, 0, V, NF, NI, SP)
        max_z = x_max / T
        top_p = tl.load(top_p_ptr + row)
        min_p = tl.load(min_p_ptr + row)
        floor_key = tl.load(state_ptr + row * NS + 2).to(tl.uint32, bitcast=True)
        row_key = _row_key(seed_ptr, step_ptr, row, MUL1, MUL2, SALT_SEED)
        z_c = tl.load(base + token).to(tl.float32) / T
        kept = _kept(pf_ptr, row, S, z_c, max_z, floor_key, top_p, min_p, NF, 3, 4, SP)
        while not kept:
            token = _race(base, vocab_ptr, V, T, row_key, z_c, floor_key, MUL1, MUL2, BLOCK)
            z_c = tl.load(base + token).to(tl.float32) / T
            kept = tl.exp(z_c - max_z) >= min_p
            if top_p < 1.0:
                kept = kept & _in_nucleus(base, V, T, max_z, floor_key, z_c, top_p, BLOCK)
    tl.store(out_ptr + row, token.to(tl.int64))
    if LOGPROBS:
        c = tl.arange(0, SP)
        slot = row.to(tl.int64) * S + c
        maxes = tl.load(pf_ptr + slot * NF + 0, mask=c < S, other=float("-inf"))
        sums = tl.load(pf_ptr + slot * NF + 1, mask=c < S, other=0.0)
        x_max = tl.max(maxes, axis=0)
        lse = x_max + tl.log(tl.sum(sums * tl.exp(maxes - x_max), axis=0))
        tl.store(logprob_ptr + row, tl.load(base + token).to(tl.float32) - lse)
        tl.store(rank_ptr + row, 1)
        tl.store(lse_ptr + row, lse)


@triton.jit
def _rank_kernel(logits_ptr, stride_l, V, out_ptr, rank_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                 PDL: tl.constexpr):
    """The tokens of one chunk more likely than the row's pick, added to its rank."""
    allow_dependents(PDL)
    dependent_wait(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    base = logits_ptr + row.to(tl.int64) * stride_l
    x_tok = tl.load(base + tl.load(out_ptr + row)).to(tl.float32)
    lanes = tl.arange(0, BLOCK)
    above = tl.zeros([BLOCK], tl.int32)
    lo = chunk * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    for start in range(lo, hi, BLOCK):
        offs = start + lanes
        x = tl.load(base + offs, mask=offs < hi, other=float("-inf")).to(tl.float32)
        above += (x > x_tok).to(tl.int32)
    tl.atomic_add(rank_ptr + row, tl.sum(above, axis=0).to(tl.int64))


_VOCAB_PARTS: dict[tuple[int, torch.device], torch.Tensor] = {}  # (V,) int32 per vocabulary size and device


def vocab_part(vocab: int, device: torch.device | str) -> torch.Tensor:
    """The noise hash's token half for a vocabulary, (V,) int32, made on first use and kept: the first call must
    come before any graph capture (a graph's warm-up run does it)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    table = _VOCAB_PARTS.get((vocab, device))
    if table is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("sample_rows: run it once before capturing a CUDA graph (its noise table is made "
                               "on first use)")
        table = torch.empty(vocab, dtype=torch.int32, device=device)
        _vocab_part_kernel[(triton.cdiv(vocab, SAMPLE_BLOCK),)](table, vocab, MUL1=_MUL1, MUL2=_MUL2,
                                                                  SALT_VOCAB=_SALT_VOCAB, BLOCK=SAMPLE_BLOCK)
        _VOCAB_PARTS[(vocab, device)] = table
    return table


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor, seeds: torch.Tensor, step_index: torch.Tensor, out: torch.Tensor, *,
                logprobs: torch.Tensor | None = None, ranks: torch.Tensor | None = None,
                lse: torch.Tensor | None = None, pdl: bool = False, any_top_k: bool = True,
                chunk: int = SAMPLE_CHUNK, block: int = SAMPLE_BLOCK, top_k_chunk: int | None = None,
                top_k_cutoffs: torch.Tensor | None = None) -> torch.Tensor:
    """Sample one token per row of logits (B, V) into out (B,) int64; returns out.

    Per row (all (B,) device tensors): temperature f32 (0: greedy), top_k int32 (<= 0: off), top_p f32, min_p f32,
    seeds and step_index int64. With logprobs, ranks and lse (all three or none): the pick's log-probability under
    the raw logits (B,) f32, its 1-based rank (B,) int64 and the row's log-sum-exp (B,) f32. any_top_k=False leaves
    out top-k's passes: only for rows none of which has top-k on. chunk (a multiple of block) sets the split passes'
    chunks; every caller that must draw the same tokens uses the same chunk. top_k_chunk (default: chunk) splits
    top-k's last three histogram passes, and changes no draw. top_k_cutoffs ((B,) f32), when given, receives each
    top-k row's cutoff: the k-th largest z = x / T, whose ties top-k keeps (-inf for rows without top-k)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be (B, V), got shape {tuple(logits.shape)}")
    rows, vocab = logits.shape
    if out.shape != (rows,) or out.dtype != torch.int64:
        raise ValueError(f"out must be ({rows},) int64, got {tuple(out.shape)} {out.dtype}")
    with_logprobs = logprobs is not None
    if with_logprobs != (ranks is not None) or with_logprobs != (lse is not None):
        raise ValueError("logprobs, ranks and lse go together")
    top_k_chunk = chunk if top_k_chunk is None else top_k_chunk
    for name, size in (("chunk", chunk), ("top_k_chunk", top_k_chunk)):
        if size <= 0 or size % block:
            raise ValueError(f"{name} must be a positive multiple of block ({block}), got {size}")
    if rows == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    chunks = triton.cdiv(vocab, chunk)
    device = logits.device
    table = vocab_part(vocab, device)
    pf = torch.empty((rows, chunks, _NF), dtype=torch.float32, device=device)  # per-chunk partial results
    pi = torch.empty((rows, chunks, _NI), dtype=torch.int32, device=device)
    state = torch.empty((rows, _NS), dtype=torch.int32, device=device)  # per row: status, candidate, top-k cutoff
    # top-k's four histograms a row, summed over chunks by atomics (so they start at zero)
    hist = torch.zeros((rows, 4, 256), dtype=torch.int32, device=device) if any_top_k else state
    dummy = out
    split = (rows, chunks)
    common = dict(PDL=pdl, launch_pdl=pdl)
    sizes = dict(NF=_NF, NI=_NI, NS=_NS, SP=triton.next_power_of_2(chunks))
    noise = dict(MUL1=_MUL1, MUL2=_MUL2, SALT_SEED=_SALT_SEED)
    walk = dict(CHUNK=chunk, BLOCK=block, num_warps=4)
    l, s = logits, logits.stride(0)
    _first_pass_kernel[split](l, s, vocab, chunks, temperature, top_k, seeds, step_index, table, pf, pi, state, hist,
                              LOGPROBS=with_logprobs, TOP_K=any_top_k, NF=_NF, NI=_NI, NS=_NS, **noise, **walk,
                              **common)
    if any_top_k:
        for p, shift in ((1, 16), (2, 8), (3, 0)):
            _top_k_hist_kernel[(rows, triton.cdiv(vocab, top_k_chunk))](
                l, s, vocab, temperature, top_k, hist, PASS=p, SHIFT=shift, CHUNK=top_k_chunk, BLOCK=block,
                num_warps=4, **common)
    nucleus_args = (l, s, vocab, chunks, temperature, top_k, top_p, min_p, pf, pi, state, hist)
    _nucleus_kernel[split](*nucleus_args, **sizes, **walk, TOP_K_CUTOFF=any_top_k, **common)
    for _ in range(SPLIT_RERUNS):
        _rerun_kernel[split](l, s, vocab, chunks, temperature, top_p, min_p, seeds, step_index, table, pf, pi, state,
                             **sizes, **noise, **walk, **common)
        _nucleus_kernel[split](*nucleus_args, **sizes, **walk, TOP_K_CUTOFF=False, **common)
    _final_kernel[(rows,)](l, s, vocab, chunks, temperature, top_p, min_p, seeds, step_index, table, pf, pi, state,
                           out, logprobs if with_logprobs else dummy, ranks if with_logprobs else dummy,
                           lse if with_logprobs else dummy, BLOCK=block, LOGPROBS=with_logprobs, **sizes, **noise,
                           **common, num_warps=8)
    if with_logprobs:
        _rank_kernel[split](l, s, vocab, out, ranks, **walk, **common)
    if top_k_cutoffs is not None:
        with_cutoff = (temperature > 0) & (top_k > 0) & (top_k < vocab) if any_top_k else torch.zeros_like(top_k).bool()
        top_k_cutoffs.copy_(torch.where(with_cutoff, _key_to_float(state[:, 2]), float("-inf")))
    return out


def _key_to_float(keys: torch.Tensor) -> torch.Tensor:
    """_order_key's inverse on int32-stored keys: (B,) int32 → (B,) float32."""
    key = keys.to(torch.int64) & 0xFFFFFFFF
    bits = torch.where(key >= 2**31, key ^ 0x80000000, key ^ 0xFFFFFFFF)
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)
