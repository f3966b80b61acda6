#!/usr/bin/env bash
# Starts tritonserver on Tandem's model repository; TANDEM_MODEL points the llm model at a mounted checkpoint.
# SIGTERM (docker stop, Kubernetes) drains: the model takes no new requests and ends the streams still running after
# its drain_timeout_s (25 s by default) with a final response, then Triton exits (keep --exit-timeout-secs above it).
set -euo pipefail
repo=/opt/tandem/model_repository
if [ -n "${TANDEM_MODEL:-}" ]; then
  sed -i "s#string_value: \"smollm2-135m-instruct\"#string_value: \"${TANDEM_MODEL}\"#" "$repo/llm/config.pbtxt"
fi
export TANDEM_DRAIN_FILE="${TANDEM_DRAIN_FILE:-/tmp/tandem-drain}"
rm -f "$TANDEM_DRAIN_FILE"
tritonserver --model-repository "$repo" "$@" &
server=$!
drain() { touch "$TANDEM_DRAIN_FILE"; kill -TERM "$server" 2>/dev/null || true; }
trap drain TERM INT
status=0
wait "$server" || status=$?
if kill -0 "$server" 2>/dev/null; then  # the trap interrupted the first wait: wait for the drained exit
  wait "$server" || status=$?
fi
exit "$status"
