"""Sampling in a few Triton-language kernels: temperature, top-k, top-p, min-p, seeded noise, the pick and logprobs.

The logits (model dtype) are read a few times and never sorted. The draw is a race: the winner of z + G over the kept
tokens, where z = x / T and G = -log(E), E ~ Exp(1), comes from a counter-based hash of (seed, step, token) (the torch
sampler's own hash: both draw the same noise), picks token i with probability softmax(z)_i among them, and a row draws
the same token whatever batch it shares.
- pass 1: the row's maximum and its first index (the greedy pick), with logprobs the sum of exp(x - max), and the
  race's winner over the whole vocabulary;
- top-p and min-p: the kept tokens are those with z at or above a cutoff, so a winner is kept or not by its own z:
  min-p by exp(z - max z) >= min_p, top-p by one pass summing the mass strictly above it against top_p of the
  mass top-k kept (transformers and vLLM renormalise top-k's tokens before top-p). A rejected winner has z below
  the cutoff, so rerunning the race above its z keeps every kept token in it: the first winner kept is the
  winner among the kept tokens, with no cutoff computed. With top-p 0.95 the first winner is kept 95% of the time;
- top-k: its cutoff exactly, by a radix descent over the order-preserving 32-bit keys of z, 8 bits a pass: a
  histogram of the next byte among the keys that match the bytes decided (4 passes); a winner below it is rejected
  like one below the other cutoffs (every top-k token lies above it);
- with logprobs, one more pass counts the tokens more likely than the pick (its rank).
A row with temperature 0 takes the first maximum, as torch.argmax does. Every setting is read per row from device
memory, so a captured graph serves any mix of settings.

Split passes. One program walking a row of 128K logits takes tens of microseconds a pass, and a batch waits for its
slowest row: at 256 rows one row or more nearly always needs a rerun, so every sampled step paid four passes one
after another. So pass 1, the top-p pass and the reruns are split: each row's vocabulary is cut into chunks of
SAMPLE_CHUNK logits, one program a chunk, and the next kernel's programs combine the chunks' partial results
(a race's winner is the best of the chunks' winners, first index on ties, so the split draws exactly the token one
program would; the masses are sums of the chunks'). The top-k histograms are split the same way, a kernel summing the chunks'
histograms after each. A row's state (open or done, its candidate, its top-k cutoff) travels between the kernels in
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

from backend.ops.triton.launch import allow_dependents, dependent_wait  # noqa: E402  (after the guarded import)

__all__ = ["sample_rows", "SAMPLE_BLOCK", "SAMPLE_CHUNK"]

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
def _gumbel(row_key, offs, MUL1: tl.constexpr, MUL2: tl.constexpr, SALT_VOCAB: tl.constexpr):
    """-log(E) for E ~ Exp(1) drawn from (the row's seed and step, token): z + this races to a draw of softmax(z)."""
    vocab = _mix32(offs.to(tl.uint32) ^ SALT_VOCAB, MUL1, MUL2)
    bits = _mix32_tail(row_key ^ (vocab ^ (vocab >> 16)), MUL1, MUL2)
    # 23 bits + 0.5: u in (0, 1) exactly, so E = -log(u) is finite and > 0
    u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    return -tl.log(-tl.log(u))


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
def _first_pass_kernel(logits_ptr, stride_l, V, S, temp_ptr, seed_ptr, step_ptr, pf_ptr, pi_ptr, state_ptr,
                       CHUNK: tl.constexpr, BLOCK: tl.constexpr, LOGPROBS: tl.constexpr, NF: tl.constexpr,
                       NI: tl.constexpr, NS: tl.constexpr, MUL1: tl.constexpr, MUL2: tl.constexpr, SALT_SEED: tl.constexpr,
                       SALT_VOCAB: tl.constexpr, PDL: tl.constexpr):
    """Pass 1 over one chunk of one row: its maximum and first index, with logprobs the sum of exp(x - max), and
    for a sampled row the race's winner in the chunk."""
    allow_dependents(PDL)
    dependent_wait(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    base = logits_ptr + row.to(tl.int64) * stride_l
    lanes = tl.arange(0, BLOCK)
    T = tl.load(temp_ptr + row)
    sampled = T > 0
    T_safe = tl.where(sampled, T, 1.0)
    row_key = _row_key(seed_ptr, step_ptr, row, MUL1, MUL2, SALT_SEED)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_at = tl.zeros([BLOCK], tl.int32)
    sums = tl.zeros([BLOCK], tl.float32)
    top_score = tl.full([BLOCK], float("-inf"), tl.float32)
    top_at = tl.zeros([BLOCK], tl.int32)
    lo = chunk * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    for start in range(lo, hi, BLOCK):
        offs = start + lanes
        x = tl.load(base + offs, mask=offs < hi, other=float("-inf")).to(tl.float32)
        best_at = tl.where(x > best, offs, best_at)
        if LOGPROBS:
            new = tl.maximum(best, x)
            safe = tl.where(new == float("-inf"), 0.0, new)
            sums = sums * tl.exp(best - safe) + tl.exp(x - safe)
            best = new
        else:
            best = tl.maximum(best, x)
        if sampled:
            score = tl.where(offs < hi, x / T_safe + _gumbel(row_key, offs, MUL1, MUL2, SALT_VOCAB), float("-inf"))
            top_at = tl.where(score > top_score, offs, top_at)
            top_score = tl.maximum(top_score, score)
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
    if chunk == 0:
        tl.store(state_ptr + row * NS, 0)  # _OPEN
        tl.store(state_ptr + row * NS + 2, 0)  # no top-k cutoff yet


@triton.jit
def _top_k_hist_kernel(logits_ptr, stride_l, V, S, temp_ptr, top_k_ptr, state_ptr, hist_ptr, above_ptr,
                       SHIFT: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, NS: tl.constexpr,
                       PDL: tl.constexpr):
    """One pass of top-k's radix descent over one chunk of a top-k row: the histogram of the key byte at SHIFT among
    the keys whose higher bytes are the ones decided, and how many keys lie above those."""
    allow_dependents(PDL)
    dependent_wait(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    T = tl.load(temp_ptr + row)
    k = tl.load(top_k_ptr + row)
    if (T <= 0) | (k <= 0) | (k >= V):
        return
    base = logits_ptr + row.to(tl.int64) * stride_l
    prefix = tl.load(state_ptr + row * NS + 2).to(tl.uint32, bitcast=True)
    lanes = tl.arange(0, BLOCK)
    hist = tl.zeros([256], tl.int32)
    above = tl.zeros([BLOCK], tl.int32)
    lo = chunk * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    for start in range(lo, hi, BLOCK):
        offs = start + lanes
        valid = offs < hi
        key = _order_key(_scaled(base, offs, hi, T))
        if SHIFT == 24:
            match = valid
        else:
            high, decided = key >> (SHIFT + 8), prefix >> (SHIFT + 8)
            match = valid & (high == decided)
            above += (valid & (high > decided)).to(tl.int32)
        hist += tl.histogram(((key >> SHIFT) & 255).to(tl.int32), 256, mask=match)
    slot = row.to(tl.int64) * S + chunk
    tl.store(hist_ptr + slot * 256 + tl.arange(0, 256), hist)
    tl.store(above_ptr + slot, tl.sum(above, axis=0))


@triton.jit
def _top_k_pick_kernel(V, S, temp_ptr, top_k_ptr, state_ptr, hist_ptr, above_ptr, SHIFT: tl.constexpr,
                       NS: tl.constexpr, SP: tl.constexpr, PDL: tl.constexpr):
    """The chunks' histograms summed: the key byte at SHIFT of the k-th largest z (ties included) joins the cutoff."""
    allow_dependents(PDL)
    dependent_wait(PDL)
    row = tl.program_id(0)
    T = tl.load(temp_ptr + row)
    k = tl.load(top_k_ptr + row)
    if (T <= 0) | (k <= 0) | (k >= V):
        return
    c = tl.arange(0, SP)
    slot = row.to(tl.int64) * S + c
    hist = tl.sum(tl.load(hist_ptr + slot[:, None] * 256 + tl.arange(0, 256)[None, :], mask=(c < S)[:, None],
                          other=0), axis=0)  # (256,)
    above = tl.sum(tl.load(above_ptr + slot, mask=c < S, other=0), axis=0)
    # tokens at or above each candidate byte d: those above the decided prefix, plus the bytes >= d
    at_least = above + tl.sum(hist, axis=0) - tl.cumsum(hist, 0) + hist
    d = tl.maximum(tl.sum((at_least >= k).to(tl.int32), axis=0) - 1, 0)
    prefix = tl.load(state_ptr + row * NS + 2).to(tl.uint32, bitcast=True) | (d.to(tl.uint32) << SHIFT)
    tl.store(state_ptr + row * NS + 2, prefix.to(tl.int32, bitcast=True))


@triton.jit
def _nucleus_kernel(logits_ptr, stride_l, V, S, temp_ptr, top_p_ptr, min_p_ptr, pf_ptr, pi_ptr, state_ptr,
                    CHUNK: tl.constexpr, BLOCK: tl.constexpr, NF: tl.constexpr, NI: tl.constexpr, NS: tl.constexpr,
                    SP: tl.constexpr, PDL: tl.constexpr):
    """An open row's candidate is the best of the chunks' race winners; with top-p, one chunk's masses among the
    tokens top-k keeps: all of them, and the part strictly above the candidate. Greedy rows, and candidates that
    top-k and min-p alone keep, are done here."""
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
def _rerun_kernel(logits_ptr, stride_l, V, S, temp_ptr, top_p_ptr, min_p_ptr, seed_ptr, step_ptr, pf_ptr, pi_ptr,
                  state_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, NF: tl.constexpr, NI: tl.constexpr,
                  NS: tl.constexpr, SP: tl.constexpr, MUL1: tl.constexpr, MUL2: tl.constexpr, SALT_SEED: tl.constexpr,
                  SALT_VOCAB: tl.constexpr, PDL: tl.constexpr):
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
        score = tl.where(inside, z + _gumbel(row_key, offs, MUL1, MUL2, SALT_VOCAB), float("-inf"))
        top_at = tl.where(score > top_score, offs, top_at)
        top_score = tl.maximum(top_score, score)
    slot = row.to(tl.int64) * S + chunk
    race = tl.max(top_score, axis=0)
    tl.store(pf_ptr + slot * NF + 2, race)
    tl.store(pi_ptr + slot * NI + 1, tl.min(tl.where(top_score == race, top_at, V), axis=0))


@triton.jit
def _final_kernel(logits_ptr, stride_l, V, S, temp_ptr, top_p_ptr, min_p_ptr, seed_ptr, step_ptr, pf_ptr, pi_ptr,
                  state_ptr, out_ptr, logprob_ptr, rank_ptr, lse_ptr,
                  BLOCK: tl.constexpr, LOGPROBS: tl.constexpr, NF: tl.constexpr, NI: tl.constexpr, NS: tl.constexpr,
                  SP: tl.constexpr, MUL1: tl.constexpr, MUL2: tl.constexpr, SALT_SEED: tl.constexpr,
                  SALT_VOCAB: tl.constexpr, PDL: tl.constexpr):
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
            token = _race(base, V, T, row_key, z_c, floor_key, MUL1, MUL2, SALT_VOCAB, BLOCK)
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


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor, seeds: torch.Tensor, step_index: torch.Tensor, out: torch.Tensor, *,
                logprobs: torch.Tensor | None = None, ranks: torch.Tensor | None = None,
                lse: torch.Tensor | None = None, pdl: bool = False, any_top_k: bool = True,
                chunk: int = SAMPLE_CHUNK, block: int = SAMPLE_BLOCK) -> torch.Tensor:
    """Sample one token per row of logits (B, V) into out (B,) int64; returns out.

    Per row (all (B,) device tensors): temperature f32 (0: greedy), top_k int32 (<= 0: off), top_p f32, min_p f32,
    seeds and step_index int64. With logprobs, ranks and lse (all three or none): the pick's log-probability under
    the raw logits (B,) f32, its 1-based rank (B,) int64 and the row's log-sum-exp (B,) f32. any_top_k=False leaves
    out top-k's passes: only for rows none of which has top-k on. chunk (a multiple of block) sets the split passes'
    chunks; every caller that must draw the same tokens uses the same chunk."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be (B, V), got shape {tuple(logits.shape)}")
    rows, vocab = logits.shape
    if out.shape != (rows,) or out.dtype != torch.int64:
        raise ValueError(f"out must be ({rows},) int64, got {tuple(out.shape)} {out.dtype}")
    with_logprobs = logprobs is not None
    if with_logprobs != (ranks is not None) or with_logprobs != (lse is not None):
        raise ValueError("logprobs, ranks and lse go together")
    if chunk <= 0 or chunk % block:
        raise ValueError(f"chunk must be a positive multiple of block ({block}), got {chunk}")
    if rows == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    chunks = triton.cdiv(vocab, chunk)
    device = logits.device
    pf = torch.empty((rows, chunks, _NF), dtype=torch.float32, device=device)  # per-chunk partial results
    pi = torch.empty((rows, chunks, _NI), dtype=torch.int32, device=device)
    state = torch.empty((rows, _NS), dtype=torch.int32, device=device)  # per row: status, candidate, top-k cutoff
    dummy = out
    split = (rows, chunks)
    common = dict(PDL=pdl, launch_pdl=pdl)
    sizes = dict(NF=_NF, NI=_NI, NS=_NS, SP=triton.next_power_of_2(chunks))
    noise = dict(MUL1=_MUL1, MUL2=_MUL2, SALT_SEED=_SALT_SEED, SALT_VOCAB=_SALT_VOCAB)
    walk = dict(CHUNK=chunk, BLOCK=block, num_warps=4)
    l, s = logits, logits.stride(0)
    _first_pass_kernel[split](l, s, vocab, chunks, temperature, seeds, step_index, pf, pi, state, LOGPROBS=with_logprobs,
                              NF=_NF, NI=_NI, NS=_NS, **noise, **walk, **common)
    if any_top_k:
        hist = torch.empty((rows, chunks, 256), dtype=torch.int32, device=device)  # one radix pass's histograms
        above = torch.empty((rows, chunks), dtype=torch.int32, device=device)
        for shift in (24, 16, 8, 0):
            _top_k_hist_kernel[split](l, s, vocab, chunks, temperature, top_k, state, hist, above, SHIFT=shift,
                                      NS=_NS, **walk, **common)
            _top_k_pick_kernel[(rows,)](vocab, chunks, temperature, top_k, state, hist, above, SHIFT=shift, NS=_NS,
                                        SP=sizes["SP"], **common, num_warps=4)
    nucleus_args = (l, s, vocab, chunks, temperature, top_p, min_p, pf, pi, state)
    _nucleus_kernel[split](*nucleus_args, **sizes, **walk, **common)
    for _ in range(SPLIT_RERUNS):
        _rerun_kernel[split](l, s, vocab, chunks, temperature, top_p, min_p, seeds, step_index, pf, pi, state,
                             **sizes, **noise, **walk, **common)
        _nucleus_kernel[split](*nucleus_args, **sizes, **walk, **common)
    _final_kernel[(rows,)](l, s, vocab, chunks, temperature, top_p, min_p, seeds, step_index, pf, pi, state, out,
                           logprobs if with_logprobs else dummy, ranks if with_logprobs else dummy,
                           lse if with_logprobs else dummy, BLOCK=block, LOGPROBS=with_logprobs, **sizes, **noise,
                           **common, num_warps=8)
    if with_logprobs:
        _rank_kernel[split](l, s, vocab, out, ranks, **walk, **common)
    return out
