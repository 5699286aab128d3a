# gemps parameter server: the SDK's numpy, grpcio and protobuf plus the server extra; no torch.
#   docker build -f deploy/server.Dockerfile -t gemps-server .
#   docker run --rm -p 50051:50051 -p 51051:51051 -p 9109:9109 gemps-server      (options: GEMPS_* variables)
ARG PYTHON_IMAGE=python:3.11-slim

# ---- build: a virtual environment in /opt/gemps, copied whole into the runtime stage --------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
# A C compiler for the server's compiled loops (server/gemps_server/csrc/) and the codec's
# (proto/gemps_proto/csrc/), in this stage only:
# the runtime stage gets the built extension, not the compiler. Python's headers come with the
# official image; a Debian-based stand-in needs python3-dev for them. Unpinned (DL3008): whichever
# gcc the base image's Debian has builds it the same, and none of it reaches the runtime stage.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && { python3 -c "import sysconfig, os, sys; sys.exit(not os.path.exists(sysconfig.get_paths()['include'] + '/Python.h'))" \
         || apt-get install -y --no-install-recommends python3-dev; } \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/gemps
WORKDIR /src
# The dependencies come from pyproject.toml alone (the SDK's base + the server extra), in a layer
# of their own: editing the source does not reinstall them.
COPY pyproject.toml ./
RUN python3 -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print(*p['dependencies'], *p['optional-dependencies']['server'], sep='\n')" \
        > requirements.txt \
    && /opt/gemps/bin/pip install --no-cache-dir -r requirements.txt
COPY README.md LICENSE ./
COPY proto proto
COPY server server
COPY client_sdk client_sdk
COPY worker worker
COPY cli cli
# Not needed to run, so left behind: pip, setuptools and the libraries' own test suites. The
# import check fails the build if the compiled loops were not built (their build is optional).
RUN /opt/gemps/bin/pip install --no-cache-dir --no-deps . \
    && /opt/gemps/bin/python -c "import gemps_server._native, gemps_proto._codes" \
    && /opt/gemps/bin/pip uninstall --yes --quiet pip setuptools \
    && find /opt/gemps/lib -depth -type d -name tests -path '*/site-packages/*' -exec rm -rf {} +

# ---- runtime -------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="gemps-server" \
      org.opencontainers.image.description="gemps: asynchronous parameter server with Gradient Energy Matching (GEM)" \
      org.opencontainers.image.licenses="Apache-2.0"
# An unprivileged user with a fixed uid (Kubernetes runAsNonRoot needs a number) that owns the
# checkpoint directory; a named volume mounted there starts out owned by it too.
RUN groupadd --system --gid 10001 gemps \
    && useradd --system --uid 10001 --gid gemps --home-dir /var/lib/gemps --no-create-home \
        --shell /usr/sbin/nologin gemps \
    && mkdir -p /var/lib/gemps \
    && chown gemps:gemps /var/lib/gemps
COPY --from=build /opt/gemps /opt/gemps
COPY deploy/healthcheck.py /opt/gemps/healthcheck.py
ENV PATH=/opt/gemps/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    GEMPS_HOST=0.0.0.0 \
    GEMPS_PORT=50051 \
    GEMPS_DATA_PORT=51051 \
    GEMPS_METRICS_PORT=9109 \
    GEMPS_CHECKPOINT_DIR=/var/lib/gemps
WORKDIR /var/lib/gemps
USER 10001:10001
EXPOSE 50051 51051 9109
# grpc.health.v1 through the image's own grpcio: no probe binary to download.
HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 \
    CMD ["python", "/opt/gemps/healthcheck.py"]
ENTRYPOINT ["gemps"]
CMD ["server"]
