"""Token sampling on the device without host synchronisation: penalties, temperature, top-k/top-p/min-p, seeds.

Everything the sampler reads from the batch lives in device tensors (`SamplingTensors`); the only host values
are flags decided from the request parameters when the batch is packed, so the sampler can be captured in a
CUDA graph and queued ahead of the GPU. Randomness is a counter-based hash of (seed, step, token), so a
request draws the same token whatever batch it shares and whichever row it sits in.
"""
from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF
# odd multipliers below 2**31 (hash-prospector 2-round hash), so x * m < 2**63 never overflows int64
_MUL1 = 0x21F0AAAD
_MUL2 = 0x735A2D97
_SALT_SEED = 0x2545F491
_SALT_VOCAB = 0x68E31DA4
_NUM_FLOAT_FIELDS = 6  # temperature, top_p, min_p, repetition, presence, frequency
_MAX_INT32 = 2**31 - 1
_FLOAT_GETTER = operator.attrgetter(
    "temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_TOP_K_GETTER = operator.attrgetter("top_k")
_LOGPROBS_GETTER = operator.attrgetter("logprobs")


@dataclass(slots=True)
class SamplingTensors:
    """Per-row sampling settings on the device, plus host flags that pick the work to do.

    The any_* flags may be set True beyond need (e.g. for one graph captured for every batch): a row whose setting is
    neutral (top_k <= 0, top_p = 1, min_p = 0, penalties 1/0/0) comes out the same either way. A graph
    captured for any batch should set any_top_p too: max_top_k alone picks a topk whose shape varies.
    """

    temperature: torch.Tensor  # (B,) f32, 0 = greedy row
    top_k: torch.Tensor  # (B,) int32, <= 0 = off
    top_p: torch.Tensor  # (B,) f32
    min_p: torch.Tensor  # (B,) f32
    repetition_penalty: torch.Tensor  # (B,) f32
    presence_penalty: torch.Tensor  # (B,) f32
    frequency_penalty: torch.Tensor  # (B,) f32
    seeds: torch.Tensor  # (B,) int64
    step_index: torch.Tensor  # (B,) int64, index of the output token being sampled
    prompt_token_ids: torch.Tensor | None  # (B, Lp) int64 padded with -1; only with penalties
    output_token_ids: torch.Tensor | None  # (B, Lo) int64 padded with -1; only with penalties
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    any_penalty: bool
    num_logprobs: int  # most top logprobs asked in the batch; 0: only the sampled token's; -1: none
    max_top_k: int = 0  # largest top_k of a sampled row (0: none): top-k alone then uses topk, not a sort

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]


def _param_columns(params) -> tuple[np.ndarray, np.ndarray]:
    """The float settings (6, n) float32 and top_k (n,) capped to int32 of params, by C-level iteration over them
    (~0.2 us per row, no per-row numpy calls)."""
    n = len(params)
    flat = itertools.chain.from_iterable(map(_FLOAT_GETTER, params))
    floats = np.fromiter(flat, dtype=np.float32, count=_NUM_FLOAT_FIELDS * n).reshape(n, -1).T
    top_k = np.minimum(np.fromiter(map(_TOP_K_GETTER, params), dtype=np.int64, count=n), _MAX_INT32)
    return floats, top_k


def _most_logprobs(params) -> int:
    """The most logprobs any of params asks for; -1 when none asks."""
    asked = [k for k in map(_LOGPROBS_GETTER, params) if k is not None]
    return max(asked) if asked else -1


def fill_request_rows(reqs, host_f, host_i, host_k) -> dict:
    """Per-row settings of requests into host arrays (6, n) f32, (2, n) i64, (n,) i32: each one's settings, seed
    and step index (its outputs before the token this step samples); returns the host flags."""
    f, ints = request_columns(reqs)
    host_f[:] = f
    host_i[:] = ints[:2]
    host_k[:] = ints[2]
    return flags_of_rows(ints[4], ints[3], _most_logprobs([r.params for r in reqs]))


# a row's flag bits (row_bits): the host flags of a batch (row_flags) come from the OR of its rows' bits
_SAMPLED, _TOP_K_ON, _TOP_P_ON, _MIN_P_ON, _PENALTY = 1, 2, 4, 8, 16
_FEW_ROWS = 16  # request_columns reads up to this many rows with per-row Python: numpy's per-call cost dominates there


def request_columns(reqs) -> tuple[np.ndarray, np.ndarray]:
    """fill_request_rows' settings of reqs and each row's flag bits: (6, m) float32 as host_f, and (5, m) int64 rows:
    seed (its low 64 bits), step index, top_k (capped to int32), the top-k cutoff in force (0: none) and the flag
    bits (row_bits). A few rows (rows joining the decode rows, prefill rows) are read row by row, more with a few
    numpy calls."""
    if len(reqs) > _FEW_ROWS:
        floats, top_k = _param_columns([r.params for r in reqs])
        steps = np.fromiter((r.num_tokens - r.num_prompt_tokens - 1 for r in reqs), dtype=np.int64, count=len(reqs))
        bits, cutoffs = row_bits(*floats, top_k)
        return floats, np.stack([_seeds_array([r.seed for r in reqs]), steps, top_k, cutoffs, bits])
    floats = np.array([_FLOAT_GETTER(r.params) for r in reqs], dtype=np.float32)  # (m, 6)
    ints = [[], [], [], [], []]
    seeds, steps, top_ks, cutoffs, bits = ints
    for req, row in zip(reqs, floats.tolist()):  # the float32 values, as the vectorised rules compare them
        seed = req.seed & _MASK64
        seeds.append(seed - (1 << 64) if seed >> 63 else seed)  # as _seeds_array's int64 view
        steps.append(req.num_tokens - req.num_prompt_tokens - 1)
        k = min(req.params.top_k, _MAX_INT32)
        top_ks.append(k)
        b, cutoff = row_bits(*row, k)
        bits.append(b)
        cutoffs.append(cutoff)
    return floats.T, np.array(ints, dtype=np.int64).reshape(5, len(reqs))


def row_bits(temperature, top_p, min_p, rep, pres, freq, top_k):
    """A row's flag bits and its top-k cutoff in force (0: none), from its settings as Python numbers; or every
    row's, from (n,) arrays of them. The one place the rules live: greedy rows ignore top-k/top-p/min-p."""
    sampled = temperature > 0
    top_k_on = sampled & (top_k > 0)
    bits = (sampled * _SAMPLED) | (top_k_on * _TOP_K_ON) | ((sampled & (top_p < 1)) * _TOP_P_ON) \
        | ((sampled & (min_p > 0)) * _MIN_P_ON) | (((rep != 1) | (pres != 0) | (freq != 0)) * _PENALTY)
    return bits, top_k_on * top_k


def row_flags(host_f, host_k, num_logprobs: int) -> dict:
    """The host flags of rows whose settings are in host_f (6, n) and host_k (n,); num_logprobs: the most any row
    asks for, -1 for none."""
    return flags_of_rows(*row_bits(*host_f, host_k), num_logprobs)


def flags_of_rows(bits: np.ndarray, cutoffs: np.ndarray, num_logprobs: int) -> dict:
    """The host flags of rows with these flag bits and top-k cutoffs (row_bits)."""
    return flags_of_bits(int(np.bitwise_or.reduce(bits, initial=0)), int(cutoffs.max(initial=0)), num_logprobs)


def flags_of_bits(bits: int, max_top_k: int, num_logprobs: int) -> dict:
    """row_flags' flags of rows whose flag bits (row_bits) OR to bits and whose largest top-k cutoff is max_top_k."""
    return dict(
        all_greedy=not bits & _SAMPLED,
        any_top_k=bool(bits & _TOP_K_ON),
        max_top_k=max_top_k,
        any_top_p=bool(bits & _TOP_P_ON),
        any_min_p=bool(bits & _MIN_P_ON),
        any_penalty=bool(bits & _PENALTY),
        num_logprobs=num_logprobs,
    )


def _seeds_array(seeds: Sequence[int]) -> np.ndarray:
    """Seeds as int64 holding their low 64 bits (any non-negative Python int is accepted)."""
    try:
        return np.asarray(seeds, dtype=np.uint64).view(np.int64)
    except (OverflowError, ValueError, TypeError):
        return np.fromiter((int(s) & _MASK64 for s in seeds), dtype=np.uint64, count=len(seeds)).view(np.int64)


_NEUTRAL_FLOATS = np.array([0.0, 1.0, 0.0, 1.0, 0.0, 0.0], dtype=np.float32)[:, None]  # (6, 1) greedy, no cutoffs


def fill_padding_rows(host_f, host_i, host_k) -> None:
    """Neutral greedy settings for padding rows (their tokens are dropped)."""
    host_f[:] = _NEUTRAL_FLOATS
    host_i[:] = 0
    host_k[:] = 0


def host_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host array to the device; through pinned memory and without blocking on CUDA (a pageable copy would wait for
    the stream's queued work: the GPU would drain before the host could queue more)."""
    if device.type != "cuda":
        return torch.from_numpy(array).to(device)
    return torch.from_numpy(array).pin_memory().to(device, non_blocking=True)


def pad_token_table(rows: Sequence[Sequence[int]], size: int, device: torch.device) -> torch.Tensor:
    """Ragged token lists to a (size, max_len) int64 table padded with -1, in one C-level pass."""
    if len(rows) > size:
        raise ValueError(f"got token lists for {len(rows)} rows, batch has {size}")
    lengths = np.zeros(size, dtype=np.int64)  # (size,)
    lengths[: len(rows)] = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    width = max(int(lengths.max()), 1)
    table = np.full((size, width), -1, dtype=np.int64)  # (size, L)
    if rows and all(isinstance(r, np.ndarray) for r in rows):  # engine-kept arrays: a memcpy, no Python ints
        flat = np.concatenate(rows).astype(np.int64, copy=False)
    else:
        flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=int(lengths.sum()))
    table[np.arange(width) < lengths[:, None]] = flat  # row-major fill matches the concatenation order
    return host_to_device(table, device)


def tensors_from_rows(rows: tuple[torch.Tensor, ...], prompt, output, flags) -> SamplingTensors:
    """SamplingTensors over per-setting (B,) device views: temperature, top_p, min_p, repetition, presence and
    frequency penalties, seeds, step indices, top_k."""
    temperature, top_p, min_p, rep, pres, freq, seeds, steps, top_k = rows
    return SamplingTensors(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=rep,
        presence_penalty=pres, frequency_penalty=freq, seeds=seeds, step_index=steps,
        prompt_token_ids=prompt, output_token_ids=output, **flags,
    )


@dataclass(slots=True)
class SamplerOutput:
    """Sampled tokens and, when asked, their logprobs and the top-n alternatives (all on the device)."""

    token_ids: torch.Tensor  # (B,) int64
    logprobs: torch.Tensor | None = None  # (B,) f32, of the sampled token under the raw logits
    ranks: torch.Tensor | None = None  # (B,) int64, the sampled token's 1-based rank in its row (1: a row maximum)
    top_ids: torch.Tensor | None = None  # (B, K) int64
    top_logprobs: torch.Tensor | None = None  # (B, K) f32


@dataclass(slots=True)
class SampleTargets:
    """Device buffers a step's samples are written into (a pipeline slot's outputs, leading rows used)."""

    tokens: torch.Tensor  # (S,) int64
    logprobs: torch.Tensor  # (S,) f32
    ranks: torch.Tensor  # (S,) int64
    top_ids: torch.Tensor  # (S, K) int64
    top_logprobs: torch.Tensor  # (S, K) f32
    lse: torch.Tensor  # (S,) f32, each row's log-sum-exp (the fused kernel's, for the top-n logprobs)


class Sampler:
    """Turns a batch of logits into next tokens on the device, with no host synchronisation.

    With a fused kernel (the Triton ops' sample_rows) `sample_into` runs temperature, top-k/top-p/min-p, the noise,
    the pick and the sampled logprobs in one launch over the model-dtype logits, and no sort; without one (the
    torch ops) it runs the torch code below, which is also the reference the kernel is tested against."""

    def __init__(self, fused: Callable | None = None) -> None:
        self.fused = fused
        self._vocab_hash: torch.Tensor | None = None  # (V,) cached per vocabulary size and device

    def sample_into(self, logits: torch.Tensor, st: SamplingTensors, out: SampleTargets) -> None:
        """Sample every row of logits (B, V) into out's leading B rows (logprobs, ranks, top-n when asked)."""
        rows = st.batch_size
        if self.fused is None:
            _write_output(self(logits, st), out, rows)
            return
        if logits.dim() != 2 or logits.shape[0] != rows:
            raise ValueError(f"logits must be (B={rows}, V), got {tuple(logits.shape)}")
        if st.any_penalty:
            logits = apply_penalties(logits.float(), st)
        asked = st.num_logprobs >= 0
        self.fused(logits, st.temperature, st.top_k, st.top_p, st.min_p, st.seeds, st.step_index,
                   out.tokens[:rows], logprobs=out.logprobs[:rows] if asked else None,
                   ranks=out.ranks[:rows] if asked else None, lse=out.lse[:rows] if asked else None,
                   any_top_k=st.any_top_k)
        if st.num_logprobs > 0:
            k = st.num_logprobs
            values, ids = logits.topk(k, dim=-1)  # (B, K) of the raw logits, as log_softmax keeps their order
            out.top_ids[:rows, :k].copy_(ids)
            out.top_logprobs[:rows, :k].copy_(values.float() - out.lse[:rows].unsqueeze(1))

    def __call__(self, logits: torch.Tensor, st: SamplingTensors) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != st.batch_size:
            raise ValueError(f"logits must be (B={st.batch_size}, V), got {tuple(logits.shape)}")
        logits = logits.float()  # the model's dtype (bf16) to float32, as transformers' generate does
        raw_logprobs = logits.log_softmax(dim=-1) if st.num_logprobs >= 0 else None  # (B, V)
        if st.any_penalty:
            logits = apply_penalties(logits, st)
        greedy = logits.argmax(dim=-1)  # (B,) bit-exact with torch.argmax of the (penalised) logits
        if st.all_greedy:
            tokens = greedy
        else:
            tokens = torch.where(st.temperature == 0, greedy, self._sample(logits, st))
        return _with_logprobs(tokens, raw_logprobs, st.num_logprobs)

    def _sample(self, logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        """Temperature, top-k/top-p/min-p, then an exponential race; returns (B,) int64."""
        temperature = torch.where(st.temperature > 0, st.temperature, 1.0)  # greedy rows: result unused
        scaled = logits / temperature.unsqueeze(1)  # (B, V)
        if st.any_top_k and not st.any_top_p and 0 < st.max_top_k <= logits.shape[1] // 8:
            scaled = apply_top_k(scaled, st.top_k, st.max_top_k)
        elif st.any_top_k or st.any_top_p:
            scaled = apply_top_k_top_p(scaled, st.top_k if st.any_top_k else None,
                                       st.top_p if st.any_top_p else None)
        probs = scaled.softmax(dim=-1)  # (B, V)
        if st.any_min_p:
            probs = apply_min_p(probs, st.min_p)
        noise = exponential_noise(st.seeds, st.step_index, self.vocab_hash(logits.shape[1], logits.device))
        # multinomial sampling without a cuda synchronization: argmax(p / Exp(1)) draws i with probability p_i
        return probs.div_(noise).argmax(dim=-1)

    def vocab_hash(self, vocab_size: int, device: torch.device | str) -> torch.Tensor:
        """(V,) int64 hashes of the token indices; cached (call once before graph capture)."""
        device = torch.device(device)
        cached = self._vocab_hash
        if cached is None or cached.shape[0] != vocab_size or cached.device != device:
            cached = _mix32_(torch.arange(vocab_size, dtype=torch.int64, device=device) ^ _SALT_VOCAB)
            self._vocab_hash = cached
        return cached


def _write_output(out: SamplerOutput, targets: SampleTargets, rows: int) -> None:
    targets.tokens[:rows].copy_(out.token_ids)
    if out.logprobs is not None:
        targets.logprobs[:rows].copy_(out.logprobs)
        targets.ranks[:rows].copy_(out.ranks)
    if out.top_ids is not None:
        k = out.top_ids.shape[1]
        targets.top_ids[:rows, :k].copy_(out.top_ids)
        targets.top_logprobs[:rows, :k].copy_(out.top_logprobs)


def _with_logprobs(tokens: torch.Tensor, raw_logprobs: torch.Tensor | None, k: int) -> SamplerOutput:
    if raw_logprobs is None:
        return SamplerOutput(tokens)
    chosen = raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)  # (B,)
    ranks = (raw_logprobs > chosen.unsqueeze(1)).sum(dim=1) + 1  # (B,) tokens more likely than it, plus one
    if k == 0:
        return SamplerOutput(tokens, chosen, ranks)
    top_logprobs, top_ids = raw_logprobs.topk(k, dim=-1)  # (B, K)
    return SamplerOutput(tokens, chosen, ranks, top_ids, top_logprobs)


def apply_penalties(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Repetition over prompt + output tokens (HF/vLLM); presence/frequency over output tokens (OpenAI)."""
    if st.prompt_token_ids is None or st.output_token_ids is None:
        raise ValueError("penalties need prompt_token_ids and output_token_ids")
    vocab = logits.shape[1]
    counts = _token_counts(st.output_token_ids, vocab, logits.dtype)  # (B, V)
    in_output = counts > 0  # (B, V)
    seen = in_output | (_token_counts(st.prompt_token_ids, vocab, logits.dtype) > 0)  # (B, V)
    rep = st.repetition_penalty.unsqueeze(1)  # (B, 1)
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - st.frequency_penalty.unsqueeze(1) * counts
    return logits - st.presence_penalty.unsqueeze(1) * in_output


def _token_counts(token_ids: torch.Tensor, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, L) ids padded with -1 → (B, V) occurrence counts (padding lands in a dropped extra column)."""
    valid = (token_ids >= 0) & (token_ids < vocab)
    index = torch.where(valid, token_ids, vocab)  # (B, L)
    counts = torch.zeros(token_ids.shape[0], vocab + 1, dtype=dtype, device=token_ids.device)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=dtype))  # exact: small integers in float
    return counts[:, :vocab]


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Mask (-inf) tokens outside each row's top-k via topk(max_top_k), cheaper than a full sort for small k."""
    best = logits.topk(max_top_k, dim=-1).values  # (B, K) descending
    k = top_k.clamp(min=1, max=max_top_k).to(torch.int64)  # (B,)
    cutoff = best.gather(1, (k - 1).unsqueeze(1))  # (B, 1) smallest kept logit
    cutoff = torch.where(top_k.unsqueeze(1) > 0, cutoff, float("-inf"))  # rows without top-k keep all
    return logits.masked_fill(logits < cutoff, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (-inf) tokens outside each row's top-k and top-p nucleus; ties with the cutoff are kept."""
    batch, vocab = logits.shape
    sorted_logits = logits.sort(dim=-1, descending=True).values  # (B, V)
    positions = torch.arange(vocab, device=logits.device)  # (V,)
    num_keep = torch.full((batch,), vocab, dtype=torch.int64, device=logits.device)  # (B,)
    if top_k is not None:
        num_keep = torch.where(top_k > 0, top_k.clamp(max=vocab).to(torch.int64), num_keep)
        sorted_logits = sorted_logits.masked_fill(positions >= num_keep.unsqueeze(1), float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)  # (B, V) after top-k, as top-p renormalises what top-k kept
        mass_before = probs.cumsum(dim=-1) - probs  # (B, V) mass of the strictly better tokens
        needed = (mass_before < top_p.unsqueeze(1)).sum(dim=-1)  # (B,) >= 1 since top_p > 0
        num_keep = torch.where(top_p < 1, torch.minimum(num_keep, needed.clamp(min=1)), num_keep)
    cutoff = sorted_logits.gather(1, (num_keep - 1).unsqueeze(1))  # (B, 1) smallest kept logit
    return logits.masked_fill(logits < cutoff, float("-inf"))


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero tokens whose probability is below min_p times the row's best (no renormalising: the race ignores scale)."""
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # (B, 1)
    return probs.masked_fill(probs < threshold, 0.0)


def exponential_noise(seeds: torch.Tensor, step_index: torch.Tensor, vocab_hash: torch.Tensor) -> torch.Tensor:
    """(B, V) Exp(1) draws that depend only on (seed, step, token): the same on any row, batch and device."""
    key = _mix32_((seeds & _MASK32) ^ _SALT_SEED)  # (B,)
    key = _mix32_(key ^ ((seeds >> 32) & _MASK32))
    key = _mix32_(key ^ (step_index & _MASK32))
    key = _mix32_(key ^ ((step_index >> 32) & _MASK32))
    # the hash's first shift-xor distributes over ^, so it runs on the (B,) and (V,) halves, not on (B, V)
    key = _shift_xor_(key, 16)
    vocab_part = vocab_hash ^ (vocab_hash >> 16)  # (V,)
    bits = _mix32_tail_(key.unsqueeze(1) ^ vocab_part.unsqueeze(0))  # (B, V) uniform 32-bit words in int64
    # 23 bits + 0.5 is exact in float32 and keeps u in (0, 1), so -log(u) is finite and > 0
    uniform = (bits >> 9).to(torch.float32).add_(0.5).mul_(2.0**-23)
    return uniform.log_().neg_()


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """In place: 32-bit avalanche hash of int64 values in [0, 2**32); multipliers < 2**31 keep products in int64."""
    return _mix32_tail_(_shift_xor_(x, 16))


def _shift_xor_(x: torch.Tensor, shift: int) -> torch.Tensor:
    return x.bitwise_xor_(x >> shift)


def _mix32_tail_(x: torch.Tensor) -> torch.Tensor:
    """In place: _mix32_ after its first shift-xor."""
    x.mul_(_MUL1).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 15)
    x.mul_(_MUL2).bitwise_and_(_MASK32)
    return x.bitwise_xor_(x >> 15)
