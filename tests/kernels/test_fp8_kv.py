"""The Triton kernels over an FP8 (e4m3) KV cache: written bits and attention read back.

- Writes (write_kv_cache, rope_write_kv, the fused rope_decode_attention) store exactly the bits of the torch
  reference, backend/ops/fp8.py's quantize_kv (x / scale in float32, saturated at ±448, rounded to nearest even).
- Reads (the decode kernel with and without splits, the fused rope decode, the prefill kernel of a mixed step) are
  held to a float64 attention over the dequantized cache (what the cache holds, times its scale), with the
  tolerances of tests/kernels/test_kernels.py: the kernels convert e4m3 tiles to q's dtype (exact) and fold the
  scales into the softmax scale and the output, so only the usual rounding of a flash kernel remains.
Scales other than 1 (not powers of two, and small enough that some values saturate) are covered throughout.

Without CUDA these run under Triton's interpreter, whose e4m3 conversions tests/triton_interpreter.py mends; the
first test holds them (and on the GPU, the hardware's) to torch's own conversions.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

pytestmark = pytest.mark.kernels

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from backend.ops import fp8  # noqa: E402
from backend.ops.partial_sums import PartialSums  # noqa: E402
from backend.ops.torch import attention as torch_attention  # noqa: E402
from backend.ops.triton import attention as ta  # noqa: E402
from backend.ops.triton import buffers as tbuf  # noqa: E402
from backend.ops.triton import layers as tly  # noqa: E402
from tests.kernels.test_kernels import (Case, _contexts, _cos_sin_cache, _poison, _qkv_views,  # noqa: E402
                                        rel_err, rope_step_inputs)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
MAX_CTX = 300 if INTERPRET else 8192
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}  # as test_kernels.py, which says why
SLOW = pytest.mark.interpreter_slow
# [k_scale, v_scale]: 1; scales that are not powers of two; scales that saturate values past about 2.7 (K) and
# 3.4 (V) of the unit-normal inputs at ±448
SCALES = [(1.0, 1.0), (0.37, 1.9), (0.006, 0.0075)]


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    """Every buffer the kernels allocate starts as NaN, so an unwritten element shows (as in test_kernels.py)."""
    monkeypatch.setattr(tbuf, "alloc", _poison)


def _kv_scale(scales) -> torch.Tensor:
    return torch.tensor(scales, dtype=torch.float32, device=DEVICE)  # (2,) [k_scale, v_scale]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).cpu()


def fp8_case(seqs, hq, hkv, d, bs, dtype, seed, scales) -> Case:
    """test_kernels.Case with its cache quantized to e4m3 by kv_scale (NaN slots stay NaN: 0x7F)."""
    case = Case(seqs, hq, hkv, d, bs, dtype, seed)
    case.kv_scale = _kv_scale(scales)
    case.cache = torch.stack([fp8.quantize_kv(case.cache[i], case.kv_scale[i]) for i in range(2)])
    return case


def cache_reference(q: torch.Tensor, cache: torch.Tensor, meta, kv_scale: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 causal attention of q (T, Hq, D) over what the FP8 cache holds for each sequence, times its scale."""
    _, _, bs, hkv, d = cache.shape
    ks, vs = (float(s) for s in kv_scale.cpu())
    grp = q.shape[1] // hkv
    qsl, lens, tables = meta.query_start_loc.tolist(), meta.seq_lens.tolist(), meta.block_tables.cpu()
    out = torch.full(q.shape, float("nan"), dtype=torch.float64)
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        slots = (tables[b, pos // bs].long() * bs + pos % bs).to(cache.device)
        k = cache[0].view(-1, hkv, d)[slots].double().cpu() * ks  # (L, Hkv, D)
        v = cache[1].view(-1, hkv, d)[slots].double().cpu() * vs
        k, v = k.repeat_interleave(grp, dim=1), v.repeat_interleave(grp, dim=1)  # (L, Hq, D)
        qb = q[qsl[b]: qsl[b + 1]].double().cpu()  # (Tq, Hq, D)
        s = torch.einsum("qhd,khd->hqk", qb, k) * scale
        qpos = torch.arange(n - qb.shape[0], n)[:, None]
        s = s.masked_fill(pos[None, :] > qpos, float("-inf"))
        out[qsl[b]: qsl[b + 1]] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
    return out


def assert_same_e4m3(got: torch.Tensor, want: torch.Tensor) -> None:
    """The same e4m3 bits, NaN aside: a NaN only has to be a NaN (torch on the CPU keeps its sign, the GPU's
    conversion and the interpreter's write 0x7F)."""
    nan = torch.isnan(want.float()).cpu()
    assert torch.equal(torch.isnan(got.float()).cpu(), nan)
    assert torch.equal(_bits(got)[~nan], _bits(want)[~nan])


def assert_written(case: Case) -> None:
    """The step's new K/V sit in their slots as quantize_kv's bits."""
    flat = case.cache.view(2, -1, case.hkv, case.d)[:, case.meta.slot_mapping]
    assert_same_e4m3(flat[0], fp8.quantize_kv(case.k, case.kv_scale[0]))
    assert_same_e4m3(flat[1], fp8.quantize_kv(case.v, case.kv_scale[1]))


# ------------------------------------------------------------------------------------------------------
# e4m3 conversions and the write kernels
# ------------------------------------------------------------------------------------------------------
@triton.jit
def _e4m3_to_f32_kernel(src_ptr, dst_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs).to(tl.float32))


def test_e4m3_conversions_match_torch():
    """Every e4m3 bit pattern widens to torch's float32 value (NaN: 0x7F, 0xFF), and write_kv_cache rounds float32
    values to torch's bits: ties to even, subnormals, values past 448 saturated, NaN kept (as a NaN: its sign is
    the platform's)."""
    every = torch.arange(256, dtype=torch.uint8).view(fp8.FP8_DTYPE).to(DEVICE)
    wide = torch.empty(256, dtype=torch.float32, device=DEVICE)
    _e4m3_to_f32_kernel[(1,)](every, wide, N=256)
    assert torch.equal(wide.cpu().nan_to_num(7.0), every.float().cpu().nan_to_num(7.0))

    grid = every.float()[torch.isfinite(every.float())].sort().values  # the 254 finite values
    mids = (grid[1:] + grid[:-1]) / 2  # ties between neighbours
    edge = torch.tensor([448.0, 449.0, 464.0, 480.0, 1e6, -1e6, float("inf"), float("-inf"), float("nan"),
                         2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -11, -0.0], device=DEVICE)
    values = torch.cat([grid, mids, mids * (1 + 2 ** -20), mids * (1 - 2 ** -20), edge,
                        torch.randn(1024, device=DEVICE) * 100])
    d = 128  # a token's row of 128 values: few programs under the interpreter
    values = torch.cat([values, values.new_zeros(-values.shape[0] % d)])
    t = values.shape[0] // d
    k = values.view(t, 1, d)  # (T, Hkv 1, D)
    cache = torch.zeros(2, t, 1, 1, d, dtype=fp8.FP8_DTYPE, device=DEVICE)
    ta.write_kv_cache(k, -k, cache, torch.arange(t, device=DEVICE), kv_scale=_kv_scale((1.0, 1.0)))
    assert_same_e4m3(cache[0].view(t, 1, d), fp8.quantize_kv(k, torch.tensor(1.0)))
    assert_same_e4m3(cache[1].view(t, 1, d), fp8.quantize_kv(-k, torch.tensor(1.0)))


@pytest.mark.parametrize("scales", SCALES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_stores_quantize_kv_bits(dtype, scales):
    """write_kv_cache into an FP8 cache: quantize_kv's bits at each slot, every other slot untouched, slot -1
    skipped."""
    g = torch.Generator().manual_seed(3)
    t, hkv, d, bs, nb = 13, 3, 64, 16, 5
    k = torch.randn(t, hkv, d, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(t, hkv, d, generator=g).to(dtype).to(DEVICE)
    slots = torch.randperm(nb * bs, generator=g)[:t]
    slots[5] = -1
    cache = torch.full((2, nb, bs, hkv, d), float("nan"), dtype=fp8.FP8_DTYPE, device=DEVICE)
    kv_scale = _kv_scale(scales)
    ta.write_kv_cache(k, v, cache, slots.to(DEVICE), kv_scale=kv_scale)
    flat = cache.view(2, nb * bs, hkv, d)
    keep = slots >= 0
    assert torch.equal(_bits(flat[0, slots[keep]]), _bits(fp8.quantize_kv(k[keep], kv_scale[0])))
    assert torch.equal(_bits(flat[1, slots[keep]]), _bits(fp8.quantize_kv(v[keep], kv_scale[1])))
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert torch.isnan(flat[:, untouched].float()).all()


@pytest.mark.parametrize("parked", [False, True])
@pytest.mark.parametrize("scales", SCALES[1:])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_write_kv_stores_quantize_kv_bits(dtype, scales, parked):
    """rope_write_kv into an FP8 cache: the rotated q as for a cache in q's dtype; the cache holds quantize_kv of
    the rotated k (rounded to q's dtype first, as apply_rope returns it) and of v, also from a GEMM's partial
    sums (added up and rounded once before quantizing)."""
    g = torch.Generator().manual_seed(5)
    t, hq, hkv, d, bs, nb = 7, 8, 2, 64, 16, 4
    if parked:
        parts = torch.randn(3, t, (hq + 2 * hkv) * d, generator=g).to(DEVICE)
        qkv, summed = PartialSums(parts, dtype), ((parts[0] + parts[1]) + parts[2]).to(dtype)
    else:
        qkv = summed = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype).to(DEVICE)
    cos_sin = _cos_sin_cache(512, d).to(DEVICE)
    pos = torch.randint(0, 512, (t,), generator=g).to(DEVICE)
    slots = torch.randperm(nb * bs, generator=g)[:t].to(DEVICE)
    cache = torch.full((2, nb, bs, hkv, d), float("nan"), dtype=fp8.FP8_DTYPE, device=DEVICE)
    kv_scale = _kv_scale(scales)
    q_rot = tly.rope_write_kv(*_qkv_views(qkv, t, hq, hkv, d), pos, cos_sin, cache, slots, kv_scale=kv_scale)
    q, k, v = _qkv_views(summed, t, hq, hkv, d)
    q_ref, k_ref = tly.apply_rope(q, k, pos, cos_sin)
    assert q_rot.dtype == dtype and torch.equal(q_rot, q_ref)
    flat = cache.view(2, nb * bs, hkv, d)[:, slots]
    assert torch.equal(_bits(flat[0]), _bits(fp8.quantize_kv(k_ref, kv_scale[0])))
    assert torch.equal(_bits(flat[1]), _bits(fp8.quantize_kv(v, kv_scale[1])))


def test_fp8_cache_needs_its_scale_and_a_model_dtype_cache_ignores_one():
    """An FP8 cache without kv_scale is refused; a cache in the model's dtype ignores a kv_scale (as the torch path
    does): the same bits as without one."""
    case = Case([(20, 1), (5, 1)], 4, 2, 64, 16, torch.bfloat16, seed=2)
    with pytest.raises(ValueError, match="needs its kv_scale"):
        ta.write_kv_cache(case.k, case.v, case.cache.to(fp8.FP8_DTYPE), case.meta.slot_mapping)
    caches = [case.cache.clone() for _ in range(2)]
    plain = ta.paged_attention(case.q, case.k, case.v, caches[0], case.meta, case.scale)
    given = ta.paged_attention(case.q, case.k, case.v, caches[1], case.meta, case.scale,
                               kv_scale=_kv_scale((0.5, 3.0)))
    assert torch.equal(plain, given) and torch.equal(caches[0].nan_to_num(7.0), caches[1].nan_to_num(7.0))


# ------------------------------------------------------------------------------------------------------
# attention over an FP8 cache
# ------------------------------------------------------------------------------------------------------
DECODE_CASES = [  # (hq, hkv, head_dim, block_size, dtype, num_splits)
    (8, 2, 64, 16, torch.bfloat16, 1),
    (8, 2, 64, 16, torch.bfloat16, 3),
    (9, 3, 64, 16, torch.float16, 2),  # a group of 3
    (4, 2, 64, 32, torch.float32, 2),  # fp32 model, e4m3 cache: IEEE fp32 dots
    pytest.param(32, 8, 128, 16, torch.bfloat16, 4, marks=SLOW),
]


@pytest.mark.parametrize("scales", SCALES)
@pytest.mark.parametrize("hq,hkv,d,bs,dtype,num_splits", DECODE_CASES)
def test_decode_over_fp8_cache(hq, hkv, d, bs, dtype, num_splits, scales):
    """write_kv_cache then the decode kernel (splits and the reduce, or one split writing the output itself) over an
    FP8 cache: the float64 attention over the dequantized cache."""
    rng = random.Random(hq + d + num_splits)
    ctx_lens = [1, 2, 70] + _contexts(3, rng, MAX_CTX)
    case = fp8_case([(c - 1, 1) for c in ctx_lens], hq, hkv, d, bs, dtype, rng.randint(0, 10**6), scales)
    ta.write_kv_cache(case.k, case.v, case.cache, case.meta.slot_mapping, kv_scale=case.kv_scale)
    assert_written(case)
    out = ta.decode_attention(case.q, case.cache, case.meta, case.scale, num_splits=num_splits,
                              kv_scale=case.kv_scale)
    assert out.shape == case.q.shape and out.dtype == dtype
    assert rel_err(out, cache_reference(case.q, case.cache, case.meta, case.kv_scale, case.scale)) < TOL[dtype]


@pytest.mark.parametrize("parked", [False, True])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("scales", SCALES[1:])
def test_rope_decode_over_fp8_cache(scales, num_splits, parked):
    """The fused rope + KV write + decode kernel over an FP8 cache gives the bits of rope_write_kv then
    decode_attention (output and cache, whichever split writes the new token), and the float64 attention over the
    dequantized cache."""
    hq, hkv, d, bs, dtype = 8, 2, 64, 16, torch.bfloat16
    rng = random.Random(num_splits)
    ctx_lens = [1, 2, 17, 130] + _contexts(2, rng, MAX_CTX)
    case = fp8_case([(c - 1, 1) for c in ctx_lens], hq, hkv, d, bs, dtype, rng.randint(0, 10**6), scales)
    q, k, v, cos_sin, pos = rope_step_inputs(case, hq, hkv, d, dtype, num_splits, parked)
    caches = [case.cache.clone() for _ in range(2)]
    q_rot = tly.rope_write_kv(q, k, v, pos, cos_sin, caches[0], case.meta.slot_mapping, kv_scale=case.kv_scale)
    want = ta.decode_attention(q_rot, caches[0], case.meta, case.scale, num_splits=num_splits,
                               kv_scale=case.kv_scale)
    got = ta.rope_decode_attention(q, k, v, pos, cos_sin, caches[1], case.meta, case.scale, num_splits=num_splits,
                                   kv_scale=case.kv_scale)
    assert got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(_bits(caches[1]), _bits(caches[0]))  # NaN slots compare as their bits: still unwritten
    assert rel_err(got, cache_reference(q_rot, caches[1], case.meta, case.kv_scale, case.scale)) < TOL[dtype]


MIXED_CASES = [  # (hq, hkv, head_dim, block_size, dtype)
    (8, 2, 64, 16, torch.bfloat16),
    (9, 3, 64, 16, torch.float16),
    pytest.param(4, 2, 64, 16, torch.float32, marks=SLOW),
]


@pytest.mark.parametrize("scales", SCALES)
@pytest.mark.parametrize("hq,hkv,d,bs,dtype", MIXED_CASES)
def test_mixed_step_over_fp8_cache(hq, hkv, d, bs, dtype, scales, monkeypatch):
    """paged_attention of a mixed step over an FP8 cache (fresh prompts, later chunks reading earlier ones from the
    cache, one-token rows in the decode kernel with splits): quantize_kv's bits written, and the float64 attention
    over the dequantized cache."""
    monkeypatch.setattr(ta, "choose_num_splits", lambda *a: 3)
    seqs = [(0, 37), (150, 20), (MAX_CTX - 1, 1), (0, 1), (60, 9), (5, 1)]
    case = fp8_case(seqs, hq, hkv, d, bs, dtype, 17, scales)
    out = ta.paged_attention(case.q, case.k, case.v, case.cache, case.meta, case.scale, kv_scale=case.kv_scale)
    assert_written(case)
    assert rel_err(out, cache_reference(case.q, case.cache, case.meta, case.kv_scale, case.scale)) < TOL[dtype]


@pytest.mark.parametrize("scales", SCALES[1:])
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=SLOW), torch.bfloat16])
def test_matches_torch_path_over_fp8_cache(dtype, scales):
    """The same mixed step through the torch path (backend/ops/torch/attention.py, the reference) and the Triton
    path, each on its own copy of an FP8 cache: the same cache bits, the same answer within the tolerance (the torch
    path rounds the dequantized K/V to q's dtype, the kernels fold the scales in instead)."""
    rng = random.Random(3)
    seqs = [(0, 45), (rng.randint(1, 200), 30), (rng.randint(1, MAX_CTX - 1), 1), (0, 1)]
    case = fp8_case(seqs, 8, 2, 64, 16, dtype, 3, scales)
    m = case.meta
    meta = torch_attention.AttentionMetadata(m.slot_mapping, m.query_start_loc, m.seq_lens, m.block_tables,
                                             m.max_query_len, m.max_seq_len)
    ref_cache = case.cache.clone()
    ref = torch_attention.paged_attention(case.q, case.k, case.v, ref_cache, meta, case.scale, kv_scale=case.kv_scale)
    out = ta.paged_attention(case.q, case.k, case.v, case.cache, meta, case.scale, kv_scale=case.kv_scale)
    assert torch.equal(_bits(case.cache), _bits(ref_cache))
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_fp8_decode_cuda_graph_reads_the_scale_on_the_device():
    """A captured FP8 decode step (the fused rope kernel, and write_kv_cache + the split decode kernel) reads
    kv_scale from the device at replay: new scales copied into the same tensor give the bits of an eager launch
    with them."""
    hq, hkv, d = 32, 8, 128
    case = fp8_case([(c - 1, 1) for c in (5, 900, 3000, 64)], hq, hkv, d, 16, torch.bfloat16, 8, (1.0, 1.0))
    kv_scale, t = case.kv_scale, case.q.shape[0]
    cos_sin = _cos_sin_cache(4096, d).to(DEVICE)
    pos = (case.meta.seq_lens - 1).long()
    q, k, v = _qkv_views(torch.randn(t, (hq + 2 * hkv) * d, device=DEVICE).to(torch.bfloat16), t, hq, hkv, d)
    start = case.cache.clone()
    caches = [start.clone(), start.clone()]

    def step(scale_tensor):
        fused = ta.rope_paged_attention(q, k, v, pos, cos_sin, caches[0], case.meta, case.scale,
                                        kv_scale=scale_tensor)
        split = ta.paged_attention(case.q, case.k, case.v, caches[1], case.meta, case.scale,
                                   kv_scale=scale_tensor)
        return fused, split

    for _ in range(2):  # compile outside the capture
        step(kv_scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(kv_scale)
    for scales in ((0.37, 1.9), (0.02, 0.05)):
        kv_scale.copy_(_kv_scale(scales))
        for c in caches:
            c.copy_(start)
        graph.replay()
        replayed = [o.clone() for o in outs] + [c.clone() for c in caches]
        for c in caches:
            c.copy_(start)
        eager = [*step(_kv_scale(scales)), *caches]
        torch.cuda.synchronize()
        for a, b in zip(replayed, eager):
            assert torch.equal(_bits(a.contiguous()), _bits(b.contiguous()))
