#!/usr/bin/env bash
# Train a hybridrl job: launch/train.sh [CONFIG] [dotted.overrides=...]
#
# Uses the Ray cluster at RAY_ADDRESS when set (multi-node: start it with launch/ray_head.sh and
# launch/ray_worker.sh, or the SLURM example); otherwise hybridrl starts a local one-node cluster.
# Everything the run prints is also kept in RUN_DIR/train.log. ADV_ESTIMATOR (grpo, gae, ...)
# overrides algorithm.adv_estimator; train_grpo.sh and train_ppo.sh set it.
set -euo pipefail

config="${1:-configs/examples/qwen2.5_7b_grpo_8gpu.yaml}"
if [ "$#" -gt 0 ]; then shift; fi
estimator="${ADV_ESTIMATOR:-}"
run_dir="${RUN_DIR:-runs/$(date +%Y%m%d-%H%M%S)-${estimator:-train}}"
mkdir -p "$run_dir"
extra=()
if [ -n "$estimator" ]; then extra+=("algorithm.adv_estimator=$estimator"); fi

# Refuse early, before any GPU or Ray is touched, if the config does not add up.
hybridrl plan "$config" "${extra[@]}" "$@" > "$run_dir/plan.txt"

echo "run dir: $run_dir (plan in $run_dir/plan.txt)"
hybridrl train "$config" "${extra[@]}" "trainer.run_dir=$run_dir" "$@" 2>&1 | tee "$run_dir/train.log"
