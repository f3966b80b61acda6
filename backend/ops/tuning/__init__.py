"""Launch shapes of the Triton GEMM measured per kind of GPU: the types the tables are made of."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LinearConfig:
    """One launch shape: W rows per program, K per loop step, warps, pipeline stages, K splits, and (FP8 weights
    only) whether x is quantized to e4m3 so that the kernel multiplies FP8 by FP8."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1  # > 1: K is cut in this many runs; the last program of a W slice to finish adds them up
    quantize_x: bool = False  # FP8 weights: x quantized per row (per 128 columns for block scales), FP8 x FP8 MMAs


@dataclass(frozen=True, slots=True)
class TuningTables:
    """The launch shapes measured on one kind of GPU, each table keyed by (N, K, BLOCK_M): plain GEMMs, GEMMs that
    park their split-K partials for the next kernel, and gate_up with SiLU-and-mul in its epilogue."""

    plain: dict[tuple[int, int, int], LinearConfig]
    parked: dict[tuple[int, int, int], LinearConfig]
    gated: dict[tuple[int, int, int], LinearConfig]
