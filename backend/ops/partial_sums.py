"""Split-K partial sums that a GEMM leaves for the next kernel to add, instead of adding them itself."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class PartialSums:
    """A GEMM's output as its split-K partials: y = parts[0] + parts[1] + ..., added in this order, then rounded.

    A split-K GEMM whose output only feeds the residual add + RMSNorm leaves its fp32 partials here; that kernel
    reads them anyway and adds them in parallel, one row per program, where the GEMM would have added them in
    one program per output tile after the last split finished."""

    parts: torch.Tensor  # (splits, rows, N) float32
    dtype: torch.dtype  # the dtype the GEMM's output would have had; the sum is rounded to it

    @property
    def shape(self) -> torch.Size:
        return self.parts.shape[1:]
