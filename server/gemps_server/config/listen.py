"""Where the server listens: its gRPC port, the data plane's TCP port and Unix socket, and the
file announcing the ports it took."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from gemps_proto.ranges import DEFAULT_TEXT, PORT, RANGE

DATA_PLANE_MODES = ("on", "off")


# The default of each port beside gRPC's: it follows --port, so a second server given only another
# --port takes none of the first's ports, and the default --port keeps the numbers that containers
# publish and firewalls open (data 51051, replication 52051, metrics 9109).
class Follows(int):
    """A port's default that follows --port: only the default is one (a value given is a plain int,
    so -2 given by hand is refused as outside the port's range, not taken for this marker)."""


FOLLOWS_PORT = Follows(-2)
DEFAULT_PORT = 50051
DATA_PORT_OFFSET, REPLICATION_PORT_OFFSET, METRICS_PORT_OFFSET = 1000, 2000, 9109 - DEFAULT_PORT
FOLLOWS_HELP = "by default --port + {offset}, or a free one where --port is 0 or that is past 65535"


def following(port: int, offset: int) -> int:
    """The port at `offset` from gRPC's `port`: 0 (a free one, announced) where gRPC's is 0 or the
    sum is no port."""
    followed = port + offset
    return followed if port > 0 and 0 < followed <= 65535 else 0


@dataclass(frozen=True)
class ListenOptions:
    """The addresses and ports this process serves on (a partition i of several run here: each
    port + i)."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on (0.0.0.0 for all)"})
    port: int = field(default=50051, metadata={"help": "gRPC port; 0 picks a free one", RANGE: PORT})
    data_plane: str = field(
        default="on",
        metadata={
            "help": "offer the data plane (commits and pulls with θ's raw bytes on --data-port, announced at "
            "Register); off: gRPC only",
            "choices": DATA_PLANE_MODES,
        },
    )
    data_port: int = field(
        default=FOLLOWS_PORT,
        metadata={
            "help": "data-plane port (partition i: this + i); 0 picks a free one; "
            + FOLLOWS_HELP.format(offset=DATA_PORT_OFFSET),
            DEFAULT_TEXT: f"--port + {DATA_PORT_OFFSET}",
            RANGE: PORT,
        },
    )
    shared_memory: str = field(
        default="on",
        metadata={
            "help": "offer clients on this host the data plane on a Unix socket, where they may attach shared "
            "memory: θ then crosses no socket (Linux; clients elsewhere use --data-port); off: TCP only",
            "choices": DATA_PLANE_MODES,
        },
    )
    port_file: str = field(
        default="", metadata={"help": "once serving, write the gRPC port and the metrics port (lines 1, 2) here"}
    )

    def followed_ports(self, replication_port: int, metrics_port: int) -> dict[str, int]:
        """The ports left at their default (FOLLOWS_PORT), each set from --port; the others as given."""
        ports = {"data_port": self.data_port, "replication_port": replication_port, "metrics_port": metrics_port}
        offsets = {"data_port": DATA_PORT_OFFSET, "replication_port": REPLICATION_PORT_OFFSET}
        offsets["metrics_port"] = METRICS_PORT_OFFSET
        return {
            name: following(self.port, offsets[name]) if isinstance(value, Follows) else value
            for name, value in ports.items()
        }

    def problems(self) -> list[str]:
        """A data-plane switch that is neither on nor off (the ports' ranges: ServerConfig)."""
        found = []
        if self.data_plane not in DATA_PLANE_MODES:
            found.append(f"data_plane {self.data_plane!r}: choose on or off")
        if self.shared_memory not in DATA_PLANE_MODES:
            found.append(f"shared_memory {self.shared_memory!r}: choose on or off")
        return found

    @property
    def data_plane_on(self) -> bool:
        return self.data_plane == "on"

    @property
    def shared_memory_on(self) -> bool:
        """Same-host clients get a Unix socket with shared memory (Linux only: memfd and seals)."""
        return self.data_plane_on and self.shared_memory == "on" and sys.platform == "linux"
