# gemps reference worker and evaluator: CPU PyTorch, scikit-learn (the bundled digits data).
#   docker build -f deploy/worker.Dockerfile -t gemps-worker .
#   docker run --rm -e GEMPS_SERVER=HOST:50051 gemps-worker            (evaluator: ... evaluate)
# The torch requirement and the index it comes from are build arguments. The defaults install
# PyTorch's CPU-only wheels (a few hundred MB) instead of PyPI's multi-GB CUDA build; for a GPU
# image pass e.g. --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128, and
# --build-arg TORCH_INDEX_URL= (empty) to take torch from pip's configured index instead.
#
# The runtime is one stage, unlike the server's: the virtual environment is a gigabyte of wheels
# the worker runs on, with nothing to leave behind, and copying it between stages would cost a
# minute on every source change. Only the project's wheel, with its compiled loops, is built in a
# stage of its own (a C compiler, which stays there). Layers from least to most often changed
# keep rebuilds to seconds.
ARG PYTHON_IMAGE=python:3.11-slim

# ---- compiled: the project's wheel with the codec's compiled passes (gemps_proto._codes: a
# worker's int8 codes cost 3-7x the CPU in numpy's) and the server's loops -----------------------
FROM ${PYTHON_IMAGE} AS compiled
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
# As in the server's build stage (deploy/server.Dockerfile): gcc, and Python's headers where the
# base image lacks them. Unpinned (DL3008): none of it reaches the runtime stage.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && { python3 -c "import sysconfig, os, sys; sys.exit(not os.path.exists(sysconfig.get_paths()['include'] + '/Python.h'))" \
         || apt-get install -y --no-install-recommends python3-dev; } \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY proto proto
COPY server server
COPY client_sdk client_sdk
COPY worker worker
COPY cli cli
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---- runtime -------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="gemps-worker" \
      org.opencontainers.image.description="gemps reference worker and evaluator (CPU PyTorch)" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
# An unprivileged user with a fixed uid (Kubernetes runAsNonRoot needs a number); its home holds
# downloaded datasets (GEMPS_DATA_DIR) and matplotlib's cache.
RUN groupadd --system --gid 10001 gemps \
    && useradd --system --uid 10001 --gid gemps --home-dir /var/lib/gemps --no-create-home \
        --shell /usr/sbin/nologin gemps \
    && mkdir -p /var/lib/gemps/data \
    && chown -R gemps:gemps /var/lib/gemps

# torch first, in a layer of its own: the biggest download, and it changes least often. The
# libraries' own test suites, and torch's C++ headers (for compiling extensions: the runtime stage
# has no compiler), stay out of every layer.
ARG TORCH_REQUIREMENT=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN python3 -m venv /opt/gemps \
    && /opt/gemps/bin/pip install --no-cache-dir ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_REQUIREMENT" \
    && rm -rf /opt/gemps/lib/python3*/site-packages/torch/test /opt/gemps/lib/python3*/site-packages/torch/include \
    && find /opt/gemps/lib -depth -type d -name tests -path '*/site-packages/*' -exec rm -rf {} +

# The other dependencies come from pyproject.toml alone (the SDK's base + the torch extra, and the
# server extra's grpcio-health-checking for healthcheck.py), in a layer of their own: editing the
# source does not reinstall them. torch is already satisfied above.
WORKDIR /opt/gemps/src
COPY pyproject.toml ./
RUN python3 -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; x = p['optional-dependencies']; print(*p['dependencies'], *x['torch'], *[r for r in x['server'] if r.startswith('grpcio-health-checking')], sep='\n')" \
        > /tmp/requirements.txt \
    && /opt/gemps/bin/pip install --no-cache-dir -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt \
    && find /opt/gemps/lib -depth -type d -name tests -path '*/site-packages/*' -exec rm -rf {} +

# The project itself, its compiled loops built in the stage above: a few hundred kB. The import
# check fails the build if they are not there.
COPY --from=compiled /wheels /tmp/wheels
RUN /opt/gemps/bin/pip install --no-cache-dir --no-deps /tmp/wheels/gemps-*.whl \
    && /opt/gemps/bin/python -c "import gemps_server._native, gemps_proto._codes" \
    && rm -rf /tmp/wheels
COPY deploy/healthcheck.py /opt/gemps/healthcheck.py

ENV PATH=/opt/gemps/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/var/lib/gemps \
    MPLCONFIGDIR=/var/lib/gemps/.matplotlib \
    GEMPS_SERVER=ps:50051 \
    GEMPS_DATA_DIR=/var/lib/gemps/data \
    GEMPS_DEVICE=cpu \
    GEMPS_THREADS=1 \
    GEMPS_METRICS_PORT=9110
WORKDIR /var/lib/gemps
USER 10001:10001
EXPOSE 9110
# Healthy while the parameter server this container trains against answers grpc.health.v1.
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "/opt/gemps/healthcheck.py", "--upstream"]
ENTRYPOINT ["gemps"]
CMD ["worker"]
