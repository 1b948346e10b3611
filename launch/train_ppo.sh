#!/usr/bin/env bash
# Train a PPO job (actor + critic + reference) with hybridrl.
#
#   launch/train_grpo.sh [CONFIG] [dotted.overrides=...]
#
# Uses the Ray cluster at RAY_ADDRESS when set (multi-node: start it with launch/ray_head.sh and
# launch/ray_worker.sh, or the SLURM example); otherwise hybridrl starts a local one-node cluster.
# Everything the run prints is also kept in RUN_DIR/train.log.
set -euo pipefail

config="${1:-configs/examples/llama3_70b_ppo_16x8.yaml}"
if [ "$#" -gt 0 ]; then shift; fi
run_dir="${RUN_DIR:-runs/$(date +%Y%m%d-%H%M%S)-ppo}"
mkdir -p "$run_dir"

# Refuse early, before any GPU or Ray is touched, if the config does not add up.
hybridrl plan "$config" "$@" > "$run_dir/plan.txt"

echo "run dir: $run_dir (plan in $run_dir/plan.txt)"
hybridrl train "$config" algorithm.adv_estimator=gae "trainer.run_dir=$run_dir" "$@" 2>&1 \
  | tee "$run_dir/train.log"
