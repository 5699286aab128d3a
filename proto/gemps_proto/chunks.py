"""Chunked payloads for CommitStream (hand-written, not generated).

CommitChunk and CommitResponseChunk carry their data pieces in field 2 (`bytes data`). Data
messages are framed and read here directly in protobuf's wire format (wire.py): a piece goes
into or out of a message with one copy instead of protobuf's two, and reading one is a
memoryview slice. Headers, and anything not framed exactly like that, go through protobuf itself.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from gemps_proto.wire import WireError, length_prefix, read_varint

#: bytes per data piece: large unary messages are slow in gRPC Python, 1 MiB pieces are not
DEFAULT_CHUNK_BYTES = 1 << 20
_DATA_FIELD = 2
_DATA_TAG = (_DATA_FIELD << 3) | 2  # field 2, wire type 2 (length-delimited)


def frame_data(piece: bytes | memoryview) -> bytes:
    """A serialized chunk message whose only field is `data = piece`."""
    return b"".join((length_prefix(_DATA_FIELD, len(piece)), piece))


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
        length, position = read_varint(message, 1)
    except WireError:
        return None
    if position + length != len(message):
        return None  # anything else (more fields, a truncated piece): protobuf decides
    return memoryview(message)[position:]


class PayloadAssembler:
    """Collects data pieces into one preallocated buffer of the size the header announced."""

    def __init__(self, expected_bytes: int, into: np.ndarray | None = None) -> None:
        """`into`: a writable uint8 array of `expected_bytes` to assemble in (else a new one)."""
        if into is not None and into.nbytes != expected_bytes:
            raise ValueError(f"the buffer holds {into.nbytes} bytes, the payload {expected_bytes}")
        self.expected_bytes = expected_bytes
        # Not zeroed: every byte is written before result() returns it.
        self._buffer = np.empty(expected_bytes, dtype=np.uint8) if into is None else into
        self.received = 0

    def add(self, piece: bytes | memoryview) -> None:
        """Append a piece; raises ValueError past the announced size."""
        end = self.received + len(piece)
        if end > self.expected_bytes:
            raise ValueError(f"data exceeds the {self.expected_bytes} bytes the header announced")
        self._buffer[self.received : end] = np.frombuffer(piece, dtype=np.uint8)
        self.received = end

    def result(self) -> memoryview:
        """The whole payload; raises ValueError if pieces are missing."""
        if self.received != self.expected_bytes:
            raise ValueError(f"{self.received} bytes of data received, the header announced {self.expected_bytes}")
        return self._buffer.data
