"""Triton-language kernels (backend/ops/triton/*.py) against float64 references on random inputs.

Tolerances are norm-wise, ‖out − ref‖ / ‖ref‖:
- fp32: 1e-4. The kernels compute in fp32 with IEEE dots (no tf32), so only summation order differs (~1e-6).
- bf16 / fp16: 1e-2. The inputs are already rounded (the reference uses the same rounded values), but the
  kernel rounds the softmax probabilities to the input dtype before the P·V product (as every flash kernel
  does, for the tensor cores) and rounds its output once: bf16 has an 8-bit mantissa, 2^-8 ≈ 4e-3 per
  element, which averages down in the norm to a few 1e-3.
Every output buffer the kernels allocate is filled with NaN first (the `buffers.alloc` hook), and every cache slot
that holds no context is NaN too, so an unwritten output or a read past a sequence shows up as NaN.

With CUDA the kernels are compiled and run on the GPU; without it tests/conftest.py turns on Triton's interpreter
(TRITON_INTERPRET=1, with the GPU's bf16 numerics: tests/triton_interpreter.py) and they run on CPU tensors, at
smaller sizes. `pytest tests/kernels` does either.
"""
from __future__ import annotations

import math
import os
import random
import types
from dataclasses import dataclass

import pytest
import torch

pytestmark = pytest.mark.kernels

import triton  # noqa: E402,F401  (a test requirement: the interpreter runs these kernels without CUDA)

from backend.ops.torch import layers as torch_layers  # noqa: E402
from backend.ops.triton import argmax as targ  # noqa: E402
from backend.ops.triton import buffers as tbuf  # noqa: E402
from backend.ops.triton import attention as ta  # noqa: E402
from backend.ops.triton import layers as tly  # noqa: E402
from backend.ops.triton import linear as tlin  # noqa: E402
from backend.ops.partial_sums import PartialSums  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
MAX_CTX = 400 if INTERPRET else 16384  # the interpreter runs every program in numpy: keep it small there
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}
EXACT_BF16 = True
# The slowest cases under the interpreter (tens of seconds each on 2 cores): `make test` skips them there; the GPU
# runs them all, and TANDEM_ALL_KERNEL_CASES=1 runs them under the interpreter too (tests/conftest.py).
SLOW = pytest.mark.interpreter_slow


@dataclass
class Meta:
    """The fields of backend.ops.torch.attention.AttentionMetadata the kernels read (duck-typed)."""

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    seq_order: torch.Tensor | None = None


def _poison(shape, dtype, device):
    fill = float("nan") if dtype.is_floating_point else -(2 ** 31)  # integers: a value no index can take
    return torch.full(shape, fill, dtype=dtype, device=device)


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(tbuf, "alloc", _poison)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.double().cpu()
    ref = ref.double().cpu()
    assert not torch.isnan(out).any(), "NaN in output (unwritten element or out-of-range read)"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------------------------------
# attention
# ------------------------------------------------------------------------------------------------------
class Case:
    """A random paged batch: sequences (ctx_before, q_len), shuffled non-contiguous blocks, NaN elsewhere."""

    def __init__(self, seqs, hq, hkv, d, bs, dtype, seed, extra_blocks=7):
        dev = DEVICE
        g = torch.Generator(device=dev).manual_seed(seed)  # drawn on the device: 16K contexts are large
        rng = random.Random(seed)
        self.seqs, self.hq, self.hkv, self.d, self.bs, self.dtype = seqs, hq, hkv, d, bs, dtype
        lens = [c + n for c, n in seqs]
        nblk = [math.ceil(n / bs) for n in lens]
        num_blocks = 1 + sum(nblk) + extra_blocks  # block 0 is the padding block, never handed out
        ids = list(range(1, num_blocks))
        rng.shuffle(ids)
        max_blocks = max(nblk) + 2
        bt = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
        self.k_all, self.v_all = [], []
        cache = torch.full((2, num_blocks, bs, hkv, d), float("nan"), dtype=dtype, device=dev)
        slots, q_rows, k_new, v_new = [], [], [], []
        for b, ((ctx, qn), n) in enumerate(zip(seqs, lens)):
            blocks = [ids.pop() for _ in range(nblk[b])]
            bt[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            kk = torch.randn(n, hkv, d, generator=g, device=dev).to(dtype)
            vv = torch.randn(n, hkv, d, generator=g, device=dev).to(dtype)
            self.k_all.append(kk)
            self.v_all.append(vv)
            p = torch.arange(n)
            pos_slots = (torch.tensor(blocks, dtype=torch.int64)[p // bs] * bs + p % bs).to(dev)
            flat = cache.view(2, num_blocks * bs, hkv, d)
            flat[0, pos_slots[:ctx]] = kk[:ctx]  # earlier steps' tokens are already in the cache
            flat[1, pos_slots[:ctx]] = vv[:ctx]
            slots.append(pos_slots[ctx:])
            k_new.append(kk[ctx:])
            v_new.append(vv[ctx:])
            q_rows.append(torch.randn(qn, hq, d, generator=g, device=dev).to(dtype))
        qsl = [0]
        for _, qn in seqs:
            qsl.append(qsl[-1] + qn)
        self.cache = cache
        self.q = torch.cat(q_rows)
        self.k = torch.cat(k_new)
        self.v = torch.cat(v_new)
        self.meta = Meta(
            slot_mapping=torch.cat(slots).to(dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_tables=bt.to(dev),
            max_query_len=max(qn for _, qn in seqs),
            max_seq_len=max(lens),
        )
        self.scale = d ** -0.5

    def reference(self) -> torch.Tensor:
        """float64 causal attention over each sequence's full K/V (from the truth, not from the cache)."""
        outs = []
        grp = self.hq // self.hkv
        for b, (ctx, qn) in enumerate(self.seqs):
            q = self.q[self.meta.query_start_loc[b]: self.meta.query_start_loc[b] + qn].double()
            k = self.k_all[b].double().repeat_interleave(grp, dim=1)  # (L, Hq, D)
            v = self.v_all[b].double().repeat_interleave(grp, dim=1)
            s = torch.einsum("qhd,khd->hqk", q, k) * self.scale
            qpos = torch.arange(ctx, ctx + qn, device=q.device)[:, None]
            kpos = torch.arange(ctx + qn, device=q.device)[None, :]
            s = s.masked_fill(kpos > qpos, float("-inf"))
            outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
        return torch.cat(outs)

    def check_cache_written(self):
        flat = self.cache.view(2, -1, self.hkv, self.d)[:, self.meta.slot_mapping]
        assert torch.equal(flat[0], self.k) and torch.equal(flat[1], self.v)


def _contexts(n, rng, max_ctx):
    """n context lengths from 1 to max_ctx, always including the two ends."""
    picks = [1, max_ctx] + [rng.randint(1, max_ctx) for _ in range(max(0, n - 2))]
    return picks[:n]


DECODE_CASES = [  # (hq, hkv, head_dim, block_size, dtype)
    pytest.param(8, 8, 128, 16, torch.float32, marks=SLOW),
    pytest.param(32, 8, 128, 16, torch.float32, marks=SLOW),
    (32, 4, 64, 16, torch.float32),
    (8, 8, 64, 32, torch.bfloat16),
    (32, 8, 128, 16, torch.bfloat16),
    (32, 4, 128, 32, torch.bfloat16),
    (9, 3, 64, 16, torch.bfloat16),  # SmolLM2-135M: group of 3, not a power of two
    (16, 4, 128, 16, torch.float16),
]


@pytest.mark.parametrize("hq,hkv,d,bs,dtype", DECODE_CASES)
def test_decode(hq, hkv, d, bs, dtype):
    rng = random.Random(hq * 1000 + d + bs)
    ctx_lens = _contexts(6, rng, MAX_CTX)
    case = Case([(c - 1, 1) for c in ctx_lens], hq, hkv, d, bs, dtype, seed=rng.randint(0, 10**6))
    out = ta.paged_attention(case.q, case.k, case.v, case.cache, case.meta, case.scale)
    case.check_cache_written()
    assert out.shape == case.q.shape and out.dtype == dtype
    assert rel_err(out, case.reference()) < TOL[dtype]


@pytest.mark.parametrize("num_splits", [1, 2, 5, pytest.param(16, marks=SLOW)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_splits(num_splits, dtype):
    """Every split count gives the same answer, including splits that get no tiles of a short sequence."""
    ctx_lens = [1, 2, 70, MAX_CTX // 3, MAX_CTX]
    case = Case([(c - 1, 1) for c in ctx_lens], 16, 2, 128, 16, dtype, seed=num_splits)
    ta.write_kv_cache(case.k, case.v, case.cache, case.meta.slot_mapping)
    out = ta.decode_attention(case.q, case.cache, case.meta, case.scale, num_splits=num_splits)
    assert rel_err(out, case.reference()) < TOL[dtype]


def test_longest_first_ranks_sequences_by_context_length():
    """The decode kernel's launch order: longest context first, ties by sequence id, over several programs."""
    rng = random.Random(5)
    lens = [rng.choice([1, 1, 7, 300, rng.randint(1, 5000)]) for _ in range(2 * ta.ORDER_BLOCK + 13)]
    meta = Meta(None, None, torch.tensor(lens, dtype=torch.int32, device=DEVICE), None, 1, max(lens))
    order = ta.longest_first(meta)
    assert order.tolist() == sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    assert ta.longest_first(meta) is order  # the step's other layers reuse it


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_longest_first_launch_gives_the_same_bits(num_splits, monkeypatch):
    """Past one wave of programs the decode kernel takes sequences longest first: the same output bits as the
    launch in sequence order, and the reference's answer."""
    rng = random.Random(num_splits)
    hkv = 8
    batch = 4 * tbuf.sm_count(torch.device(DEVICE)) // hkv + 3  # more programs than one wave
    case = Case([(c - 1, 1) for c in _contexts(batch, rng, 48 if INTERPRET else 3000)], 16, hkv, 64, 16,
                torch.bfloat16, seed=7)
    assert ta._ordered(batch, hkv, torch.device(DEVICE))
    ta.write_kv_cache(case.k, case.v, case.cache, case.meta.slot_mapping)
    ordered = ta.decode_attention(case.q, case.cache, case.meta, case.scale, num_splits=num_splits)
    assert case.meta.seq_order is not None
    monkeypatch.setattr(ta, "_ordered", lambda *a: False)
    plain = ta.decode_attention(case.q, case.cache, case.meta, case.scale, num_splits=num_splits)
    assert torch.equal(ordered, plain)
    assert rel_err(ordered, case.reference()) < TOL[torch.bfloat16]


PREFILL_CASES = [  # (hq, hkv, head_dim, block_size, dtype)
    pytest.param(8, 8, 128, 16, torch.float32, marks=SLOW),
    pytest.param(32, 8, 128, 16, torch.float32, marks=SLOW),
    pytest.param(32, 4, 64, 32, torch.float32, marks=SLOW),
    (32, 8, 128, 16, torch.bfloat16),
    (9, 3, 64, 16, torch.bfloat16),
    (16, 2, 64, 32, torch.float16),
]


@pytest.mark.parametrize("hq,hkv,d,bs,dtype", PREFILL_CASES)
def test_chunked_prefill(hq, hkv, d, bs, dtype):
    """Mixed step: fresh prompts, later chunks of long prompts (earlier chunks read from the cache), decodes."""
    rng = random.Random(hq * 7 + d + bs)
    big = MAX_CTX // 2 if INTERPRET else 2048
    seqs = [
        (0, rng.randint(2, big // 4)),               # whole prompt in one step
        (rng.randint(1, big), rng.randint(1, 200)),  # a later chunk
        (rng.randint(1, MAX_CTX - 1), 1),            # a decode in the same step
        (0, 1),                                      # a one-token prompt
        (rng.randint(1, big), rng.randint(30, 90)),
        (0, 37),
    ]
    case = Case(seqs, hq, hkv, d, bs, dtype, seed=rng.randint(0, 10**6))
    out = ta.paged_attention(case.q, case.k, case.v, case.cache, case.meta, case.scale)
    case.check_cache_written()
    assert rel_err(out, case.reference()) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_step_splits_rows_between_the_decode_and_prefill_kernels(dtype, monkeypatch):
    """A mixed step as a mixed graph lays it out: one-token rows go to the decode kernel (split, as in decode steps),
    longer queries to the prefill kernel, and the layout's empty sequence slots after the step's own are read by
    neither (their query start is the token count, their block-table row the padding block)."""
    seqs = [(300, 1), (0, 23), (120, 1), (57, 9), (1, 1)]
    case = Case(seqs, 32, 8, 64, 16, dtype, seed=11)
    m, empty = case.meta, 3
    T = int(m.query_start_loc[-1])
    meta = Meta(m.slot_mapping, torch.cat([m.query_start_loc, m.query_start_loc.new_full((empty,), T)]),
                torch.cat([m.seq_lens, m.seq_lens.new_ones(empty)]),
                torch.cat([m.block_tables, m.block_tables.new_zeros(empty, m.block_tables.shape[1])]),
                m.max_query_len, m.max_seq_len)
    calls = []

    def recorded(name, real):
        def call(*args, **kwargs):
            calls.append((name, kwargs.get("single_only", kwargs.get("skip_single"))))
            return real(*args, **kwargs)
        return call

    for name in ("decode_attention", "prefill_attention"):
        monkeypatch.setattr(ta, name, recorded(name, getattr(ta, name)))
    monkeypatch.setattr(ta, "choose_num_splits", lambda *a: 3)  # the decode rows' contexts split as in decode steps
    out = ta.paged_attention(case.q, case.k, case.v, case.cache, meta, case.scale)
    assert calls == [("decode_attention", True), ("prefill_attention", True)]
    case.check_cache_written()
    assert rel_err(out, case.reference()) < TOL[dtype]
    # the one-token rows are the same bits as a decode step of those sequences alone gives them
    ones = [b for b, (_, q) in enumerate(seqs) if q == 1]
    rows = m.query_start_loc[ones].long()
    alone = ta.decode_attention(case.q[rows], case.cache, Meta(
        m.slot_mapping[rows], torch.arange(len(ones) + 1, dtype=torch.int32, device=DEVICE), m.seq_lens[ones],
        m.block_tables[ones], 1, m.max_seq_len), case.scale)
    assert torch.equal(out[rows], alone)


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=SLOW), torch.bfloat16])
def test_matches_torch_path(dtype):
    """Same inputs through backend.ops.torch.attention (the plain-torch path) and the Triton path: same answer."""
    from backend.ops.torch import attention as torch_attention

    rng = random.Random(3)
    seqs = [(0, 45), (rng.randint(1, 600), 70), (rng.randint(1, 900), 1), (0, 1)]
    case = Case(seqs, 32, 8, 128, 16, dtype, seed=3)
    m = case.meta
    meta = torch_attention.AttentionMetadata(m.slot_mapping, m.query_start_loc, m.seq_lens, m.block_tables,
                                             m.max_query_len, m.max_seq_len)
    ref = torch_attention.paged_attention(case.q, case.k, case.v, case.cache.clone(), meta, case.scale)
    out = ta.paged_attention(case.q, case.k, case.v, case.cache, meta, case.scale)
    assert rel_err(out, ref) < TOL[dtype]
    assert rel_err(out, case.reference()) < TOL[dtype]


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_cuda_graph(dtype):
    """Capture one decode step with static buffers, then replay it on two fresh batches (with padding rows)."""
    hq, hkv, d, bs, batch, bound = 32, 8, 128, 16, 12, 8192
    rng = random.Random(5)
    first = Case([(c - 1, 1) for c in _contexts(batch, rng, bound)], hq, hkv, d, bs, dtype, seed=1)
    nb_static = 1 + batch * (bound // bs + 1) + 8  # room for any case of this batch under the bound
    max_blocks = bound // bs + 2

    def staged(case, real):
        """Copy a case into static-shaped tensors; rows >= real are padding (seq_len 1, block 0)."""
        cache = torch.full((2, nb_static, bs, hkv, d), float("nan"), dtype=dtype, device=DEVICE)
        cache[:, : case.cache.shape[1]] = case.cache
        bt = torch.zeros(batch, max_blocks, dtype=torch.int32, device=DEVICE)
        bt[:real, : case.meta.block_tables.shape[1]] = case.meta.block_tables[:real]
        seq_lens = torch.ones(batch, dtype=torch.int32, device=DEVICE)
        seq_lens[:real] = case.meta.seq_lens[:real]
        slots = torch.arange(batch, dtype=torch.int64, device=DEVICE) % bs  # padding writes into block 0
        slots[:real] = case.meta.slot_mapping[:real]
        return cache, bt, seq_lens, slots

    cache, bt, seq_lens, slots = staged(first, batch)
    q, k, v = first.q.clone(), first.k.clone(), first.v.clone()
    meta = Meta(slots, torch.arange(batch + 1, dtype=torch.int32, device=DEVICE), seq_lens, bt, 1, bound)
    for _ in range(2):  # compile and warm up outside the capture
        ta.paged_attention(q, k, v, cache, meta, first.scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ta.paged_attention(q, k, v, cache, meta, first.scale)

    for seed, real in ((11, batch), (12, batch - 3)):
        ctxs = _contexts(real, random.Random(seed), bound)
        case = Case([(c - 1, 1) for c in ctxs], hq, hkv, d, bs, dtype, seed=seed)
        c2, bt2, sl2, slots2 = staged(case, real)
        cache.copy_(c2)
        bt.copy_(bt2)
        seq_lens.copy_(sl2)
        slots.copy_(slots2)
        q[:real].copy_(case.q)
        k[:real].copy_(case.k)
        v[:real].copy_(case.v)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out[:real], case.reference()) < TOL[dtype]


# ------------------------------------------------------------------------------------------------------
# layers
# ------------------------------------------------------------------------------------------------------
LAYER_DTYPES = [torch.float32, torch.bfloat16]


def _hf_rms_norm(x, w, eps):
    """HF LlamaRMSNorm in the input dtype: the exact semantics the kernel follows."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * y.to(x.dtype)


@pytest.mark.parametrize("dtype", LAYER_DTYPES)
@pytest.mark.parametrize("hidden", [576, 4096])
def test_rms_norm(dtype, hidden):
    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(37, hidden, generator=g) * 3).to(dtype).to(DEVICE)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(DEVICE)
    out = tly.rms_norm(x, w, 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    ref64 = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    assert rel_err(out, ref64) < TOL[dtype]
    if dtype == torch.float32 or EXACT_BF16:
        assert rel_err(out, _hf_rms_norm(x, w, 1e-5)) < (1e-6 if dtype == torch.float32 else 4e-3)


@pytest.mark.parametrize("dtype", LAYER_DTYPES)
@pytest.mark.parametrize("hidden", [576, 4096])
def test_add_rms_norm(dtype, hidden):
    g = torch.Generator().manual_seed(hidden + 1)
    x = torch.randn(3, 11, hidden, generator=g).to(dtype).to(DEVICE)
    r = torch.randn(3, 11, hidden, generator=g).to(dtype).to(DEVICE)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(DEVICE)
    normed, total = tly.add_rms_norm(x, r, w, 1e-6)
    assert normed.shape == x.shape and total.shape == x.shape
    if dtype == torch.float32 or EXACT_BF16:
        assert torch.equal(total, x + r)  # the sum is rounded exactly as torch rounds it
        assert rel_err(normed, _hf_rms_norm(x + r, w, 1e-6)) < (1e-6 if dtype == torch.float32 else 4e-3)
    s64 = x.double() + r.double()
    ref64 = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert rel_err(normed, ref64) < TOL[dtype]


def _cos_sin_cache(max_pos, d, base=10000.0):
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    f = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([f.cos(), f.sin()], dim=-1).float()  # (max_pos, d): [cos | sin]


def _rope_ref(x, pos, cache):
    """HF rotate_half style in float64."""
    d = x.shape[-1]
    cs = cache.double().cpu()[pos.cpu()]
    cos = torch.cat([cs[:, : d // 2]] * 2, -1)[:, None, :]
    sin = torch.cat([cs[:, d // 2:]] * 2, -1)[:, None, :]
    x = x.double().cpu()
    rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rot * sin


@pytest.mark.parametrize("dtype", LAYER_DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (9, 3, 64)])
def test_apply_rope(dtype, hq, hkv, d):
    g = torch.Generator().manual_seed(hq + d)
    T = 29
    qkv = torch.randn(T, (hq + 2 * hkv) * d, generator=g).to(dtype).to(DEVICE)
    q = qkv[:, : hq * d].view(T, hq, d)  # strided views of a fused qkv output, as the model passes them
    k = qkv[:, hq * d: (hq + hkv) * d].view(T, hkv, d)
    q0, k0 = q.clone(), k.clone()
    cache = _cos_sin_cache(8192, d).to(DEVICE)
    pos = torch.randint(0, 8192, (T,), generator=g).to(DEVICE)
    qo, ko = tly.apply_rope(q, k, pos, cache)
    assert torch.equal(q, q0) and torch.equal(k, k0)  # out of place
    assert rel_err(qo, _rope_ref(q, pos, cache)) < TOL[dtype]
    assert rel_err(ko, _rope_ref(k, pos, cache)) < TOL[dtype]


@pytest.mark.parametrize("dtype", LAYER_DTYPES)
@pytest.mark.parametrize("hq,hkv,d,bs", [(32, 8, 128, 16), (9, 3, 64, 32), (4, 4, 64, 16)])
def test_rope_write_kv(dtype, hq, hkv, d, bs):
    """One launch = apply_rope, then the rotated k and v into their slots; other slots untouched, slot -1 skipped."""
    g = torch.Generator().manual_seed(hq * d + bs)
    T, nb = 11, 9
    qkv = torch.randn(T, (hq + 2 * hkv) * d, generator=g).to(dtype).to(DEVICE)
    q = qkv[:, : hq * d].view(T, hq, d)
    k = qkv[:, hq * d: (hq + hkv) * d].view(T, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(T, hkv, d)
    cos_sin = _cos_sin_cache(4096, d).to(DEVICE)
    pos = torch.randint(0, 4096, (T,), generator=g).to(DEVICE)
    slots = torch.randperm(nb * bs, generator=g)[:T]
    slots[4] = -1
    cache = torch.full((2, nb, bs, hkv, d), float("nan"), dtype=dtype, device=DEVICE)
    q_rot = tly.rope_write_kv(q, k, v, pos, cos_sin, cache, slots.to(DEVICE))
    q_ref, k_ref = tly.apply_rope(q, k, pos, cos_sin)
    assert torch.equal(q_rot, q_ref)
    flat = cache.view(2, nb * bs, hkv, d).cpu()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat[0, slot], k_ref[t].cpu()) and torch.equal(flat[1, slot], v[t].cpu())
    written = slots[slots >= 0]
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[written] = False
    assert torch.isnan(flat[:, untouched].float()).all()


@pytest.mark.parametrize("dtype", LAYER_DTYPES)
def test_layers_match_torch_path(dtype):
    """backend.ops.torch.layers (the plain-torch path) and the Triton layers agree on the same inputs."""
    from backend.ops.torch import layers as torch_layers

    g = torch.Generator().manual_seed(7)
    T, hq, hkv, d, hidden, inter = 13, 9, 3, 64, 576, 1536
    x = torch.randn(T, hidden, generator=g).to(dtype).to(DEVICE)
    r = torch.randn(T, hidden, generator=g).to(dtype).to(DEVICE)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(DEVICE)
    q = torch.randn(T, hq, d, generator=g).to(dtype).to(DEVICE)
    k = torch.randn(T, hkv, d, generator=g).to(dtype).to(DEVICE)
    pos = torch.randint(0, 2048, (T,), generator=g).to(DEVICE)
    cache = _cos_sin_cache(2048, d).to(DEVICE)
    gu = torch.randn(T, 2 * inter, generator=g).to(dtype).to(DEVICE)
    tol = 1e-5 if dtype == torch.float32 else (8e-3 if EXACT_BF16 else 2e-2)
    assert rel_err(tly.rms_norm(x, w, 1e-5), torch_layers.rms_norm(x, w, 1e-5)) < tol
    for a_, b_ in zip(tly.add_rms_norm(x, r, w, 1e-5), torch_layers.add_rms_norm(x, r, w, 1e-5)):
        assert rel_err(a_, b_) < tol
    for a_, b_ in zip(tly.apply_rope(q, k, pos, cache), torch_layers.apply_rope(q, k, pos, cache)):
        assert rel_err(a_, b_) < tol
    assert rel_err(tly.silu_and_mul(gu), torch_layers.silu_and_mul(gu)) < tol


@pytest.mark.parametrize("dtype", LAYER_DTYPES)
@pytest.mark.parametrize("inter", [1536, 14336, 100])
def test_silu_and_mul(dtype, inter):
    g = torch.Generator().manual_seed(inter)
    x = torch.randn(2, 9, 2 * inter, generator=g).to(dtype).to(DEVICE)
    out = tly.silu_and_mul(x)
    assert out.shape == (2, 9, inter)
    xd = x.double()
    ref = torch.nn.functional.silu(xd[..., :inter]) * xd[..., inter:]
    assert rel_err(out, ref) < TOL[dtype]


# ------------------------------------------------------------------------------------------------------
# decode-sized GEMM (triton_linear)
# ------------------------------------------------------------------------------------------------------
LINEAR_CONFIGS = [None, tlin.LinearConfig(16, 64, 4, 2), tlin.LinearConfig(64, 128, 4, 3),
                  tlin.LinearConfig(128, 256, 8, 4), tlin.LinearConfig(16, 64, 4, 2, split_k=3),
                  tlin.LinearConfig(64, 128, 4, 3, split_k=4)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,n,k,bias", [(1, 96, 512, False), (5, 200, 576, True), (32, 256, 1024, False),
                                           (17, 48, 200, True), (64, 128, 256, True)])
@pytest.mark.parametrize("config", LINEAR_CONFIGS, ids=["auto", "n16", "n64", "n128", "n16_split3", "n64_split4"])
def test_linear(dtype, rows, n, k, bias, config):
    """Every output row and column written once and equal to x @ W.T + b (float64) within output rounding."""
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE) if bias else None
    out = tlin.linear(x, w, b, config=config)
    assert out.shape == (rows, n) and out.dtype == dtype
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    assert rel_err(out, ref) < 5e-3  # fp32 accumulation; one rounding of the output (bf16: 2^-9 relative)


def test_linear_strided_and_batched_rows():
    """Leading dims are kept, a strided x (a column slice of a wider buffer) is read correctly."""
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(2, 3, 700, generator=g).to(torch.bfloat16).to(DEVICE)
    x = wide[..., 100:612]  # (2, 3, 512), row stride 700
    w = (torch.randn(64, 512, generator=g) * 512 ** -0.5).to(torch.bfloat16).to(DEVICE)
    out = tlin.linear(x, w)
    assert out.shape == (2, 3, 64)
    assert rel_err(out, x.double() @ w.double().T) < 5e-3


def test_linear_falls_back_to_torch(monkeypatch):
    """fp32 and batches over MAX_ROWS rows go to F.linear (the kernel is never launched)."""
    def fail(*a, **k):
        raise AssertionError("kernel launched")

    monkeypatch.setattr(tbuf, "alloc", fail)
    w = torch.randn(32, 64, device=DEVICE)
    x = torch.randn(3, 64, device=DEVICE)
    assert torch.equal(tlin.linear(x, w), torch.nn.functional.linear(x, w))
    xb = torch.randn(tlin.MAX_ROWS + 1, 64, device=DEVICE).to(torch.bfloat16)
    wb = w.to(torch.bfloat16)
    assert torch.equal(tlin.linear(xb, wb), torch.nn.functional.linear(xb, wb))


def test_linear_choose_config_fills_the_gpu():
    """A program per SM at least where the matrix has the rows for it; K steps divide K when they can."""
    for n, k in [(6144, 4096), (4096, 14336), (28672, 4096), (128256, 4096), (4096, 4096)]:
        cfg = tlin.choose_config(n, k, 132)
        assert n // cfg.block_n >= 132 or cfg.block_n == 16
        assert k % cfg.block_k == 0
    assert tlin.choose_config(576, 576, 132) == tlin.LinearConfig(16, 64)


def test_tuned_linear_uses_the_table_only_on_its_gpu(monkeypatch):
    """Listed shapes on a 9.0 GPU launch the listed config; unlisted shapes and other GPUs go to cuBLAS."""
    launched = []
    monkeypatch.setattr(tlin, "linear", lambda x, w, b=None, out=None, config=None, pdl=False, park=False:
                        launched.append((config, park)) or "kernel")
    monkeypatch.setattr(tlin.torch_layers, "linear", lambda x, w, b=None, out=None: "cublas")
    x = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), shape=(32, 4096),
                              numel=lambda: 32 * 4096)
    listed = types.SimpleNamespace(shape=(6144, 4096))
    unlisted = types.SimpleNamespace(shape=(4096, 14336))
    monkeypatch.setattr(tlin, "_capability", lambda index: (9, 0))
    assert tlin.tuned_linear(x, listed) == "kernel" and launched == [(tlin.H200_CONFIGS[(6144, 4096, 32)], False)]
    assert tlin.tuned_linear(x, unlisted) == "cublas"
    # park: the parked table first (its shapes at 64 rows), the plain table and cuBLAS otherwise
    x64 = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), shape=(64, 2048),
                                numel=lambda: 64 * 2048)
    o_proj, qkv = types.SimpleNamespace(shape=(2048, 2048)), types.SimpleNamespace(shape=(3072, 2048))
    launched.clear()
    assert tlin.tuned_linear(x64, o_proj, park=True) == "kernel"
    assert tlin.tuned_linear(x64, o_proj) == "cublas"
    assert tlin.tuned_linear(x64, o_proj, torch.zeros(2048), park=True) == "cublas"  # bias: not parked
    assert tlin.tuned_linear(x64, qkv, park=True) == "kernel"
    down = types.SimpleNamespace(shape=(2048, 8192))
    x64_down = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), shape=(64, 8192),
                                     numel=lambda: 64 * 8192)
    assert tlin.tuned_linear(x64_down, down, park=True) == "kernel"
    assert launched == [(tlin.H200_PARKED_CONFIGS[(2048, 2048, 64)], True),
                        (tlin.H200_PARKED_CONFIGS[(3072, 2048, 64)], True),
                        (tlin.H200_PARKED_CONFIGS[(2048, 8192, 64)], True)]
    monkeypatch.setattr(tlin, "_capability", lambda index: (8, 0))
    assert tlin.tuned_linear(x, listed) == "cublas"
    assert tlin.tuned_linear(x64, o_proj, park=True) == "cublas"


def test_tuned_linear_silu_and_mul_fuses_only_listed_shapes(monkeypatch):
    """gate_up shapes in the gated table run the fused kernel with its config; a bias, a shape listed only in the
    GEMM table, an unlisted shape or another GPU run the tuned GEMM and the separate SiLU-and-mul."""
    calls = []
    monkeypatch.setattr(tlin, "linear_silu_and_mul", lambda x, w, b=None, config=None, pdl=False:
                        calls.append(("fused", config)) or "fused")
    monkeypatch.setattr(tlin, "tuned_linear", lambda x, w, b=None, out=None, pdl=False:
                        calls.append(("gemm", w.shape)) or "gemm")
    monkeypatch.setattr(tlin.triton_layers, "silu_and_mul", lambda y, pdl=False: f"silu({y})")
    monkeypatch.setattr(tlin, "_capability", lambda index: (9, 0))

    def rows(n, k):
        return types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), shape=(n, k), numel=lambda: n * k)

    gate_up = types.SimpleNamespace(shape=(16384, 2048))
    assert tlin.tuned_linear_silu_and_mul(rows(64, 2048), gate_up) == "fused"
    assert calls.pop() == ("fused", tlin.H200_GATED_CONFIGS[(16384, 2048, 64)])
    assert tlin.tuned_linear_silu_and_mul(rows(16, 2048), gate_up) == "fused"
    assert calls.pop() == ("fused", tlin.H200_GATED_CONFIGS[(16384, 2048, 16)])
    assert tlin.tuned_linear_silu_and_mul(rows(32, 2048), gate_up) == "fused"
    assert calls.pop() == ("fused", tlin.H200_GATED_CONFIGS[(16384, 2048, 32)])
    qkv_8b = types.SimpleNamespace(shape=(6144, 4096))
    assert tlin.tuned_linear_silu_and_mul(rows(16, 4096), qkv_8b) == "silu(gemm)"  # in the GEMM table only
    assert tlin.tuned_linear_silu_and_mul(rows(64, 2048), gate_up, torch.zeros(16384)) == "silu(gemm)"
    assert tlin.tuned_linear_silu_and_mul(rows(64, 4096), types.SimpleNamespace(shape=(999, 4096))) == "silu(gemm)"
    monkeypatch.setattr(tlin, "_capability", lambda index: (8, 0))
    assert tlin.tuned_linear_silu_and_mul(rows(64, 2048), gate_up) == "silu(gemm)"
    assert [c[0] for c in calls] == ["gemm"] * 4


@pytest.mark.parametrize("config", [None, tlin.LinearConfig(64, 128, 4, 3)], ids=["auto", "n64"])
@pytest.mark.parametrize("rows,bias", [(5, False), (64, True)])
def test_linear_into_out(config, rows, bias):
    """out= gets exactly what the kernel returns without it, in place, and rows past it stay untouched."""
    g = torch.Generator().manual_seed(rows)
    n, k = 320, 256
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(torch.bfloat16).to(DEVICE)
    b = torch.randn(n, generator=g).to(torch.bfloat16).to(DEVICE) if bias else None
    buf = torch.full((rows + 3, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    got = tlin.linear(x, w, b, config=config, out=buf[:rows])
    assert got.data_ptr() == buf.data_ptr()
    assert torch.equal(buf[:rows], tlin.linear(x, w, b, config=config))
    assert buf[rows:].isnan().all()
    with pytest.raises(ValueError, match="out must be"):
        tlin.linear(x, w, b, config=config, out=buf[: rows + 1])


def test_linear_into_out_falls_back_to_torch():
    """fp32 (no kernel) with out= runs the torch product into out."""
    x, w = torch.randn(3, 64, device=DEVICE), torch.randn(32, 64, device=DEVICE)
    out = torch.empty(3, 32, device=DEVICE)
    assert tlin.linear(x, w, out=out) is out
    assert torch.equal(out, torch.nn.functional.linear(x, w))


def _argmax_cases(dtype):
    """(name, logits) on the device: random rows, ties inside and across chunks, -inf rows, odd vocabularies."""
    g = torch.Generator().manual_seed(11)
    vocab = 20000 if INTERPRET else 128256
    cases = {}
    for rows, v in [(1, vocab), (3, 49152), (64, vocab), (2, 100), (2, targ.ARGMAX_CHUNK),
                    (2, targ.ARGMAX_CHUNK + 1)]:
        cases[f"random_{rows}x{v}"] = torch.randn(rows, v, generator=g).to(dtype)
    tied = torch.randn(4, vocab, generator=g).to(dtype)
    tied[0, [5, 9000, vocab - 1]] = 50.0  # the same maximum in three chunks: the first wins
    tied[1, [targ.ARGMAX_CHUNK - 1, targ.ARGMAX_CHUNK]] = 50.0  # across a chunk border
    tied[2, :] = 1.0  # a constant row: index 0
    tied[3, :] = float("-inf")  # every token banned: index 0, as torch
    cases["ties"] = tied
    inf = torch.randn(2, vocab, generator=g).to(dtype)
    inf[0, 777] = float("inf")
    inf[1, [3, vocab - 2]] = float("inf")
    cases["inf"] = inf
    return {name: t.to(DEVICE) for name, t in cases.items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_argmax_matches_torch(dtype):
    """Every case equals torch.argmax (first index of the maximum), written into a strided out."""
    for name, logits in _argmax_cases(dtype).items():
        rows = logits.shape[0]
        buf = torch.full((rows, 2), -7, dtype=torch.int64, device=DEVICE)
        got = targ.greedy_argmax(logits, buf[:, 0])
        assert torch.equal(buf[:, 0], logits.argmax(dim=-1)), name
        assert (buf[:, 1] == -7).all() and got.data_ptr() == buf.data_ptr(), name
        ref = torch.empty(rows, dtype=torch.int64, device=DEVICE)
        assert torch.equal(torch_layers.greedy_argmax(logits, ref), buf[:, 0]), name


def test_greedy_argmax_rejects_bad_shapes():
    """A 1-D logits or a wrong out buffer is a ValueError, not a silent wrong write."""
    logits = torch.zeros(4, 300, device=DEVICE)
    with pytest.raises(ValueError, match="logits must be"):
        targ.greedy_argmax(logits[0], torch.empty(1, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="out must be"):
        targ.greedy_argmax(logits, torch.empty(4, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="out must be"):
        targ.greedy_argmax(logits, torch.empty(5, dtype=torch.int64, device=DEVICE))


@pytest.mark.parametrize("split_k", [2, 5])
def test_linear_split_k_is_repeatable(split_k):
    """Split-K launches leave their counters at zero and sum the splits in a fixed order: launch after launch
    gives the same bits, also for K runs that leave a split empty (K = 192 in 64-steps over 5 splits)."""
    g = torch.Generator().manual_seed(split_k)
    x = torch.randn(9, 192, generator=g).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(80, 192, generator=g) * 192 ** -0.5).to(torch.bfloat16).to(DEVICE)
    cfg = tlin.LinearConfig(16, 64, 4, 2, split_k=split_k)
    first = tlin.linear(x, w, config=cfg)
    assert rel_err(first, x.double() @ w.double().T) < 5e-3
    for _ in range(3):
        assert torch.equal(tlin.linear(x, w, config=cfg), first)
    counters = tlin._split_counters(torch.device(DEVICE), 5)
    assert int(counters.abs().sum()) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_adds_partial_sums_in_split_order(dtype):
    """Partial sums given as x: add_rms_norm equals adding them in split order in fp32, rounding once to the
    GEMM's dtype, then the plain add_rms_norm."""
    g = torch.Generator().manual_seed(11)
    parts = torch.randn(3, 7, 384, generator=g).to(DEVICE)
    r = torch.randn(7, 384, generator=g).to(dtype).to(DEVICE)
    norm_w = (torch.rand(384, generator=g) + 0.5).to(dtype).to(DEVICE)
    summed = ((parts[0] + parts[1]) + parts[2]).to(dtype)
    got = tly.add_rms_norm(PartialSums(parts, dtype), r, norm_w, 1e-5)
    want = tly.add_rms_norm(summed, r, norm_w, 1e-5)
    for a, b in zip(got, want):
        assert a.shape == b.shape == (7, 384)
        if dtype == torch.float32 or EXACT_BF16:
            assert torch.equal(a, b)
        else:
            assert rel_err(a, b.double()) < 2e-2


@pytest.mark.parametrize("rows,split_k", [(5, 2), (64, 4)])
def test_parked_split_k_through_add_rms_norm_equals_the_summed_split_k(rows, split_k):
    """A parked split-K GEMM (partials left unsummed) fed to add_rms_norm gives the same bits as the GEMM that adds
    its partials itself fed to add_rms_norm: both add them in split order and round once."""
    g = torch.Generator().manual_seed(rows)
    hidden, k = 320, 512
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(hidden, k, generator=g) * k ** -0.5).to(torch.bfloat16).to(DEVICE)
    r = torch.randn(rows, hidden, generator=g).to(torch.bfloat16).to(DEVICE)
    norm_w = (torch.rand(hidden, generator=g) + 0.5).to(torch.bfloat16).to(DEVICE)
    cfg = tlin.LinearConfig(32, 64, 4, 2, split_k=split_k)
    parked = tlin.linear(x, w, config=cfg, park=True)
    assert isinstance(parked, PartialSums) and parked.parts.shape == (split_k, rows, hidden)
    assert parked.shape == (rows, hidden) and parked.dtype == torch.bfloat16
    summed = tlin.linear(x, w, config=cfg)
    for got, want in zip(tly.add_rms_norm(parked, r, norm_w, 1e-5), tly.add_rms_norm(summed, r, norm_w, 1e-5)):
        assert torch.equal(got, want)
    # nothing to park: no split, a bias, or an out buffer give y itself
    assert isinstance(tlin.linear(x, w, config=tlin.LinearConfig(32, 64), park=True), torch.Tensor)
    assert torch.equal(tlin.linear(x, w, torch.zeros(hidden, dtype=torch.bfloat16, device=DEVICE), config=cfg,
                                   park=True), summed)
    out = torch.empty(rows, hidden, dtype=torch.bfloat16, device=DEVICE)
    got = tlin.linear(x, w, out=out, config=cfg, park=True)
    assert got.data_ptr() == out.data_ptr() and torch.equal(out, summed)
    with pytest.raises(ValueError, match="do not match the residual"):
        tly.add_rms_norm(parked, r[:, :64], norm_w[:64], 1e-5)


def _qkv_views(y, t, hq, hkv, d):
    """q (T, Hq, D), k and v (T, Hkv, D) views of a fused qkv output, or of its partial sums."""
    q, k, v = y.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)


@pytest.mark.parametrize("dtype", LAYER_DTYPES)
def test_rope_write_kv_adds_partial_sums_in_split_order(dtype):
    """q, k and v given as views of one GEMM's partial sums: rope_write_kv writes the same q and cache bits as
    for the partials added in split order in fp32 and rounded once to the GEMM's dtype."""
    g = torch.Generator().manual_seed(12)
    t, hq, hkv, d, bs, nb = 6, 8, 2, 64, 16, 4
    parts = torch.randn(3, t, (hq + 2 * hkv) * d, generator=g).to(DEVICE)
    summed = ((parts[0] + parts[1]) + parts[2]).to(dtype)
    cos_sin = _cos_sin_cache(512, d).to(DEVICE)
    pos = torch.randint(0, 512, (t,), generator=g).to(DEVICE)
    slots = torch.randperm(nb * bs, generator=g)[:t].to(DEVICE)
    caches = [torch.full((2, nb, bs, hkv, d), float("nan"), dtype=dtype, device=DEVICE) for _ in range(2)]
    got = tly.rope_write_kv(*_qkv_views(PartialSums(parts, dtype), t, hq, hkv, d), pos, cos_sin, caches[0], slots)
    want = tly.rope_write_kv(*_qkv_views(summed, t, hq, hkv, d), pos, cos_sin, caches[1], slots)
    assert got.shape == (t, hq, d) and got.dtype == dtype
    if dtype == torch.float32 or EXACT_BF16:
        assert torch.equal(got, want)
        assert torch.equal(caches[0].nan_to_num(7.0), caches[1].nan_to_num(7.0))  # unwritten slots stay NaN
    else:
        assert rel_err(got, want.double()) < 2e-2
    q, k, v = _qkv_views(PartialSums(parts, dtype), t, hq, hkv, d)
    with pytest.raises(ValueError, match="all tensors or all views"):
        tly.rope_write_kv(q, k, summed[:, :hkv * d].view(t, hkv, d), pos, cos_sin, caches[0], slots)


ROPE_DECODE_CASES = [  # (hq, hkv, head_dim, block_size, dtype, num_splits)
    (32, 8, 64, 16, torch.bfloat16, 1),  # the 1B model's heads
    pytest.param(32, 8, 64, 16, torch.bfloat16, 3, marks=SLOW),
    pytest.param(32, 8, 128, 16, torch.bfloat16, 1, marks=SLOW),  # the 8B model's heads
    pytest.param(8, 8, 128, 32, torch.float32, 2, marks=SLOW),
    (9, 3, 64, 16, torch.float16, 4),  # a group of 3
    (4, 2, 96, 16, torch.float32, 2),  # a head_dim that is not a power of two
]


def rope_step_inputs(case, hq: int, hkv: int, d: int, dtype, seed: int, parked: bool):
    """A decode step's inputs for a rope + KV write kernel: q, k, v as views of a fresh qkv GEMM output (or of its
    parked partial sums), the rotary cache, and each sequence's new position."""
    t = case.q.shape[0]
    g = torch.Generator().manual_seed(seed)
    if parked:
        qkv = PartialSums(torch.randn(3, t, (hq + 2 * hkv) * d, generator=g).to(DEVICE), dtype)
    else:
        qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype).to(DEVICE)
    q, k, v = _qkv_views(qkv, t, hq, hkv, d)
    return q, k, v, _cos_sin_cache(MAX_CTX + 1, d).to(DEVICE), (case.meta.seq_lens - 1).long()


@pytest.mark.parametrize("parked", [False, True])
@pytest.mark.parametrize("hq,hkv,d,bs,dtype,num_splits", ROPE_DECODE_CASES)
def test_rope_decode_attention_equals_rope_write_kv_then_decode(hq, hkv, d, bs, dtype, num_splits, parked):
    """The fused kernel gives the bits of rope_write_kv followed by decode_attention: the same output and the same
    cache (the new K/V in their slots, nothing else written), whichever split holds the new token, also from a
    GEMM's partial sums."""
    rng = random.Random(hq + d + num_splits)
    ctx_lens = [1, 2, 17, 130] + _contexts(3, rng, MAX_CTX)
    case = Case([(c - 1, 1) for c in ctx_lens], hq, hkv, d, bs, dtype, seed=rng.randint(0, 10**6))
    t = case.q.shape[0]
    q, k, v, cos_sin, pos = rope_step_inputs(case, hq, hkv, d, dtype, num_splits, parked)
    caches = [case.cache.clone() for _ in range(2)]
    q_rot = tly.rope_write_kv(q, k, v, pos, cos_sin, caches[0], case.meta.slot_mapping)
    want = ta.decode_attention(q_rot, caches[0], case.meta, case.scale, num_splits=num_splits)
    got = ta.rope_decode_attention(q, k, v, pos, cos_sin, caches[1], case.meta, case.scale, num_splits=num_splits)
    assert got.shape == (t, hq, d) and got.dtype == dtype
    assert not torch.isnan(got).any()
    assert torch.equal(got, want)
    assert torch.equal(caches[1].nan_to_num(7.0), caches[0].nan_to_num(7.0))  # unwritten slots stay NaN


@pytest.mark.parametrize("parked", [False, True])
def test_rope_paged_attention_fuses_only_decode_steps_of_one_wave(monkeypatch, parked):
    """rope_paged_attention takes the fused kernel for decode steps whose programs fit one wave (here 8 SMs × 4
    programs = 32 ≥ sequences × 2 KV heads), and rope_write_kv + the decode or prefill kernel otherwise, with the
    same results as the two calls; also for q, k and v as views of a parked qkv GEMM's partial sums (which have
    no device of their own: the choice reads the cache's)."""
    hq, hkv, d, bs, dtype = 8, 2, 64, 16, torch.bfloat16
    g = torch.Generator().manual_seed(4)
    cos_sin = _cos_sin_cache(MAX_CTX + 1, d).to(DEVICE)
    fused = []
    original = ta.rope_decode_attention
    monkeypatch.setattr(ta, "rope_decode_attention", lambda *a, **kw: fused.append(a[0].shape[0]) or original(*a, **kw))
    monkeypatch.setattr(tbuf, "sm_count", lambda device: 8)
    for seqs in ([(40, 1), (3, 1)], [(0, 20), (30, 1), (5, 7)], [(i, 1) for i in range(16)],
                 [(i, 1) for i in range(17)]):
        case = Case(seqs, hq, hkv, d, bs, dtype, seed=len(seqs))
        t = case.q.shape[0]
        if parked:
            qkv = PartialSums(torch.randn(2, t, (hq + 2 * hkv) * d, generator=g).to(DEVICE), dtype)
        else:
            qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype).to(DEVICE)
        q, k, v = _qkv_views(qkv, t, hq, hkv, d)
        pos = torch.cat([torch.arange(c, c + n) for c, n in seqs]).to(DEVICE)
        caches = [case.cache.clone() for _ in range(2)]
        q_rot = tly.rope_write_kv(q, k, v, pos, cos_sin, caches[0], case.meta.slot_mapping)
        want = ta.paged_attention(q_rot, None, None, caches[0], case.meta, case.scale)
        got = ta.rope_paged_attention(q, k, v, pos, cos_sin, caches[1], case.meta, case.scale)
        assert torch.equal(got, want)
        assert torch.equal(caches[1].nan_to_num(7.0), caches[0].nan_to_num(7.0))
    assert fused == [2, 16]  # the decode steps of up to 16 sequences


@pytest.mark.parametrize("rows,split_k", [(5, 2), (64, 2)])
def test_parked_qkv_through_rope_write_kv_equals_the_summed_split_k(rows, split_k):
    """The qkv GEMM parked and fed to rope_write_kv writes the same q and cache bits as the split-K GEMM that adds
    its partials itself."""
    g = torch.Generator().manual_seed(rows + 1)
    hq, hkv, d, bs, nb, k = 8, 2, 64, 16, 8, 512
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn((hq + 2 * hkv) * d, k, generator=g) * k ** -0.5).to(torch.bfloat16).to(DEVICE)
    cos_sin = _cos_sin_cache(512, d).to(DEVICE)
    pos = torch.randint(0, 512, (rows,), generator=g).to(DEVICE)
    slots = torch.randperm(nb * bs, generator=g)[:rows].to(DEVICE)
    cfg = tlin.LinearConfig(32, 64, 4, 2, split_k=split_k)
    caches = [torch.zeros((2, nb, bs, hkv, d), dtype=torch.bfloat16, device=DEVICE) for _ in range(2)]
    parked = tlin.linear(x, w, config=cfg, park=True)
    assert isinstance(parked, PartialSums)
    got = tly.rope_write_kv(*_qkv_views(parked, rows, hq, hkv, d), pos, cos_sin, caches[0], slots)
    want = tly.rope_write_kv(*_qkv_views(tlin.linear(x, w, config=cfg), rows, hq, hkv, d), pos, cos_sin,
                             caches[1], slots)
    assert torch.equal(got, want) and torch.equal(caches[0], caches[1])


@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("k,block_k", [(512, 128), (200, 64)])
def test_linear_silu_and_mul_equals_the_gemm_then_silu_and_mul(rows, k, block_k):
    """One launch for gate_up and SiLU-and-mul: the same bits as the GEMM (at the same tile of W rows per half)
    followed by triton_layers.silu_and_mul, also for a K that the K step does not divide and an I that the tile
    does not divide."""
    g = torch.Generator().manual_seed(rows * k)
    inter = 200
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(2 * inter, k, generator=g) * k ** -0.5).to(torch.bfloat16).to(DEVICE)
    fused = tlin.linear_silu_and_mul(x, w, config=tlin.LinearConfig(64, block_k, 4, 3))  # 32 rows of each half
    unfused = tly.silu_and_mul(tlin.linear(x, w, config=tlin.LinearConfig(32, block_k, 4, 3)))
    assert fused.shape == (rows, inter)
    if EXACT_BF16 and not INTERPRET:
        assert torch.equal(fused, unfused)
    else:  # the interpreter's dot is numpy's matmul, whose summation order may differ between tile widths on a CPU
        assert rel_err(fused, unfused) < 1e-2
    xd, wd = x.double(), w.double()
    ref = torch.nn.functional.silu(xd @ wd[:inter].T) * (xd @ wd[inter:].T)
    assert rel_err(fused, ref) < 1e-2
    # a bias, a K split or too many rows take the GEMM and the separate kernel
    bias = torch.randn(2 * inter, generator=g).to(torch.bfloat16).to(DEVICE)
    assert torch.equal(tlin.linear_silu_and_mul(x, w, bias, config=tlin.LinearConfig(32, block_k, 4, 3)),
                       tly.silu_and_mul(tlin.linear(x, w, bias, config=tlin.LinearConfig(32, block_k, 4, 3))))
    split = tlin.LinearConfig(32, block_k, 4, 3, split_k=2)
    assert torch.equal(tlin.linear_silu_and_mul(x, w, config=split), tly.silu_and_mul(tlin.linear(x, w, config=split)))


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs need a GPU")
def test_linear_split_k_in_a_cuda_graph():
    """Captured after a warm-up call (which allocates the counters), replays compute fresh inputs correctly."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(32, 2048, generator=g).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(512, 2048, generator=g) * 2048 ** -0.5).to(torch.bfloat16).to(DEVICE)
    cfg = tlin.LinearConfig(32, 128, 4, 4, split_k=4)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        tlin.linear(x, w, config=cfg)
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = tlin.linear(x, w, config=cfg)
    for seed in (6, 7):
        x.copy_(torch.randn(32, 2048, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, x.double() @ w.double().T) < 5e-3


@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="programmatic dependent launch needs compute capability 9.0")
def test_dependent_launch_chain_in_a_cuda_graph_equals_plain_launches():
    """A decode layer's kernels, each reading the one before, launched as programmatic dependents inside one
    captured graph: every output equals the plain launches' bits, replay after replay with new inputs. A kernel
    that read before its wait would see the previous replay's values."""
    torch.manual_seed(0)
    case = Case([(300, 1), (40, 1), (900, 1), (1, 1)], 8, 2, 64, 16, torch.bfloat16, seed=3)
    hidden, inter = 8 * 64, 384
    w_qkv = (torch.randn((8 + 4) * 64, hidden, device=DEVICE) * hidden ** -0.5).to(torch.bfloat16)
    w_o = (torch.randn(hidden, hidden, device=DEVICE) * hidden ** -0.5).to(torch.bfloat16)
    w_gu = (torch.randn(2 * inter, hidden, device=DEVICE) * hidden ** -0.5).to(torch.bfloat16)
    w_down = (torch.randn(hidden, inter, device=DEVICE) * inter ** -0.5).to(torch.bfloat16)
    norm_w = torch.rand(hidden, device=DEVICE).to(torch.bfloat16) + 0.5
    cos_sin = torch.randn(2048, 64, device=DEVICE)
    cfg_split = tlin.LinearConfig(16, 64, 4, 3, split_k=3)
    positions = case.meta.seq_lens.long() - 1
    h0 = torch.randn(4, hidden, device=DEVICE).to(torch.bfloat16)
    r0 = torch.randn(4, hidden, device=DEVICE).to(torch.bfloat16)

    def layer(pdl):
        x, res = tly.add_rms_norm(h0, r0, norm_w, 1e-5, pdl=pdl)
        qkv = tlin.linear(x, w_qkv, config=cfg_split, pdl=pdl, park=True)  # partials for rope_write_kv
        q, k, v = qkv.split([8 * 64, 2 * 64, 2 * 64], dim=-1)
        q = tly.rope_write_kv(q.view(4, 8, 64), k.view(4, 2, 64), v.view(4, 2, 64), positions, cos_sin,
                              case.cache, case.meta.slot_mapping, pdl=pdl)
        attn = ta.decode_attention(q, case.cache, case.meta, 0.125, num_splits=3, pdl=pdl)
        h = tlin.linear(attn.reshape(4, -1), w_o, config=cfg_split, pdl=pdl, park=True)  # partials for the norm
        x, res = tly.add_rms_norm(h, res, norm_w, 1e-5, pdl=pdl)
        act = tlin.linear_silu_and_mul(x, w_gu, config=tlin.LinearConfig(64, 128, 4, 3), pdl=pdl)
        out = tlin.linear(act, w_down, config=cfg_split, pdl=pdl)
        best = torch.empty(4, dtype=torch.int64, device=DEVICE)
        targ.greedy_argmax(out, best, pdl=pdl)
        return out, res, best

    def capture(pdl):
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            layer(pdl)  # compile and allocate the split-K counters outside the capture
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            outs = layer(pdl)
        return graph, outs

    plain, plain_outs = capture(False)
    dependent, dependent_outs = capture(True)
    cache_start = case.cache.clone()
    for seed in range(4):
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        h0.copy_(torch.randn(h0.shape, generator=gen, device=DEVICE))
        r0.copy_(torch.randn(r0.shape, generator=gen, device=DEVICE))
        results = []
        for graph, outs in ((plain, plain_outs), (dependent, dependent_outs)):
            case.cache.copy_(cache_start)
            graph.replay()
            torch.cuda.synchronize()
            results.append([o.clone() for o in outs] + [case.cache.clone()])
        for a, b in zip(*results):
            assert torch.equal(_bits(a), _bits(b))  # bits: the cache's unused slots hold NaN


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's raw bits, so NaN equals NaN."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(ints[t.element_size()]) if t.is_floating_point() else t
