# syntax=docker/dockerfile:1
# vLLM's OpenAI-compatible server with kvkeeper[vllm] (the KVKeeperConnector)
# installed. Build from the repository root:
#
#   docker build -f deploy/docker/vllm.Dockerfile -t vllm-kvkeeper .
#
# VLLM_IMAGE must carry a vLLM that kvkeeper[vllm] accepts (vllm>=0.32):
# pip then keeps the image's vllm and torch and adds only kvkeeper's own
# dependencies (grpcio, protobuf, prometheus-client, ...).

ARG VLLM_IMAGE=vllm/vllm-openai:v0.33.0
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY server ./server
COPY client ./client
COPY connector ./connector
# Pure Python (py3-none-any): it installs into the vLLM image's Python whatever its version.
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM ${VLLM_IMAGE}
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    python3 -m pip install "$(echo /wheels/kvkeeper-*.whl)[vllm]" \
 && python3 -c "import kvkeeper.connector, kvkeeper.client; print('kvkeeper connector installed')"
ENTRYPOINT ["vllm", "serve"]
