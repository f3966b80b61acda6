#!/usr/bin/env bash
# `make test-gpu`: what a change to code that runs only with CUDA must pass on a GPU machine before it lands.
# The CUDA tests (tests/gpu, and tests/kernels compiled rather than interpreted), then one short benchmark of each
# model shape, so a crash at start-up or in the first steps shows: small-64 (Llama-3.2-1B shape) and blog-quick
# (Llama-3-8B shape), each in sync and async mode. Uses the machine's own python3 (PY=... to choose another) and
# its installed torch, triton and transformers; LOG_DIR (default out/test-gpu) keeps every log.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
LOG_DIR=${LOG_DIR:-out/test-gpu}
mkdir -p "$LOG_DIR"
export PYTHONUNBUFFERED=1
fail=0

"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "test-gpu: CUDA is not available")' || exit 2
# a host without the structured-outputs library (llguidance, requirements.txt) or the schema validator its tests use
# (jsonschema) may bring their wheels, with jsonschema's dependencies, in .whl/
if ! "$PY" -c 'import llguidance, jsonschema' 2>/dev/null; then
  wheels=$(ls .whl/llguidance-*.whl .whl/jsonschema*.whl .whl/referencing-*.whl .whl/rpds_py-*.whl .whl/attrs-*.whl 2>/dev/null)
  [ -n "$wheels" ] && "$PY" -m pip install -q --no-index --no-deps --target /tmp/tandem-site $wheels &&
    export PYTHONPATH=/tmp/tandem-site${PYTHONPATH:+:$PYTHONPATH}
fi
# the two folders run side by side: the kernel tests spend most of their time compiling (CPU), the engine tests on
# the GPU, and every test sizes its own KV cache small, so both fit on one card at once
"$PY" -m pytest tests/kernels -q -p no:cacheprovider --durations=10 >"$LOG_DIR/tests-kernels.log" 2>&1 &
kernels_pid=$!
"$PY" -m pytest tests/gpu -q -p no:cacheprovider --durations=10 >"$LOG_DIR/tests-gpu.log" 2>&1
gpu_rc=$?
wait "$kernels_pid"
kernels_rc=$?
cat "$LOG_DIR/tests-kernels.log" "$LOG_DIR/tests-gpu.log" | tee "$LOG_DIR/tests.log"
tests_rc=$(( gpu_rc || kernels_rc ))
[ "$tests_rc" -eq 0 ] || fail=1

summary=()
for workload in ${WORKLOADS:-small-64 blog-quick}; do
  "$PY" -m bench.offline --workload "$workload" 2>&1 | tee "$LOG_DIR/bench-$workload.log"
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || fail=1
  rates=$(grep -oE '^engine=tandem  mode=[a-z]+ .* tok_per_s=[0-9.]+' "$LOG_DIR/bench-$workload.log" |
          sed -E 's/^engine=tandem  mode=([a-z]+) .* tok_per_s=([0-9.]+)/\1 \2 tok\/s/' | paste -sd, -)
  summary+=("$workload: ${rates:-no result} (rc $rc)")
done

echo "== test-gpu summary =="
for part in kernels gpu; do
  echo "tests/$part: $(grep -E '(passed|failed|error)' "$LOG_DIR/tests-$part.log" | tail -1)"
done
echo "tests: rc $tests_rc"
printf '%s\n' "${summary[@]}"
[ "$fail" -eq 0 ] && echo "test-gpu: PASSED" || echo "test-gpu: FAILED"
exit "$fail"
