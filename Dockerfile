# gpumesh in a container: the coordinator (`serve`) or a worker (`join URL`).
#
#   docker build -t gpumesh:0.1.0 .                                  # CPU
#   docker build -t gpumesh:cuda --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu124 .
#   docker run --gpus all --network gpumesh ... gpumesh:cuda join http://gpumesh-coordinator:8732
#                                         # a GPU worker, on the coordinator's network
#
# README.md (Docker) has the whole recipe: a network of your own (docker network create
# gpumesh) on which the worker joins the coordinator by its container name.
#
# State (the SQLite job store, payload files and config.json) lives under /data
# (HOME=/data, so ~/.gpumesh is /data/.gpumesh): mount a volume there for a coordinator.
ARG PYTHON_IMAGE=python:3.12-slim
FROM ${PYTHON_IMAGE}

# Set to a PyTorch wheel index (e.g. https://download.pytorch.org/whl/cu124) for a GPU
# image with CUDA-capable torch; empty: no torch (CPU tasks, NVML still finds GPUs).
ARG TORCH_INDEX_URL=""
# Extras installed with gpumesh (gpu: NVML for GPU detection; sysinfo: psutil).
ARG EXTRAS="gpu,sysinfo"
# Build-time only, never kept in the image: a CA bundle (mounted into the build) or a
# package mirror for pip, for builds behind a TLS-inspecting proxy.
ARG PIP_CERT
ARG PIP_INDEX_URL

# GPUMESH_HOST: inside a container the coordinator must bind 0.0.0.0, since anything
# reaching it arrives from outside the container. Who can reach it is decided by the
# host-side publish address (-p 127.0.0.1:8732:8732).
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/gpumesh/bin:$PATH \
    HOME=/data \
    GPUMESH_HOST=0.0.0.0

RUN useradd --system --uid 10001 --user-group --home-dir /data --no-create-home gpumesh \
    && mkdir -p /data && chown gpumesh:gpumesh /data && chmod 0700 /data

COPY pyproject.toml README.md LICENSE /src/
COPY src /src/src
COPY docker/healthcheck.py /usr/local/bin/gpumesh-healthcheck
RUN set -eu; \
    python3 -m venv /opt/gpumesh; \
    if [ -n "$TORCH_INDEX_URL" ]; then \
        /opt/gpumesh/bin/pip install --index-url "$TORCH_INDEX_URL" torch; \
    fi; \
    /opt/gpumesh/bin/pip install "/src[$EXTRAS]"; \
    rm -rf /src; \
    chmod 0755 /usr/local/bin/gpumesh-healthcheck; \
    /opt/gpumesh/bin/gpumesh --version

USER gpumesh
WORKDIR /data
# The API port the image's recipes use (serve --port 8732; on a host serve defaults to 8000).
EXPOSE 8732
# A coordinator: GET /v1/health on its port. A worker: healthy while its agent runs.
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["/opt/gpumesh/bin/python", "/usr/local/bin/gpumesh-healthcheck"]
ENTRYPOINT ["gpumesh"]
CMD ["serve", "--port", "8732"]
