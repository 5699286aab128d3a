"""Where the server listens: its gRPC port, the data plane's TCP port and Unix socket, and the
file announcing the ports it took."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from gemps_proto.ranges import PORT, RANGE

DATA_PLANE_MODES = ("on", "off")


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
        default=51051,
        metadata={"help": "data-plane port (partition i: this + i); 0 picks a free one", RANGE: PORT},
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
