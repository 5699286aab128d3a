"""θ inside gRPC's messages and streams, framed by hand in protobuf's format: the one definition, for both ends.

θ-sized tensors never go through a protobuf message on the hot path. Three things are framed
by hand in protobuf's own wire format (gemps_proto.protobuf_wire), so any gRPC client still reads them:
- a message with one Tensor field: serialised with the tensor's data copied once
  (`with_tensor`), parsed with the data as a view of the received bytes (`parse_with_tensor`);
- a streamed tensor's header: its dtype and shape announced, the data to follow (`announce`);
- the data pieces of the streaming RPCs (CommitStream, RegisterStream, PullStream): one field,
  `bytes data = 2`, framed with one copy (`frame_data`) and read as a slice (`read_data`), then
  collected into one preallocated buffer (`PayloadAssembler`).
Anything not framed exactly as expected is left to protobuf itself.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar

from google.protobuf.message import Message

from gemps_proto import protobuf_wire, vectors
from gemps_proto.schema_proto import tensor_from_proto
from gemps_proto.tensor_codec import EncodedTensor
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_proto.vectors import Vector

M = TypeVar("M", bound=Message)

# Field numbers of the θ-sized tensors in gemps.v1 (parameter_server.proto).
REGISTER_INITIAL_FIELD = pb.RegisterRequest.DESCRIPTOR.fields_by_name["initial_parameters"].number
REGISTER_REPLY_FIELD = pb.RegisterResponse.DESCRIPTOR.fields_by_name["parameters"].number
PULL_REPLY_FIELD = pb.PullResponse.DESCRIPTOR.fields_by_name["parameters"].number
COMMIT_PAYLOAD_FIELD = pb.CommitRequest.DESCRIPTOR.fields_by_name["payload"].number
COMMIT_REPLY_FIELD = pb.CommitResponse.DESCRIPTOR.fields_by_name["parameters"].number

#: bytes per data piece: large unary messages are slow in gRPC Python, 1 MiB pieces are not
DEFAULT_CHUNK_BYTES = 1 << 20
_DATA_FIELD = 2  # `bytes data` in every chunk message
_DATA_TAG = (_DATA_FIELD << 3) | protobuf_wire.LENGTH_DELIMITED


# -- one Tensor field, framed by hand ------------------------------------------------------------


def with_tensor(
    header: Message, field_number: int, dtype: int, shape: Sequence[int], data: bytes | memoryview
) -> bytes:
    """`header` serialised, plus Tensor field `field_number` holding `data`: the bytes of the whole
    message, `data` copied once (protobuf would copy it into the message and again out of it)."""
    framed = protobuf_wire.tensor_field(field_number, dtype, shape, len(data))
    return b"".join((header.SerializeToString(), framed, data))


def parse_with_tensor(message_class: type[M], field_number: int, data: bytes) -> tuple[M, EncodedTensor | None]:
    """A message and its Tensor field `field_number` (None if absent), the tensor's data a view of
    `data` (no copy). Raises protobuf's DecodeError for bytes that are not such a message."""
    split = protobuf_wire.split_tensor_field(data, field_number)
    if split is None:  # absent, framed unusually, or malformed: protobuf decides, with copies
        message = message_class.FromString(data)
        field = message.DESCRIPTOR.fields_by_number[field_number].name
        return message, tensor_from_proto(getattr(message, field)) if message.HasField(field) else None
    message = message_class.FromString(split.rest)
    parts = pb.Tensor.FromString(split.tensor)
    return message, EncodedTensor(parts.dtype, tuple(parts.shape), split.data)


def announce(tensor: pb.Tensor, dtype: int, size: int) -> None:
    """A streamed flat tensor's header: its dtype and shape, the data left to follow in pieces."""
    tensor.dtype = dtype  # type: ignore[assignment]
    tensor.shape.append(size)


# -- the data pieces of the streaming RPCs ---------------------------------------------------------


def frame_data(piece: bytes | memoryview) -> bytes:
    """A serialized chunk message whose only field is `data = piece`."""
    return b"".join((protobuf_wire.length_prefix(_DATA_FIELD, len(piece)), piece))


def data_frames(data: bytes | memoryview, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
    """`data` as framed data messages of at most `chunk_bytes` each (none when it is empty)."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0, not {chunk_bytes}")
    view = memoryview(data).cast("B")
    for start in range(0, len(view), chunk_bytes):
        yield frame_data(view[start : start + chunk_bytes])


def read_data(message: bytes) -> memoryview | None:
    """The data piece of a serialized chunk message framed as frame_data does, else None."""
    if not message or message[0] != _DATA_TAG:
        return None
    try:
        length, position = protobuf_wire.read_varint(message, 1)
    except protobuf_wire.WireError:
        return None
    if position + length != len(message):
        return None  # anything else (more fields, a truncated piece): protobuf decides
    return memoryview(message)[position:]


class PayloadAssembler:
    """Collects data pieces into one preallocated buffer of the size the header announced."""

    def __init__(self, expected_bytes: int, into: Vector | memoryview | None = None) -> None:
        """`into`: a writable buffer of `expected_bytes` to assemble in (else a new one)."""
        if into is not None and into.nbytes != expected_bytes:
            raise ValueError(f"the buffer holds {into.nbytes} bytes, the payload {expected_bytes}")
        self.expected_bytes = expected_bytes
        # Not zeroed with numpy: every byte is written before result() returns it.
        self._buffer = vectors.writable_bytes(expected_bytes) if into is None else memoryview(into).cast("B")  # type: ignore[arg-type, unused-ignore]  # numpy arrays are buffers (typed so in the SDK alone's pass only)
        self.received = 0

    def add(self, piece: bytes | memoryview) -> None:
        """Append a piece; raises ValueError past the announced size."""
        end = self.received + len(piece)
        if end > self.expected_bytes:
            raise ValueError(f"data exceeds the {self.expected_bytes} bytes the header announced")
        self._buffer[self.received : end] = memoryview(piece).cast("B")
        self.received = end

    def result(self) -> memoryview:
        """The whole payload; raises ValueError if pieces are missing."""
        if self.received != self.expected_bytes:
            raise ValueError(f"{self.received} bytes of data received, the header announced {self.expected_bytes}")
        return self._buffer
