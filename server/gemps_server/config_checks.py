"""The checks of ServerConfig that involve several options: TLS, the token, partitions."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from gemps_server import partition_addresses

if TYPE_CHECKING:
    from gemps_server.config import ServerConfig


def valid_token(token: str) -> bool:
    """A bearer token fits an HTTP/2 header value: visible ASCII, no spaces, not empty."""
    return bool(token) and all(33 <= ord(c) <= 126 for c in token)


def security_problems(config: ServerConfig) -> list[str]:
    found = []
    if bool(config.tls_cert) != bool(config.tls_key):
        found.append("tls_cert and tls_key go together: give both or neither")
    if config.tls_client_ca and not config.tls_cert:
        found.append("tls_client_ca (mutual TLS) needs tls_cert and tls_key")
    if config.auth_token and config.auth_token_file:
        found.append("give auth_token or auth_token_file, not both")
    if config.auth_token and not valid_token(config.auth_token):
        found.append("auth_token must be printable ASCII without spaces")
    for name in ("tls_cert", "tls_key", "tls_client_ca", "auth_token_file"):
        path = getattr(config, name)
        if path and not Path(path).is_file():
            found.append(f"{name} {path!r} is not a readable file")
    return found


def partition_problems(config: ServerConfig) -> list[str]:
    if config.partition_index >= config.partitions:
        return [f"partition_index {config.partition_index} outside -1..{config.partitions - 1}"]
    if config.partition_addresses:
        found = partition_addresses.problems(config.partition_addresses, config.partitions)
        if found:
            return found
    if config.partitions > 1 and config.partition_index == 0 and not config.partition_addresses:
        return ["partition 0 of several announces the layout: give partition_addresses"]
    if config.partitions > 1 and config.partition_index == -1:  # partition i listens on these ports + i
        return [
            f"{name} {port} + {config.partitions - 1} (the last partition's) is past 65535"
            for name, port in (("port", config.port), ("data_port", config.data_port))
            if port + config.partitions - 1 > 65535 and port > 0
        ]
    return []


def replica_problems(config: ServerConfig) -> list[str]:
    if config.replica_index >= config.replicas:
        return [f"replica_index {config.replica_index} outside -1..{config.replicas - 1}"]
    if config.replicas > 1 and config.replica_index >= 0 and not config.etcd:
        return ["a replica of a replicated partition needs etcd to tell it its role: give etcd (e.g. http://etcd:2379)"]
    if config.replicas > 1 and config.tls:
        return ["replicas with TLS are not supported yet: the replication stream is plain TCP (use a private network)"]
    if config.replicas > 1 and not config.job.replace("-", "").replace("_", "").isalnum():
        return [f"job {config.job!r}: letters, digits, '-' and '_' only (it names keys in etcd)"]
    return []
