# etcd for replicated gemps servers (docs/CONTAINERS.md, "Replicas"): Debian's etcd-server (and
# etcd-client, for the health check) on the server image's base, so compose pulls nothing more.
# It only decides which replica of each partition is primary (a few small keys and a lease per
# partition); any etcd 3.4+ cluster will do instead: point GEMPS_ETCD at it.
#   docker build -f deploy/etcd.Dockerfile -t gemps-etcd .
#   docker run --rm -p 2379:2379 gemps-etcd
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.title="gemps-etcd" \
      org.opencontainers.image.description="etcd (Debian's etcd-server) electing gemps replicas' primaries" \
      org.opencontainers.image.licenses="Apache-2.0"
# Unpinned (DL3008): the base image's Debian release fixes the version (bookworm: 3.4).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends etcd-server etcd-client \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 etcd-gemps \
    && useradd --system --uid 10001 --gid etcd-gemps --home-dir /var/lib/etcd-gemps --no-create-home \
        --shell /usr/sbin/nologin etcd-gemps \
    && mkdir -p /var/lib/etcd-gemps \
    && chown etcd-gemps:etcd-gemps /var/lib/etcd-gemps
# One member listening on every address; ETCD_* variables (etcd's own) override any of these.
# Its raft timing is `gemps server --replicas`' own etcd's (local_etcd.py): etcd raises a lease to
# 1.5 election timeouts in whole seconds, 2 s at its default 1000 ms, so GEMPS_REPLICA_LEASE=1
# would be refused; one member elects against nobody, and at 600 ms its shortest lease is 1 s.
ENV ETCD_NAME=etcd \
    ETCD_LOGGER=zap \
    ETCD_HEARTBEAT_INTERVAL=100 \
    ETCD_ELECTION_TIMEOUT=600 \
    ETCD_DATA_DIR=/var/lib/etcd-gemps \
    ETCD_LISTEN_CLIENT_URLS=http://0.0.0.0:2379 \
    ETCD_ADVERTISE_CLIENT_URLS=http://etcd:2379 \
    ETCD_LISTEN_PEER_URLS=http://0.0.0.0:2380 \
    ETCD_INITIAL_ADVERTISE_PEER_URLS=http://etcd:2380 \
    ETCD_INITIAL_CLUSTER=etcd=http://etcd:2380
WORKDIR /var/lib/etcd-gemps
USER 10001:10001
EXPOSE 2379 2380
HEALTHCHECK --interval=5s --timeout=3s --start-period=5s --retries=3 \
    CMD ["etcdctl", "--endpoints=http://127.0.0.1:2379", "endpoint", "health"]
ENTRYPOINT ["etcd"]
