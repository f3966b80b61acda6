"""The Hopper (compute capability 9.0) launch shapes for the FP8-weight decode GEMM (triton/fp8_linear.py):
(N, K, BLOCK_M) → config, one set of tables per scale layout, since the block-scaled kernel scales every K step and
may want other tiles than the per-channel one. A config with quantize_x multiplies FP8 by FP8: x is quantized per
row first (one more launch) and W goes to the FP8 MMAs unconverted.

Measured on an H100 (the same sm_90 kernels as the H200's), 2026-12-06, `python -m bench.microbench --linear --fp8
[--park | --gated] --shapes 8b_qkv,8b_o,8b_gate_up,8b_down --rows 1,16,32,64 --prefill-rows ''`: the fastest path
per shape and BLOCK_M (rows 1 and 16 for 16), µs beside each entry with the rule's (W widened to bf16) after the
slash. Shapes not listed (the 70B's, block scales) run fp8_linear.choose_config's rule; none are invented here.
"""
from __future__ import annotations

from backend.ops.tuning import LinearConfig, TuningTables

# per output channel scales (N,): plain GEMMs, parked split-K partials (o, down, qkv), gate_up with SiLU-and-mul
_X8 = dict(quantize_x=True)
H200_FP8_CHANNEL_TABLES = TuningTables(
    plain={
        (6144, 4096, 16): LinearConfig(64, 256, 4, 4, **_X8),  # 8B qkv: 9.5 / 14.5 (rows 1)
        (6144, 4096, 32): LinearConfig(64, 128, 4, 4, **_X8),  # 10.4 / 15.7
        (6144, 4096, 64): LinearConfig(64, 256, 4, 4, **_X8),  # 11.4 / 26.9
        (4096, 4096, 16): LinearConfig(64, 256, 4, 4, **_X8),  # 8B o: 8.7 / 11.7
        (4096, 4096, 32): LinearConfig(64, 256, 4, 4, **_X8),  # 9.2 / 12.4
        (4096, 4096, 64): LinearConfig(64, 256, 4, 4, **_X8),  # 10.2 / 16.2
        (4096, 14336, 64): LinearConfig(64, 256, 4, 6, **_X8),  # 8B down: 33.2 / 37.5 (x's quantization costs
        # more at K = 14,336: at 1-32 rows the rule's W8A16 shape was as fast)
    },
    parked={
        (6144, 4096, 16): LinearConfig(64, 128, 4, 4, split_k=4, **_X8),  # 8B qkv: 9.1 / 13.0 (rows 1)
        (6144, 4096, 32): LinearConfig(64, 128, 4, 4, split_k=4, **_X8),  # 10.1 / 13.8
        (6144, 4096, 64): LinearConfig(64, 128, 4, 4, split_k=2, **_X8),  # 11.5 / 24.7
        (4096, 4096, 16): LinearConfig(64, 128, 4, 4, split_k=2, **_X8),  # 8B o: 7.4 / 9.5
        (4096, 4096, 32): LinearConfig(64, 128, 4, 4, split_k=2, **_X8),  # 8.0 / 10.3
        (4096, 4096, 64): LinearConfig(64, 128, 4, 4, split_k=2, **_X8),  # 8.7 / 13.3
        (4096, 14336, 64): LinearConfig(64, 256, 4, 4, split_k=2, **_X8),  # 8B down: 32.0 / 36.3
    },
    gated={
        (28672, 4096, 16): LinearConfig(128, 256, 8, 4, **_X8),  # 8B gate_up + SiLU-and-mul: 47.1 / 58.2 (rows 1)
        (28672, 4096, 32): LinearConfig(128, 256, 8, 4, **_X8),  # 49.2 / 62.1
        (28672, 4096, 64): LinearConfig(128, 128, 4, 4, **_X8),  # 51.4 / 70.7
    },
)

# 128 x 128 block scales: configs must keep block_k ≤ 128 (one scale column per K step; fp8_linear checks it)
H200_FP8_BLOCK_TABLES = TuningTables(
    plain={},
    parked={},
    gated={},
)

H200_FP8_TABLES: dict[str, TuningTables] = {"channel": H200_FP8_CHANNEL_TABLES, "block": H200_FP8_BLOCK_TABLES}

__all__ = ["H200_FP8_TABLES", "H200_FP8_CHANNEL_TABLES", "H200_FP8_BLOCK_TABLES", "LinearConfig"]
