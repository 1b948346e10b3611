#!/usr/bin/env bash
# Train a GRPO job: launch/train_grpo.sh [CONFIG] [dotted.overrides=...]  (see launch/train.sh)
set -euo pipefail
ADV_ESTIMATOR=grpo exec "$(dirname "$0")/train.sh" "${1:-configs/examples/qwen2.5_7b_grpo_8gpu.yaml}" "${@:2}"
