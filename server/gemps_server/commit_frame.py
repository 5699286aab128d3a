"""A commit's one byte form: the CommitRequest, and the data plane's COMMIT frame around it.

gRPC's Commit carries a `gemps.v1.CommitRequest` with its payload inside; the data plane's COMMIT
frame carries the same message with the payload announced (dtype and shape) and its raw bytes
after it (DESIGN §3c):

    preamble  gemps_proto.data_plane_frames: op COMMIT, header length, payload length
    header    gemps.v1.CommitRequest, the payload announced, no data
    payload   the payload's raw little-endian bytes

A replicated primary journals each commit it applied as that same frame (DESIGN §3d: the
replication stream's entry holds it as two blobs, the frame's start and its payload), so a backup
reads it with the function the data plane reads it with (`commit_from_proto`) and applies the
very bytes the worker sent. The wire (both planes) and replication import this; it imports the
domain's records and the protocol only.
"""

from __future__ import annotations

from collections.abc import Sequence

from google.protobuf.message import DecodeError

from gemps_proto import schema_proto as shared
from gemps_proto.data_plane_frames import PREAMBLE, FrameError, Op, frame_start, read_preamble
from gemps_proto.schema_proto import tensor_from_proto
from gemps_proto.tensor_codec import FLOAT32, EncodedTensor
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_server.domain.records import Commit

Blob = bytes | bytearray | memoryview


def reply_dtype_from_proto(dtype: int) -> int:
    """The wire format a reply asks for: float32 when unspecified; others as sent (the state checks
    them in the protocol's order: after the worker)."""
    return FLOAT32 if dtype == pb.DTYPE_UNSPECIFIED else dtype


def commit_from_proto(
    request: pb.CommitRequest,
    payload: EncodedTensor | None = None,
    payload_peak: float | None = None,
    *,
    volatile: bool = False,
    history: str = "",
) -> Commit:
    """The domain's Commit; `payload` when it was received apart (a view, or CommitStream's pieces),
    its max |value| when the wire measured it, and whether it lies in memory its client can still
    write (`volatile`: its shared memory). `history`: the server's (ServerState.history), which the
    request's known_history must name for its client to hold θ of its base version (a journal's
    entry is replayed with none: a replay sends no reply)."""
    return Commit(
        worker_id=request.worker_id,
        base_version=request.base_version,
        kind=request.kind,
        payload=tensor_from_proto(request.payload) if payload is None else payload,
        request_id=request.request_id,
        sequence=request.sequence,
        reply_dtype=reply_dtype_from_proto(request.reply_dtype),
        loss=request.loss if request.HasField("loss") else None,
        num_samples=request.num_samples if request.HasField("num_samples") else None,
        buffer_delta=shared.buffers_from_proto(request, "buffer_delta", "integer_buffer_delta"),
        payload_peak=payload_peak,
        held_copy=request.held_copy,
        payload_volatile=volatile,
        base_held=bool(history) and request.known_history == history,
        gradient_sums=shared.gradient_sums_from_proto(request),
    )


def commit_to_proto(commit: Commit) -> pb.CommitRequest:
    """`commit` as a COMMIT frame's header: the CommitRequest with its payload announced."""
    request = pb.CommitRequest(
        worker_id=commit.worker_id,
        base_version=commit.base_version,
        kind=commit.kind,  # type: ignore[arg-type]
        loss=commit.loss,
        num_samples=commit.num_samples,
        request_id=commit.request_id,
        sequence=commit.sequence,
        reply_dtype=commit.reply_dtype,  # type: ignore[arg-type]
        held_copy=commit.held_copy,
    )
    if commit.buffer_delta is not None:  # small: inside the header, as the worker sent it
        delta = commit.buffer_delta
        for field, tensor in ((request.buffer_delta, delta.floats), (request.integer_buffer_delta, delta.integers)):
            if tensor is not None:
                field.CopyFrom(_tensor(tensor))
    if commit.gradient_sums is not None:  # a backup folds them into its estimate as the primary did
        request.gradient_sums.CopyFrom(shared.gradient_sums_to_proto(commit.gradient_sums))
    request.payload.dtype = commit.payload.dtype  # type: ignore[assignment]
    request.payload.shape.extend(commit.payload.shape)  # announced: its bytes follow the header
    return request


def _tensor(tensor: EncodedTensor) -> pb.Tensor:
    return pb.Tensor(dtype=tensor.dtype, shape=tensor.shape, data=bytes(tensor.data))  # type: ignore[arg-type]


def frame_of(commit: Commit) -> tuple[bytes, Blob]:
    """`commit` as a COMMIT frame: its start (preamble and header) and its payload: a copy taken now
    (the wire reuses the buffer the payload is in once the commit returns), or the payload itself
    when its buffer is the commit's own (`payload_owned`: landed out of a client's shared memory)."""
    payload = commit.payload.data if commit.payload_owned else bytes(commit.payload.data)
    size = memoryview(payload).nbytes
    return frame_start(Op.COMMIT, commit_to_proto(commit).SerializeToString(), size), payload


def commit_of(parts: Sequence[Blob]) -> Commit:
    """The Commit a COMMIT frame holds, given as its start and its payload; ValueError (naming what
    is wrong) when they are not one."""
    if len(parts) != 2:
        raise ValueError(f"a COMMIT frame is its start and its payload, not {len(parts)} parts")
    start, payload = memoryview(parts[0]).cast("B"), memoryview(parts[1]).cast("B")
    try:
        preamble = read_preamble(start)
    except (FrameError, ValueError) as error:  # struct.error is a ValueError too
        raise ValueError(f"not a COMMIT frame: {error}") from None
    if preamble.op != Op.COMMIT or preamble.flags:
        raise ValueError(f"a frame of op {preamble.op:#x} (flags {preamble.flags:#x}), not a COMMIT")
    if preamble.header_bytes != start.nbytes - PREAMBLE.size or preamble.payload_bytes != payload.nbytes:
        raise ValueError("a COMMIT frame whose lengths are not its parts'")
    try:
        request = pb.CommitRequest.FromString(bytes(start[PREAMBLE.size :]))
    except DecodeError as error:
        raise ValueError(f"a COMMIT frame's header is not a CommitRequest: {error}") from None
    tensor = request.payload
    return commit_from_proto(request, EncodedTensor(tensor.dtype, tuple(tensor.shape), payload))
