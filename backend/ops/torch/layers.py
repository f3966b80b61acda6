"""Plain-torch linear, norm, rotary, activation and greedy-pick ops: the numerics reference for the CUDA kernels."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from backend.ops import fp8
from backend.ops.torch.attention import write_kv


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None, *, scale: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias); with `out` (x 2-D), the same cuBLAS product written into out instead.

    scale: weight is FP8 with these scales (backend/ops/fp8.py); it is dequantized to x's dtype first, so the
    product is exactly that of a model holding the dequantized weight (the reference the FP8 kernels are held to)."""
    if scale is not None:
        weight = fp8.dequantize(weight, scale, x.dtype)
    elif fp8.is_fp8(weight):
        raise ValueError("an FP8 weight needs its scale")
    if out is None:
        return F.linear(x, weight, bias)
    if x.dim() != 2:
        raise ValueError(f"linear with out= takes 2-D x, got shape {tuple(x.shape)}")
    if bias is None:
        return torch.mm(x, weight.t(), out=out)  # what F.linear runs for 2-D x without bias
    return torch.addmm(bias, x, weight.t(), out=out)


def greedy_argmax(logits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[i] = the first index of row i's maximum of logits (N, V); out is (N,) int64. Returns out."""
    return out.copy_(logits.argmax(dim=-1))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, exactly as transformers' LlamaRMSNorm (float32 math, cast, then * weight)."""
    input_dtype = x.dtype
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    xf = xf * torch.rsqrt(variance + eps)
    return weight * xf.to(input_dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm; returns (normed, x + residual), the sum in the model dtype as in HF."""
    summed = x + residual  # (T, H)
    return rms_norm(summed, weight, eps), summed


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (T, Hq, D) and k (T, Hkv, D) at `positions` (T,), HF rotate_half (neox) style.

    `cos_sin_cache` is (max_pos, D) float32: columns [:D/2] hold cos(pos * inv_freq) and [D/2:] hold sin,
    both already multiplied by the rope type's attention scaling.
    """
    half = cos_sin_cache.shape[-1] // 2
    cos_sin = cos_sin_cache.index_select(0, positions)  # (T, D)
    cos = cos_sin[:, :half].repeat(1, 2).unsqueeze(1)  # (T, 1, D): HF duplicates the freqs
    sin = cos_sin[:, half:].repeat(1, 2).unsqueeze(1)  # (T, 1, D)
    # HF casts cos/sin to the activations' dtype before rotating; do the same so bf16 matches it
    cos, sin = cos.to(q.dtype), sin.to(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  cos_sin_cache: torch.Tensor, kv_cache_layer: torch.Tensor, slot_mapping: torch.Tensor, *,
                  kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """apply_rope, then the rotated k and v into the paged cache at slot_mapping (an FP8 cache: divided by
    kv_scale's [k_scale, v_scale]); returns the rotated q."""
    q, k = apply_rope(q, k, positions, cos_sin_cache)
    write_kv(k, v, kv_cache_layer, slot_mapping, kv_scale=kv_scale)
    return q


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] (T, 2I) -> (T, I)."""
    inter = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :inter]) * x[..., inter:]
