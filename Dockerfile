# syntax=docker/dockerfile:1
# minivllm: an OpenAI-compatible LLM server in one image.
#
# GPU hosts (the default base carries CUDA PyTorch):
#   docker build -t minivllm .
#   docker run --gpus all -p 8000:8000 -v /path/to/models:/models -v minivllm-cache:/cache minivllm --model /models/X
# (PyTorch's CUDA 12.8 runtime: the host needs NVIDIA driver 570 or newer.)
#
# CPU only (a laptop; with no --model it serves the default model):
#   docker build -t minivllm:cpu --build-arg BASE=python:3.11-slim \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
#   docker run -p 8000:8000 -v minivllm-cache:/cache minivllm:cpu
#
# Arguments after the image name replace the default CMD; `minivllm serve` listens on
# 0.0.0.0:8000 by default, so `--model /models/X` alone still serves on port 8000.

ARG BASE=pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime
FROM ${BASE}

# Empty: keep the base image's torch. Otherwise install torch==TORCH_VERSION from this wheel index first.
ARG TORCH_INDEX_URL=""
ARG TORCH_VERSION=2.9.1

# Triton's compiled kernels go to the /cache volume with the converted default model, so a new container
# reuses them instead of compiling every variant again at start-up.
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    MINIVLLM_CACHE=/cache \
    TRITON_CACHE_DIR=/cache/triton

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Triton compiles a small launcher with the host C compiler at run time, and the runtime
# images have none. Versions come from the base image's distribution release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

RUN if [ -n "${TORCH_INDEX_URL}" ]; then \
        pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"; \
    fi

WORKDIR /opt/minivllm
COPY pyproject.toml README.md constraints.txt ./
COPY engine ./engine
COPY kvcache ./kvcache
COPY server ./server
# The project's dependencies at the versions constraints.txt pins (make uses the same file); torch is
# already satisfied above. The check imports the installed package (-I: not the sources in the working directory).
RUN pip install --no-cache-dir -c constraints.txt . \
    && python -I -c "import torch, server.cli; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

# /cache holds the converted default model (and survives restarts as a volume); /models is for mounts.
RUN groupadd --gid 1000 minivllm \
    && useradd --create-home --uid 1000 --gid 1000 minivllm \
    && mkdir -p /cache /models \
    && chown minivllm:minivllm /cache
USER 1000:1000
WORKDIR /home/minivllm
VOLUME ["/cache"]
EXPOSE 8000

# Loading a large model (or converting the default one on first start) takes a while: a long start period.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ.get('MINIVLLM_HEALTH_URL', 'http://127.0.0.1:8000/health'), timeout=4)"]

ENTRYPOINT ["minivllm", "serve"]
CMD ["--host", "0.0.0.0", "--port", "8000"]
