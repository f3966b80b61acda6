#!/usr/bin/env bash
# Before and after on one GPU, in one run: each benchmark runs in another tree of this repository (BEFORE_DIR, made
# e.g. with `git worktree add /tmp/before <rev>` or `git archive <rev> backend bench | tar -x -C /tmp/before`) and
# then in this one, ROUNDS times (default 2), so the ratios compare like with like on the same warm GPU.
# BENCHES: "name:args ..." entries, each `python -m bench.offline` arguments with pluses read as spaces, e.g.
# BENCHES="mix1b:--workload+mix-1b+--modes+async+--decoding+sampled+--set+max_num_seqs=256".
# Uses the machine's python3 (PY=...); LOG_DIR (default out/ab) keeps every log; each run's engine lines are listed.
set -uo pipefail
cd "$(dirname "$0")/../.."
here=$(pwd)
PY=${PY:-python3}
case $PY in */*) PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY") ;; esac  # the runs change directory
LOG_DIR=${LOG_DIR:-out/ab}
BEFORE_DIR=$(cd "${BEFORE_DIR:?set BEFORE_DIR to the tree to compare against}" && pwd)
mkdir -p "$LOG_DIR"
export PYTHONUNBUFFERED=1
fail=0
for round in $(seq 1 "${ROUNDS:-2}"); do
  for spec in ${BENCHES:?set BENCHES}; do
    name=${spec%%:*}
    args=${spec#*:}
    for side in before after; do
      dir=$here
      [ "$side" = before ] && dir=$BEFORE_DIR
      log="$LOG_DIR/$name-$side-$round.log"
      (cd "$dir" && "$PY" -m bench.offline ${args//+/ }) > "$log" 2>&1 || { fail=1; tail -5 "$log"; }
      echo "$name $side $round: $(grep -E '^engine=tandem' "$log" | sed -E 's/ prompt_tok_per_s=[0-9.]+//' | paste -sd'|')"
    done
  done
done
echo "ab_trees: $([ "$fail" -eq 0 ] && echo PASSED || echo FAILED)"
exit "$fail"
