"""Hand-framed protobuf (gemps_proto.protobuf_wire) is exactly what protobuf itself writes and reads."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gemps_proto import protobuf_wire
from gemps_proto.schema_proto import tensor_to_proto
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_server.commit_frame import commit_from_proto
from gemps_server.wire import messages as serde
from gemps_server.wire.messages import MalformedRequest, WithTensor


@pytest.mark.parametrize("value", [1, 127, 128, 300, 2**32, 2**63 - 1, -1, -(2**63)])  # proto3 omits 0
def test_varints_round_trip_like_protobuf(value: int) -> None:
    encoded = protobuf_wire.varint(value)
    assert encoded == pb.CommitRequest(base_version=value).SerializeToString()[1:]
    assert protobuf_wire.read_varint(encoded, 0) == (value % 2**64, len(encoded))


@pytest.mark.parametrize("size", [0, 1, 300, 70_000])
@pytest.mark.parametrize("dtype", [pb.DTYPE_FLOAT32, pb.DTYPE_BFLOAT16])
def test_a_framed_reply_parses_as_protobuf_builds_it(size: int, dtype: int) -> None:
    data = np.arange(size, dtype=np.float32).tobytes()[: size * (2 if dtype == pb.DTYPE_BFLOAT16 else 4)]
    header = pb.CommitResponse(version=7, staleness=3, scaling_mean=0.5)
    framed = header.SerializeToString() + protobuf_wire.tensor_field(2, dtype, [size], len(data)) + data
    expected = pb.CommitResponse(version=7, staleness=3, scaling_mean=0.5)
    expected.parameters.CopyFrom(pb.Tensor(dtype=dtype, shape=[size], data=data))  # type: ignore[arg-type]
    assert pb.CommitResponse.FromString(framed) == expected


def test_a_commit_is_split_without_copying_its_payload() -> None:
    request = pb.CommitRequest(
        worker_id="w", base_version=4, kind=pb.PAYLOAD_KIND_GRADIENT, payload=tensor_to_proto(np.ones(5, np.float32))
    )
    data = request.SerializeToString()
    split = protobuf_wire.split_tensor_field(data, 4)
    assert split is not None and split.data.obj is data  # a view of the received bytes
    assert bytes(split.data) == request.payload.data
    parsed = serde.parse_with_tensor(pb.CommitRequest, 4, data)
    assert isinstance(parsed, WithTensor) and parsed.tensor is not None
    assert (parsed.message.worker_id, parsed.message.base_version) == ("w", 4)
    assert (parsed.tensor.dtype, parsed.tensor.shape) == (pb.DTYPE_FLOAT32, (5,))
    np.testing.assert_array_equal(parsed.tensor.decode(), np.ones(5, np.float32))


def test_unusual_framings_are_left_to_protobuf() -> None:
    one = pb.CommitRequest(payload=tensor_to_proto(np.ones(2, np.float32))).SerializeToString()
    twice = one + one  # valid protobuf: the two payloads merge
    assert protobuf_wire.split_tensor_field(twice, 4) is None
    parsed = serde.parse_with_tensor(pb.CommitRequest, 4, twice)
    assert isinstance(parsed, WithTensor) and parsed.tensor is not None
    assert parsed.tensor.shape == (2, 2)  # protobuf's merge: repeated shape appended
    assert (
        protobuf_wire.split_tensor_field(pb.CommitRequest(worker_id="w").SerializeToString(), 4) is None
    )  # no payload
    assert protobuf_wire.split_tensor_field(one[:-3], 4) is None  # truncated
    assert isinstance(serde.parse_with_tensor(pb.CommitRequest, 4, one[:-3]), MalformedRequest)


def _payloads() -> st.SearchStrategy[pb.Tensor]:
    return st.builds(
        lambda dtype, shape, data: pb.Tensor(dtype=dtype, shape=shape, data=data),
        st.sampled_from([0, 1, 2, 9]),
        st.lists(st.integers(-(2**40), 2**40), max_size=3),
        st.binary(max_size=64),
    )


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    st.text(max_size=8),
    st.integers(-(2**63), 2**63 - 1),
    st.sampled_from([0, 1, 2, 7]),
    st.one_of(st.none(), _payloads()),
    st.text(max_size=8),
    st.binary(max_size=16),
)
def test_the_fast_path_reads_what_protobuf_reads(
    worker_id: str, base: int, kind: int, payload: pb.Tensor | None, request_id: str, junk: bytes
) -> None:
    request = pb.CommitRequest(worker_id=worker_id, base_version=base, kind=kind, request_id=request_id)  # type: ignore[arg-type]
    if payload is not None:
        request.payload.CopyFrom(payload)
    for data in (request.SerializeToString(), request.SerializeToString() + junk):
        try:
            expected: pb.CommitRequest | None = pb.CommitRequest.FromString(data)
        except Exception:
            expected = None
        parsed = serde.parse_with_tensor(pb.CommitRequest, 4, data)
        if expected is None:
            assert isinstance(parsed, MalformedRequest)
            continue
        assert isinstance(parsed, WithTensor)
        commit = commit_from_proto(parsed.message, parsed.tensor)
        reference = commit_from_proto(expected)
        assert commit.payload.dtype == reference.payload.dtype
        assert commit.payload.shape == reference.payload.shape
        assert bytes(commit.payload.data) == bytes(reference.payload.data)
        assert (commit.worker_id, commit.base_version, commit.kind, commit.request_id) == (
            reference.worker_id,
            reference.base_version,
            reference.kind,
            reference.request_id,
        )
