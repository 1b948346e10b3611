# hybridrl GPU image: NGC PyTorch base (CUDA 12.9, Python 3.12, Ubuntu 24.04), vLLM, megatron-core,
# TransformerEngine, Ray and hybridrl; runs as a non-root user.
#
#   docker build -t hybridrl:gpu .
#   docker run --gpus all --ipc=host --ulimit memlock=-1 --rm hybridrl:gpu doctor
#   docker run --gpus all --ipc=host --ulimit memlock=-1 --rm -v "$PWD/runs:/opt/hybridrl/runs" hybridrl:gpu \
#       train configs/examples/qwen2.5_7b_grpo_8gpu.yaml
#
# Why the installs are ordered as they are:
#   1. vLLM pins torch exactly (e.g. vllm 0.11.0 -> torch==2.8.0) and NGC's torch is an NVIDIA build
#      ("2.8.0a0+...") that does not satisfy the pin, so vLLM's torch replaces it. The NGC packages
#      compiled against NGC's torch (TransformerEngine's torch extension, flash-attn, apex) would
#      then fail with undefined symbols: they are removed first.
#   2. TransformerEngine is rebuilt against that torch (--no-build-isolation: it must see the
#      installed torch; the image has CUDA headers and nvcc). MAX_JOBS bounds the build's memory.
#   3. megatron-core is pinned to the release hybridrl's megatron code is written and tested
#      against (setup.py's `gpu` extra pins the same).
#   4. `hybridrl doctor --device cuda` at the end refuses a stack with mismatched versions (vLLM's
#      torch/transformers pins are read from its metadata) before the image is published; it needs
#      no GPU.
FROM nvcr.io/nvidia/pytorch:25.06-py3

ARG VLLM_VERSION=0.11.0
ARG MCORE_VERSION=0.16.1
ARG TE_VERSION=2.8.0
ARG RAY_VERSION=2.60.0
ARG MAX_JOBS=8

# PIP_CONSTRAINT: NGC images ship a pip constraint file that pins their own torch; vLLM's pin must win.
# VLLM_ENABLE_V1_MULTIPROCESSING=0: vLLM's engine runs inside the training processes (hybrid engine).
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PIP_CONSTRAINT= \
    VLLM_ENABLE_V1_MULTIPROCESSING=0

# DL3013 (pin every pip package): pyarrow, matplotlib and tensorboard only write metrics and plots
# and may float; everything the training path imports is pinned by an ARG above.
# hadolint ignore=DL3013
RUN pip uninstall -y transformer-engine transformer-engine-cu12 transformer-engine-torch \
        flash-attn apex torch-tensorrt \
    && pip install --no-cache-dir "vllm==${VLLM_VERSION}" "ray[default]==${RAY_VERSION}" \
        "megatron-core==${MCORE_VERSION}" pyarrow matplotlib tensorboard \
    && MAX_JOBS=${MAX_JOBS} NVTE_FRAMEWORK=pytorch pip install --no-cache-dir --no-build-isolation \
        "transformer-engine[pytorch]==${TE_VERSION}"

WORKDIR /opt/hybridrl
COPY setup.py pyproject.toml README.md ./
COPY hybridrl ./hybridrl
COPY configs ./configs
COPY launch ./launch
COPY tools ./tools
COPY bench ./bench
# --no-deps: the stack above is the GPU extra, installed with the versions chosen there.
RUN pip install --no-cache-dir --no-deps -e . \
    && hybridrl doctor --device cuda \
    && useradd --create-home --uid 10001 --user-group --shell /bin/bash hybridrl \
    && mkdir -p /opt/hybridrl/runs /opt/hybridrl/checkpoints \
    && chown -R 10001:10001 /opt/hybridrl/runs /opt/hybridrl/checkpoints

# numeric, so hosts and Kubernetes' runAsNonRoot can verify it without the image's /etc/passwd
USER 10001:10001
# configs/ and launch/ resolve relative to here; runs/ and checkpoints/ are the writable mounts
WORKDIR /opt/hybridrl
# The whole stack imports and its versions fit (a few seconds; torch's import dominates).
HEALTHCHECK --interval=10m --timeout=120s --start-period=30s --retries=1 CMD ["hybridrl", "doctor"]
ENTRYPOINT ["hybridrl"]
CMD ["--help"]
