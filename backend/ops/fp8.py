"""FP8 (e4m3) numbers for weights and the KV cache: quantize, dequantize, and the scale layouts the ops accept.

A quantized weight W (N, K) is stored as e4m3 values q and float32 scales s with W ≈ q * s, in one of two layouts:
- per output channel: s is (N,), row n of W is q[n] * s[n] (per-tensor checkpoints are stored this way, every
  row's scale the same: exact);
- per 128 x 128 block: s is (ceil(N / 128), ceil(K / 128)), W[n, k] = q[n, k] * s[n // 128, k // 128].
A KV-cache value v is stored as e4m3 v / scale, one scale for K and one for V per layer.
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 (fn) value
WEIGHT_BLOCK = 128  # the block edge of block-wise scales, the only one supported (as DeepSeek-V3 and Qwen3 FP8 use)
_MIN_SCALE = 1e-12  # an all-zero row or block keeps a positive scale


def is_fp8(t: torch.Tensor | None) -> bool:
    return t is not None and t.dtype == FP8_DTYPE


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    """amax / FP8_MAX as a true division (CUDA turns a division by a Python number into a product with its
    reciprocal, whose last bit can differ): the same scale bits on every device."""
    return (amax / torch.full_like(amax, FP8_MAX)).clamp(min=_MIN_SCALE)


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W (N, K) -> (q (N, K) e4m3, scale (N,) float32): each row's largest magnitude maps to FP8_MAX."""
    w = weight.float()
    scale = _scale_of(w.abs().amax(dim=1))  # (N,)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_per_block(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W (N, K) -> (q (N, K) e4m3, scale (ceil(N/128), ceil(K/128)) float32), one scale per 128 x 128 block."""
    n, k = weight.shape
    bn, bk = -(-n // WEIGHT_BLOCK), -(-k // WEIGHT_BLOCK)
    padded = torch.zeros(bn * WEIGHT_BLOCK, bk * WEIGHT_BLOCK, dtype=torch.float32, device=weight.device)
    padded[:n, :k] = weight.float()
    blocks = padded.view(bn, WEIGHT_BLOCK, bk, WEIGHT_BLOCK)  # (bn, 128, bk, 128)
    scale = _scale_of(blocks.abs().amax(dim=(1, 3)))  # (bn, bk)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view_as(padded)[:n, :k]
    return q.to(FP8_DTYPE).contiguous(), scale


def expand_scale(scale: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """A weight's scales as a float32 (N, K) or broadcastable (N, 1) tensor, whichever layout scale has."""
    n, k = shape
    if scale.dim() == 1:
        if scale.shape[0] != n:
            raise ValueError(f"a per-channel scale of a ({n}, {k}) weight must be ({n},), got {tuple(scale.shape)}")
        return scale.float()[:, None]
    want = (-(-n // WEIGHT_BLOCK), -(-k // WEIGHT_BLOCK))
    if tuple(scale.shape) != want:
        raise ValueError(f"a block scale of a ({n}, {k}) weight must be {want}, got {tuple(scale.shape)}")
    return scale.float().repeat_interleave(WEIGHT_BLOCK, 0)[:n].repeat_interleave(WEIGHT_BLOCK, 1)[:, :k]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q * s in float32, rounded once to dtype: the weight a model in dtype would hold."""
    return (weight.float() * expand_scale(scale, tuple(weight.shape))).to(dtype)


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Cache values x (any shape) -> e4m3 x / scale (scale a 0-d or 1-element float32 tensor), saturated."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 cache values -> x * scale in dtype."""
    return (x.float() * scale).to(dtype)
