#!/usr/bin/env bash
# One GPU-machine session: GPU tests, then the benchmarks; logs under $OUT.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
timeout ${T_TESTS:-200} python3 -m pytest tests/gpu -x -q -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/gpu_tests.log"
timeout ${T_BENCH:-300} python3 -m backend.bench --workload blog-quick --new-tokens ${NEW:-512} --timeline "$OUT/blog" 2>&1 | tee "$OUT/blog.log" | grep -v "^#"
timeout 120 python3 -m backend.bench --workload small-64 --new-tokens ${NEW:-512} 2>&1 | tee "$OUT/small.log" | grep -v "^#"
timeout 60 python3 -m backend.bench --workload cpu-overhead --modes async 2>&1 | tee "$OUT/cpu.log" | tail -1
