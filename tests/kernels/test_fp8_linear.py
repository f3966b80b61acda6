"""GEMMs with FP8 (e4m3) weights (backend/ops/triton/fp8_linear.py) against float64 references of the dequantized
math: y = x @ (q * s).T + b, with s per output channel (N,) or per 128 x 128 block.

Tolerances are norm-wise, ‖out − ref‖ / ‖ref‖:
- decode kernel, 5e-3: W is converted to x's dtype exactly and the scales are applied to fp32 sums, so the only
  errors are fp32 summation order (~1e-6) and the one rounding of y to bf16 (2^-9 relative per element, a few
  1e-3 in the norm), the bf16 decode GEMM's bound in test_kernels.py.
- gate_up with SiLU-and-mul, 1e-2: gate and up are rounded to bf16 before the activation (as the bf16 kernel and
  the unfused path do), then y once more.
- prefill (x quantized to e4m3 per row or per 128-column group), 5e-3 against the float64 product of the same
  quantized x (its scales and values are checked bit for bit separately), and 5e-2 against the unquantized x: e4m3
  keeps 3 mantissa bits, a value's rounding error is up to 2^-4 of it, ~2e-2 in y's norm on random data.
Every buffer the kernels allocate is filled with NaN first (the `buffers.alloc` hook; 0x7F for e4m3), so an
unwritten element shows up.

Without CUDA the kernels run under Triton's interpreter (tests/conftest.py), whose e4m3 conversions
tests/triton_interpreter.py mends; torch's CPU build has a row-wise torch._scaled_mm, so the per-channel prefill
path runs here as well. With CUDA everything is compiled; the tests marked gpu need it.
"""
from __future__ import annotations

import os
import types

import pytest
import torch

pytestmark = pytest.mark.kernels

import triton  # noqa: E402,F401  (a test requirement: the interpreter runs these kernels without CUDA)

from backend.ops import fp8, get_ops  # noqa: E402
from backend.ops.partial_sums import PartialSums  # noqa: E402
from backend.ops.torch import layers as torch_layers  # noqa: E402
from backend.ops.triton import buffers as tbuf  # noqa: E402
from backend.ops.triton import fp8_linear as f8  # noqa: E402
from backend.ops.triton import layers as tly  # noqa: E402
from backend.ops.triton import linear as tlin  # noqa: E402
from backend.ops.tuning import LinearConfig, TuningTables  # noqa: E402
from tests.kernels.test_kernels import _poison, rel_err  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
SLOW = pytest.mark.interpreter_slow
DECODE_TOL, GATED_TOL, PREFILL_TOL, QUANTIZED_X_TOL = 5e-3, 1e-2, 5e-3, 5e-2
LAYOUTS = ["channel", "block"]


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(tbuf, "alloc", _poison)


def _weight(n: int, k: int, layout: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random (n, k) weight quantized in `layout`, on the device: (q e4m3, scale float32). Rows of different
    magnitudes, so that per-row and per-block scales differ from one another."""
    w = torch.randn(n, k, generator=g) * k ** -0.5 * (0.25 + torch.rand(n, 1, generator=g) * 4)
    q, s = (fp8.quantize_per_block if layout == "block" else fp8.quantize_per_channel)(w)
    return q.to(DEVICE), s.to(DEVICE)


def _dequantized(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """q * s in float64 (on q's device): the weight the FP8 kernels multiply by, exactly."""
    return q.double() * fp8.expand_scale(s, tuple(q.shape)).double()


def _reference(x, q, s, b=None) -> torch.Tensor:
    ref = x.double() @ _dequantized(q, s).T
    return ref + b.double() if b is not None else ref


# ------------------------------------------------------------------------------------------------------
# decode kernel (≤ FP8_MAX_ROWS rows)
# ------------------------------------------------------------------------------------------------------
DECODE_CONFIGS = [None, LinearConfig(16, 64, 4, 2), LinearConfig(64, 128, 4, 3), LinearConfig(16, 64, 4, 2, split_k=3),
                  LinearConfig(64, 128, 4, 3, split_k=4)]
DECODE_IDS = ["auto", "n16", "n64", "n16_split3", "n64_split4"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows,n,k,bias", [(1, 96, 512, False), (5, 200, 576, True), (17, 48, 200, True),
                                           (64, 256, 384, False)])
@pytest.mark.parametrize("config", DECODE_CONFIGS, ids=DECODE_IDS)
def test_fp8_linear(layout, rows, n, k, bias, config):
    """Every output element written once and equal to x @ (q * s).T + b (float64) within output rounding; also
    for N and K that the tiles do not divide (200 x 576, 48 x 200), where block scales have partial blocks."""
    g = torch.Generator().manual_seed(rows * 1000 + n)
    q, s = _weight(n, k, layout, g)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16).to(DEVICE)
    b = torch.randn(n, generator=g).to(torch.bfloat16).to(DEVICE) if bias else None
    out = tlin.linear(x, q, b, config=config, scale=s)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    assert rel_err(out, _reference(x, q, s, b)) < DECODE_TOL


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows,n,k,bias", [(1, 96, 512, False), (17, 200, 576, True), (64, 48, 200, True)])
@pytest.mark.parametrize("config", DECODE_CONFIGS, ids=DECODE_IDS)
def test_fp8_decode_with_quantized_x(layout, rows, n, k, bias, config):
    """quantize_x: x quantized as the prefill path quantizes it, then FP8 x FP8 in the decode kernel (serial and
    parked K splits alike): equal to the float64 product of the quantized x within output rounding."""
    g = torch.Generator().manual_seed(rows * 1000 + n + 1)
    q, s = _weight(n, k, layout, g)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16).to(DEVICE)
    b = torch.randn(n, generator=g).to(torch.bfloat16).to(DEVICE) if bias else None
    out = f8.decode_linear(x, q, s, b, config=config, quantize_x=True)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    ref = _quantized_x_reference(x, q, s, layout, b)
    assert rel_err(out, ref) < PREFILL_TOL
    assert rel_err(out, _reference(x, q, s, b)) < QUANTIZED_X_TOL
    if config is not None and config.split_k > 1 and not bias:
        parked = f8.decode_linear(x, q, s, config=config, park=True, quantize_x=True)
        assert rel_err(parked.parts.sum(0), ref) < PREFILL_TOL
    # the same W as [gate; up] (n is even), SiLU-and-mul in the epilogue; quantize_x asked by the config this time
    gate_up, inter = _quantized_x_reference(x, q, s, layout), n // 2
    fused = f8.linear_silu_and_mul(x, q, s, config=LinearConfig(64, 64, 4, 2, quantize_x=True))
    ref = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    assert rel_err(fused, ref) < GATED_TOL


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_linear_fp16_strided_and_batched_rows(layout):
    """fp16 x, leading dims kept, a strided x (a column slice of a wider buffer) read correctly."""
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(2, 3, 700, generator=g).to(torch.float16).to(DEVICE)
    x = wide[..., 100:612]  # (2, 3, 512), row stride 700
    q, s = _weight(160, 512, layout, g)
    out = tlin.linear(x, q, scale=s)
    assert out.shape == (2, 3, 160) and out.dtype == torch.float16
    assert rel_err(out, _reference(x.reshape(6, 512), q, s).view(2, 3, 160)) < DECODE_TOL


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows,bias", [(5, False), (64, True)])
def test_fp8_linear_into_out(layout, rows, bias):
    """out= gets exactly what the kernel returns without it, in place; rows past it stay untouched."""
    g = torch.Generator().manual_seed(rows)
    n, k = 320, 256
    q, s = _weight(n, k, layout, g)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16).to(DEVICE)
    b = torch.randn(n, generator=g).to(torch.bfloat16).to(DEVICE) if bias else None
    cfg = LinearConfig(64, 128, 4, 3)
    buf = torch.full((rows + 3, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    got = tlin.linear(x, q, b, out=buf[:rows], config=cfg, scale=s)
    assert got.data_ptr() == buf.data_ptr()
    assert torch.equal(buf[:rows], tlin.linear(x, q, b, config=cfg, scale=s))
    assert buf[rows:].isnan().all()
    with pytest.raises(ValueError, match="out must be"):
        tlin.linear(x, q, b, out=buf[: rows + 1], config=cfg, scale=s)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("split_k", [2, 5])
def test_fp8_linear_serial_split_k_is_repeatable(layout, split_k):
    """Serial split-K sums the splits in a fixed order and leaves its counters at zero: the same bits launch after
    launch, also where a split gets no K step (K = 192 in 64-steps over 5 splits)."""
    g = torch.Generator().manual_seed(split_k)
    q, s = _weight(80, 192, layout, g)
    x = torch.randn(9, 192, generator=g).to(torch.bfloat16).to(DEVICE)
    cfg = LinearConfig(16, 64, 4, 2, split_k=split_k)
    first = tlin.linear(x, q, config=cfg, scale=s)
    assert rel_err(first, _reference(x, q, s)) < DECODE_TOL
    for _ in range(2):
        assert torch.equal(tlin.linear(x, q, config=cfg, scale=s), first)
    assert int(tlin._split_counters(torch.device(DEVICE), 5).abs().sum()) == 0


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows,split_k", [(5, 2), pytest.param(64, 4, marks=SLOW)])
def test_fp8_parked_split_k_through_add_rms_norm_equals_the_summed_split_k(layout, rows, split_k):
    """Parked partials (PartialSums) fed to add_rms_norm give the bits of the split-K GEMM that adds them itself:
    both add the scaled partials in split order and round once. A bias or out= gives y instead."""
    g = torch.Generator().manual_seed(rows + split_k)
    hidden, k = 320, 512
    q, s = _weight(hidden, k, layout, g)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16).to(DEVICE)
    r = torch.randn(rows, hidden, generator=g).to(torch.bfloat16).to(DEVICE)
    norm_w = (torch.rand(hidden, generator=g) + 0.5).to(torch.bfloat16).to(DEVICE)
    cfg = LinearConfig(32, 64, 4, 2, split_k=split_k)
    parked = tlin.linear(x, q, config=cfg, park=True, scale=s)
    assert isinstance(parked, PartialSums) and parked.parts.shape == (split_k, rows, hidden)
    assert parked.dtype == torch.bfloat16
    summed = tlin.linear(x, q, config=cfg, scale=s)
    assert rel_err(summed, _reference(x, q, s)) < DECODE_TOL
    for got, want in zip(tly.add_rms_norm(parked, r, norm_w, 1e-5), tly.add_rms_norm(summed, r, norm_w, 1e-5)):
        assert torch.equal(got, want)
    zero_bias = torch.zeros(hidden, dtype=torch.bfloat16, device=DEVICE)
    assert torch.equal(tlin.linear(x, q, zero_bias, config=cfg, park=True, scale=s), summed)
    out = torch.empty(rows, hidden, dtype=torch.bfloat16, device=DEVICE)
    assert tlin.linear(x, q, out=out, config=cfg, park=True, scale=s).data_ptr() == out.data_ptr()
    assert torch.equal(out, summed)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows", [1, 5, pytest.param(64, marks=SLOW)])
@pytest.mark.parametrize("k,block_k", [(512, 128), (200, 64)])
def test_fp8_linear_silu_and_mul(layout, rows, k, block_k):
    """gate_up with SiLU-and-mul in one launch: equal to the float64 SiLU(gate) * up of the dequantized halves,
    each with its own scales (I = 200: with block scales the up half starts inside a scale block), and to the GEMM
    (at the same tile of W rows per half) followed by triton_layers.silu_and_mul."""
    g = torch.Generator().manual_seed(rows * k + len(layout))
    inter = 200
    q, s = _weight(2 * inter, k, layout, g)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16).to(DEVICE)
    fused = tlin.linear_silu_and_mul(x, q, config=LinearConfig(64, block_k, 4, 3), scale=s)  # 32 rows of each half
    unfused = tly.silu_and_mul(tlin.linear(x, q, config=LinearConfig(32, block_k, 4, 3), scale=s))
    assert fused.shape == (rows, inter)
    if INTERPRET:  # numpy's matmul may sum in another order for another tile width on a CPU
        assert rel_err(fused, unfused) < GATED_TOL
    else:
        assert torch.equal(fused, unfused)
    gate_up = _reference(x, q, s)
    ref = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    assert rel_err(fused, ref) < GATED_TOL
    # the default (rule) shape, a bias and a K split: the GEMM and the separate kernel where the fused kernel can't
    assert rel_err(tlin.linear_silu_and_mul(x, q, scale=s), ref) < GATED_TOL
    bias = torch.randn(2 * inter, generator=g).to(torch.bfloat16).to(DEVICE)
    cfg = LinearConfig(32, block_k, 4, 3)
    assert torch.equal(tlin.linear_silu_and_mul(x, q, bias, config=cfg, scale=s),
                       tly.silu_and_mul(tlin.linear(x, q, bias, config=cfg, scale=s)))
    split = LinearConfig(32, block_k, 4, 3, split_k=2)
    assert torch.equal(tlin.linear_silu_and_mul(x, q, config=split, scale=s),
                       tly.silu_and_mul(tlin.linear(x, q, config=split, scale=s)))


def test_fp8_linear_rejects_what_it_cannot_compute():
    """Scales of neither layout, a K step wider than a scale block, or a weight that is not e4m3: ValueError."""
    g = torch.Generator().manual_seed(1)
    q, s = _weight(96, 256, "block", g)
    x = torch.randn(4, 256, generator=g).to(torch.bfloat16).to(DEVICE)
    with pytest.raises(ValueError, match="block scale"):
        tlin.linear(x, q, scale=s[:, :1])
    with pytest.raises(ValueError, match="per-channel scale"):
        tlin.linear(x, q, scale=torch.ones(95, device=DEVICE))
    with pytest.raises(ValueError, match="divides 128"):
        tlin.linear(x, q, config=LinearConfig(32, 256), scale=s)
    with pytest.raises(ValueError, match="2-D"):
        tlin.linear(x, q.to(torch.bfloat16), scale=s)


def test_fp8_linear_falls_back_to_the_torch_reference(monkeypatch):
    """fp32 x goes to the torch reference (dequantize, then F.linear) without a launch: the same bits."""
    def fail(*a, **k):
        raise AssertionError("kernel launched")

    g = torch.Generator().manual_seed(2)
    q, s = _weight(64, 128, "channel", g)
    x = torch.randn(3, 128, generator=g, device="cpu").to(DEVICE)
    monkeypatch.setattr(tbuf, "alloc", fail)
    assert torch.equal(tlin.linear(x, q, scale=s), torch_layers.linear(x, q, scale=s))


def test_choose_config_rules():
    """The rule: 64 W rows per program, fewer where that leaves SMs idle; K steps of 128 (64 where K needs), K cut in
    4 for per-channel scales where K holds whole runs; the gated rule 128 rows of both halves, at least 32."""
    for n, k in [(6144, 4096), (4096, 14336), (28672, 4096), (10240, 8192), (8192, 28672)]:
        for block in (False, True):
            cfg = f8.choose_config(n, k, 132, block)
            assert (n // cfg.block_n) * cfg.split_k >= 132 or cfg.block_n == 16
            assert k % (cfg.block_k * cfg.split_k) == 0 and (cfg.split_k == 1 or not block)
            assert k % cfg.block_k == 0 and (not block or cfg.block_k <= 128)
    assert f8.choose_config(4096, 4096, 132) == LinearConfig(64, 128, split_k=4)
    assert f8.choose_config(576, 200, 132, True) == LinearConfig(16, 64)
    assert f8.choose_gated_config(28672, 4096, 132) == LinearConfig(128, 128)
    assert f8.choose_gated_config(57344, 8192, 132, True) == LinearConfig(128, 128)
    assert f8.choose_gated_config(400, 512, 132).block_n == 32


# ------------------------------------------------------------------------------------------------------
# activation quantization and the prefill GEMMs (> FP8_MAX_ROWS rows)
# ------------------------------------------------------------------------------------------------------
def _quantize_groups_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8.quantize_per_channel of every 128-column group of every row (K padded with zeros to whole groups)."""
    m, k = x.shape
    groups = -(-k // 128)
    padded = torch.zeros(m, groups * 128, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    q, s = fp8.quantize_per_channel(padded.view(m * groups, 128))
    return q.view(m, groups * 128)[:, :k], s.view(m, groups)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view(torch.uint8) if t.dtype == fp8.FP8_DTYPE else t.cpu().view(torch.int32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [4096, 300])
def test_quantize_rows_equals_the_torch_quantization(dtype, k):
    """Bit for bit: per row, the e4m3 values and scales of fp8.quantize_per_channel (amax / 448, x / scale,
    clamped, rounded to nearest even); per 128-column group, the same of every group. One row holds 448 (scale
    exactly 1) and the midpoints between neighbouring e4m3 values, so ties to even are checked; one row is zero
    (the smallest scale). A strided x is read correctly."""
    g = torch.Generator().manual_seed(k)
    wide = torch.randn(7, k + 50, generator=g) * torch.logspace(-3, 3, 7).view(7, 1)
    x = wide[:, 20:20 + k]
    values = torch.arange(127, dtype=torch.uint8).view(fp8.FP8_DTYPE).double()
    mids = ((values[:-1] + values[1:]) / 2).float()
    ties = torch.cat([mids, -mids]).repeat(k // 252 + 1)[:k]
    ties[::128] = 448.0  # every group of this row holds 448: scale 1, so x / scale is x
    x[5] = ties
    x[6] = 0.0
    x = x.to(dtype).to(DEVICE)
    q, s = f8.quantize_rows(x)
    want_q, want_s = fp8.quantize_per_channel(x)
    assert s.shape == (7, 1) and torch.equal(_bits(s[:, 0]), _bits(want_s))
    assert torch.equal(_bits(q), _bits(want_q))
    qg, sg = f8.quantize_rows(x, 128)
    want_qg, want_sg = _quantize_groups_reference(x)
    assert sg.shape == (7, -(-k // 128)) and torch.equal(_bits(sg), _bits(want_sg))
    assert torch.equal(_bits(qg), _bits(want_qg))


def _quantized_x_reference(x, q, s, layout, b=None) -> torch.Tensor:
    """The float64 product of x quantized as the prefill path quantizes it (per row or per 128-column group)."""
    if layout == "block":
        xq, xs = _quantize_groups_reference(x)
        xd = xq.double() * xs.double().repeat_interleave(128, 1)[:, : x.shape[1]]
    else:
        xq, xs = fp8.quantize_per_channel(x)
        xd = xq.double() * xs.double()[:, None]
    ref = xd @ _dequantized(q, s).T
    return ref + b.double() if b is not None else ref


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows,n,k,bias", [(65, 96, 512, False), (130, 208, 384, True), (100, 64, 200, True)])
def test_fp8_prefill_linear(layout, rows, n, k, bias):
    """More than FP8_MAX_ROWS rows: x quantized on the fly, then FP8 x FP8 (_scaled_mm per channel, the Triton
    block-scaled GEMM per block). Equal to the float64 product of the quantized x within output rounding, and to
    the unquantized one within the activation quantization's error. K = 200 (not 16-aligned) takes the torch
    reference with per-channel scales and the block GEMM's partial last K step with block scales."""
    g = torch.Generator().manual_seed(rows + n)
    q, s = _weight(n, k, layout, g)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16).to(DEVICE)
    b = torch.randn(n, generator=g).to(torch.bfloat16).to(DEVICE) if bias else None
    out = tlin.linear(x, q, b, scale=s)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    reference_path = layout == "channel" and k % 16
    assert rel_err(out, _reference(x, q, s, b)) < (DECODE_TOL if reference_path else QUANTIZED_X_TOL)
    if not reference_path:
        assert rel_err(out, _quantized_x_reference(x, q, s, layout, b)) < PREFILL_TOL
    buf = torch.full((rows + 2, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    assert tlin.linear(x, q, b, out=buf[:rows], scale=s).data_ptr() == buf.data_ptr()
    assert torch.equal(buf[:rows], out) and buf[rows:].isnan().all()


@pytest.mark.parametrize("config", [f8.GemmConfig(16, 32, 4, 2), f8.GemmConfig(64, 128, 4, 3)],
                         ids=["m16n32", "m64n128"])
def test_block_scaled_gemm_tiles(config):
    """The block-scaled GEMM over tiles that divide neither M nor N, with a grouped program order."""
    g = torch.Generator().manual_seed(config.block_m)
    q, s = _weight(200, 384, "block", g)
    x = torch.randn(70, 384, generator=g).to(torch.bfloat16).to(DEVICE)
    out = f8.block_scaled_linear(x, q, s, config=config)
    assert rel_err(out, _quantized_x_reference(x, q, s, "block")) < PREFILL_TOL


@pytest.mark.parametrize("rows", [4, 80])
def test_cublas_backend_runs_scaled_mm_for_every_row_count(rows, monkeypatch):
    """linear_backend "cublas" with an FP8 weight: x quantized per row and torch._scaled_mm, decode rows too;
    block scales take the torch reference."""
    calls = []
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    g = torch.Generator().manual_seed(rows)
    q, s = _weight(96, 256, "channel", g)
    x = torch.randn(rows, 256, generator=g).to(torch.bfloat16).to(DEVICE)
    ops = get_ops("triton", "cublas")
    out = ops.linear(x, q, scale=s)
    assert calls == [(rows, 256)]
    assert rel_err(out, _quantized_x_reference(x, q, s, "channel")) < PREFILL_TOL
    qb, sb = _weight(96, 256, "block", g)
    assert torch.equal(ops.linear(x, qb, scale=sb), torch_layers.linear(x, qb, scale=sb)) and len(calls) == 1


# ------------------------------------------------------------------------------------------------------
# dispatch
# ------------------------------------------------------------------------------------------------------
def _fake(rows, k, device=("cuda", 0)):
    return types.SimpleNamespace(is_cuda=True, device=torch.device(*device), shape=(rows, k), numel=lambda: rows * k,
                                 dim=lambda: 2)


def test_tuned_fp8_linear_uses_its_own_tables_then_the_rule(monkeypatch):
    """On a 9.0 GPU a shape in the FP8 table of its scale layout launches the listed config (the parked table
    first where the caller adds partials); an unlisted one the rule's (config None), not cuBLAS; other GPUs the
    rule; more rows than FP8_MAX_ROWS the prefill path (linear with no config)."""
    launched = []
    monkeypatch.setattr(f8, "linear", lambda x, w, s, b=None, out=None, config=None, pdl=False, park=False:
                        launched.append((config, park)) or "kernel")
    monkeypatch.setattr(f8, "_is_block", lambda w, s: s == "block")
    plain, parked = LinearConfig(64, 256, 4, 4), LinearConfig(64, 128, 4, 4, split_k=2)
    tables = {"channel": TuningTables({(4096, 4096, 32): plain}, {(4096, 4096, 32): parked}, {}),
              "block": TuningTables({}, {}, {})}
    monkeypatch.setattr(f8, "H200_FP8_TABLES", tables)
    monkeypatch.setattr(tlin, "_capability", lambda index: (9, 0))
    w = types.SimpleNamespace(shape=(4096, 4096))
    x = _fake(32, 4096)
    assert tlin.tuned_linear(x, w, scale="channel") == "kernel" and launched.pop() == (plain, False)
    assert tlin.tuned_linear(x, w, park=True, scale="channel") == "kernel" and launched.pop() == (parked, True)
    assert tlin.tuned_linear(x, w, torch.zeros(4096), park=True, scale="channel") == "kernel"
    assert launched.pop() == (plain, False)  # a bias: not parked
    assert tlin.tuned_linear(x, w, scale="block") == "kernel" and launched.pop() == (None, False)
    assert tlin.tuned_linear(_fake(16, 4096), w, scale="channel") == "kernel" and launched.pop() == (None, False)
    assert tlin.tuned_linear(_fake(200, 4096), w, scale="channel") == "kernel" and launched.pop() == (None, False)
    monkeypatch.setattr(tlin, "_capability", lambda index: (8, 0))
    assert tlin.tuned_linear(x, w, scale="channel") == "kernel" and launched.pop() == (None, False)


def test_tuned_fp8_linear_silu_and_mul_dispatch(monkeypatch):
    """A gated entry fuses with its config; a shape only the plain table lists runs that GEMM and the separate
    SiLU-and-mul; an unlisted shape fuses with the rule (config None); a bias goes the unfused way."""
    calls = []
    monkeypatch.setattr(f8, "linear_silu_and_mul", lambda x, w, s, b=None, config=None, pdl=False:
                        calls.append(("fused", config)) or "fused")
    monkeypatch.setattr(f8, "tuned_linear", lambda x, w, s, b=None, out=None, pdl=False, park=False:
                        calls.append(("gemm", None)) or "gemm")
    monkeypatch.setattr(f8.triton_layers, "silu_and_mul", lambda y, pdl=False: f"silu({y})")
    monkeypatch.setattr(f8, "_is_block", lambda w, s: False)
    gated = LinearConfig(128, 256, 4, 4)
    tables = {"channel": TuningTables({(6144, 4096, 16): LinearConfig(64, 256)}, {}, {(28672, 4096, 16): gated}),
              "block": TuningTables({}, {}, {})}
    monkeypatch.setattr(f8, "H200_FP8_TABLES", tables)
    monkeypatch.setattr(tlin, "_capability", lambda index: (9, 0))
    x = _fake(16, 4096)
    assert tlin.tuned_linear_silu_and_mul(x, types.SimpleNamespace(shape=(28672, 4096)), scale="s") == "fused"
    assert calls.pop() == ("fused", gated)
    assert tlin.tuned_linear_silu_and_mul(x, types.SimpleNamespace(shape=(6144, 4096)), scale="s") == "silu(gemm)"
    assert calls.pop() == ("gemm", None)
    assert tlin.tuned_linear_silu_and_mul(x, types.SimpleNamespace(shape=(999, 4096)), scale="s") == "fused"
    assert calls.pop() == ("fused", None)


@pytest.mark.parametrize("linear_backend", ["auto", "triton", "cublas"])
def test_ops_take_fp8_weights_on_every_linear_backend(linear_backend):
    """get_ops("triton", ...) passes scale= through every binding (also with dependent launch), decode rows."""
    g = torch.Generator().manual_seed(9)
    q, s = _weight(256, 256, "channel", g)
    x = torch.randn(8, 256, generator=g).to(torch.bfloat16).to(DEVICE)
    tol = PREFILL_TOL if linear_backend == "cublas" else DECODE_TOL
    want = _quantized_x_reference(x, q, s, "channel") if linear_backend == "cublas" else _reference(x, q, s)
    gate_up = want.view(8, 2, 128)
    act = torch.nn.functional.silu(gate_up[:, 0]) * gate_up[:, 1]
    for pdl in (False, True):
        ops = get_ops("triton", linear_backend, dependent_launch=pdl)
        assert rel_err(ops.linear(x, q, scale=s), want) < tol
        parked = ops.linear_parked(x, q, scale=s)
        assert rel_err(parked.parts.sum(0) if isinstance(parked, PartialSums) else parked, want) < tol
        assert rel_err(ops.linear_silu_and_mul(x, q, scale=s), act) < GATED_TOL


# ------------------------------------------------------------------------------------------------------
# GPU only
# ------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_decode_and_prefill_in_a_cuda_graph(layout):
    """Captured after a warm-up call (split-K counters, compiled kernels), the decode kernel (split-K, dependent
    launch) and the prefill path (quantization + _scaled_mm or the block GEMM) replay fresh inputs correctly."""
    g = torch.Generator().manual_seed(5)
    q, s = _weight(512, 2048, layout, g)
    x_dec = torch.randn(32, 2048, generator=g).to(torch.bfloat16).to(DEVICE)
    x_pre = torch.randn(300, 2048, generator=g).to(torch.bfloat16).to(DEVICE)
    cfg = LinearConfig(32, 128, 4, 4, split_k=4)

    def step():
        return tlin.linear(x_dec, q, config=cfg, pdl=True, scale=s), tlin.linear(x_pre, q, scale=s)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        dec, pre = step()
    for seed in (6, 7):
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        x_dec.copy_(torch.randn(x_dec.shape, generator=gen, device=DEVICE))
        x_pre.copy_(torch.randn(x_pre.shape, generator=gen, device=DEVICE))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(dec, _reference(x_dec, q, s)) < DECODE_TOL
        assert rel_err(pre, _quantized_x_reference(x_pre, q, s, layout)) < PREFILL_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
def test_fp8_kernels_at_model_sizes(layout, n, k):
    """Llama-3-8B's qkv and down shapes at 1, 64 and 2048 rows, against the float64 references: of x itself where
    the decode kernel widens W, of x quantized per row where the tuning table's config multiplies FP8 by FP8 (and
    in prefill)."""
    g = torch.Generator().manual_seed(n)
    q, s = _weight(n, k, layout, g)
    tables = f8.tables_for(q.device, layout == "block")
    for rows in (1, 64, 2048):
        x = torch.randn(rows, k, generator=g).to(torch.bfloat16).to(DEVICE)
        out = tlin.tuned_linear(x, q, scale=s)
        listed = tables.plain.get((n, k, tlin._block_m(rows))) if tables is not None else None
        if rows <= f8.FP8_MAX_ROWS and not (listed is not None and listed.quantize_x):
            assert rel_err(out, _reference(x, q, s)) < DECODE_TOL
        else:
            assert rel_err(out, _quantized_x_reference(x, q, s, layout)) < PREFILL_TOL
