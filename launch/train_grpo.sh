#!/usr/bin/env bash
# Train a GRPO job with hybridrl.
#
#   launch/train_grpo.sh [CONFIG] [dotted.overrides=...]
#
# Uses the Ray cluster at RAY_ADDRESS when set (multi-node: start it with launch/ray_head.sh and
# launch/ray_worker.sh, or the SLURM example); otherwise hybridrl starts a local one-node cluster.
# Everything the run prints is also kept in RUN_DIR/train.log.
set -euo pipefail

config="${1:-configs/examples/qwen2.5_7b_grpo_8gpu.yaml}"
if [ "$#" -gt 0 ]; then shift; fi
run_dir="${RUN_DIR:-runs/$(date +%Y%m%d-%H%M%S)-grpo}"
mkdir -p "$run_dir"

# Refuse early, before any GPU or Ray is touched, if the config does not add up.
hybridrl plan "$config" "$@" > "$run_dir/plan.txt"

echo "run dir: $run_dir (plan in $run_dir/plan.txt)"
hybridrl train "$config" algorithm.adv_estimator=grpo "trainer.run_dir=$run_dir" "$@" 2>&1 \
  | tee "$run_dir/train.log"
