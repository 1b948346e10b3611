#!/usr/bin/env bash
# The GPU check (issue 9) on one lent GPU, offline, in under 6 minutes (the 15-minute device budget leaves room for a rerun):
# the workers' own data path on a CPU-resident batch (log-probs vs transformers, one PPO update with
# megatron DDP + the distributed optimizer, critic values and one critic update), megatron's MoE layers
# against transformers, the resharder's shards against the layout math, actor forward/backward throughput and MFU
# (bf16) for Qwen2-shaped 0.5B and 1.5B models with random weights, log-prob throughput, the
# resharder on CUDA tensors, and vLLM generation if vLLM is there. The JSON is rewritten after each part
# and ends with `unreached`: the GPU-only paths one GPU without TE or vLLM cannot prove.
#
# Installs nothing from the network. The lent H200 image has torch, transformers, safetensors, pyyaml
# and psutil but no megatron-core (and no vLLM or TransformerEngine: the check then uses megatron's
# local layer spec and reports vLLM as skipped). Carry megatron-core as a wheel, prepared here once:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.16.1
# then run with the device tool: command `bash bench/gpu_check.sh`, carry [".whl"]; the JSON lands in $OUT.
# Extra arguments go to bench/gpu_check.py (e.g. --seq 4096 --skip-vllm).
set -euo pipefail
cd "$(dirname "$0")/.."

if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# megatron's TP layers expect it (ordering of their async communication); harmless at TP=1
export CUDA_DEVICE_MAX_CONNECTIONS=1

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
# 5.5 minutes for the Python part, so the whole script stays under 6 (the JSON keeps what finished)
timeout -k 10 330 python3 bench/gpu_check.py --device cuda "$@"
