#!/usr/bin/env bash
# FP8 against bf16 on one GPU, in one run so the ratios compare like with like: each group runs the same workload in
# bf16, with FP8 weights (quantization=fp8), and with FP8 weights + an FP8 KV cache, async mode.
# RUNS chooses (default: all, in this order):
#   linear   bench.microbench --linear --fp8 (the FP8 decode GEMM, bf16 and FP8 x FP8 per shape)
#   b32      8B shape, 32 x (128 + 2,048) greedy
#   b256     8B shape, 256 x (128 + 2,048) greedy, and 512 with the FP8 KV cache
#   mix      8B realistic mix, sampled, 256 running at most
#   batch1   8B shape, 1 x (128 + 512)
#   prefill  8B shape, 32 prompts of 2,048 tokens, one new token
#   b70      70B shape, FP8 weights + FP8 KV, 32 x (128 + 2,048)
# Uses the machine's python3 (PY=...); LOG_DIR (default out/fp8) keeps every log; the summary lists each run's line.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
LOG_DIR=${LOG_DIR:-out/fp8}
mkdir -p "$LOG_DIR"
export PYTHONUNBUFFERED=1
fail=0
FP8=(--set quantization=fp8)
FP8KV=(--set quantization=fp8 --set kv_cache_dtype=fp8)
run() {  # name, then bench.offline arguments
  local name=$1
  shift
  "$PY" -m bench.offline --modes async "$@" > "$LOG_DIR/$name.log" 2>&1
  local rc=$?
  [ "$rc" -eq 0 ] || { fail=1; tail -5 "$LOG_DIR/$name.log"; }
  echo "$name (rc $rc): $(grep -E '^engine=tandem' "$LOG_DIR/$name.log" | sed -E 's/ cpu_us_by_phase=.*//' | tail -2)"
}
for group in ${RUNS:-linear b32 b256 mix batch1 prefill b70}; do
  case $group in
    linear) "$PY" -m bench.microbench --linear --fp8 > "$LOG_DIR/linear.log" 2>&1 || fail=1
            grep -vE '^#' "$LOG_DIR/linear.log" | tail -60 ;;
    b32) run b32-bf16 --workload blog-quick
         run b32-fp8 --workload blog-quick "${FP8[@]}"
         run b32-fp8kv --workload blog-quick "${FP8KV[@]}" ;;
    b256) run b256-bf16 --workload blog-quick --requests 256 --set max_num_seqs=256
          run b256-fp8kv --workload blog-quick --requests 256 --set max_num_seqs=256 "${FP8KV[@]}"
          run b512-fp8kv --workload blog-quick --requests 512 --set max_num_seqs=512 --set max_graph_batch_size=512 \
              "${FP8KV[@]}" ;;
    mix) run mix-bf16 --workload mix-8b --decoding sampled --set max_num_seqs=256
         run mix-fp8kv --workload mix-8b --decoding sampled --set max_num_seqs=256 "${FP8KV[@]}" ;;
    batch1) run batch1-bf16 --workload blog-quick --requests 1 --new-tokens 512
            run batch1-fp8kv --workload blog-quick --requests 1 --new-tokens 512 "${FP8KV[@]}" ;;
    prefill) run prefill-bf16 --workload prefill-8b
             run prefill-fp8 --workload prefill-8b "${FP8[@]}" ;;
    b70) run b70-fp8kv --workload blog-70b "${FP8KV[@]}" ;;
    *) echo "unknown group $group"; fail=1 ;;
  esac
done
echo "fp8_bench: $([ "$fail" -eq 0 ] && echo PASSED || echo FAILED)"
exit "$fail"
