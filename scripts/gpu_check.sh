#!/usr/bin/env bash
# One GPU-machine session: GPU tests, then the benchmarks. Everything lands in four files under $OUT (the device
# tool brings back only a few files per call): gpu.txt, gpu_tests.log, bench.log (every run's output, each
# headed "== name") and bench.jsonl (each run's JSON line, tagged with its name).
# BENCHES="name:timeout:args+with+plus ..." e.g. "small:150:--workload+small-64+--modes+async".
set -u
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
if [ -n "${TESTS:-}" ]; then
  timeout ${T_TESTS:-200} "$PY" -m pytest $TESTS -q -p no:cacheprovider 2>&1 | tail -25 > "$OUT/gpu_tests.log"
  tail -3 "$OUT/gpu_tests.log"
fi
bench() {  # name, timeout, args...
  local name=$1 t=$2; shift 2
  local log; log=$(mktemp)
  timeout "$t" "$PY" -m backend.bench "$@" > "$log" 2>&1
  echo "rc=$? (timeout $t s)" >> "$log"
  { echo "== $name: $*"; cat "$log"; } >> "$OUT/bench.log"
  grep -E "engine=|Error|error|^rc=" "$log" | grep -v '^{' | cut -c1-400 | sed "s/^/$name  /" | head -12
  grep '^{' "$log" | tail -1 | sed "s/^{/{\"name\": \"$name\", /" >> "$OUT/bench.jsonl"
  rm -f "$log"
}
for spec in ${BENCHES:-}; do
  IFS=: read -r name t rest <<< "$spec"
  bench "$name" "$t" ${rest//+/ }
done
