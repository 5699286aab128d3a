"""The client's side of the wire: the requests the SDK sends and the replies it reads.

Paired with the server's serde (server/gemps_server/serde.py); what both ends convert is in
gemps_proto.serde.
"""

from __future__ import annotations

import numpy as np

from gemps.records import CentralVariable, CommitResult, ParameterSpec
from gemps_proto import serde as shared
from gemps_proto.codec import array_to_tensor
from gemps_proto.schema import PayloadKind
from gemps_proto.v1 import parameter_server_pb2 as pb


def register_request(
    spec: tuple[ParameterSpec, ...], worker_name: str, initial: np.ndarray | None
) -> pb.RegisterRequest:
    request = pb.RegisterRequest(spec=shared.spec_to_proto(spec), worker_name=worker_name)
    if initial is not None:
        request.initial_parameters.CopyFrom(array_to_tensor(initial))
    return request


def commit_request(
    *,
    worker_id: str,
    base_version: int,
    kind: PayloadKind,
    wire_dtype: int,
    num_parameters: int,
    data: bytes,
    loss: float | None,
    num_samples: int | None,
    request_id: str,
) -> pb.CommitRequest:
    """A Commit request; with empty `data` for CommitStream (the payload follows in pieces)."""
    return pb.CommitRequest(
        worker_id=worker_id,
        base_version=base_version,
        kind=kind.value,  # type: ignore[arg-type]
        payload=pb.Tensor(dtype=wire_dtype, shape=[num_parameters], data=data),  # type: ignore[arg-type]
        loss=loss,
        num_samples=num_samples,
        request_id=request_id,
        reply_dtype=wire_dtype,  # type: ignore[arg-type]
    )


def pull_request(worker_id: str, known_version: int, wire_dtype: int) -> pb.PullRequest:
    return pb.PullRequest(worker_id=worker_id, known_version=known_version, reply_dtype=wire_dtype)  # type: ignore[arg-type]


def commit_result_from_proto(reply: pb.CommitResponse, central: CentralVariable) -> CommitResult:
    """The reply's figures; `central` holds its parameters (decoded by the caller, unary or streamed)."""
    return CommitResult(
        version=reply.version,
        staleness=reply.staleness,
        scaling_mean=reply.scaling_mean,
        parameters=central,
        scaling_median=reply.scaling_median,
        scaling_at_zero=reply.scaling_at_zero,
        scaling_at_max=reply.scaling_at_max,
    )
