"""One server process the client talks to, and what the client holds of it.

θ may be split across several server processes ("partitions", docs/ARCHITECTURE.md): each holds
the contiguous range [start, stop) of the flat central variable with its own version, worker id
and lease. A Client has one Endpoint per partition (just one when θ is not partitioned) and
keeps here, per partition, the registration it got and the newest slice of θ it received.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gemps.connection import Connection
from gemps.records import Registration
from gemps_proto.v1 import parameter_server_pb2_grpc as pb_grpc

_METHOD = "/gemps.v1.ParameterServer/"
# How soon a disconnected channel tries the server again (gRPC's default grows to 120 s).
RECONNECT_BACKOFF_MS = (200, 2000)  # initial, max


def _raw(data: bytes) -> bytes:
    return data


def resolve_address(announced: str, reached: str) -> str:
    """Where a partition is, from the layout another one announced: "" is `reached` itself,
    ":PORT" is `reached`'s host with that port, anything else a target as it stands."""
    if not announced:
        return reached
    if announced.startswith(":"):
        host, separator, _port = reached.rpartition(":")
        if not separator:
            raise ValueError(f"cannot tell the host of {reached!r} to reach partition at {announced!r}")
        return host + announced
    return announced


@dataclass(eq=False)
class Endpoint:
    """A channel to one server process (all of θ, or one partition of it) and its calls.

    The calls that carry θ send and receive bytes: serde frames and reads θ without copies."""

    target: str
    connection: Connection
    max_message_bytes: int
    start: int = 0  # the range of θ this server holds: [start, stop)
    stop: int = 0
    registration: Registration | None = None  # this server's registration of the client's worker
    version: int = -1  # of the slice held in `flat`; -1: none yet
    history: str = ""  # which history of this server `version` counts in ("unchanged" needs both)
    flat: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.float32))

    def __post_init__(self) -> None:
        self.channel = self.connection.channel(
            self.target,
            options=[
                ("grpc.max_receive_message_length", self.max_message_bytes),
                ("grpc.max_send_message_length", self.max_message_bytes),
                ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
                ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
            ],
        )
        self.stub = pb_grpc.ParameterServerStub(self.channel)
        self.register = self.channel.unary_unary(_METHOD + "Register", _raw, _raw)
        self.register_stream = self.channel.stream_unary(_METHOD + "RegisterStream", _raw, _raw)
        self.pull = self.channel.unary_unary(_METHOD + "Pull", _raw, _raw)
        self.pull_stream = self.channel.unary_stream(_METHOD + "PullStream", _raw, _raw)
        self.commit = self.channel.unary_unary(_METHOD + "Commit", _raw, _raw)
        self.commit_stream = self.channel.stream_stream(_METHOD + "CommitStream", _raw, _raw)

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def worker_id(self) -> str:
        return self.registration.worker_id if self.registration else ""

    def close(self) -> None:
        self.channel.close()
