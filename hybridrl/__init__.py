"""hybridrl: a Megatron-backed, 3D-parallel RLHF trainer (PPO / GRPO) with a vLLM hybrid engine."""

__version__ = "0.1.0"
