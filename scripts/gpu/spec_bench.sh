#!/usr/bin/env bash
# On a host with a CUDA GPU: what speculative decoding gives against how often drafts are right, on the 8B shape
# (random weights, an oracle proposer: bench/spec_speed.py). BATCHES (default "1,8,32,128"), ALPHAS, K pick the runs,
# DRAFT_MODEL (e.g. random:llama-3.2-1b) adds a draft model's runs at DRAFT_ALPHAS (default 0.8);
# the log goes to $OUT/spec_speed.log (default out/spec).
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
OUT=${OUT:-out/spec}; mkdir -p "$OUT"
timeout "${T_SPEC:-400}" "$PY" -m bench.spec_speed --batches "${BATCHES:-1,8,32,128}" \
  --alphas "${ALPHAS:-0,0.5,0.8,1.0}" --k "${K:-4}" --draft-model "${DRAFT_MODEL:-}" \
  --draft-alphas "${DRAFT_ALPHAS:-0.8}" > "$OUT/spec_speed.log" 2>&1
rc=$?
grep -v '^{' "$OUT/spec_speed.log" | grep -v Warning | tail -45
exit $rc
