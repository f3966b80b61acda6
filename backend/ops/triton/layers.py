"""Fused element-wise layers for CUDA in the Triton language: RMSNorm, residual add + RMSNorm, RoPE, SiLU-and-mul."""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # the dispatcher catches this and keeps the plain-torch path
    raise ImportError("backend.ops.triton.layers needs the `triton` package") from exc

from backend.ops.triton import buffers  # noqa: E402

from backend.ops import fp8  # noqa: E402  (after the guarded import)
from backend.ops.partial_sums import PartialSums  # noqa: E402
from backend.ops.triton.launch import allow_dependents, dependent_wait  # noqa: E402

__all__ = ["rms_norm", "add_rms_norm", "apply_rope", "rope_write_kv", "silu_and_mul", "unpack_qkv", "load_summed",
           "rope_cos_sin", "rope_rotate", "to_cache", "is_fp8_cache"]

FP8_MAX: tl.constexpr = tl.constexpr(fp8.FP8_MAX)


def is_fp8_cache(kv_cache_layer: torch.Tensor, kv_scale: torch.Tensor | None) -> bool:
    """Whether the cache holds e4m3 values (the kernels' KV_FP8 flag); such a cache needs its kv_scale."""
    if kv_cache_layer.dtype != fp8.FP8_DTYPE:
        return False  # a cache in the model's dtype ignores kv_scale, as the torch path does
    if kv_scale is None:
        raise ValueError("an FP8 KV cache needs its kv_scale")
    return True



def _rows(x: torch.Tensor) -> torch.Tensor:
    """(…, N) → (R, N) with unit stride along N (a view when possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _row_warps(block: int) -> int:
    # about 16 bytes (8 bf16) per thread per load; more warps for wide rows keep registers low
    return max(1, min(16, block // 256))


@triton.jit
def load_summed(ptr, mask, stride_part, PARTS: tl.constexpr, ty: tl.constexpr):
    """A (…) block of y, or with PARTS > 0 of a split-K GEMM's fp32 partials added in split order and rounded to
    ty once, as the GEMM would have written y (PartialSums)."""
    if PARTS:
        first = tl.load(ptr, mask=mask, other=0.0)
        total = tl.zeros_like(first)
        total += first
        for s in tl.static_range(1, PARTS):
            total += tl.load(ptr + s * stride_part, mask=mask, other=0.0)
        return total.to(ty)
    else:
        return tl.load(ptr, mask=mask, other=0.0)


@triton.jit
def to_cache(x, cache_ty: tl.constexpr, scale_ptr, FP8: tl.constexpr):
    """x as a cache of cache_ty stores it. FP8: x / scale (the float32 at scale_ptr) saturated to ±FP8_MAX in e4m3,
    fp8.quantize_kv's bits: an IEEE division as torch's (a plain / is approximate on the GPU), then round to
    nearest even. Otherwise x in cache_ty."""
    if FP8:
        y = tl.math.div_rn(x.to(tl.float32), tl.load(scale_ptr))
        return tl.clamp(y, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL).to(cache_ty)
    else:
        return x.to(cache_ty)


# --------------------------------------------------------------------------------------------------------
# RMSNorm, optionally fused with the residual add (one read of x and residual, one write of each output)
# --------------------------------------------------------------------------------------------------------
@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_r, stride_o, stride_s, stride_part, eps,
    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RES: tl.constexpr, PARTS: tl.constexpr, PDL: tl.constexpr,
):
    allow_dependents(PDL)
    dependent_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    # with PARTS, x arrives as a split-K GEMM's fp32 partials: added in split order and rounded once, as the GEMM would
    x = load_summed(x_ptr + row * stride_x + offs, mask, stride_part, PARTS, sum_ptr.dtype.element_ty)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        # rounded to the sum's dtype before the norm, as `hidden = hidden + residual` does in torch
        x = (x.to(tl.float32) + r.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / N
    # HF LlamaRMSNorm: normalise in fp32, cast back to the input dtype, then multiply by the weight
    y = (xf * tl.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + offs, (y.to(tl.float32) * w.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, pdl: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim, numerics of HF LlamaRMSNorm (fp32 compute, cast, times weight)."""
    shape = x.shape
    x2 = _rows(x)
    R, N = x2.shape
    out = buffers.alloc((R, N), torch.promote_types(x.dtype, weight.dtype), x.device)
    if R:
        block = triton.next_power_of_2(N)
        _rms_norm_kernel[(R,)](x2, x2, weight, out, out, x2.stride(0), 0, out.stride(0), 0, 0, float(eps),
                               N=N, BLOCK=block, HAS_RES=False, PARTS=0, PDL=pdl, num_warps=_row_warps(block),
                               launch_pdl=pdl)
    return out.view(shape)


def add_rms_norm(x: torch.Tensor | PartialSums, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 pdl: bool = False):
    """Fused residual add + RMSNorm: returns (rms_norm(x + residual), x + residual).

    x may be a GEMM's unsummed split-K partials (PartialSums, from the Triton GEMM's park): added up here first."""
    r2 = _rows(residual)
    if isinstance(x, PartialSums):
        if x.shape != r2.shape or x.dtype != residual.dtype:
            raise ValueError(f"partial sums of shape {tuple(x.shape)} ({x.dtype}) do not match the residual "
                             f"{tuple(r2.shape)} ({residual.dtype})")
        shape, x2, parts = residual.shape, x.parts, x.parts.shape[0]
    else:
        shape, x2, parts = x.shape, _rows(x), 0
    R, N = r2.shape
    sum_dtype = torch.promote_types(x.dtype, residual.dtype)
    total = buffers.alloc((R, N), sum_dtype, residual.device)
    out = buffers.alloc((R, N), torch.promote_types(sum_dtype, weight.dtype), residual.device)
    if R:
        block = triton.next_power_of_2(N)
        # partials are several fp32 rows per row: twice the warps (1B at 64 rows, 4 parts: 1.66 µs a call at 16
        # warps against 1.90 at 8, eight dependent launches in a row on the H200)
        warps = _row_warps(2 * block if parts else block)
        _rms_norm_kernel[(R,)](x2, r2, weight, out, total, x2.stride(-2), r2.stride(0), out.stride(0),
                               total.stride(0), x2.stride(0) if parts else 0, float(eps), N=N, BLOCK=block,
                               HAS_RES=True, PARTS=parts, PDL=pdl, num_warps=warps, launch_pdl=pdl)
    return out.view(shape), total.view(shape)


# --------------------------------------------------------------------------------------------------------
# RoPE (neox / HF rotate_half): q and k of one token in one program, one launch for both
# --------------------------------------------------------------------------------------------------------
@triton.jit
def rope_rotate(src_ptr, dst_ptr, t, stride_t, stride_h, stride_ot, stride_oh, cos, sin, offs_j, j_mask,
                H: tl.constexpr, H_PAD: tl.constexpr, HALF: tl.constexpr, stride_part, PARTS: tl.constexpr,
                ty: tl.constexpr, scale_ptr, FP8: tl.constexpr):
    """H heads of token t rotated (neox rotate_half, fp32 math) from src to dst, rounded to ty (the model's dtype).
    FP8: dst is an FP8 cache, which stores the rounded values quantized by the scale at scale_ptr (to_cache)."""
    offs_h = tl.arange(0, H_PAD)
    mask = (offs_h < H)[:, None] & j_mask[None, :]
    src = src_ptr + t * stride_t + offs_h[:, None] * stride_h + offs_j[None, :]
    cache_ty = dst_ptr.dtype.element_ty
    x1 = load_summed(src, mask, stride_part, PARTS, ty).to(tl.float32)
    x2 = load_summed(src + HALF, mask, stride_part, PARTS, ty).to(tl.float32)
    dst = dst_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_j[None, :]
    # HF (and the torch path) cast cos/sin to the activations' dtype before rotating: same rounding here
    cos = cos.to(ty).to(tl.float32)
    sin = sin.to(ty).to(tl.float32)
    tl.store(dst, to_cache((x1 * cos[None, :] - x2 * sin[None, :]).to(ty), cache_ty, scale_ptr, FP8), mask=mask)
    tl.store(dst + HALF, to_cache((x2 * cos[None, :] + x1 * sin[None, :]).to(ty), cache_ty, scale_ptr, FP8),
             mask=mask)


@triton.jit
def rope_cos_sin(cs_ptr, pos_ptr, t, stride_cs, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """Token t's cos and sin rows (fp32) from the [cos | sin] cache, with the half-dim offsets and mask."""
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_j = tl.arange(0, HALF_PAD)
    j_mask = offs_j < HALF
    cos = tl.load(cs_ptr + pos * stride_cs + offs_j, mask=j_mask, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + offs_j, mask=j_mask, other=0.0).to(tl.float32)
    return cos, sin, offs_j, j_mask


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, pos_ptr, cs_ptr, qo_ptr, ko_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs,
    HQ: tl.constexpr, HK: tl.constexpr, HQ_PAD: tl.constexpr, HK_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, PDL: tl.constexpr,
):
    allow_dependents(PDL)
    dependent_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    cos, sin, offs_j, j_mask = rope_cos_sin(cs_ptr, pos_ptr, t, stride_cs, HALF, HALF_PAD)
    rope_rotate(q_ptr, qo_ptr, t, stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin, offs_j, j_mask,
                HQ, HQ_PAD, HALF, 0, 0, qo_ptr.dtype.element_ty, qo_ptr, False)
    rope_rotate(k_ptr, ko_ptr, t, stride_kt, stride_kh, stride_kot, stride_koh, cos, sin, offs_j, j_mask,
                HK, HK_PAD, HALF, 0, 0, ko_ptr.dtype.element_ty, ko_ptr, False)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, *,
               pdl: bool = False):
    """Rotary embedding, neox style: q (T,Hq,D), k (T,Hkv,D), positions (T,), cache (max_pos, D) = [cos | sin].

    Out of place (q and k, often views of one fused qkv output, are left untouched); returns (q, k)."""
    T, HQ, D = q.shape
    HK = k.shape[1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    cs = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    q_out = buffers.alloc((T, HQ, D), q.dtype, q.device)
    k_out = buffers.alloc((T, HK, D), k.dtype, k.device)
    if T:
        half = D // 2
        _rope_kernel[(T,)](
            q, k, positions, cs, q_out, k_out,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), q_out.stride(0), q_out.stride(1),
            k_out.stride(0), k_out.stride(1), cs.stride(0),
            HQ=HQ, HK=HK, HQ_PAD=triton.next_power_of_2(HQ), HK_PAD=triton.next_power_of_2(HK),
            HALF=half, HALF_PAD=triton.next_power_of_2(half), PDL=pdl, num_warps=4, launch_pdl=pdl,
        )
    return q_out, k_out


@triton.jit
def _rope_write_kv_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cs_ptr, qo_ptr, cache_ptr, slot_ptr, kv_scale_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_qot, stride_qoh, stride_cs,
    stride_ckv, stride_cb, stride_cslot, stride_ch, stride_part,
    HQ: tl.constexpr, HK: tl.constexpr, HQ_PAD: tl.constexpr, HK_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr,
    PARTS: tl.constexpr, PDL: tl.constexpr, KV_FP8: tl.constexpr,
):
    # PARTS > 0: q, k and v are views of a split-K qkv GEMM's fp32 partials, stride_part apart (PartialSums)
    # KV_FP8: the cache is e4m3; k and v are rounded to the model's dtype (qo's), then stored divided by kv_scale's
    # [k_scale, v_scale]
    allow_dependents(PDL)
    dependent_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    ty = qo_ptr.dtype.element_ty
    cos, sin, offs_j, j_mask = rope_cos_sin(cs_ptr, pos_ptr, t, stride_cs, HALF, HALF_PAD)
    rope_rotate(q_ptr, qo_ptr, t, stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin, offs_j, j_mask,
                HQ, HQ_PAD, HALF, stride_part, PARTS, ty, qo_ptr, False)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # a negative slot means "do not cache", as in write_kv_cache
        dst = cache_ptr + (slot // BS) * stride_cb + (slot % BS) * stride_cslot
        # the rotated k goes straight to its cache slot (token stride 0: dst already points at the slot)
        rope_rotate(k_ptr, dst, t, stride_kt, stride_kh, 0, stride_ch, cos, sin, offs_j, j_mask, HK, HK_PAD, HALF,
                    stride_part, PARTS, ty, kv_scale_ptr, KV_FP8)
        offs_h = tl.arange(0, HK_PAD)
        offs_d = tl.arange(0, D_PAD)
        mask = (offs_h < HK)[:, None] & (offs_d < D)[None, :]
        v = load_summed(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask, stride_part,
                        PARTS, ty)
        tl.store(dst + stride_ckv + offs_h[:, None] * stride_ch + offs_d[None, :],
                 to_cache(v, cache_ptr.dtype.element_ty, kv_scale_ptr + 1, KV_FP8), mask=mask)


def unpack_qkv(q, k, v, cache_dtype: torch.dtype):
    """q, k, v as tensors with unit stride along the head dim, plus (dtype, parts, stride_part) for the kernels.

    All three may instead be views of one split-K qkv GEMM's partials (PartialSums): then the tensors returned are
    views of the first split, the others stride_part elements on, and parts is the split count (0: plain tensors)."""
    parked = [isinstance(t, PartialSums) for t in (q, k, v)]
    if any(parked):
        one_gemm = all(parked) and len({(t.parts.stride(0), t.dtype) for t in (q, k, v)}) == 1
        if not one_gemm:
            raise ValueError("q, k and v must be all tensors or all views of one GEMM's partial sums")
        dtype, parts, stride_part = q.dtype, q.parts.shape[0], q.parts.stride(0)
        q, k, v = (t.parts[0] for t in (q, k, v))  # (T, H, D) views of the first split; the rest stride_part on
        if not all(t.stride(-1) == 1 for t in (q, k, v)):
            raise ValueError("partial sums must have unit stride along the head dim")
    else:
        dtype, parts, stride_part = q.dtype, 0, 0
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if cache_dtype != dtype and cache_dtype != fp8.FP8_DTYPE:
        raise ValueError(f"the KV cache dtype ({cache_dtype}) must be k's ({dtype}) or FP8 ({fp8.FP8_DTYPE})")
    return (q, k, v), dtype, parts, stride_part


def rope_write_kv(q: torch.Tensor | PartialSums, k: torch.Tensor | PartialSums, v: torch.Tensor | PartialSums,
                  positions: torch.Tensor, cos_sin_cache: torch.Tensor, kv_cache_layer: torch.Tensor,
                  slot_mapping: torch.Tensor, *, pdl: bool = False, kv_scale: torch.Tensor | None = None):
    """apply_rope on q and k, then k and v into the paged cache (2, NB, BS, Hkv, D) at slot_mapping: one launch.

    q (T, Hq, D), k and v (T, Hkv, D) may instead all be views of one split-K qkv GEMM's partials (PartialSums,
    from the Triton GEMM's park): added up here first. Returns the rotated q (T, Hq, D); the rotated k exists only
    in the cache. kv_scale: an FP8 cache's (2,) float32 [k_scale, v_scale]; it stores k / k_scale and v / v_scale
    (fp8.quantize_kv of the values rounded to q's dtype, as the torch path writes them)."""
    T, HQ, D = q.shape
    HK = k.shape[1]
    kv_fp8 = is_fp8_cache(kv_cache_layer, kv_scale)
    (q, k, v), dtype, parts, stride_part = unpack_qkv(q, k, v, kv_cache_layer.dtype)
    cs = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    c = kv_cache_layer
    q_out = buffers.alloc((T, HQ, D), dtype, c.device)
    if T:
        half = D // 2
        hq_pad, half_pad = triton.next_power_of_2(HQ), triton.next_power_of_2(half)
        # one program rotates all of a token's heads: 8 warps from 1,024 q pairs (1B at 64 rows: 1.91 µs a call
        # against 2.22 at 4 warps from parked partials, 1.77 against 1.86 from qkv, on the H200)
        warps = 8 if hq_pad * half_pad >= 1024 else 4
        _rope_write_kv_kernel[(T,)](
            q, k, v, positions, cs, q_out, c, slot_mapping, kv_scale if kv_fp8 else c,  # c: unused without KV_FP8
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            q_out.stride(0), q_out.stride(1), cs.stride(0), c.stride(0), c.stride(1), c.stride(2), c.stride(3),
            stride_part,
            HQ=HQ, HK=HK, HQ_PAD=hq_pad, HK_PAD=triton.next_power_of_2(HK),
            HALF=half, HALF_PAD=half_pad, D=D, D_PAD=triton.next_power_of_2(D),
            BS=c.shape[2], PARTS=parts, PDL=pdl, KV_FP8=kv_fp8, num_warps=warps, launch_pdl=pdl,
        )
    return q_out


# --------------------------------------------------------------------------------------------------------
# SiLU(gate) * up over the fused gate_up projection output
# --------------------------------------------------------------------------------------------------------
@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, I, BLOCK: tl.constexpr, PDL: tl.constexpr):
    allow_dependents(PDL)
    dependent_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, *, pdl: bool = False) -> torch.Tensor:
    """(…, 2I) → (…, I): silu(x[..., :I]) * x[..., I:] (gate first, as in the fused gate_up weight)."""
    shape = x.shape
    x2 = _rows(x)
    R, two_i = x2.shape
    I = two_i // 2
    out = buffers.alloc((R, I), x.dtype, x.device)
    if R and I:
        block = min(2048, triton.next_power_of_2(I))
        _silu_and_mul_kernel[(R, triton.cdiv(I, block))](x2, out, x2.stride(0), out.stride(0), I,
                                                        BLOCK=block, PDL=pdl, num_warps=_row_warps(block),
                                                        launch_pdl=pdl)
    return out.view(*shape[:-1], I)
