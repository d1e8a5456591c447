# kvfence server image. `make image` builds the CPU image (kvfence:0.1.0); `make image-cuda`
# builds the CUDA variant (kvfence:0.1.0-cuda) from this same file with two build arguments:
# PyPI's torch (a CUDA build on Linux x86_64) and the `gpu` extra (FlashInfer). The host
# needs the NVIDIA driver and container toolkit; CUDA's runtime libraries come with torch.
#
#   docker run -p 50051:50051 -v $PWD/tenants.toml:/etc/kvfence/tenants.toml:ro kvfence:0.1.0
#
# Every `kvfence serve` flag can follow the image name, or be set as KVFENCE_<FLAG>.
FROM python:3.11-slim

# torch first and pinned, as the Makefile installs it (TORCH_SPEC, TORCH_INDEX): from the CPU
# wheel index, so nothing pulls a multi-GB CUDA build into the CPU image. An empty
# TORCH_INDEX means PyPI's own torch.
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# The extras installed with the package: server (always), tracing (--otlp-endpoint), gpu.
ARG EXTRAS=server,tracing

ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KVFENCE_HOST=0.0.0.0 \
    KVFENCE_PORT=50051 \
    KVFENCE_TENANTS=/etc/kvfence/tenants.toml

# A C compiler: kvfence builds its native kernels (service/model/native) at first use, into
# a private cache under the user's home.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

RUN pip install --no-cache-dir "${TORCH_SPEC}" ${TORCH_INDEX:+--index-url "${TORCH_INDEX}"}

WORKDIR /opt/kvfence
COPY pyproject.toml README.md ./
COPY kvcache ./kvcache
COPY service ./service
COPY clients ./clients
COPY protos ./protos
RUN pip install --no-cache-dir ".[${EXTRAS}]"

# Non-root, with the uid the Kubernetes manifests run as (runAsUser: 10001).
RUN useradd --create-home --uid 10001 --user-group kvfence \
    && mkdir -p /etc/kvfence && chown kvfence:kvfence /etc/kvfence
USER 10001
WORKDIR /home/kvfence
# The default model, pulled and sha256-checked at build time: the container starts offline.
RUN kvfence models pull

EXPOSE 50051 9400 8000
# grpc.health.v1 on the gRPC port (plaintext; with --tls-cert, use the orchestrator's own
# probes, as deploy/kubernetes does, or override this check).
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
    CMD python -c "import os, sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; c = grpc.insecure_channel('127.0.0.1:' + os.environ.get('KVFENCE_PORT', '50051')); r = g.HealthStub(c).Check(h.HealthCheckRequest(), timeout=4); sys.exit(r.status != h.HealthCheckResponse.SERVING)"

ENTRYPOINT ["kvfence", "serve"]
