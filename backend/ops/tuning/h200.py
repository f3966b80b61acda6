"""The H200's (compute capability 9.0) launch shapes for the Triton GEMM: (N, K, BLOCK_M) → config, each kept where
it beat cuBLAS on one H200 (torch 2.11, triton 3.6) by the TB/s of W noted beside it, measured with
`python -m bench.microbench --linear` (options as noted) on 2026-11-28 to 2026-11-30; docs/history/ holds the
runs. Every shape not listed, and every other GPU, keeps cuBLAS."""
from __future__ import annotations

from backend.ops.tuning import LinearConfig, TuningTables

# Where the kernel beat cuBLAS by 3% or more on the H200 (`python -m bench.microbench --linear`, TB/s of W
# kernel / cuBLAS in KERNELS.md): (N, K, BLOCK_M) → config. Every other shape, and every other GPU, keeps cuBLAS.
H200_CONFIGS: dict[tuple[int, int, int], LinearConfig] = {
    # Llama-3-8B: qkv, o, gate_up, lm_head
    (6144, 4096, 16): LinearConfig(64, 128, 4, 6),
    (4096, 4096, 16): LinearConfig(64, 128, 4, 4),
    (128256, 4096, 16): LinearConfig(128, 128, 4, 4),
    (6144, 4096, 32): LinearConfig(64, 128, 4, 6),
    (4096, 4096, 32): LinearConfig(64, 128, 4, 4, split_k=2),  # 3.62 TB/s; cuBLAS 3.02, no split 3.26
    (28672, 4096, 32): LinearConfig(64, 128, 4, 4),
    (128256, 4096, 32): LinearConfig(128, 128, 4, 4),
    (128256, 4096, 64): LinearConfig(128, 128, 4, 4),
    (4096, 14336, 64): LinearConfig(64, 128, 4, 4, split_k=2),  # down: 3.33 TB/s; cuBLAS (split-K + reduce) 3.20
    # Llama-3.2-1B: qkv, o, gate_up, lm_head (lm_head: 3.95 / 4.15 TB/s against cuBLAS's 3.71 / 4.03 at 64 / 32 rows)
    (3072, 2048, 16): LinearConfig(64, 128, 4, 4),
    (2048, 2048, 16): LinearConfig(32, 256, 4, 4),
    (16384, 2048, 16): LinearConfig(64, 128, 4, 4),
    (2048, 2048, 32): LinearConfig(16, 256, 4, 4),
    (2048, 8192, 32): LinearConfig(64, 128, 4, 4, split_k=4),  # down: 3.40 TB/s; cuBLAS 3.02
    (128256, 2048, 32): LinearConfig(128, 64, 4, 4),
    (128256, 2048, 64): LinearConfig(128, 64, 4, 4),
    # 64 rows, timed as 8 dependent launches in a row (`--chain 8 --pdl`), as they run in a step with
    # dependent_launch: gate_up 3.59 TB/s against cuBLAS 3.46, down 2.56 against cuBLAS (split-K + reduce) 2.28
    (16384, 2048, 64): LinearConfig(128, 128, 4, 4),
    (2048, 8192, 64): LinearConfig(64, 128, 4, 4, split_k=4),
}

# Where the output feeds add_rms_norm or rope_write_kv, which add parked split-K partials themselves: qkv, o and
# down. Timed as 8 dependent launches in a row (`--linear --park --chain 8 --pdl`), TB/s of W, against the best of
# cuBLAS and the unsplit kernel in the same run: 1B at 64 rows o 1.93 (1.32), down 3.17 (2.57 with the split-K sum
# in the GEMM); 8B at 16 / 32 / 64 rows o 3.49 / 3.28 / 3.21 (3.07 / 3.01 / 2.77), down 4.08 / 3.95 / 3.77 (3.78 /
# 3.68 / 3.25). 8B qkv won only at 16 rows, by 3%, and is not parked: its rope kernel would read four partials.
# 1B at 16 / 32 rows (2026-11-29, 932b23f): qkv 2.42 / 2.32 (2.13 / 2.00), o 1.96 / 1.79 (1.49 / 1.39), down 3.34 / 3.17
# (2.45 / 2.39; at 32 rows the GEMM table has the serial split-K of the same shape, not timed in that run).
H200_PARKED_CONFIGS: dict[tuple[int, int, int], LinearConfig] = {
    (3072, 2048, 16): LinearConfig(64, 128, 4, 6, split_k=2),
    (3072, 2048, 32): LinearConfig(64, 128, 4, 6, split_k=2),
    (3072, 2048, 64): LinearConfig(64, 128, 4, 4, split_k=2),  # qkv, read by rope_write_kv: 2.15; cuBLAS 1.93
    (2048, 2048, 16): LinearConfig(64, 128, 4, 6, split_k=2),
    (2048, 2048, 32): LinearConfig(64, 128, 4, 6, split_k=2),
    (2048, 2048, 64): LinearConfig(64, 128, 4, 4, split_k=4),
    (2048, 8192, 16): LinearConfig(64, 128, 4, 4, split_k=4),
    (2048, 8192, 32): LinearConfig(64, 128, 4, 4, split_k=4),
    (2048, 8192, 64): LinearConfig(64, 128, 4, 4, split_k=4),
    (4096, 4096, 16): LinearConfig(64, 128, 4, 6, split_k=2),
    (4096, 4096, 32): LinearConfig(64, 128, 4, 6, split_k=2),
    (4096, 4096, 64): LinearConfig(64, 128, 4, 4, split_k=2),
    (4096, 14336, 16): LinearConfig(64, 128, 4, 6, split_k=2),
    (4096, 14336, 32): LinearConfig(64, 128, 4, 6, split_k=2),
    (4096, 14336, 64): LinearConfig(64, 128, 4, 4, split_k=2),
}


# gate_up with SiLU-and-mul in the epilogue (linear_silu_and_mul; block_n counts the rows of both halves). Timed as
# 8 dependent launches in a row (`--linear --gated --chain 8 --pdl`), TB/s of W, against the table's GEMM followed
# by the SiLU-and-mul kernel (or cuBLAS and SiLU-and-mul where the GEMM table has no entry): 1B at 16 rows 3.78
# (3.57), at 32 rows 3.67 (cuBLAS 3.17; 6f64151), at 64 rows 3.45 (3.24); 8B at 16 / 32 / 64 rows 4.11 /
# 4.01 / 3.83 (3.99 / 3.91 / 3.53). With the GEMM table's 64-row tile at 16 rows the fused 1B kernel ran at 2.98,
# slower than the two kernels, so only measured shapes fuse.
H200_GATED_CONFIGS: dict[tuple[int, int, int], LinearConfig] = {
    (16384, 2048, 16): LinearConfig(128, 128, 4, 4),
    (16384, 2048, 32): LinearConfig(128, 128, 4, 4),
    (16384, 2048, 64): LinearConfig(128, 128, 4, 4),
    (28672, 4096, 16): LinearConfig(128, 128, 4, 4),
    (28672, 4096, 32): LinearConfig(128, 128, 4, 4),
    (28672, 4096, 64): LinearConfig(128, 128, 4, 4),
}


H200_TABLES = TuningTables(H200_CONFIGS, H200_PARKED_CONFIGS, H200_GATED_CONFIGS)
