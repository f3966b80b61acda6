#!/usr/bin/env bash
# GPU tests, then benchmarks, on any host with a CUDA GPU and this repository's dependencies installed.
# Results go to four files under $OUT (default ./out): gpu.txt (nvidia-smi: GPU name, memory used, SM clock),
# gpu_tests.log (the last lines of pytest), bench.log (every benchmark's output, each headed "== name") and
# bench.jsonl (each benchmark's JSON line, tagged with its name).
# TESTS="<pytest paths>" runs those tests first (T_TESTS: their timeout in seconds, default 200).
# BENCHES="name:timeout:args+with+plus ..." runs `python -m bench.offline` once per entry, the pluses read as
# spaces, e.g. BENCHES="small:150:--workload+small-64+--modes+async". PY: the Python to use (default python3).
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
  timeout "$t" "$PY" -m bench.offline "$@" > "$log" 2>&1
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
