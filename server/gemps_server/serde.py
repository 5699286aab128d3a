"""The server's side of the wire: requests into domain types, outcomes into replies.

Paired with the SDK's serde (client_sdk/gemps/serde.py); what both ends convert is in
gemps_proto.serde. Checks that need only the message (a dtype, a payload kind) happen here and
raise InvalidArgument; checks against the server's state happen in state.py.
"""

from __future__ import annotations

from collections.abc import Sequence

from google.protobuf.message import DecodeError, Message

from gemps_proto import serde as shared
from gemps_proto.codec import FLOAT32, EncodedTensor, bytes_to_tensor, dtype_name, received
from gemps_proto.reasons import Reason
from gemps_proto.schema import ParameterSpec, Registration
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_server.errors import InvalidArgument
from gemps_server.state import Admission, Commit, CommitOutcome, Snapshot


class MalformedRequest:
    """Stands in for request bytes that are not a valid message of the method's type, so the
    handler can answer INVALID_ARGUMENT (gRPC itself would answer UNKNOWN)."""

    def __init__(self, message_type: str, error: str) -> None:
        self.message_type = message_type
        self.error = error

    def refusal(self) -> InvalidArgument:
        return InvalidArgument(f"request is not a valid {self.message_type}: {self.error}", Reason.MALFORMED)


def parse_request(message_class: type[Message], data: bytes) -> Message | MalformedRequest:
    try:
        return message_class.FromString(data)
    except DecodeError as error:
        return MalformedRequest(message_class.DESCRIPTOR.full_name, str(error))


def reply_dtype_from_proto(dtype: int) -> int:
    """The wire format a reply asks for: float32 when unspecified; others as sent (the state checks
    them in the protocol's order: after the worker)."""
    return FLOAT32 if dtype == pb.DTYPE_UNSPECIFIED else dtype


def spec_from_proto(messages: Sequence[pb.ParameterSpec]) -> tuple[ParameterSpec, ...]:
    """A worker's spec; InvalidArgument for an entry whose dtype is not the central variable's."""
    for entry in messages:
        if entry.dtype != pb.DTYPE_FLOAT32:
            raise InvalidArgument(
                f"parameter {entry.name!r} has dtype {dtype_name(entry.dtype)}; the central variable is DTYPE_FLOAT32",
                Reason.BAD_DTYPE,
            )
    return shared.spec_from_proto(messages)


def initial_parameters_from_proto(request: pb.RegisterRequest) -> EncodedTensor | None:
    return received(request.initial_parameters) if request.HasField("initial_parameters") else None


def admission_to_proto(admission: Admission, registration: Registration, num_parameters: int) -> pb.RegisterResponse:
    reply = shared.registration_to_proto(registration)
    # No values for the worker whose initial_parameters became theta: it has them already.
    theta = admission.snapshot.data()
    if not admission.initialized_theta and theta is not None:
        reply.parameters.CopyFrom(bytes_to_tensor(theta, num_parameters))
    return reply


def commit_from_proto(request: pb.CommitRequest, payload: EncodedTensor | None = None) -> Commit:
    """The domain's Commit; `payload` is the streamed one (CommitStream), else the request's own."""
    return Commit(
        worker_id=request.worker_id,
        base_version=request.base_version,
        kind=request.kind,
        payload=received(request.payload) if payload is None else payload,
        request_id=request.request_id,
        reply_dtype=reply_dtype_from_proto(request.reply_dtype),
        loss=request.loss if request.HasField("loss") else None,
        num_samples=request.num_samples if request.HasField("num_samples") else None,
    )


def outcome_to_proto(
    outcome: CommitOutcome, reply_dtype: int, num_parameters: int, with_parameters: bool = True
) -> pb.CommitResponse:
    """The reply; without parameter bytes for CommitStream, which sends them in pieces after it."""
    data = (outcome.snapshot.data(reply_dtype) or b"") if with_parameters else b""
    stats = outcome.stats
    return pb.CommitResponse(
        version=outcome.snapshot.version,
        parameters=bytes_to_tensor(data, num_parameters, reply_dtype),
        staleness=outcome.staleness,
        scaling_mean=stats.scaling_mean,
        scaling_median=stats.scaling_median,
        scaling_at_zero=stats.fraction_at_zero,
        scaling_at_max=stats.fraction_at_max,
    )


def pull_to_proto(snapshot: Snapshot, reply_dtype: int, num_parameters: int) -> pb.PullResponse:
    return pb.PullResponse(
        version=snapshot.version,
        parameters=bytes_to_tensor(snapshot.data(reply_dtype) or b"", num_parameters, reply_dtype),
    )


def unchanged_to_proto(version: int) -> pb.PullResponse:
    return pb.PullResponse(version=version, unchanged=True)
