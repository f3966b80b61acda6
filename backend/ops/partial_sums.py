"""Split-K partial sums that a GEMM leaves for the next kernel to add, instead of adding them itself."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class PartialSums:
    """A GEMM's output as its split-K partials: y = parts[0] + parts[1] + ..., added in this order, then rounded.

    A split-K GEMM whose output only feeds a kernel that reads it anyway (the residual add + RMSNorm, or rope +
    KV write) leaves its fp32 partials here; that kernel adds them in parallel, many programs at once, where the
    GEMM would have added them in one program per output tile after the last split finished."""

    parts: torch.Tensor  # (splits, rows, ...) float32
    dtype: torch.dtype  # the dtype the GEMM's output would have had; the sum is rounded to it

    @property
    def shape(self) -> torch.Size:
        return self.parts.shape[1:]

    def split(self, sizes: list[int], dim: int = -1) -> tuple["PartialSums", ...]:
        """y.split(sizes, dim=-1) as partial sums: views of the same parts (only the last dim may be split)."""
        if dim not in (-1, self.parts.dim() - 2):
            raise ValueError(f"partial sums split only along the last dim, got dim={dim}")
        return tuple(PartialSums(p, self.dtype) for p in self.parts.split(sizes, dim=-1))

    def view(self, *shape: int) -> "PartialSums":
        """y.view(*shape) as partial sums: a view of the parts with the split dim kept in front."""
        return PartialSums(self.parts.view(self.parts.shape[0], *shape), self.dtype)
