#!/usr/bin/env bash
# Train a PPO job (actor + critic + reference): launch/train_ppo.sh [CONFIG] [overrides]  (see launch/train.sh)
set -euo pipefail
ADV_ESTIMATOR=gae exec "$(dirname "$0")/train.sh" "${1:-configs/examples/llama3_70b_ppo_16x8.yaml}" "${@:2}"
