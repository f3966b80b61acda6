"""Decode-sized GEMMs for CUDA in the Triton language: y = x @ W.T (+ b) for a few rows of x, at weight bandwidth.

A decode step multiplies a handful of token rows by every weight matrix once; the work is streaming W from
memory. The kernel gives each program a slice of W's output rows and the whole K range, so no split-K partials
and no second launch are needed; small slices make enough programs even for narrow matrices.

Where K is long, the tuning tables may split it (split_k): the splits' fp32 partials are then either summed by the
last split to finish (serial split-K, one launch), or "parked": left unsummed in a PartialSums for the next kernel
(a norm or rotary kernel that reads the GEMM's output anyway and adds the partials as it loads them).

FP8 (e4m3) weights, called with their `scale`, are dispatched to fp8_linear.py's kernels.
"""
from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # the dispatcher catches this and keeps the plain-torch path
    raise ImportError("backend.ops.triton.linear needs the `triton` package") from exc

from backend.ops.triton import buffers  # noqa: E402

from backend.ops.torch import layers as torch_layers  # noqa: E402  (after the guarded triton import)
from backend.ops.triton import layers as triton_layers  # noqa: E402
from backend.ops.partial_sums import PartialSums  # noqa: E402
from backend.ops.tuning import LinearConfig, TuningTables  # noqa: E402
from backend.ops.tuning.h200 import H200_CONFIGS, H200_GATED_CONFIGS, H200_PARKED_CONFIGS, H200_TABLES  # noqa: E402
from backend.ops.triton.launch import INTERPRET, allow_dependents, dependent_wait  # noqa: E402

__all__ = ["linear", "tuned_linear", "linear_silu_and_mul", "tuned_linear_silu_and_mul", "LinearConfig",
           "TuningTables", "tables_for", "choose_config", "H200_CONFIGS", "H200_PARKED_CONFIGS", "H200_GATED_CONFIGS",
           "H200_TABLES", "MAX_ROWS", "cublas_linear"]

MAX_ROWS = 64  # above this many rows cuBLAS's tiles reuse each weight load enough; F.linear takes over



@triton.jit
def _bias_and_store(acc, b_ptr, y_ptr, offs_n, offs_m, n_mask, out_mask, stride_ym, HAS_BIAS: tl.constexpr):
    """The epilogue: bias added in fp32, one rounding, y[m, n] = acc[n, m]."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], acc.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _skinny_linear_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr, PARK: tl.constexpr, GATED: tl.constexpr,
):
    # GATED: W is [gate; up] (2N, K) and y (M, N) = silu(x @ gate.T) * (x @ up.T); each program takes BLOCK_N rows
    # of both halves, so the activation is formed in registers and gate_up never goes to memory
    pid = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    k_run = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K  # whole K steps per split
    k_start = split * k_run
    allow_dependents(PDL)
    dependent_wait(PDL)
    # the weight slice is the MMA's A operand (BLOCK_N ≥ 16 rows); x's padded rows are B's columns
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # GATED only
    up_rows = w_rows + N.to(tl.int64) * stride_wn  # GATED only: the up half's rows
    for k0 in range(k_start, tl.minimum(k_start + k_run, K), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w_mask = n_mask[:, None]
            x_mask = m_mask[:, None]
        else:
            k_mask = offs_k < K
            w_mask = n_mask[:, None] & k_mask[None, :]
            x_mask = m_mask[:, None] & k_mask[None, :]
        w = tl.load(w_rows + offs_k[None, :], mask=w_mask, other=0.0)
        x = tl.load(x_rows + offs_k[None, :], mask=x_mask, other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
        if GATED:
            acc_up = tl.dot(tl.load(up_rows + offs_k[None, :], mask=w_mask, other=0.0), tl.trans(x), acc_up)
    out_mask = n_mask[:, None] & m_mask[None, :]
    if GATED:
        # the numerics of gate_up rounded to y's dtype, then triton_layers' SiLU-and-mul in fp32, rounded once
        ty = y_ptr.dtype.element_ty
        gate = acc.to(ty).to(tl.float32)
        act = gate * tl.sigmoid(gate) * acc_up.to(ty).to(tl.float32)
        tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], act.to(ty), mask=out_mask)
    elif PARK:
        # Each split leaves its fp32 partial at part[split] (SPLIT_K, M, N); the next kernel, which reads y
        # anyway, adds them in split order, row by row in parallel (PartialSums).
        tl.store(part_ptr + split * (M * N).to(tl.int64) + offs_m[None, :] * N + offs_n[:, None], acc, mask=out_mask)
    elif SPLIT_K > 1:
        # Serial split-K in one launch: each split parks its fp32 partial, then counts itself in on the slice's
        # counter; the split that arrives last adds all partials, writes y and resets the counter for the next
        # launch. why the barrier: every thread's partial store must be done before one thread's release-atomic.
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


def choose_config(n: int, k: int, sms: int) -> LinearConfig:
    """64 W rows per program (fewer for narrow matrices), K step by K's size: the kernel's default shape."""
    block_n = 64
    while block_n > 16 and n // block_n < sms:
        block_n //= 2
    block_k = 256 if k % 256 == 0 else 128 if k % 128 == 0 else 64
    return LinearConfig(block_n=block_n, block_k=block_k)


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def tables_for(device: torch.device) -> TuningTables | None:
    """H200_TABLES on compute capability 9.0 (H100 / H200: where they were measured); None on other GPUs and on the
    CPU, which keep F.linear for every shape. Tests of the dispatch give the interpreter tables of their own."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return H200_TABLES if _capability(index) == (9, 0) else None


_SHARED_MEMORY = 200 * 1024  # bytes of the H100/H200's 227 KB per block that the pipeline stages may take


def _stages(cfg: LinearConfig, block_m: int, itemsize: int) -> int:
    """cfg's stages, fewer where the W and x tiles of that many stages would not fit in shared memory."""
    per_stage = (cfg.block_n + block_m) * cfg.block_k * itemsize
    return max(2, min(cfg.num_stages, _SHARED_MEMORY // per_stage))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
           config: LinearConfig | None = None, *, pdl: bool = False, park: bool = False,
           scale: torch.Tensor | None = None) -> torch.Tensor | PartialSums:
    """F.linear(x, weight, bias); rows ≤ MAX_ROWS of bf16/fp16 go through the decode kernel, the rest to cuBLAS.

    out: a (rows, N) buffer with unit stride along N to write into (x 2-D), as torch_layers.linear takes.
    config None: the kernel's default shape (choose_config). tuned_linear uses the measured table instead.
    pdl: launch as a programmatic dependent of the previous kernel (ops/triton/launch.py).
    park: a split-K launch without bias or out returns its partials unsummed (PartialSums), for a caller whose
    next kernel adds them (triton_layers.add_rms_norm); any other launch returns y as usual."""
    if scale is not None:  # an e4m3 weight: fp8_linear's kernels
        return fp8_linear.linear(x, weight, scale, bias, out, config, pdl=pdl, park=park)
    rows = _row_count(x)
    if (rows == 0 or rows > MAX_ROWS or x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype
            or not x.is_cuda and not INTERPRET or out is not None and out.stride(-1) != 1):
        return torch_layers.linear(x, weight, bias, out)
    x2 = x.reshape(rows, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    n, k = w.shape
    cfg = config or choose_config(n, k, buffers.sm_count(x.device) if x.is_cuda else 132)  # 132: the H200's SMs
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
    _skinny_linear_kernel[(tiles, cfg.split_k)](
        x2, w, bias if bias is not None else w, y, parts, counts, rows, n, k, x2.stride(0), w.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k, PDL=pdl, PARK=parked is not None, GATED=False,
        num_warps=cfg.num_warps, num_stages=_stages(cfg, block_m, x.element_size()), launch_pdl=pdl,
    )
    if parked is not None:
        return PartialSums(parked, x.dtype)
    return y.view(*x.shape[:-1], n)


def linear_silu_and_mul(x: torch.Tensor, gate_up_weight: torch.Tensor, bias: torch.Tensor | None = None,
                        config: LinearConfig | None = None, *, pdl: bool = False,
                        scale: torch.Tensor | None = None) -> torch.Tensor:
    """silu_and_mul(linear(x, gate_up_weight, bias)) for gate_up_weight = [gate; up] (2I, K): (…, I).

    Rows ≤ MAX_ROWS of bf16/fp16 without bias run one kernel whose programs each take the same W rows of both
    halves, so gate_up never goes to memory; config's block_n counts the rows of both halves. A bias, a config
    that splits K or more rows run the GEMM and triton_layers.silu_and_mul instead, with the same numerics."""
    if scale is not None:
        return fp8_linear.linear_silu_and_mul(x, gate_up_weight, scale, bias, config, pdl=pdl)
    rows = _row_count(x)
    two_i, k = gate_up_weight.shape
    cfg = config or choose_config(two_i, k, buffers.sm_count(x.device) if x.is_cuda else 132)
    if (rows == 0 or rows > MAX_ROWS or bias is not None or cfg.split_k > 1 or cfg.block_n < 32 or two_i % 2
            or x.dtype not in (torch.bfloat16, torch.float16) or gate_up_weight.dtype != x.dtype
            or not x.is_cuda and not INTERPRET):
        return triton_layers.silu_and_mul(linear(x, gate_up_weight, bias, config=config, pdl=pdl), pdl=pdl)
    x2 = x.reshape(rows, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = gate_up_weight if gate_up_weight.stride(-1) == 1 else gate_up_weight.contiguous()
    inter, block_n, block_m = two_i // 2, cfg.block_n // 2, _block_m(rows)
    y = buffers.alloc((rows, inter), x.dtype, x.device)
    _skinny_linear_kernel[(triton.cdiv(inter, block_n), 1)](
        x2, w, w, y, y, y, rows, inter, k, x2.stride(0), w.stride(0), y.stride(0),
        HAS_BIAS=False, EVEN_K=k % cfg.block_k == 0, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=cfg.block_k,
        SPLIT_K=1, PDL=pdl, PARK=False, GATED=True, num_warps=cfg.num_warps,
        num_stages=_stages(cfg, block_m, x.element_size()), launch_pdl=pdl,
    )
    return y.view(*x.shape[:-1], inter)


_COUNTERS: dict[tuple, torch.Tensor] = {}


def _split_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 arrival counters, one per W slice, kept per (device, stream).

    Each launch leaves them at zero again, so launches on one stream can share them; a second stream (another
    engine on the same GPU) gets its own, because launches on two streams may overlap. Allocated outside graph
    capture (the warm-up call before capture does it), since a captured graph must not own them."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    counters = _COUNTERS.get(key)
    if counters is None or counters.numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("split-K counters must be allocated before CUDA graph capture: run the GEMM once first")
        counters = _COUNTERS[key] = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)
    return counters


def _block_m(rows: int) -> int:
    return max(16, triton.next_power_of_2(rows))


def _row_count(x: torch.Tensor) -> int:
    """Rows of x as the GEMM sees them: every leading dim flattened."""
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def _lookup(x: torch.Tensor, weight: torch.Tensor) -> tuple[TuningTables | None, tuple[int, int, int]]:
    """This device's tables (None where none apply: too many rows, another GPU) and the key (N, K, BLOCK_M)."""
    rows = _row_count(x)
    tables = tables_for(x.device) if 0 < rows <= MAX_ROWS else None
    return tables, (weight.shape[0], weight.shape[1], _block_m(rows))


def tuned_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, *, pdl: bool = False, park: bool = False,
                 scale: torch.Tensor | None = None) -> torch.Tensor | PartialSums:
    """F.linear(x, weight, bias) through the kernel where this device's plain table lists the shape, else cuBLAS.

    park: the caller's next kernel can add split-K partials (linear's park); the parked table comes first."""
    if scale is not None:  # its own tables (tuning/h200_fp8.py), and no cuBLAS fallback for decode rows
        return fp8_linear.tuned_linear(x, weight, scale, bias, out, pdl=pdl, park=park)
    tables, key = _lookup(x, weight)
    if tables is not None:
        config = tables.parked.get(key) if park and bias is None and out is None else None
        if config is not None:
            return linear(x, weight, None, None, config=config, pdl=pdl, park=True)
        config = tables.plain.get(key)
        if config is not None:
            return linear(x, weight, bias, out, config=config, pdl=pdl)
    return torch_layers.linear(x, weight, bias, out)


def tuned_linear_silu_and_mul(x: torch.Tensor, gate_up_weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                              pdl: bool = False, scale: torch.Tensor | None = None) -> torch.Tensor:
    """silu_and_mul(tuned_linear(x, gate_up_weight, bias)): one kernel where this device's gated table lists the
    gate_up shape (linear_silu_and_mul), else the tuned GEMM and triton_layers.silu_and_mul."""
    if scale is not None:
        return fp8_linear.tuned_linear_silu_and_mul(x, gate_up_weight, scale, bias, pdl=pdl)
    tables, key = _lookup(x, gate_up_weight) if bias is None else (None, None)
    if tables is not None:
        config = tables.gated.get(key)
        if config is not None:
            return linear_silu_and_mul(x, gate_up_weight, config=config, pdl=pdl)
    return triton_layers.silu_and_mul(tuned_linear(x, gate_up_weight, bias, pdl=pdl), pdl=pdl)


def cublas_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, *, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The "cublas" linear backend: F.linear; an e4m3 weight goes to torch._scaled_mm with x quantized per row,
    for every row count (fp8_linear.cublas_linear)."""
    if scale is not None:
        return fp8_linear.cublas_linear(x, weight, scale, bias, out)
    return torch_layers.linear(x, weight, bias, out)


# last: fp8_linear imports this module's helpers (MAX_ROWS, _block_m, _split_counters, the epilogue)
from backend.ops.triton import fp8_linear  # noqa: E402
