"""The H200's (compute capability 9.0) launch shapes for the FP8-weight decode GEMM (triton/fp8_linear.py):
(N, K, BLOCK_M) → config, one set of tables per scale layout, since the block-scaled kernel scales every K step and
may want other tiles than the per-channel one.

Empty until measured: every shape not listed runs fp8_linear.choose_config's rule. Entries are to be added from
`python -m bench.microbench --linear --fp8` runs on the GPU (the TB/s of W beside each, as in h200.py); none are
invented here.
"""
from __future__ import annotations

from backend.ops.tuning import LinearConfig, TuningTables

# per output channel scales (N,): plain GEMMs, parked split-K partials (o, down, qkv), gate_up with SiLU-and-mul
H200_FP8_CHANNEL_TABLES = TuningTables(
    plain={},
    parked={},
    gated={},
)

# 128 x 128 block scales: configs must keep block_k ≤ 128 (one scale column per K step; fp8_linear checks it)
H200_FP8_BLOCK_TABLES = TuningTables(
    plain={},
    parked={},
    gated={},
)

H200_FP8_TABLES: dict[str, TuningTables] = {"channel": H200_FP8_CHANNEL_TABLES, "block": H200_FP8_BLOCK_TABLES}

__all__ = ["H200_FP8_TABLES", "H200_FP8_CHANNEL_TABLES", "H200_FP8_BLOCK_TABLES", "LinearConfig"]
