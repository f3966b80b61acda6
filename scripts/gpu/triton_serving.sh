#!/usr/bin/env bash
# On a host with a CUDA GPU: Tandem served by a real tritonserver (the one inside the nvidia-pytriton wheel),
# compared with the engine alone (bench.serve_bench), then Locust at 32, 64 and 128 users.
# Results under $OUT (default ./out): serve_bench.log, triton_tests.log, locust.jsonl (one summary per user
# count), locust_server.log, the last level's charts (locust_<users>_*.png), and pyspy_gil.txt / pyspy.log with PYSPY.
# MODEL (default random:llama-3-8b), LEVELS (serve_bench's concurrencies, default 32,64,128), NEW_TOKENS (default
# 512), USERS (default "32 64 128"), LOCUST_DURATION (seconds, default 60); SERVE_BENCH=0 or LOCUST=0 skips a part.
# SERVE_ARGS: more serve_bench options (e.g. --engine-stream).
# PYSPY=<seconds>: py-spy samples the model's stub process (threads holding the GIL) from its start, into pyspy_gil.txt.
# TRITON_TESTS=<pytest paths> first runs tests that need this tritonserver (e.g. the multi-GPU test).
#
# Installs nothing from a package registry, so it runs on hosts without one: everything comes from `.whl/`
# (git-ignored), holding pytriton-trim.tar.xz (the wheel's pytriton/ and nvidia_pytriton.libs/ without what a
# Python 3.12 server doesn't need), numpy-1.26.4 (the wheel's stub needs NumPy 1), tritonclient + python-rapidjson,
# and locust with the dependencies the host lacks (README, "Benchmarks and load tests"). Unpacked into /tmp.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
PY=${PY:-python3}
MODEL=${MODEL:-random:llama-3-8b}
NEW_TOKENS=${NEW_TOKENS:-512}
SITE=/tmp/tandem-site; NUMPY1=/tmp/tandem-numpy1
mkdir -p "$SITE" "$NUMPY1"
tar xJf .whl/pytriton-trim.tar.xz -C "$SITE"
"$PY" -m pip install -q --no-index --no-deps --target "$SITE" $(ls .whl/*.whl | grep -v '/numpy-') 2>&1 | tail -2
"$PY" -m pip install -q --no-index --no-deps --target "$NUMPY1" .whl/numpy-*.whl 2>&1 | tail -2
export PYTHONPATH="$SITE:$PWD/client" TANDEM_SERVER_PYTHONPATH="$NUMPY1"  # client/: the tandem_client package, not installed here

if [ -n "${TRITON_TESTS:-}" ]; then  # tests that start tritonserver themselves, e.g. tests/gpu/test_multi_gpu.py
  timeout "${T_TESTS:-300}" "$PY" -m pytest $TRITON_TESTS -q -s -p no:cacheprovider > "$OUT/triton_tests.log" 2>&1
  grep -E "requests per instance|passed|failed|Error" "$OUT/triton_tests.log" | tail -8
fi

if [ -n "${PYSPY:-}" ]; then  # PYSPY=<seconds>: sample which stub threads hold the GIL (py-spy wheel in .whl/)
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/pyspy .whl/py_spy-*.whl 2>&1 | tail -2
  # the newest stub alive for 10 s: the first one only answers auto_complete_config and exits
  ( for _ in $(seq 600); do pid=$(pgrep -n -f triton_python_backend_stub)
      [ -n "$pid" ] && [ "$(ps -o etimes= -p "$pid" | tr -d ' ')" -ge 10 ] 2>/dev/null && break; sleep 1; done
    /tmp/pyspy/bin/py-spy record --pid "$pid" --duration "$PYSPY" --rate 500 --gil --threads --nonblocking \
      --format raw -o "$OUT/pyspy_gil.txt" > "$OUT/pyspy.log" 2>&1 ) &
fi

if [ "${SERVE_BENCH:-1}" = 1 ]; then
  timeout "${T_SERVE_BENCH:-330}" "$PY" -m bench.serve_bench --model "$MODEL" --concurrency "${LEVELS:-32,64,128}" \
    --new-tokens "$NEW_TOKENS" --log /tmp/serve_bench_server.log ${SERVE_ARGS:-} > "$OUT/serve_bench.log" 2>&1
  grep -E "^E[0-9]|tandem:" /tmp/serve_bench_server.log | cut -c1-600 >> "$OUT/serve_bench.log"
  grep -E "^triton|^engine|Error|error:|^E[0-9]" "$OUT/serve_bench.log" | cut -c1-400
fi

if [ "${LOCUST:-1}" = 1 ]; then
  "$PY" -m scripts.serve --param "model=$MODEL" --param max_num_seqs=128 --param max_model_len=4096 --param timeline=true \
    > "$OUT/locust_server.log" 2>&1 &
  server=$!
  for _ in $(seq 600); do grep -q "Ctrl-C stops" "$OUT/locust_server.log" && break; kill -0 $server || break; sleep 1; done
  for users in ${USERS:-32 64 128}; do
    timeout "${T_LOCUST:-120}" "$PY" -m loadtest.run --users "$users" --spawn-rate "$users" \
      --duration "${LOCUST_DURATION:-60}" --max-tokens "$NEW_TOKENS" --ignore-eos --out "/tmp/lt$users" \
      --metrics-url http://localhost:8002/metrics \
      > "/tmp/lt$users.log" 2>&1
    echo "users=$users rc=$?: $(tail -2 /tmp/lt$users.log | head -1)"
    [ -f "/tmp/lt$users/summary.json" ] && "$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); \
print(json.dumps({'users': int(sys.argv[2]), **d}))" "/tmp/lt$users/summary.json" "$users" >> "$OUT/locust.jsonl"
  done
  last=$(echo ${USERS:-32 64 128} | awk '{print $NF}')
  for png in /tmp/lt$last/*.png; do [ -e "$png" ] && cp "$png" "$OUT/locust_${last}_$(basename "$png")"; done
  kill -TERM $server; wait $server; echo "server exit: $?"
fi
ls "$OUT"
