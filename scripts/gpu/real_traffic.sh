#!/usr/bin/env bash
# Realistic traffic on one GPU (bench/traffic.py mixes): each workload in async mode, greedy and sampled, once with
# the engine's defaults (the fused sampler and the mixed-step graphs) and once with both off, so one run of this
# script gives before/after ratios; then, with KERNEL_BUSY=1, the defaults once more under torch.profiler, to check
# the timeline's GPU-busy figure against the kernel time. Uses the machine's python3 (PY=... to choose another);
# LOG_DIR (default out/real-traffic) keeps every log. WORKLOADS, DECODING choose the runs.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
LOG_DIR=${LOG_DIR:-out/real-traffic}
mkdir -p "$LOG_DIR"
export PYTHONUNBUFFERED=1
fail=0
run() {  # name, then bench.offline arguments
  local name=$1
  shift
  "$PY" -m bench.offline --modes async --decoding "${DECODING:-greedy,sampled}" "$@" 2>&1 | tee "$LOG_DIR/$name.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || fail=1
}
for workload in ${WORKLOADS:-mix-1b mix-8b}; do
  run "$workload-defaults" --workload "$workload"
  run "$workload-without" --workload "$workload" --set fused_sampler=false --set mixed_step_graphs=false
  if [ -n "${KERNEL_BUSY:-}" ]; then
    run "$workload-kernel-busy" --workload "$workload" --kernel-busy
  fi
done
echo "== real-traffic summary =="
grep -hE '^engine=tandem' "$LOG_DIR"/*.log | sed -E 's/ cpu_us_by_phase=.*//'
exit "$fail"
