"""FP8 weights in the model's fused layout: quantize a wide weight on its device, fuse quantized parts (q/k/v,
gate/up) into one weight with scales in a layout backend/ops/fp8.py takes."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.ops import fp8

# rows quantized at once: the float32 temporaries of a 70B's gate_up (57,344 x 8,192) stay a few hundred MB
_QUANTIZE_ROWS = 4096


@dataclass(slots=True)
class FP8Weight:
    """An e4m3 weight and its float32 scales: (N,) per output channel or (ceil(N/128), ceil(K/128)) per block."""

    weight: torch.Tensor  # (N, K) float8_e4m3fn
    scale: torch.Tensor  # (N,) or (ceil(N/128), ceil(K/128)) float32

    @property
    def is_block(self) -> bool:
        return self.scale.dim() == 2

    def to(self, device: torch.device) -> FP8Weight:
        return FP8Weight(self.weight.to(device).contiguous(), self.scale.to(device).contiguous())


def quantize_on_device(weight: torch.Tensor, device: torch.device) -> FP8Weight:
    """A wide weight (N, K), in whatever dtype the checkpoint holds, quantized per output channel on device.

    Only this one tensor is ever wide on the device, and it is quantized a few thousand rows at a time (each row's
    scale depends on that row alone, so this is exactly fp8.quantize_per_channel of the whole)."""
    wide = weight.to(device)
    n, k = wide.shape
    q = torch.empty(n, k, dtype=fp8.FP8_DTYPE, device=device)  # (N, K)
    scale = torch.empty(n, dtype=torch.float32, device=device)  # (N,)
    for start in range(0, n, _QUANTIZE_ROWS):
        rows = slice(start, min(start + _QUANTIZE_ROWS, n))
        q[rows], scale[rows] = fp8.quantize_per_channel(wide[rows])
    del wide  # the wide copy goes as soon as the FP8 one exists
    return FP8Weight(q, scale)


def fuse(parts: list[FP8Weight], names: list[str]) -> tuple[FP8Weight, bool]:
    """Parts stacked along N (q, k, v or gate, up) -> (one FP8Weight, whether it had to be requantized).

    Per-channel scales concatenate. Block scales concatenate their block rows when every part but the last fills
    whole 128-row blocks (a real model's q, k and v do); otherwise a fused block would straddle two parts with two
    scales, so the parts are dequantized to float32 and the fused weight requantized per block: a second rounding,
    within one e4m3 step of the checkpoint's values (tiny models only; the loader says so once)."""
    if len(parts) == 1:
        return parts[0], False
    k = parts[0].weight.shape[1]
    if any(p.weight.shape[1] != k for p in parts):
        raise ValueError(f"{names} have different input sizes: {[tuple(p.weight.shape) for p in parts]}")
    weight = torch.cat([p.weight for p in parts], dim=0)  # (sum N, K) e4m3
    if not any(p.is_block for p in parts):
        return FP8Weight(weight, torch.cat([p.scale for p in parts])), False
    aligned = all(p.weight.shape[0] % fp8.WEIGHT_BLOCK == 0 for p in parts[:-1])
    if all(p.is_block for p in parts) and aligned:
        return FP8Weight(weight, torch.cat([p.scale for p in parts], dim=0)), False
    wide = torch.cat([fp8.dequantize(p.weight, p.scale, torch.float32) for p in parts])  # (sum N, K)
    q, scale = fp8.quantize_per_block(wide)
    return FP8Weight(q, scale), True
