#!/usr/bin/env bash
# One GPU-machine session: GPU tests, then the benchmarks; logs under $OUT.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
if [ -n "${TESTS:-}" ]; then
  timeout ${T_TESTS:-200} python3 -m pytest $TESTS -q -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
fi
bench() {  # name, timeout, args...
  local name=$1 t=$2; shift 2
  timeout "$t" python3 -m backend.bench "$@" > "$OUT/$name.log" 2>&1
  grep -v '^{' "$OUT/$name.log" | grep -v "^#" | grep -E "engine=|Error|error" | head -12
  tail -1 "$OUT/$name.log" > "$OUT/$name.json"
}
for spec in ${BENCHES:-}; do
  IFS=: read -r name t rest <<< "$spec"
  bench "$name" "$t" ${rest//+/ }
done
