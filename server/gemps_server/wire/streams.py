"""Client-streaming RPCs (CommitStream, RegisterStream): a header message, then data pieces.

How a stream's messages arrive (`Chunk`: a data piece as a memoryview of the received bytes, a
header, or bytes that did not parse), how long the server waits for them (`Pace`), and how the
data pieces are assembled into the bytes their header announced, refused as soon as they cannot
be (more or fewer bytes, a second header).

A stream may hold the one upload of initial values or a pooled θ-sized buffer, so it must keep
moving: at most --stream-idle-timeout between two pieces, and once its data began, on average at
least --min-stream-rate-mb with the idle timeout as slack (the data plane's floor, one option for
both planes). A client that trickles a few bytes just inside the idle timeout held the upload or
a buffer for as long as it liked before (issue 28, item 3); now it is cut off after about the
idle timeout, DEADLINE_EXCEEDED, reason `stream_idle`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import overload

from gemps_proto.grpc_framing import PayloadAssembler, read_data
from gemps_proto.reasons import Reason
from gemps_proto.tensor_codec import (
    EncodedBuffers,
    EncodedTensor,
    TensorDecodeError,
    expected_int64_nbytes,
    expected_nbytes,
    num_elements,
)
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_server.domain.errors import DeadlineExceeded, InvalidArgument
from gemps_server.wire.messages import MalformedRequest, parse_request
from gemps_server.wire.stream_buffers import Buffer

# What a client-streaming RPC's parser hands the handler: a data piece, a header, or undecodable bytes.
ChunkMessage = pb.CommitChunk | pb.RegisterChunk
Chunk = ChunkMessage | memoryview | MalformedRequest
# The request message of each client-streaming RPC: a header, then data pieces.
CHUNK_CLASSES: dict[str, type[ChunkMessage]] = {"CommitStream": pb.CommitChunk, "RegisterStream": pb.RegisterChunk}


def chunk_parser(chunk_class: type[ChunkMessage], on_bytes: Callable[[int], None]) -> Callable[[bytes], Chunk]:
    """A client-streaming RPC's request parser: a data piece comes back as a memoryview of the
    message (no copy), anything else as the protobuf message; `on_bytes` is told each size."""

    def parse(data: bytes) -> Chunk:
        on_bytes(len(data))
        piece = read_data(data)
        return piece if piece is not None else parse_request(chunk_class, data)

    return parse


def method_of(chunk_class: type[ChunkMessage]) -> str:
    """The RPC whose pieces `chunk_class` carries (CommitChunk: CommitStream)."""
    return chunk_class.__name__.removesuffix("Chunk") + "Stream"


@dataclass(frozen=True)
class Pace:
    """How long a stream may take: `idle_timeout` seconds between two pieces, and for its data,
    on average at least `min_bytes_per_second` since it began, with `idle_timeout` as slack."""

    idle_timeout: float  # --stream-idle-timeout
    min_bytes_per_second: float  # --min-stream-rate-mb

    def allowance(self, moved: int) -> float:
        """Seconds since its data began by which a stream that has moved `moved` bytes must move more."""
        return self.idle_timeout + moved / self.min_bytes_per_second


async def next_piece(requests: AsyncIterator[Chunk], timeout: float, method: str) -> Chunk | None:
    """The stream's next piece (None at its end); DeadlineExceeded after `timeout` seconds of silence."""
    try:
        return await asyncio.wait_for(anext(requests, None), timeout)
    except asyncio.TimeoutError:
        raise DeadlineExceeded(
            f"{method} sent nothing for {timeout:g} s (the server's --stream-idle-timeout)", Reason.STREAM_IDLE
        ) from None


async def next_data_piece(
    requests: AsyncIterator[Chunk], pace: Pace, began: float, moved: int, method: str
) -> Chunk | None:
    """The next piece of a stream whose data began at `began` (monotonic) and has moved `moved`
    bytes: waits at most the idle timeout, and no later than the pace allows."""
    left = began + pace.allowance(moved) - time.monotonic()
    if left >= pace.idle_timeout:
        return await next_piece(requests, pace.idle_timeout, method)
    try:
        return await asyncio.wait_for(anext(requests, None), max(left, 0.0))
    except asyncio.TimeoutError:
        rate = pace.min_bytes_per_second / (1 << 20)
        raise DeadlineExceeded(
            f"{method} sent {moved} bytes in {time.monotonic() - began:.1f} s: slower than the server's "
            f"--min-stream-rate-mb ({rate:g} MiB/s on average after --stream-idle-timeout)",
            Reason.STREAM_IDLE,
        ) from None


@overload
async def stream_header(
    requests: AsyncIterator[Chunk], timeout: float, chunk_class: type[pb.CommitChunk]
) -> pb.CommitRequest: ...
@overload
async def stream_header(
    requests: AsyncIterator[Chunk], timeout: float, chunk_class: type[pb.RegisterChunk]
) -> pb.RegisterRequest: ...
async def stream_header(
    requests: AsyncIterator[Chunk], timeout: float, chunk_class: type[ChunkMessage]
) -> pb.CommitRequest | pb.RegisterRequest:
    """A client-streaming RPC's first message, its header."""
    method = method_of(chunk_class)
    first = await next_piece(requests, timeout, method)
    if isinstance(first, MalformedRequest):
        raise first.refusal()
    if not isinstance(first, chunk_class) or first.WhichOneof("part") != "header":
        raise InvalidArgument(
            f"{method} must start with a header chunk ({chunk_class.__name__}.header)", Reason.MALFORMED
        )
    return first.header


async def assemble(
    requests: AsyncIterator[Chunk], assembler: PayloadAssembler, pace: Pace, chunk_class: type[ChunkMessage]
) -> memoryview:
    """The data pieces after a stream's header, into `assembler`; InvalidArgument for anything
    else, or more or fewer bytes than announced; DeadlineExceeded when the client stalls or
    falls behind the pace."""
    method = method_of(chunk_class)
    began, moved = time.monotonic(), 0
    while (chunk := await next_data_piece(requests, pace, began, moved, method)) is not None:
        if isinstance(chunk, MalformedRequest):
            raise chunk.refusal()
        if isinstance(chunk, chunk_class):
            if chunk.WhichOneof("part") != "data":
                raise InvalidArgument(f"{method} sent a second header", Reason.MALFORMED)
            chunk = memoryview(chunk.data)
        elif not isinstance(chunk, memoryview):
            raise InvalidArgument(f"{method} sent a {type(chunk).__name__}", Reason.MALFORMED)
        try:
            assembler.add(chunk)
        except ValueError as error:
            raise InvalidArgument(f"payload: {error}", Reason.BAD_PAYLOAD) from None
        moved += chunk.nbytes
    try:
        return assembler.result()
    except ValueError as error:
        raise InvalidArgument(f"payload: {error}", Reason.BAD_PAYLOAD) from None


def announced_bytes(
    tensor: pb.Tensor, what: str, size_of: Callable[[int, tuple[int, ...]], int] = expected_nbytes
) -> int:
    """The bytes a streamed tensor's header announces, by `size_of(dtype, shape)`; InvalidArgument
    for a bad dtype or shape."""
    try:
        return size_of(tensor.dtype, tuple(tensor.shape))
    except TensorDecodeError as error:
        raise InvalidArgument(f"{what}: {error}", Reason.BAD_PAYLOAD) from None


# A RegisterRequest's buffer tensors, in the order their data follows the parameters' in RegisterStream.
INITIAL_BUFFER_FIELDS = ("initial_buffers", "initial_integer_buffers")
# How each of RegisterStream's tensors is sized: θ and the float buffers in θ's wire dtypes, the
# integer buffers in int64 alone.
_INITIAL_SIZES = (expected_nbytes, expected_nbytes, expected_int64_nbytes)


async def receive_initial_values(
    header: pb.RegisterRequest,
    requests: AsyncIterator[Chunk],
    pace: Pace,
    check_counts: Callable[[int, tuple[int, int] | None], None],
) -> tuple[EncodedTensor, EncodedBuffers | None]:
    """RegisterStream's initial parameters, float buffers and integer buffers, in the pieces after
    the header in that order; `check_counts` is given their value counts (buffers: None when
    neither tensor is announced) and refuses them before a byte is buffered."""
    announced = [
        header.initial_parameters,
        *(getattr(header, name) if header.HasField(name) else None for name in INITIAL_BUFFER_FIELDS),
    ]
    sizes = [0 if tensor is None else announced_bytes(tensor, name, size_of) for tensor, name, size_of in zip(
        announced, ("initial_parameters", *INITIAL_BUFFER_FIELDS), _INITIAL_SIZES, strict=True
    )]  # fmt: skip
    counts = [0 if tensor is None else num_elements(tensor.shape) for tensor in announced]
    buffers_sent = announced[1] is not None or announced[2] is not None
    check_counts(counts[0], (counts[1], counts[2]) if buffers_sent else None)
    data = await assemble(requests, PayloadAssembler(sum(sizes)), pace, pb.RegisterChunk)
    parts: list[EncodedTensor | None] = []
    offset = 0
    for tensor, size in zip(announced, sizes, strict=True):
        parts.append(
            None if tensor is None else EncodedTensor(tensor.dtype, tuple(tensor.shape), data[offset : offset + size])
        )
        offset += size
    initial = parts[0]
    assert initial is not None
    return initial, EncodedBuffers(parts[1], parts[2]) if buffers_sent else None


async def receive_payload(
    header: pb.CommitRequest,
    requests: AsyncIterator[Chunk],
    pace: Pace,
    buffer: Buffer,
    expected_bytes: Callable[[int, tuple[int, ...]], int],
) -> EncodedTensor:
    """CommitStream's payload, in the pieces after the header, assembled into `buffer`; the size
    the header announces is checked by `expected_bytes(dtype, shape)` before any is buffered."""
    shape = tuple(header.payload.shape)
    expected = expected_bytes(header.payload.dtype, shape)
    assembler = PayloadAssembler(expected, into=buffer.take(expected))
    data = await assemble(requests, assembler, pace, pb.CommitChunk)
    return EncodedTensor(header.payload.dtype, shape, data)
