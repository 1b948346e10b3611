# GPU image for hybridrl on clusters: filled in by the GPU-cluster issue (CUDA torch base image,
# vLLM, megatron-core, TransformerEngine, Ray, non-root runtime). Until then this builds the
# package on a plain Python base for CPU use.
FROM python:3.11-slim
WORKDIR /opt/hybridrl
COPY . .
RUN pip install --no-cache-dir -e . && useradd --create-home hybridrl
USER hybridrl
ENTRYPOINT ["hybridrl"]
