"""The compose stack's fixed host ports kept out of Linux's ephemeral range while the suite runs.

docker-compose.yml publishes 50051-50052 and 51051-51052 on the host (deploy/compose.replicas.yml the
second of each), all inside the ephemeral range (32768-60999): any socket another test opens, a
client's or a Ray process's, may be given one of them by the kernel, and the stack's `up` then fails
with "address already in use" (twice in full runs here). `net.ipv4.ip_local_reserved_ports` keeps
them from automatic assignment; explicit binds (the stack's) still get them. Root only, as the
container tests are; the previous setting comes back at the end of the session.
"""

from __future__ import annotations

from pathlib import Path

RESERVED_PORTS = Path("/proc/sys/net/ipv4/ip_local_reserved_ports")
COMPOSE_HOST_PORTS = "50051-50052,51051-51052"


def reserve(ports: str = COMPOSE_HOST_PORTS) -> str | None:
    """Add `ports` to the reserved ones; the setting before, to give back to `restore`, or None when
    this process may not change it (not root, or no such setting: nothing to restore)."""
    try:
        before = RESERVED_PORTS.read_text().strip()
        RESERVED_PORTS.write_text(",".join(part for part in (before, ports) if part) + "\n")
    except OSError:
        return None
    return before


def restore(before: str | None) -> None:
    if before is not None:
        RESERVED_PORTS.write_text((before or "") + "\n")
