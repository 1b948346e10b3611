#!/usr/bin/env bash
# Start the Ray head on this node. Then, on every other node: launch/ray_worker.sh HEAD_IP
# and run the job anywhere with RAY_ADDRESS=HEAD_IP:PORT launch/train_grpo.sh CONFIG.
#   launch/ray_head.sh [extra `ray start` flags, e.g. --block to stay in the foreground]
#
# The head listens on the node's address so workers can join: run it inside the cluster's private
# network only (Ray's ports have no authentication by default; see the README's security notes).
# Export NCCL/InfiniBand variables before running this: Ray's worker processes (the training
# actors) inherit the environment of this `ray start`, not changes made after it.
set -euo pipefail

port="${RAY_PORT:-6379}"
num_gpus="${NUM_GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}"
# the address (and its interface) workers reach this node on: NODE_IP / NODE_IFNAME, else the default
# route's (launch/node_ip.sh); gloo and NCCL's bootstrap sockets use that interface unless told otherwise
read -r node_ip ifname < <("$(dirname "$0")/node_ip.sh" --ifname)
if [ -n "${ifname:-}" ]; then
  export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-$ifname}" NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-$ifname}"
fi

# How fast the head declares a silent node dead (its GCS pings every raylet): Ray's defaults (every 3 s, 10 s
# timeout, 5 misses) took 63 s to notice a host cut off the network; these take ~20 s (tests/e2e/test_multi_host.py).
# A run with trainer.max_restarts restarts that much sooner. Set any of them yourself to keep your own.
export RAY_health_check_period_ms="${RAY_health_check_period_ms:-1000}"
export RAY_health_check_timeout_ms="${RAY_health_check_timeout_ms:-1000}"
export RAY_health_check_failure_threshold="${RAY_health_check_failure_threshold:-10}"

echo "RAY_ADDRESS=$node_ip:$port"
ray start --head --node-ip-address="$node_ip" --port="$port" --num-gpus="$num_gpus" \
  --dashboard-host=127.0.0.1 --disable-usage-stats "$@"
