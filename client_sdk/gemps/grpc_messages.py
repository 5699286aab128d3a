"""The gRPC messages the SDK frames and the replies it reads, as the transport's records.

Both transports use them: gRPC sends them whole, the data plane (gemps.data_plane_transport) as
its frames' headers, with the tensors' data announced and sent raw beside them.

Paired with the server's wire messages (server/gemps_server/wire/messages.py); what both ends convert is in
gemps_proto.schema_proto. Requests and replies that carry θ are bytes: θ is framed into a request with
one copy and read out of a reply as a view of the received bytes (gemps_proto.grpc_framing), never
copied through a protobuf message.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from gemps.records import Buffers, ParameterSpec
from gemps.transport import CommitCall, Committed, PullCall, Pulled, Registered
from gemps_proto import grpc_framing, vectors, versions
from gemps_proto import schema_proto as shared
from gemps_proto.reply_differences import DIFFERENCE_DTYPES
from gemps_proto.tensor_codec import (
    FLOAT32,
    INT64,
    EncodedTensor,
    TensorDecodeError,
    checked_block_codes,
    dtype_name,
    encode,
    wire_view,
)
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_proto.vectors import Vector

if TYPE_CHECKING:
    from gemps_proto.block_quantisation import BlockCodes


def register_request(
    spec: tuple[ParameterSpec, ...],
    worker_name: str,
    initial: Vector | None,
    *,
    omit_parameters: bool = False,
    buffer_spec: tuple[ParameterSpec, ...] = (),
    buffers: Buffers | None = None,
    client_id: str = "",
    job: str = "",
    streamed: bool = False,
) -> bytes:
    """A Register request; for RegisterStream (`streamed`) the initial tensors' dtype and shape
    only, in a RegisterChunk: their data follows in pieces (register_stream_data)."""
    request = pb.RegisterRequest(
        spec=shared.spec_to_proto(spec),
        worker_name=worker_name,
        omit_parameters=omit_parameters,
        buffer_spec=shared.spec_to_proto(buffer_spec),
        client_id=client_id,
        job=job,
        versions=shared.versions_to_proto(versions.THIS),  # the server refuses a client it cannot serve
    )
    with_buffers = bool(buffer_spec) and buffers is not None
    if streamed:
        assert initial is not None, "a streamed Register carries initial values"
        grpc_framing.announce(request.initial_parameters, FLOAT32, vectors.size(initial))
        if with_buffers:
            assert buffers is not None
            if vectors.size(buffers.floats):
                grpc_framing.announce(request.initial_buffers, FLOAT32, vectors.size(buffers.floats))
            if vectors.size(buffers.integers):
                grpc_framing.announce(request.initial_integer_buffers, INT64, vectors.size(buffers.integers))
        return pb.RegisterChunk(header=request).SerializeToString()
    if with_buffers:
        assert buffers is not None
        shared.set_buffers(request.initial_buffers, request.initial_integer_buffers, buffers)
    if initial is None:
        return request.SerializeToString()
    return grpc_framing.with_tensor(
        request, grpc_framing.REGISTER_INITIAL_FIELD, FLOAT32, [vectors.size(initial)], encode(initial)
    )


def register_stream_data(
    initial: Vector, buffer_spec: tuple[ParameterSpec, ...], buffers: Buffers | None
) -> list[bytes | memoryview]:
    """What follows a streamed Register's header, in order: the parameters', then the float
    buffers' float32 bytes and the integer buffers' int64 bytes (the parameters' a view, not a
    copy: the caller leaves the array unchanged meanwhile)."""
    parts = [wire_view(initial)]
    if buffer_spec and buffers is not None:
        parts.append(wire_view(vectors.flat(buffers.floats)))
        parts.append(vectors.little_endian_int64(buffers.integers))
    return parts


def buffers_from_proto(reply: pb.RegisterResponse | pb.PullResponse | pb.CommitResponse) -> Buffers | None:
    """A reply's central buffers; None when it carries none (a model without buffers, or unchanged)."""
    found = shared.buffers_from_proto(reply, "buffers", "integer_buffers")
    if found is None:
        return None
    return Buffers(
        vectors.empty_float32() if found.floats is None else found.floats.decode(),
        vectors.empty_int64() if found.integers is None else found.integers.decode_int64(),
    )


def register_reply(data: bytes) -> Registered:
    """The registration, the central variable (None for the worker whose values set it), the
    central buffers (None when the model has none), and the version and history θ counts in."""
    reply, parameters = grpc_framing.parse_with_tensor(pb.RegisterResponse, grpc_framing.REGISTER_REPLY_FIELD, data)
    registration = shared.registration_from_proto(reply)
    theta = None if parameters is None else parameters.decode()
    return Registered(registration, theta, buffers_from_proto(reply), registration.version, reply.history)


def pull_request(call: PullCall, wire_dtype: int) -> bytes:
    """A Pull request: gRPC's Pull and PullStream message, and a data-plane PULL's header."""
    request = pb.PullRequest(
        worker_id=call.worker_id,
        known_version=call.known_version,
        reply_dtype=wire_dtype,  # type: ignore[arg-type]
        known_history=call.known_history,
        wait_seconds=call.wait_seconds,
    )
    return request.SerializeToString()


def pulled_from_proto(reply: pb.PullResponse, parameters: Vector | None) -> Pulled:
    """A Pull reply (unary or streamed) with its central variable, decoded by the caller."""
    return Pulled(reply.version, parameters, buffers_from_proto(reply), reply.history, reply.round_takes_next)


def pull_reply(data: bytes) -> Pulled:
    """The reply's version and flag, and the central variable unless it is unchanged."""
    reply, parameters = grpc_framing.parse_with_tensor(pb.PullResponse, grpc_framing.PULL_REPLY_FIELD, data)
    return pulled_from_proto(reply, None if parameters is None or reply.unchanged else parameters.decode())


def commit_message(call: CommitCall, wire_dtype: int) -> pb.CommitRequest:
    """A Commit request's fields, its payload aside; replies come in `wire_dtype` too."""
    header = pb.CommitRequest(
        worker_id=call.worker_id,
        base_version=call.base_version,
        kind=call.kind.value,  # type: ignore[arg-type]
        loss=call.loss,
        num_samples=call.num_samples,
        request_id=call.request_id,
        sequence=call.sequence,
        reply_dtype=call.reply_code or wire_dtype,  # type: ignore[arg-type]
        held_copy=call.held_copy,
        known_history=call.known_history,
    )
    if call.buffer_delta is not None:
        shared.set_buffers(header.buffer_delta, header.integer_buffer_delta, call.buffer_delta)
    if call.gradient_sums is not None:
        header.gradient_sums.CopyFrom(shared.gradient_sums_to_proto(call.gradient_sums))
    return header


def announced_commit(call: CommitCall, wire_dtype: int, payload_dtype: int | None = None) -> pb.CommitRequest:
    """A Commit request whose payload's dtype (`payload_dtype`, else `wire_dtype`) and shape are
    announced, its data left to follow: CommitStream's header, and a data-plane COMMIT's (its raw
    bytes after it). Replies come in `wire_dtype`."""
    header = commit_message(call, wire_dtype)
    grpc_framing.announce(
        header.payload, wire_dtype if payload_dtype is None else payload_dtype, vectors.size(call.payload)
    )
    return header


def commit_request(
    call: CommitCall, wire_dtype: int, payload_dtype: int, data: bytes | memoryview, *, streamed: bool = False
) -> bytes:
    """A Commit request with its payload's wire bytes `data` in `payload_dtype` (replies in
    `wire_dtype`); for CommitStream (`streamed`) the payload's dtype and shape only: its data
    follows in pieces."""
    if streamed:
        return pb.CommitChunk(header=announced_commit(call, wire_dtype, payload_dtype)).SerializeToString()
    header = commit_message(call, wire_dtype)
    return grpc_framing.with_tensor(
        header, grpc_framing.COMMIT_PAYLOAD_FIELD, payload_dtype, [vectors.size(call.payload)], data
    )


def committed_from_proto(reply: pb.CommitResponse, parameters: Vector | BlockCodes | None) -> Committed:
    """A Commit reply's figures (unary or streamed) with its central variable (or, for a difference
    reply, the difference's code), read by the caller (`reply_values`); None when `unchanged`."""
    values, difference = (None, cast("BlockCodes", parameters)) if reply.difference_of else (parameters, None)
    return Committed(
        version=reply.version,
        staleness=reply.staleness,
        scaling_mean=reply.scaling_mean,
        scaling_median=reply.scaling_median,
        scaling_at_zero=reply.scaling_at_zero,
        scaling_at_max=reply.scaling_at_max,
        parameters=cast("Vector | None", values),
        buffers=buffers_from_proto(reply),
        epoch=reply.epoch,
        copy=reply.copy,
        difference_of=reply.difference_of,
        round_pending=reply.round_pending,
        difference=difference,
    )


def reply_values(reply: pb.CommitResponse, parameters: EncodedTensor) -> Vector | BlockCodes:
    """A Commit reply's θ (read-only float32 values), or a difference reply's code, checked and not
    decoded (the held copy reads it as it moves); TensorDecodeError for a code where θ was due, θ
    where a difference was, θ in a reply that says it is unchanged, or bytes no encoder writes."""
    if reply.unchanged:
        raise TensorDecodeError("a commit reply that says θ is unchanged, and carries it")
    if (parameters.dtype in DIFFERENCE_DTYPES) != bool(reply.difference_of):
        said = f"a difference from copy {reply.difference_of}" if reply.difference_of else "θ whole"
        raise TensorDecodeError(f"a commit reply in {dtype_name(parameters.dtype)} that says it is {said}")
    if reply.difference_of:
        return checked_block_codes(parameters.dtype, parameters.shape, parameters.data)
    return vectors.read_only(parameters.decode())


def commit_reply(data: bytes) -> Committed:
    """The reply's figures and the central variable (a read-only view of `data`)."""
    reply, parameters = grpc_framing.parse_with_tensor(pb.CommitResponse, grpc_framing.COMMIT_REPLY_FIELD, data)
    if parameters is None:
        if not reply.unchanged:
            raise TensorDecodeError("a commit reply with no θ that does not say it is unchanged")
        return committed_from_proto(reply, None)
    return committed_from_proto(reply, reply_values(reply, parameters))
