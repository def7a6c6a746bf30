# syntax=docker/dockerfile:1
# The operator: `slipstream operator run`, without torch (the operator imports none of the
# engine). Build from the repository root:
#   docker build -f docker/operator.Dockerfile -t ghcr.io/slipstream-dev/slipstream-operator:0.1.0 .
# The Helm chart (charts/slipstream) runs it.
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/slipstream
ENV PATH=/opt/slipstream/bin:$PATH
# What the operator imports (tests/chart/test_deploy_files.py keeps this list complete);
# prometheus-client parses the pods' /metrics for the autoscaler.
RUN pip install "kopf>=1.37" kubernetes aiohttp pyyaml prometheus-client "pydantic>=2.11"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
# --no-deps: the `slipstream` command and its packages, not the engine's torch and transformers.
RUN pip install --no-deps . && pip uninstall -y pip

FROM python:${PYTHON_VERSION}-slim-bookworm
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="slipstream-operator" \
      org.opencontainers.image.description="slipstream operator: InferenceService → autoscaled slipstream serve pods" \
      org.opencontainers.image.source="https://github.com/slipstream-dev/slipstream" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin slipstream
COPY --from=build /opt/slipstream /opt/slipstream
# The chart mounts /tmp writable and keeps the root filesystem read-only.
ENV PATH=/opt/slipstream/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["slipstream"]
CMD ["operator", "run", "--all-namespaces", "--liveness", "http://0.0.0.0:8080/healthz"]
