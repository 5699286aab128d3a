"""The server's protobuf messages: requests into domain records, outcomes into replies.

Paired with the SDK's protobuf conversions (client_sdk/gemps); what both ends convert is in
gemps_proto.schema_proto. Checks against the server's state, in the protocol's order, happen in the
domain (domain/validation.py, run by domain/state.py); here only what needs nothing but the
message (a spec entry's dtype).

θ never goes through a protobuf message on the hot path. A request's tensor (a commit's payload,
the first worker's initial parameters) is a memoryview of the received bytes; a reply carrying θ
is its small header, serialised by protobuf, joined with the snapshot's bytes framed in the
wire format (gemps_proto.grpc_framing): one copy of θ per reply, nothing per field.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from google.protobuf.message import DecodeError, Message

from gemps_proto import grpc_framing as framing
from gemps_proto import schema_proto as shared
from gemps_proto import versions
from gemps_proto.reasons import Reason
from gemps_proto.schema import ParameterSpec, Registration
from gemps_proto.tensor_codec import FLOAT32, EncodedBuffers, EncodedTensor, dtype_name
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_server.domain.errors import FailedPrecondition, InvalidArgument
from gemps_server.domain.records import CommitOutcome, RegistrationOutcome, ReplyWriter, Snapshot
from gemps_server.domain.validation import check_spec_length
from gemps_server.wire.stream_buffers import Buffer

M = TypeVar("M", bound=Message)


class MalformedRequest:
    """Stands in for request bytes that are not a valid message of the method's type, so the
    handler can answer INVALID_ARGUMENT (gRPC itself would answer UNKNOWN)."""

    def __init__(self, message_type: str, error: str) -> None:
        self.message_type = message_type
        self.error = error

    def refusal(self) -> InvalidArgument:
        return InvalidArgument(f"request is not a valid {self.message_type}: {self.error}", Reason.MALFORMED)


@dataclass(frozen=True)
class WithTensor(Generic[M]):
    """A request whose θ-sized tensor field was kept out of protobuf: the message without that
    tensor's data, and the tensor (its data a view of the received bytes), or None if absent."""

    message: M
    tensor: EncodedTensor | None


def parse_request(message_class: type[M], data: bytes) -> M | MalformedRequest:
    try:
        return message_class.FromString(data)
    except DecodeError as error:
        return MalformedRequest(message_class.DESCRIPTOR.full_name, str(error))


def parse_with_tensor(message_class: type[M], field_number: int, data: bytes) -> WithTensor[M] | MalformedRequest:
    """Parse a request, its tensor field `field_number` without copying the tensor's data."""
    try:
        message, tensor = framing.parse_with_tensor(message_class, field_number, data)
    except DecodeError as error:
        return MalformedRequest(message_class.DESCRIPTOR.full_name, str(error))
    return WithTensor(message, tensor)


def spec_from_proto(messages: Sequence[pb.ParameterSpec]) -> tuple[ParameterSpec, ...]:
    """A worker's spec; InvalidArgument for an entry whose dtype is not the central variable's, or
    for more entries than a spec may have (checked before reading any)."""
    return _spec_of_dtypes(messages, "parameter", (pb.DTYPE_FLOAT32,))


def buffer_spec_from_proto(messages: Sequence[pb.ParameterSpec]) -> tuple[ParameterSpec, ...]:
    """A worker's buffer spec: float32 entries, and int64 ones for integer buffers (kept exact)."""
    return _spec_of_dtypes(messages, "buffer", (pb.DTYPE_FLOAT32, pb.DTYPE_INT64))


def _spec_of_dtypes(
    messages: Sequence[pb.ParameterSpec], what: str, dtypes: tuple[int, ...]
) -> tuple[ParameterSpec, ...]:
    check_spec_length(len(messages))
    for entry in messages:
        if entry.dtype not in dtypes:
            allowed = " or ".join(dtype_name(dtype) for dtype in dtypes)
            raise InvalidArgument(
                f"{what} {entry.name!r} has dtype {dtype_name(entry.dtype)}; {what}s are {allowed}",
                Reason.BAD_DTYPE,
            )
    return shared.spec_from_proto(messages)


def buffers_from_proto(request: pb.RegisterRequest) -> tuple[tuple[ParameterSpec, ...], EncodedBuffers | None]:
    """A registering worker's buffer spec and initial buffers (None when it sent none)."""
    initial = shared.buffers_from_proto(request, "initial_buffers", "initial_integer_buffers")
    return buffer_spec_from_proto(request.buffer_spec), initial


def check_client_versions(request: pb.RegisterRequest) -> None:
    """FailedPrecondition, naming both ends' versions, for a client that shares no protocol with
    this server; a client that sends none is taken to speak the legacy protocol (versions.py)."""
    client = shared.versions_from_proto(request) or versions.LEGACY
    refusal = versions.incompatibility(versions.THIS, client)
    if refusal is not None:
        raise FailedPrecondition(refusal, Reason.INCOMPATIBLE_VERSION)


def set_buffers(header: pb.RegisterResponse | pb.PullResponse | pb.CommitResponse, snapshot: Snapshot) -> None:
    """A reply's `buffers` and `integer_buffers`: the snapshot's whole (small), each left unset
    when the model has none of its kind."""
    if snapshot.buffers is not None:
        shared.set_buffers(header.buffers, header.integer_buffers, snapshot.buffers)


def with_parameters(header: Message, field_number: int, snapshot: Snapshot, dtype: int, num_parameters: int) -> bytes:
    """`header` serialised, with the snapshot's θ in `dtype` framed as Tensor field `field_number`."""
    return framing.with_tensor(header, field_number, dtype, [num_parameters], snapshot.data(dtype) or b"")


def registered_to_proto(
    registered: RegistrationOutcome,
    registration: Registration,
    num_parameters: int,
    *,
    include_parameters: bool = True,
    history: str = "",
) -> bytes:
    """The RegisterResponse; without θ for the worker whose initial_parameters became it, and
    when the worker asked to pull it apart (`include_parameters` False)."""
    header = shared.registration_to_proto(registration)
    header.versions.CopyFrom(shared.versions_to_proto(versions.THIS))
    header.history = history
    set_buffers(header, registered.snapshot)
    if not include_parameters or registered.initialized_theta or registered.snapshot.data(FLOAT32) is None:
        return header.SerializeToString()
    return with_parameters(header, framing.REGISTER_REPLY_FIELD, registered.snapshot, FLOAT32, num_parameters)


def outcome_header(outcome: CommitOutcome) -> pb.CommitResponse:
    """The CommitResponse's fields other than the parameters."""
    stats = outcome.stats
    header = pb.CommitResponse(
        version=outcome.snapshot.version,
        staleness=outcome.staleness,
        scaling_mean=stats.scaling_mean,
        scaling_median=stats.scaling_median,
        scaling_at_zero=stats.fraction_at_zero,
        scaling_at_max=stats.fraction_at_max,
        epoch=outcome.epoch,
        unchanged=outcome.unchanged,
    )
    if not outcome.duplicate:  # a retry's reply is today's θ: nothing to wait for
        header.round_pending = stats.pending
    if outcome.reply is not None:  # a difference-reply client's copy: which it is, and from which
        header.copy, header.difference_of = outcome.reply.copy, outcome.reply.difference_of
    set_buffers(header, outcome.snapshot)
    return header


def outcome_to_proto(outcome: CommitOutcome, dtype: int, theta: bytes | memoryview, num_parameters: int) -> bytes:
    """The serialized CommitResponse, with `theta`: the commit's version of θ, in the reply's `dtype`
    (none when the outcome is `unchanged`)."""
    if outcome.unchanged:
        return outcome_header(outcome).SerializeToString()
    return framing.with_tensor(outcome_header(outcome), framing.COMMIT_REPLY_FIELD, dtype, [num_parameters], theta)


def commit_reply(dtype: int, num_parameters: int) -> ReplyWriter[bytes]:
    """A unary Commit's reply writer: the serialized CommitResponse, framed by the state's call
    on the applier straight from θ's bytes at the commit's version (one copy of θ)."""
    return functools.partial(_framed_outcome, dtype, num_parameters)


def _framed_outcome(dtype: int, num_parameters: int, outcome: CommitOutcome, theta: bytes | memoryview) -> bytes:
    return outcome_to_proto(outcome, outcome.reply_dtype(dtype), theta, num_parameters)


def stream_commit_reply(buffer: Buffer) -> ReplyWriter[memoryview]:
    """The reply writer for θ sent from a buffer (a CommitStream's or the data plane's pooled
    `buffer`, or the client's shared memory): θ at the commit's version placed at the buffer's
    start (a payload it held is applied, done with), nothing copied when the rule already wrote it
    there (the domain's `out=`), then sent in pieces from there."""
    return functools.partial(_placed_in, buffer)


def _placed_in(buffer: Buffer, outcome: CommitOutcome, theta: bytes | memoryview) -> memoryview:
    return buffer.copy_in(theta)


def written_there(outcome: CommitOutcome, theta: bytes | memoryview) -> memoryview:
    """The reply writer where the rule wrote θ where the client reads it (its shared memory, the
    domain's `out=`): nothing to place, only θ's size to announce."""
    return memoryview(theta)


def announced_header(outcome: CommitOutcome, reply_dtype: int, num_parameters: int) -> pb.CommitResponse:
    """The CommitResponse whose parameters say dtype and shape, θ's data to follow apart (in
    CommitStream's pieces, or after a data-plane frame's header); parameters unset, and nothing to
    follow, when the outcome is `unchanged`."""
    header = outcome_header(outcome)
    if not outcome.unchanged:
        framing.announce(header.parameters, outcome.reply_dtype(reply_dtype), num_parameters)
    return header


def stream_header_to_proto(outcome: CommitOutcome, reply_dtype: int, num_parameters: int) -> pb.CommitResponseChunk:
    """CommitStream's first reply: announced_header in a chunk; the data follows in pieces."""
    return pb.CommitResponseChunk(header=announced_header(outcome, reply_dtype, num_parameters))


def pull_to_proto(snapshot: Snapshot, reply_dtype: int, num_parameters: int, history: str = "") -> bytes:
    header = pb.PullResponse(version=snapshot.version, history=history)
    set_buffers(header, snapshot)
    return with_parameters(header, framing.PULL_REPLY_FIELD, snapshot, reply_dtype, num_parameters)


def pull_stream_header_to_proto(
    snapshot: Snapshot,
    unchanged: bool,
    reply_dtype: int,
    num_parameters: int,
    history: str = "",
    takes_next: bool = False,
) -> pb.PullResponseChunk:
    """PullStream's first reply: the PullResponse whose parameters say dtype and shape (unless
    `unchanged`: then whether the round open now `takes_next`); the data follows in pieces."""
    if unchanged:
        return pb.PullResponseChunk(header=unchanged_to_proto(snapshot.version, history, takes_next))
    header = pb.PullResponse(version=snapshot.version, history=history)
    set_buffers(header, snapshot)
    framing.announce(header.parameters, reply_dtype, num_parameters)
    return pb.PullResponseChunk(header=header)


def unchanged_to_proto(version: int, history: str = "", takes_next: bool = False) -> pb.PullResponse:
    return pb.PullResponse(version=version, unchanged=True, history=history, round_takes_next=takes_next)
