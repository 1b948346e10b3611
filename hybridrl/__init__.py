"""hybridrl: a Megatron-backed, 3D-parallel RLHF trainer (PPO / GRPO) with a vLLM hybrid engine."""

import os

__version__ = "0.1.0"

# oneDNN's CPU kernels capped at AVX2 in every process of a run, set here because each of them (the driver, Ray
# workers, forked ranks) imports hybridrl before anything first calls into oneDNN, which reads it once; a user's
# own value stands. On a CPU with AVX-512 (measured on an AMD EPYC) oneDNN's AVX-512 matmul kernels made a
# worker's memory grow ~3 MiB a step with no end in sight (+22 % over 80 demo steps; capped: +0.07 %) and summed
# fp32 products in another order than transformers (PP2 logits 1.3e-4 apart; capped: bit for bit). CPU-side
# only: a GPU's kernels are not oneDNN's.
CPU_KERNEL_ENV = {"DNNL_MAX_CPU_ISA": "AVX2"}
for _name, _value in CPU_KERNEL_ENV.items():
    os.environ.setdefault(_name, _value)
