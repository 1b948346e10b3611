#!/usr/bin/env bash
# Join this node to a Ray head started with launch/ray_head.sh:
#   launch/ray_worker.sh HEAD_IP[:PORT] [extra `ray start` flags, e.g. --block]
# As for the head: export NCCL/InfiniBand variables before this (the actors inherit them from here).
set -euo pipefail

if [ "$#" -lt 1 ]; then
  echo "usage: $0 HEAD_IP[:PORT] [ray start flags]" >&2
  exit 2
fi
head="$1"
shift
case "$head" in *:*) ;; *) head="$head:${RAY_PORT:-6379}" ;; esac
num_gpus="${NUM_GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}"
# this node's address on the route to the head (or NODE_IP / NODE_IFNAME): launch/node_ip.sh
read -r node_ip ifname < <("$(dirname "$0")/node_ip.sh" --ifname "$head")
if [ -n "${ifname:-}" ]; then
  export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-$ifname}" NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-$ifname}"
fi

ray start --address="$head" --node-ip-address="$node_ip" --num-gpus="$num_gpus" --disable-usage-stats "$@"
