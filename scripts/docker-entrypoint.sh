#!/usr/bin/env bash
# Starts tritonserver on Tandem's model repository; TANDEM_MODEL points the llm model at a mounted checkpoint.
set -euo pipefail
repo=/opt/tandem/model_repository
if [ -n "${TANDEM_MODEL:-}" ]; then
  sed -i "s#string_value: \"smollm2-135m-instruct\"#string_value: \"${TANDEM_MODEL}\"#" "$repo/llm/config.pbtxt"
fi
exec tritonserver --model-repository "$repo" "$@"
