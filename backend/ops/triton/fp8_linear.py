"""GEMMs with FP8 (e4m3) weights for CUDA in the Triton language: y = x @ (q * s).T (+ b), q the e4m3 weight (N, K)
and s its float32 scales (backend/ops/fp8.py: (N,) per output channel, or (ceil(N/128), ceil(K/128)) per block).

Decode (≤ FP8_MAX_ROWS rows, `_fp8_skinny_kernel`): the bf16 decode GEMM's shape (triton/linear.py: a program per
slice of W's rows over the whole K range, optional split-K summed serially or parked, optional gate_up with
SiLU-and-mul in the epilogue). The step is memory-bound, so W is streamed as e4m3 (half the bytes of bf16), in one
of two ways, chosen per shape by the tuning tables (tuning/h200_fp8.py; the rule takes the first):
- W widened: each tile is converted to x's dtype in registers (exact: every e4m3 value is a bf16 / fp16 value) and
  multiplied on the tensor cores with fp32 accumulation; x is not quantized, so the product is that of x and the
  exactly dequantized weight, up to fp32 summation order;
- FP8 x FP8 (a config's quantize_x): x is quantized per row first (`quantize_rows`, one small launch), and W and x
  go to the FP8 MMAs as loaded; x's scale joins W's. On an H100 this streamed the 8B's q/k/v, o and gate_up weights
  1.2-2.3x faster (no conversion, half the x bytes), at the numerics of the prefill path below.
Per-channel scales multiply the fp32 accumulator once, in the epilogue; block scales multiply each K step's partial
product (a K step lies inside one 128-column scale block), as they must.

Prefill (more rows): FP8 × FP8 on the tensor cores, x quantized on the fly to e4m3 with dynamic scales
(`quantize_rows`: amax / 448 per row, or per 128-column group of a row for block-scaled weights).
- per-channel weights: torch._scaled_mm with row-wise scales (x's (M, 1), W's (1, N)), bf16 out, bias fused;
- block-scaled weights: `_block_scaled_gemm_kernel`, each K step's product scaled by x's group scale times W's
  block scale (1 x 128 activation groups against 128 x 128 weight blocks);
- what neither takes (per-channel weights with fp16 x or shapes _scaled_mm cannot align): the torch reference
  (dequantize to x's dtype, then cuBLAS).
Quantizing x costs accuracy the decode path does not pay: e4m3 keeps 3 mantissa bits (a value's rounding error is up
to 2^-4 of it), and y's norm-wise error is of that order, about 2e-2 on random data, where the decode kernel's is
its bf16 output rounding (~2e-3). It is what lets the prefill GEMM run at the FP8 tensor-core rate.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # the dispatcher catches this and keeps the plain-torch path
    raise ImportError("backend.ops.triton.fp8_linear needs the `triton` package") from exc

from backend.ops import fp8  # noqa: E402
from backend.ops.partial_sums import PartialSums  # noqa: E402
from backend.ops.torch import layers as torch_layers  # noqa: E402
from backend.ops.triton import buffers  # noqa: E402
from backend.ops.triton import layers as triton_layers  # noqa: E402
from backend.ops.triton import linear as tlin  # noqa: E402  (tlin imports this module last: no cycle at import)
from backend.ops.triton.launch import INTERPRET, allow_dependents, dependent_wait  # noqa: E402
from backend.ops.triton.linear import MAX_ROWS, _bias_and_store, _block_m, _row_count, _split_counters  # noqa: E402
from backend.ops.tuning import LinearConfig, TuningTables  # noqa: E402
from backend.ops.tuning.h200_fp8 import H200_FP8_TABLES  # noqa: E402

__all__ = ["linear", "linear_silu_and_mul", "tuned_linear", "tuned_linear_silu_and_mul", "cublas_linear",
           "decode_linear", "prefill_linear", "quantize_rows", "block_scaled_linear", "choose_config",
           "choose_gated_config", "choose_gemm_config", "GemmConfig", "tables_for", "FP8_MAX_ROWS", "DECODE_ROW_LIMIT"]

FP8_MAX_ROWS = MAX_ROWS  # decode kernel up to here, FP8 x FP8 GEMMs above (bench.microbench --linear --fp8 times both)
DECODE_ROW_LIMIT = 256  # the most rows decode_linear takes (its x tile is BLOCK_M = next_pow2(rows) wide)
_BLOCK = fp8.WEIGHT_BLOCK  # 128: the edge of a weight scale block and of an activation scale group
_SHARED_MEMORY = 200 * 1024  # bytes of the H100/H200's 227 KB per block that the pipeline stages may take
_SCALED_MM = hasattr(torch, "_scaled_mm")


# ------------------------------------------------------------------------------------------------------
# decode: e4m3 W tiles converted in registers, bf16 / fp16 tensor-core dots
# ------------------------------------------------------------------------------------------------------
@triton.jit
def _fp8_skinny_kernel(
    x_ptr, xs_ptr, w_ptr, s_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K, stride_xm, stride_xsm, stride_wn,
    stride_ym, stride_sn, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr, PARK: tl.constexpr,
    GATED: tl.constexpr, BLOCK_SCALES: tl.constexpr, X_FP8: tl.constexpr,
):
    # the bf16 _skinny_linear_kernel with W in e4m3: W's tile is the MMA's A operand (BLOCK_N ≥ 16 rows), x's
    # padded rows are B's columns. GATED: W is [gate; up] (2N, K), y (M, N) = silu(gate·x) * (up·x), each half
    # with its own scale rows (per channel s[n] and s[N + n]; per block s[n // 128] and s[(N + n) // 128]).
    # BLOCK_SCALES: s is (ceil(rows / 128), ceil(K / 128)), row stride stride_sn; BLOCK_K divides 128, so a K
    # step reads one scale per W row. Otherwise s is (rows,): one scale per W row, applied after the K loop.
    # X_FP8: x is e4m3 too (quantize_rows), with float32 scales xs (M, 1) per row or (M, ceil(K / 128)) per
    # 128-column group (BLOCK_SCALES): W and x go to the FP8 MMA as they are loaded, nothing is converted, and
    # x's scales join W's where W's are applied.
    pid = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    up_rows = w_rows + N.to(tl.int64) * stride_wn  # GATED only: the up half's rows
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    s_rows = s_ptr + (offs_n // 128) * stride_sn  # BLOCK_SCALES only: each W row's scale row
    xs_rows = xs_ptr + offs_m * stride_xsm  # X_FP8 only: each x row's scale row
    up_s_rows = s_ptr + ((offs_n + N) // 128) * stride_sn  # BLOCK_SCALES and GATED only
    k_run = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K  # whole K steps per split
    k_start = split * k_run
    allow_dependents(PDL)
    dependent_wait(PDL)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # GATED only
    for k0 in range(k_start, tl.minimum(k_start + k_run, K), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w_mask = n_mask[:, None]
            x_mask = m_mask[:, None]
        else:
            k_mask = offs_k < K
            w_mask = n_mask[:, None] & k_mask[None, :]
            x_mask = m_mask[:, None] & k_mask[None, :]
        xt = tl.trans(tl.load(x_rows + offs_k[None, :], mask=x_mask, other=0.0))  # (BLOCK_K, BLOCK_M)
        w = tl.load(w_rows + offs_k[None, :], mask=w_mask, other=0.0)
        if not X_FP8:
            w = w.to(xt.dtype)  # e4m3 -> x's dtype: exact
        if BLOCK_SCALES:
            # this K step's block scale per W row (and x's group scale per x row), times the step's partial product
            s = tl.load(s_rows + k0 // 128, mask=n_mask, other=0.0)[:, None]
            if X_FP8:
                s = s * tl.load(xs_rows + k0 // 128, mask=m_mask, other=0.0)[None, :]
            acc += tl.dot(w, xt) * s
            if GATED:
                up = tl.load(up_rows + offs_k[None, :], mask=w_mask, other=0.0)
                if not X_FP8:
                    up = up.to(xt.dtype)
                s_up = tl.load(up_s_rows + k0 // 128, mask=n_mask, other=0.0)[:, None]
                if X_FP8:
                    s_up = s_up * tl.load(xs_rows + k0 // 128, mask=m_mask, other=0.0)[None, :]
                acc_up += tl.dot(up, xt) * s_up
        else:
            acc = tl.dot(w, xt, acc)
            if GATED:
                up = tl.load(up_rows + offs_k[None, :], mask=w_mask, other=0.0)
                if not X_FP8:
                    up = up.to(xt.dtype)
                acc_up = tl.dot(up, xt, acc_up)
    if not BLOCK_SCALES:
        # per-channel scales: one multiply of the fp32 sum (each split scales its own partial: the sum is linear)
        acc *= tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[:, None]
        if GATED:
            acc_up *= tl.load(s_ptr + N + offs_n, mask=n_mask, other=0.0)[:, None]
        if X_FP8:
            x_scale = tl.load(xs_rows, mask=m_mask, other=0.0)[None, :]
            acc *= x_scale
            if GATED:
                acc_up *= x_scale
    out_mask = n_mask[:, None] & m_mask[None, :]
    if GATED:
        # the numerics of the bf16 kernel: gate_up rounded to y's dtype, SiLU-and-mul in fp32, rounded once
        ty = y_ptr.dtype.element_ty
        gate = acc.to(ty).to(tl.float32)
        act = gate * tl.sigmoid(gate) * acc_up.to(ty).to(tl.float32)
        tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], act.to(ty), mask=out_mask)
    elif PARK:
        # each split leaves its fp32 partial at part[split] (SPLIT_K, M, N) for the next kernel (PartialSums)
        tl.store(part_ptr + split * (M * N).to(tl.int64) + offs_m[None, :] * N + offs_n[:, None], acc, mask=out_mask)
    elif SPLIT_K > 1:
        # serial split-K in one launch, as in the bf16 kernel: the split that arrives last on the slice's counter
        # adds all partials in split order, writes y and resets the counter. why the barrier: every thread's
        # partial store must be done before one thread's release-atomic.
        tile = (BLOCK_N * BLOCK_M) * pid.to(tl.int64)
        offs_tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + offs_m[None, :]
        part_stride = (BLOCK_N * BLOCK_M) * tl.num_programs(0).to(tl.int64)
        tl.store(part_ptr + split * part_stride + tile + offs_tile, acc)
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel")  # acquire: the other splits' partials
        if arrived == SPLIT_K - 1:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # in split order, so the sum does not depend on arrival order
                acc += tl.load(part_ptr + s * part_stride + tile + offs_tile, cache_modifier=".cg")
            _bias_and_store(acc, b_ptr, y_ptr, offs_n, offs_m, n_mask, out_mask, stride_ym, HAS_BIAS)
            tl.atomic_xchg(count_ptr + pid, 0)
    else:
        _bias_and_store(acc, b_ptr, y_ptr, offs_n, offs_m, n_mask, out_mask, stride_ym, HAS_BIAS)


def choose_config(n: int, k: int, sms: int, block_scales: bool = False) -> LinearConfig:
    """The decode kernel's default shape (W widened to x's dtype): 64 W rows per program, K steps of 128 e4m3
    values, K cut in 4 where it holds whole 512-value runs (per-channel scales), fewer rows while the programs leave
    SMs idle. Measured (H100, 2026-12-06, `bench.microbench --linear --fp8`, rows 1 and 32, plain and parked): 64 x
    128 with 4 splits was the fastest widening shape of the sweep on every Llama-3-8B shape (o 11.8 / 12.4 µs, down
    30.8 / 32.0, qkv parked 16.5), where 256-value steps without splits took 1.3-3x longer."""
    block_k = 128 if k % 128 == 0 else 64
    split_k = 4 if not block_scales and k % (4 * block_k) == 0 else 1
    block_n = 64
    while block_n > 16 and (n // block_n) * split_k < sms:
        block_n //= 2
    return LinearConfig(block_n=block_n, block_k=block_k, split_k=split_k)


def choose_gated_config(two_i: int, k: int, sms: int, block_scales: bool = False) -> LinearConfig:
    """The fused gate_up + SiLU-and-mul kernel's default shape: 128 rows of both halves per program, fewer while
    that leaves SMs idle, never under 32; K steps of 128 (measured on the 8B gate_up, H100, rows 1 / 32: 57.9 /
    61.2 µs against 86.1 / 89.9 with 256-value steps, bf16's kernel 80.1 / 82.4)."""
    block_n = 128
    while block_n > 32 and two_i // block_n < sms:
        block_n //= 2
    return LinearConfig(block_n=block_n, block_k=128 if k % 128 == 0 else 64)


def _is_block(weight: torch.Tensor, scale: torch.Tensor) -> bool:
    """True for 128 x 128 block scales, False for per-channel ones; a weight that is not e4m3 or scales of neither
    layout are a ValueError (fp8.expand_scale's checks)."""
    if not fp8.is_fp8(weight) or weight.dim() != 2:
        raise ValueError(f"an FP8 linear needs a 2-D {fp8.FP8_DTYPE} weight, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    if scale.dim() == 1:
        if scale.shape[0] != n:
            raise ValueError(f"a per-channel scale of a ({n}, {k}) weight must be ({n},), got {tuple(scale.shape)}")
        return False
    want = (triton.cdiv(n, _BLOCK), triton.cdiv(k, _BLOCK))
    if tuple(scale.shape) != want:
        raise ValueError(f"a block scale of a ({n}, {k}) weight must be {want}, got {tuple(scale.shape)}")
    return True


def _stages(cfg: LinearConfig, block_m: int, x_itemsize: int) -> int:
    """cfg's stages, fewer where the e4m3 W and x tiles of that many stages would not fit in shared memory."""
    per_stage = (cfg.block_n + block_m * x_itemsize) * cfg.block_k
    return max(2, min(cfg.num_stages, _SHARED_MEMORY // per_stage))


def _kernel_ok(x: torch.Tensor) -> bool:
    """Whether x can go to the Triton kernels at all: bf16 / fp16, on CUDA or under the interpreter."""
    return x.dtype in (torch.bfloat16, torch.float16) and (x.is_cuda or INTERPRET)


def _rows2d(x: torch.Tensor, rows: int) -> torch.Tensor:
    x2 = x.reshape(rows, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _sms(x: torch.Tensor) -> int:
    return buffers.sm_count(x.device) if x.is_cuda else 132  # 132: the H200's SMs


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None, config: LinearConfig | None = None, *, pdl: bool = False,
           park: bool = False, quantize_x: bool = False) -> torch.Tensor | PartialSums:
    """x @ (weight * scale).T (+ bias) for an e4m3 weight: the decode kernel up to FP8_MAX_ROWS rows, the FP8 x FP8
    GEMMs above (prefill_linear); fp32 x or an out with a strided last dim: the torch reference.

    out, config, pdl and park as triton_linear.linear takes them (config: the decode kernel's launch shape, None
    for choose_config's rule); quantize_x as decode_linear takes it."""
    block = _is_block(weight, scale)
    rows = _row_count(x)
    if rows == 0 or not _kernel_ok(x) or out is not None and out.stride(-1) != 1:
        return torch_layers.linear(x, weight, bias, out, scale=scale)
    if rows > FP8_MAX_ROWS:
        return prefill_linear(x, weight, scale, bias, out, pdl=pdl, block=block)
    return decode_linear(x, weight, scale, bias, out, config, pdl=pdl, park=park, block=block, quantize_x=quantize_x)


def decode_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, config: LinearConfig | None = None, *, pdl: bool = False,
                  park: bool = False, block: bool | None = None,
                  quantize_x: bool = False) -> torch.Tensor | PartialSums:
    """The decode kernel for 1..DECODE_ROW_LIMIT rows of bf16 / fp16 x (linear takes it up to FP8_MAX_ROWS; the
    benchmark also times it above). park: a split-K launch without bias or out returns PartialSums. quantize_x:
    x is quantized to e4m3 first (quantize_rows: per row, or per 128-column group for block scales) and the kernel
    multiplies FP8 by FP8; otherwise W is widened to x's dtype."""
    block = _is_block(weight, scale) if block is None else block
    rows = _row_count(x)
    if not 0 < rows <= DECODE_ROW_LIMIT or not _kernel_ok(x):
        raise ValueError(f"the FP8 decode kernel takes 1..{DECODE_ROW_LIMIT} rows of bf16 / fp16 on CUDA, "
                         f"got {rows} {x.dtype} on {x.device}")
    x2 = _rows2d(x, rows)
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    s = scale.float().contiguous()
    n, k = w.shape
    cfg = config or choose_config(n, k, _sms(x), block)
    quantize_x = quantize_x or cfg.quantize_x
    xk, xs = quantize_rows(x2, _BLOCK if block else None, pdl=pdl) if quantize_x else (x2, s)
    if block and _BLOCK % cfg.block_k:
        raise ValueError(f"block scales need a K step that divides {_BLOCK}, got block_k={cfg.block_k}")
    if out is not None and (x.dim() != 2 or out.shape != (rows, n) or out.dtype != x.dtype):
        raise ValueError(f"out must be ({rows}, {n}) {x.dtype} for 2-D x, got {tuple(out.shape)} {out.dtype}")
    block_m = _block_m(rows)
    tiles = triton.cdiv(n, cfg.block_n)
    parked = None
    if park and cfg.split_k > 1 and bias is None and out is None:
        parked = y = parts = counts = buffers.alloc((cfg.split_k, rows, n), torch.float32, x.device)  # y, counts unused
    elif cfg.split_k > 1:
        y = out if out is not None else buffers.alloc((rows, n), x.dtype, x.device)
        parts = buffers.alloc((cfg.split_k, tiles, cfg.block_n, block_m), torch.float32, x.device)
        counts = _split_counters(x.device, tiles)
    else:
        y = parts = counts = out if out is not None else buffers.alloc((rows, n), x.dtype, x.device)  # parts unused
    _fp8_skinny_kernel[(tiles, cfg.split_k)](
        xk, xs, w, s, bias if bias is not None else s, y, parts, counts, rows, n, k, xk.stride(0),
        xs.stride(0) if quantize_x else 0, w.stride(0), y.stride(0), s.stride(0), HAS_BIAS=bias is not None,
        EVEN_K=k % cfg.block_k == 0, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SPLIT_K=cfg.split_k, PDL=pdl, PARK=parked is not None, GATED=False, BLOCK_SCALES=block,
        X_FP8=quantize_x, num_warps=cfg.num_warps, num_stages=_stages(cfg, block_m, xk.element_size()),
        launch_pdl=pdl,
    )
    if parked is not None:
        return PartialSums(parked, x.dtype)
    return y.view(*x.shape[:-1], n)


def linear_silu_and_mul(x: torch.Tensor, gate_up_weight: torch.Tensor, scale: torch.Tensor,
                        bias: torch.Tensor | None = None, config: LinearConfig | None = None, *,
                        pdl: bool = False, quantize_x: bool = False) -> torch.Tensor:
    """silu_and_mul(linear(x, gate_up_weight, scale, bias)) for an e4m3 [gate; up] (2I, K): (…, I).

    Up to FP8_MAX_ROWS rows without bias: one kernel whose programs take the same rows of both halves (config's
    block_n counts both; None: choose_gated_config). A bias, a split-K config, a block_n under 32 or more rows
    run linear and triton_layers.silu_and_mul, with the same numerics. quantize_x as decode_linear takes it."""
    block = _is_block(gate_up_weight, scale)
    rows = _row_count(x)
    two_i, k = gate_up_weight.shape
    cfg = config or choose_gated_config(two_i, k, _sms(x), block)
    if (rows == 0 or rows > FP8_MAX_ROWS or bias is not None or cfg.split_k > 1 or cfg.block_n < 32 or two_i % 2
            or not _kernel_ok(x)):
        return triton_layers.silu_and_mul(linear(x, gate_up_weight, scale, bias, config=config, pdl=pdl,
                                                 quantize_x=quantize_x), pdl=pdl)
    if block and _BLOCK % cfg.block_k:
        raise ValueError(f"block scales need a K step that divides {_BLOCK}, got block_k={cfg.block_k}")
    x2 = _rows2d(x, rows)
    w = gate_up_weight if gate_up_weight.stride(-1) == 1 else gate_up_weight.contiguous()
    s = scale.float().contiguous()
    quantize_x = quantize_x or cfg.quantize_x
    xk, xs = quantize_rows(x2, _BLOCK if block else None, pdl=pdl) if quantize_x else (x2, s)
    inter, block_n, block_m = two_i // 2, cfg.block_n // 2, _block_m(rows)
    y = buffers.alloc((rows, inter), x.dtype, x.device)
    _fp8_skinny_kernel[(triton.cdiv(inter, block_n), 1)](
        xk, xs, w, s, s, y, y, y, rows, inter, k, xk.stride(0), xs.stride(0) if quantize_x else 0, w.stride(0),
        y.stride(0), s.stride(0), HAS_BIAS=False, EVEN_K=k % cfg.block_k == 0, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=cfg.block_k, SPLIT_K=1, PDL=pdl, PARK=False, GATED=True, BLOCK_SCALES=block, X_FP8=quantize_x,
        num_warps=cfg.num_warps, num_stages=_stages(cfg, block_m, xk.element_size()), launch_pdl=pdl,
    )
    return y.view(*x.shape[:-1], inter)


# ------------------------------------------------------------------------------------------------------
# prefill: x quantized to e4m3 on the fly, FP8 x FP8 tensor-core GEMMs
# ------------------------------------------------------------------------------------------------------
@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # program `row` quantizes x[row] with one scale: amax / 448 (at least 1e-12, as fp8.quantize_per_channel), each
    # value divided by it (IEEE division, as torch's), clamped to ±448 and rounded to e4m3. Two passes over the
    # row: the second reads it from L2.
    row = tl.program_id(0).to(tl.int64)
    allow_dependents(PDL)
    dependent_wait(PDL)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + row * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    scale = tl.maximum(tl.div_rn(tl.max(amax, axis=0), 448.0), 1e-12)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        mask = offs < K
        v = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.div_rn(v, scale), -448.0), 448.0)
        tl.store(q_ptr + row * stride_qm + offs, q.to(tl.float8e4nv), mask=mask)


@triton.jit
def _quantize_groups_kernel(x_ptr, q_ptr, s_ptr, K, G, stride_xm, stride_qm, stride_sm, GROUPS: tl.constexpr,
                            PDL: tl.constexpr):
    # program (row, c) quantizes GROUPS consecutive 128-column groups of x[row] in one pass: a (GROUPS, 128) tile,
    # one scale per tile row, the same numbers as _quantize_rows_kernel's per group
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    offs = groups[:, None] * 128 + tl.arange(0, 128)[None, :]
    mask = offs < K
    allow_dependents(PDL)
    dependent_wait(PDL)
    v = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.div_rn(tl.max(tl.abs(v), axis=1), 448.0), 1e-12)  # (GROUPS,)
    tl.store(s_ptr + row * stride_sm + groups, scale, mask=groups < G)
    q = tl.minimum(tl.maximum(tl.div_rn(v, scale[:, None]), -448.0), 448.0)
    tl.store(q_ptr + row * stride_qm + offs, q.to(tl.float8e4nv), mask=mask)


def quantize_rows(x: torch.Tensor, group: int | None = None, *, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) bf16 / fp16 / fp32 → (q (M, K) e4m3, s (M, G) float32) with x ≈ q * s: one scale per row (G = 1,
    group None) or per 128 columns of a row (group 128, G = ceil(K / 128)); each is amax / 448 of its values, so
    the largest maps to ±448. Row by row (group by group) the numbers of fp8.quantize_per_channel."""
    if group not in (None, _BLOCK):
        raise ValueError(f"activation groups are whole rows (None) or {_BLOCK} columns, got {group}")
    m, k = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    groups = 1 if group is None else triton.cdiv(k, _BLOCK)
    q = buffers.alloc((m, k), fp8.FP8_DTYPE, x.device)
    s = buffers.alloc((m, groups), torch.float32, x.device)
    if m and k:
        if group is None:
            block = min(triton.next_power_of_2(k), 2048)
            _quantize_rows_kernel[(m,)](x, q, s, k, x.stride(0), q.stride(0), BLOCK=block, PDL=pdl,
                                        num_warps=4 if block <= 512 else 8, launch_pdl=pdl)
        else:
            per_program = min(triton.next_power_of_2(groups), 16)  # up to 2048 columns a program
            _quantize_groups_kernel[(m, triton.cdiv(groups, per_program))](
                x, q, s, k, groups, x.stride(0), q.stride(0), s.stride(0), GROUPS=per_program, PDL=pdl,
                num_warps=4 if per_program <= 4 else 8, launch_pdl=pdl)
    return q, s


@triton.jit
def _block_scaled_gemm_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, M, N, K, stride_am, stride_asm, stride_wn, stride_wsn, stride_ym,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr,
):
    # y (M, N) = sum over K steps of (a_q · w_q.T) * a_s[m, k // 128] * w_s[n // 128, k // 128], a (M, K) and
    # w (N, K) e4m3; BLOCK_K divides 128, so a step has one x scale per row and one W scale per column.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # grouped order: GROUP_M row tiles in a row take the same W column tiles while those are in L2
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    as_rows = as_ptr + offs_m.to(tl.int64) * stride_asm
    ws_rows = ws_ptr + (offs_n // 128) * stride_wsn
    allow_dependents(PDL)
    dependent_wait(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            a_mask = m_mask[:, None]
            w_mask = n_mask[:, None]
        else:
            a_mask = m_mask[:, None] & (offs_k < K)[None, :]
            w_mask = n_mask[:, None] & (offs_k < K)[None, :]
        a = tl.load(a_rows + offs_k[None, :], mask=a_mask, other=0.0)
        w = tl.load(w_rows + offs_k[None, :], mask=w_mask, other=0.0)
        a_s = tl.load(as_rows + k0 // 128, mask=m_mask, other=0.0)
        w_s = tl.load(ws_rows + k0 // 128, mask=n_mask, other=0.0)
        acc += tl.dot(a, tl.trans(w)) * (a_s[:, None] * w_s[None, :])  # W K-major: what FP8 MMAs take
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


class GemmConfig(NamedTuple):
    """The block-scaled GEMM's launch shape (its K step is 128, one scale block)."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 3


def choose_gemm_config(m: int, n: int) -> GemmConfig:
    """The block-scaled GEMM's default tiles, a rule (not measured): 64 x 128 for a few hundred rows, 128 x 128
    with 8 warps for long prompts."""
    return GemmConfig(64, 128, 4, 4) if m <= 512 else GemmConfig(128, 128, 8, 3)


def block_scaled_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                        out: torch.Tensor | None = None, config: GemmConfig | None = None, *,
                        pdl: bool = False) -> torch.Tensor:
    """x (M, K) @ (weight * scale).T (+ bias) for 128 x 128 block scales: x quantized per row and 128-column group
    (quantize_rows), then _block_scaled_gemm_kernel; y (M, N) in x's dtype (or into out, unit stride along N)."""
    m, k = x.shape
    n = weight.shape[0]
    xq, xs = quantize_rows(x, _BLOCK, pdl=pdl)
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    ws = scale.float().contiguous()
    y = out if out is not None else buffers.alloc((m, n), x.dtype, x.device)
    block_m, block_n, warps, stages = config or choose_gemm_config(m, n)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _block_scaled_gemm_kernel[grid](
        xq, xs, w, ws, bias if bias is not None else ws, y, m, n, k, xq.stride(0), xs.stride(0), w.stride(0),
        ws.stride(0), y.stride(0), HAS_BIAS=bias is not None, EVEN_K=k % _BLOCK == 0, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=_BLOCK, GROUP_M=8, PDL=pdl, num_warps=warps, num_stages=stages, launch_pdl=pdl,
    )
    return y


def _scaled_mm_ok(x: torch.Tensor, n: int, k: int) -> bool:
    """torch._scaled_mm with row-wise scales: bf16 out only, and 16-byte aligned rows of x and of W (K, N % 16)."""
    return _SCALED_MM and x.dtype == torch.bfloat16 and k % 16 == 0 and n % 16 == 0


def _scaled_mm(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
               pdl: bool) -> torch.Tensor:
    """x2 (M, K) bf16 quantized per row, then torch._scaled_mm against the per-channel e4m3 weight: (M, N) bf16."""
    xq, xs = quantize_rows(x2, pdl=pdl)  # (M, K) e4m3, (M, 1) float32
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    # w.t() is (K, N) column-major, the layout _scaled_mm wants for its second operand: no copy
    b = bias if bias is None or bias.dtype == torch.bfloat16 else bias.to(torch.bfloat16)
    return torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=scale.float().reshape(1, -1), bias=b,
                            out_dtype=torch.bfloat16)


def prefill_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                   out: torch.Tensor | None = None, *, pdl: bool = False, block: bool | None = None) -> torch.Tensor:
    """Any number of rows in FP8 x FP8: _scaled_mm (per-channel weights, bf16 x) or the block-scaled GEMM (block
    weights); what neither takes (fp16 x with per-channel scales, unaligned shapes) runs the torch reference."""
    block = _is_block(weight, scale) if block is None else block
    rows, (n, k) = _row_count(x), weight.shape
    if rows == 0 or not _kernel_ok(x) or not block and not _scaled_mm_ok(x, n, k):
        return torch_layers.linear(x, weight, bias, out, scale=scale)
    if out is not None and (x.dim() != 2 or out.shape != (rows, n) or out.dtype != x.dtype or out.stride(-1) != 1):
        raise ValueError(f"out must be ({rows}, {n}) {x.dtype} for 2-D x, got {tuple(out.shape)} {out.dtype}")
    x2 = _rows2d(x, rows)
    if block:
        return block_scaled_linear(x2, weight, scale, bias, out, pdl=pdl).view(*x.shape[:-1], n)
    y = _scaled_mm(x2, weight, scale, bias, pdl)
    if out is not None:
        return out.copy_(y)
    return y.view(*x.shape[:-1], n)


def cublas_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """The "cublas" linear backend for FP8 weights: x quantized per row, then torch._scaled_mm (cuBLASLt / CUTLASS)
    for every row count, decode steps included. Block-scaled weights (no row-wise _scaled_mm for them) and what
    _scaled_mm cannot take run the torch reference: dequantized to x's dtype, then cuBLAS."""
    block = _is_block(weight, scale)
    rows, (n, k) = _row_count(x), weight.shape
    if block or rows == 0 or not _kernel_ok(x) or not _scaled_mm_ok(x, n, k) or (
            out is not None and (x.dim() != 2 or out.stride(-1) != 1)):
        return torch_layers.linear(x, weight, bias, out, scale=scale)
    y = _scaled_mm(_rows2d(x, rows), weight, scale, bias, pdl=False)
    if out is not None:
        return out.copy_(y)
    return y.view(*x.shape[:-1], n)


# ------------------------------------------------------------------------------------------------------
# tuned dispatch
# ------------------------------------------------------------------------------------------------------
def tables_for(device: torch.device, block: bool) -> TuningTables | None:
    """The H200 FP8 tables of this scale layout on compute capability 9.0, None elsewhere (the rule then)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return H200_FP8_TABLES["block" if block else "channel"] if tlin._capability(index) == (9, 0) else None


def _lookup(x: torch.Tensor, weight: torch.Tensor, block: bool) -> tuple[TuningTables | None, tuple[int, int, int]]:
    rows = _row_count(x)
    tables = tables_for(x.device, block) if 0 < rows <= FP8_MAX_ROWS else None
    return tables, (weight.shape[0], weight.shape[1], _block_m(rows))


def tuned_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, *, pdl: bool = False,
                 park: bool = False) -> torch.Tensor | PartialSums:
    """linear with this device's FP8 table: a listed shape launches its config (the parked table first when the
    caller can add partials), an unlisted one the rule's; more rows than FP8_MAX_ROWS go to the FP8 x FP8 GEMMs.

    Unlike the bf16 tuned_linear, an unlisted decode shape does not go to cuBLAS: its only cuBLAS path would read
    the weight dequantized (three times the bytes, written and read back) or quantize x (other numerics)."""
    block = _is_block(weight, scale)
    tables, key = _lookup(x, weight, block)
    config = None
    if tables is not None:
        config = tables.parked.get(key) if park and bias is None and out is None else None
        if config is not None:
            return linear(x, weight, scale, None, None, config=config, pdl=pdl, park=True)
        config = tables.plain.get(key)
    return linear(x, weight, scale, bias, out, config=config, pdl=pdl)


def tuned_linear_silu_and_mul(x: torch.Tensor, gate_up_weight: torch.Tensor, scale: torch.Tensor,
                              bias: torch.Tensor | None = None, *, pdl: bool = False) -> torch.Tensor:
    """silu_and_mul of the FP8 gate_up GEMM: the fused kernel with the gated table's config where listed; a shape
    only the plain table lists runs that GEMM, then triton_layers.silu_and_mul; an unlisted one the fused kernel
    with choose_gated_config's rule (one kernel, gate_up never in memory)."""
    block = _is_block(gate_up_weight, scale)
    tables, key = _lookup(x, gate_up_weight, block) if bias is None else (None, None)
    if tables is not None:
        config = tables.gated.get(key)
        if config is not None:
            return linear_silu_and_mul(x, gate_up_weight, scale, config=config, pdl=pdl)
        if key in tables.plain:
            return triton_layers.silu_and_mul(tuned_linear(x, gate_up_weight, scale, pdl=pdl), pdl=pdl)
    return linear_silu_and_mul(x, gate_up_weight, scale, bias, pdl=pdl)

