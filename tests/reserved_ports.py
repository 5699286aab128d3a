"""Ports the suite binds by number kept out of Linux's ephemeral range while it runs: the compose
stack's fixed host ports, and the band the side-by-side servers draw theirs from.

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
#: where tests/integration/test_servers_side_by_side.py's servers take their gRPC port (P) and so
#: their data (P + 1000) and replication (P + 2000) ports: picked free, then bound by a child process
#: a moment later, by which time another test's socket could have been given one (a replica's data
#: port was, once, in a fresh clone's full run: "Address already in use")
SIDE_BY_SIDE_GRPC = range(41000, 42000)
SIDE_BY_SIDE_PORTS = f"{SIDE_BY_SIDE_GRPC.start}-{SIDE_BY_SIDE_GRPC.stop + 2000}"
#: where tests.helpers.free_port takes the ports tests need a number for up front, a share per xdist
#: worker: a server restarted on its port after an outage found it taken (a fresh clone's CI run:
#: the kernel had given 44005 to another test's connection in the seconds between)
TEST_PORTS = range(45000, 47000)


def reserve(
    ports: str = f"{COMPOSE_HOST_PORTS},{SIDE_BY_SIDE_PORTS},{TEST_PORTS.start}-{TEST_PORTS.stop - 1}",
) -> str | None:
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
