"""Reading a data-plane call's reply off its connection: the COMMIT's and the PULL's, each its
gRPC message as the header (`gemps.grpc_messages` reads it into the same record as gRPC's reply),
then θ's bytes, unless the reply says θ is the one the caller holds (`unchanged`: none follow)."""

from __future__ import annotations

import functools

from gemps import grpc_messages as messages
from gemps.data_plane_connection import DataConnection
from gemps.transport import Committed, Pulled
from gemps_proto import vectors
from gemps_proto.data_plane_frames import Op
from gemps_proto.tensor_codec import EncodedTensor
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_proto.vectors import Vector


def read_committed(connection: DataConnection, timeout: float | None = None) -> Committed:
    """A COMMIT's reply: the CommitResponse (θ announced, buffers whole), then θ's bytes (or a
    difference's), unless it is unchanged."""
    connection.bound(timeout)
    header, payload_bytes = connection.receive(Op.COMMIT)
    reply = connection.parse(pb.CommitResponse, header)
    if _unchanged(connection, reply.unchanged, payload_bytes):
        return messages.committed_from_proto(reply, None)
    values = connection.receive_tensor(reply.parameters, payload_bytes, functools.partial(messages.reply_values, reply))
    return messages.committed_from_proto(reply, values)


def read_pulled(connection: DataConnection, timeout: float | None = None) -> Pulled:
    """A PULL's reply: the PullResponse, then θ's bytes unless it is unchanged."""
    connection.bound(timeout)
    header, payload_bytes = connection.receive(Op.PULL)
    reply = connection.parse(pb.PullResponse, header)
    if _unchanged(connection, reply.unchanged, payload_bytes):
        return messages.pulled_from_proto(reply, None)
    values = connection.receive_tensor(reply.parameters, payload_bytes, _read_only_values)
    return messages.pulled_from_proto(reply, values)


def _read_only_values(tensor: EncodedTensor) -> Vector:
    """θ's float32 values, read-only like the gRPC path's (a bfloat16 reply's are decoded anew)."""
    return vectors.read_only(tensor.decode())


def _unchanged(connection: DataConnection, unchanged: bool, payload_bytes: int) -> bool:
    """Whether a reply says θ is unchanged; a protocol error when bytes follow it all the same."""
    if unchanged and payload_bytes:
        connection.protocol_error(f"an unchanged reply with {payload_bytes} bytes of payload")
    return unchanged
