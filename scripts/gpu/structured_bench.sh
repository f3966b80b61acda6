#!/usr/bin/env bash
# On a host with a CUDA GPU: what structured outputs cost on the 8B shape (random weights), part by part:
#   stall  bench.grammar_stall: new ~2 KB tool schemas compiled while 128 streams decode (longest step / median)
#   mix    bench.offline mix-8b, sampled, async: every request a JSON schema, then none (output tok/s of each)
#   serve  bench.serve_bench through tritonserver: 32 free streams alone, then beside 32 JSON-schema streams (ITL)
#   free   bench.offline mix-1b, sampled, async, unconstrained: the figure structured outputs must leave unchanged
# PARTS (default "stall mix serve free") picks them; logs go to $OUT (default out/structured).
# Needs llguidance (installed from .whl/ where missing); serve also needs what scripts/gpu/triton_serving.sh needs.
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
OUT=${OUT:-out/structured}; mkdir -p "$OUT"
if ! "$PY" -c 'import llguidance' 2>/dev/null && ls .whl/llguidance-*.whl > /dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/tandem-grammar .whl/llguidance-*.whl &&
    export PYTHONPATH=/tmp/tandem-grammar${PYTHONPATH:+:$PYTHONPATH}
fi
for part in ${PARTS:-stall mix serve free}; do
  echo "== $part $(date -u +%H:%M:%S)"
  case $part in
    stall) timeout 200 "$PY" -m bench.grammar_stall --streams 128 > "$OUT/stall.log" 2>&1
           tail -3 "$OUT/stall.log" | head -2 ;;
    mix) for share in 1.0 0; do
           timeout 200 "$PY" -m bench.offline --workload mix-8b --decoding sampled --modes async \
             --structured-share "$share" > "$OUT/mix-8b-share-$share.log" 2>&1
           grep -E "^engine=tandem" "$OUT/mix-8b-share-$share.log" | cut -c1-400
         done ;;
    serve) OUT="$OUT/serve" LEVELS=64 NEW_TOKENS=512 LOCUST=0 T_SERVE_BENCH=300 \
             SERVE_ARGS="--structured-share 0.5" bash scripts/gpu/triton_serving.sh 2>&1 | tail -6
           grep -oE "(unconstrained_itl_vs_alone|constrained_itl_vs_unconstrained|itl_ms_[a-z_]+)=[^ ]*( '[a-z0-9]+': [0-9.]+,?)*" \
             "$OUT/serve/serve_bench.log" | head -8 ;;
    free) timeout 200 "$PY" -m bench.offline --workload mix-1b --decoding sampled --modes async \
            > "$OUT/mix-1b.log" 2>&1
          grep -E "^engine=tandem" "$OUT/mix-1b.log" | cut -c1-400 ;;
  esac
done
