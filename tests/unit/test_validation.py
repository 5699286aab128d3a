"""The domain's checks (gemps_server.domain.validation): each refuses with the status class and
Reason the protocol names, and lets the valid case through."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gemps_proto.reasons import Reason
from gemps_proto.schema import Buffers, Evaluation, ParameterSpec, PayloadKind
from gemps_proto.tensor_codec import BFLOAT16, FLOAT32, INT64, EncodedBuffers, EncodedTensor
from gemps_server.domain import validation
from gemps_server.domain.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, ServiceError
from gemps_server.domain.records import Commit, PartitionOf
from tests.helpers import encoded

SPEC = (ParameterSpec("w", (2, 3)), ParameterSpec("b", (4,)))  # 10 values
BUFFERS = (ParameterSpec("mean", (2,)),)
MIXED_BUFFERS = (*BUFFERS, ParameterSpec("count", (), INT64))  # an integer buffer too
ALL = PartitionOf()


def refused(error_class: type[ServiceError], reason: Reason, call: object, *args: object) -> ServiceError:
    """The error `call(*args)` raises, checked for its class and reason."""
    assert callable(call)
    with pytest.raises(error_class) as raised:
        call(*args)
    assert raised.value.reason is reason, raised.value.message
    return raised.value


def commit(values: np.ndarray, base_version: int = 0, kind: int = PayloadKind.GRADIENT.value) -> Commit:
    return Commit(worker_id="w", base_version=base_version, kind=kind, payload=encoded(values))


def test_names_and_client_ids() -> None:
    validation.check_name("worker_name", "x" * validation.MAX_NAME_LENGTH)
    error = refused(InvalidArgument, Reason.TOO_LONG, validation.check_name, "worker_name", "x" * 257)
    assert "worker_name has 257 characters" in error.message
    validation.check_client_id("a-client")
    refused(InvalidArgument, Reason.BAD_CLIENT_ID, validation.check_client_id, "has space")


def test_specs() -> None:
    validation.check_spec(SPEC, BUFFERS)
    refused(InvalidArgument, Reason.BAD_SPEC, validation.check_spec, ())
    refused(InvalidArgument, Reason.BAD_SPEC, validation.check_spec, (ParameterSpec("", (1,)),))
    error = refused(InvalidArgument, Reason.BAD_SPEC, validation.check_spec, SPEC, (ParameterSpec("w", (1,)),))
    assert "'w' appears twice" in error.message
    refused(InvalidArgument, Reason.BAD_SPEC, validation.check_spec, (ParameterSpec("w", (-1,)),))
    refused(InvalidArgument, Reason.BAD_SPEC, validation.check_spec, (ParameterSpec("w", (0, 3)),))
    refused(InvalidArgument, Reason.BAD_SPEC, validation.check_spec_length, validation.MAX_SPEC_ENTRIES + 1)
    validation.check_spec_length(validation.MAX_SPEC_ENTRIES)


def test_spec_differences_and_mismatch() -> None:
    other = (ParameterSpec("w", (3, 2)), ParameterSpec("c", (4,)))
    differences = validation.spec_differences(SPEC, other)
    assert differences == [
        "parameter 0: server has " + SPEC[0].describe() + ", worker sent " + other[0].describe(),
        "parameter 1: server has " + SPEC[1].describe() + ", worker sent " + other[1].describe(),
        "missing from worker: b",
        "unknown to server: c",
    ]
    assert validation.spec_differences(SPEC, SPEC) == []
    validation.check_same_spec((SPEC, BUFFERS), (SPEC, BUFFERS))
    error = refused(FailedPrecondition, Reason.SPEC_MISMATCH, validation.check_same_spec, (SPEC, BUFFERS), (SPEC, ()))
    assert "server has 1 buffers, worker sent 0" in error.message
    ours = tuple(ParameterSpec(f"p{i}", (1,)) for i in range(8))
    theirs = tuple(ParameterSpec(f"p{i}", (2,)) for i in range(8))  # 8 differences: 5 spelled out
    error = refused(FailedPrecondition, Reason.SPEC_MISMATCH, validation.check_same_spec, (ours, ()), (theirs, ()))
    assert error.message.endswith("; and 3 more") and "parameter 4:" in error.message
    assert "parameter 5:" not in error.message


def test_sizes_of_the_first_upload() -> None:
    validation.check_size(SPEC, BUFFERS, ALL, 12)
    validation.check_size(SPEC, BUFFERS, ALL, None)
    refused(ResourceExhausted, Reason.TOO_LARGE, validation.check_size, SPEC, BUFFERS, ALL, 11)
    second = PartitionOf(1, 2)  # values 5..10 of 10
    validation.check_size(SPEC, (), second, 5)
    assert validation.initial_range(SPEC, 10, second) == slice(5, 10)
    assert validation.initial_range(SPEC, 5, second) == slice(None)
    refused(InvalidArgument, Reason.BAD_SHAPE, validation.initial_range, SPEC, 7, second)
    refused(InvalidArgument, Reason.BAD_SPEC, validation.initial_range, SPEC, 10, PartitionOf(0, 11))
    validation.check_buffer_count(MIXED_BUFFERS, (2, 1))
    refused(InvalidArgument, Reason.BAD_SHAPE, validation.check_buffer_count, MIXED_BUFFERS, (3, 1))
    refused(InvalidArgument, Reason.BAD_SHAPE, validation.check_buffer_count, MIXED_BUFFERS, (2, 0))
    validation.check_upload(SPEC, MIXED_BUFFERS, (10, (2, 1)), ALL, None)
    refused(InvalidArgument, Reason.BAD_SHAPE, validation.check_upload, SPEC, MIXED_BUFFERS, (10, (1, 1)), ALL, None)
    refused(InvalidArgument, Reason.BAD_SHAPE, validation.check_upload, SPEC, MIXED_BUFFERS, (9, (2, 1)), ALL, None)
    refused(ResourceExhausted, Reason.TOO_LARGE, validation.check_upload, SPEC, MIXED_BUFFERS, (10, (2, 1)), ALL, 3)


def test_initial_values_and_buffers() -> None:
    values = np.arange(10, dtype=np.float32)
    np.testing.assert_array_equal(validation.initial_values(SPEC, encoded(values), PartitionOf(1, 2)), values[5:])
    bad = values.copy()
    bad[7] = np.nan
    refused(InvalidArgument, Reason.NON_FINITE, validation.initial_values, SPEC, encoded(bad), ALL)
    short = EncodedTensor(FLOAT32, (10,), b"\0" * 8)
    refused(InvalidArgument, Reason.BAD_PAYLOAD, validation.initial_values, SPEC, short, ALL)
    buffers = validation.initial_buffers(MIXED_BUFFERS, both(np.array([1.0, 2.0], np.float32), [2**24 + 1]), ALL)
    assert (
        buffers.floats.dtype == np.float32 and buffers.floats.tolist() == [1.0, 2.0] and buffers.floats.flags.writeable
    )
    assert buffers.integers.dtype == np.int64 and buffers.integers.tolist() == [2**24 + 1]
    assert validation.initial_buffers((), None, ALL).size == 0
    refused(InvalidArgument, Reason.BAD_SHAPE, validation.initial_buffers, MIXED_BUFFERS, None, ALL)
    refused(InvalidArgument, Reason.BAD_SPEC, validation.initial_buffers, MIXED_BUFFERS, None, PartitionOf(1, 2))
    infinite = both(np.array([1.0, np.inf], np.float32), [0])
    refused(InvalidArgument, Reason.NON_FINITE, validation.initial_buffers, MIXED_BUFFERS, infinite, ALL)
    as_float = EncodedBuffers(encoded(np.array([1.0, 2.0], np.float32)), encoded(np.array([1.0], np.float32)))
    refused(InvalidArgument, Reason.BAD_PAYLOAD, validation.initial_buffers, MIXED_BUFFERS, as_float, ALL)


def both(floats: np.ndarray, integers: list[int]) -> EncodedBuffers:
    values = np.array(integers, "<i8")
    return EncodedBuffers(encoded(floats), EncodedTensor(INT64, values.shape, values.tobytes()))


def test_buffers_after_a_delta() -> None:
    central = Buffers(np.array([1.0, 2.0], np.float32), np.array([2**24], np.int64))
    assert validation.buffers_after(central, None, MIXED_BUFFERS) is central
    updated = validation.buffers_after(central, both(np.array([0.5, -1.0], np.float32), [1]), MIXED_BUFFERS)
    assert updated.floats.tolist() == [1.5, 1.0] and central.floats.tolist() == [1.0, 2.0]
    assert updated.integers.tolist() == [2**24 + 1]  # exact: float32 would stay at 2**24
    only_integers = validation.buffers_after(
        central, EncodedBuffers(None, both(central.floats, [3]).integers), MIXED_BUFFERS
    )
    assert only_integers.floats is central.floats and only_integers.integers.tolist() == [2**24 + 3]
    wrong_shape = both(np.ones(3, np.float32), [1])
    refused(InvalidArgument, Reason.BAD_SHAPE, validation.buffers_after, central, wrong_shape, MIXED_BUFFERS)
    overflow = both(np.array([3e38, 0.0], np.float32), [0])
    near_top = Buffers(np.array([3e38, 0.0], np.float32), np.array([0], np.int64))
    refused(InvalidArgument, Reason.NON_FINITE, validation.buffers_after, near_top, overflow, MIXED_BUFFERS)


@pytest.mark.parametrize(("central", "step"), [(2**63 - 1, 1), (-(2**63), -1), (2**62, 2**62)])
def test_an_integer_delta_past_int64_is_refused_naming_its_buffer(central: int, step: int) -> None:
    """Issue 77, item 7: the refusal said "a buffer"; with several integer buffers, which one?"""
    spec = (ParameterSpec("bn1.num_batches_tracked", (2,), INT64), *BUFFERS, ParameterSpec("bn2.count", (), INT64))
    buffers = Buffers(np.array([1.0, 2.0], np.float32), np.array([5, 6, central], np.int64))
    delta = both(buffers.floats * 0, [0, 0, step])
    error = refused(InvalidArgument, Reason.BAD_PAYLOAD, validation.buffers_after, buffers, delta, spec)
    assert f"buffer 'bn2.count' leave int64's range [-2**63, 2**63 - 1] ({central} + {step})" in error.message


def test_commit_fields() -> None:
    validation.check_reply_dtype(FLOAT32)
    validation.check_reply_dtype(BFLOAT16)
    refused(InvalidArgument, Reason.BAD_DTYPE, validation.check_reply_dtype, 99)
    validation.check_request_id("r" * 128)
    refused(InvalidArgument, Reason.BAD_REQUEST_ID, validation.check_request_id, "r" * 129)
    assert validation.payload_kind(PayloadKind.UPDATE.value) is PayloadKind.UPDATE
    refused(InvalidArgument, Reason.BAD_KIND, validation.payload_kind, 42)
    assert validation.expected_payload_bytes(FLOAT32, (10,), 10) == 40
    assert validation.expected_payload_bytes(BFLOAT16, (10,), 10) == 20
    refused(InvalidArgument, Reason.BAD_SHAPE, validation.expected_payload_bytes, FLOAT32, (2, 5), 10)
    refused(InvalidArgument, Reason.BAD_PAYLOAD, validation.expected_payload_bytes, 99, (10,), 10)


def validated_commit(commit: Commit, num_parameters: int, version: int) -> tuple[PayloadKind, np.ndarray, float]:
    """validation.validated_payload of a commit record's fields (as the commit core calls it)."""
    return validation.validated_payload(commit.kind, commit.payload, commit.base_version, num_parameters, version)


def test_validated_payload_in_the_protocols_order() -> None:
    values = np.linspace(-3.0, 2.0, 10, dtype=np.float32)
    kind, decoded, peak = validated_commit(commit(values, base_version=2), 10, version=2)
    assert kind is PayloadKind.GRADIENT and peak == 3.0
    np.testing.assert_array_equal(decoded, values)
    refused(InvalidArgument, Reason.BAD_KIND, validated_commit, commit(values, kind=7), 10, 0)
    refused(InvalidArgument, Reason.BAD_SHAPE, validated_commit, commit(values[:9]), 10, 0)
    refused(InvalidArgument, Reason.BAD_VERSION, validated_commit, commit(values, -1), 10, 0)
    error = refused(InvalidArgument, Reason.BAD_VERSION, validated_commit, commit(values, 3), 10, 2)
    assert "ahead of the server's version 2" in error.message
    nan = values.copy()
    nan[4] = np.nan
    refused(InvalidArgument, Reason.NON_FINITE, validated_commit, commit(nan), 10, 0)
    # the shape is checked before the version, the version before finiteness
    refused(InvalidArgument, Reason.BAD_SHAPE, validated_commit, commit(nan[:9], 5), 10, 0)
    refused(InvalidArgument, Reason.BAD_VERSION, validated_commit, commit(nan, 5), 10, 0)


def test_evaluations() -> None:
    validation.check_evaluation(Evaluation(version=3, loss=0.5, accuracy=0.9, num_samples=10), 3)
    for report in (
        Evaluation(version=3, loss=math.nan, accuracy=0.9, num_samples=10),
        Evaluation(version=3, loss=-1.0, accuracy=0.9, num_samples=10),
        Evaluation(version=3, loss=0.5, accuracy=1.5, num_samples=10),
    ):
        refused(InvalidArgument, Reason.BAD_EVALUATION, validation.check_evaluation, report, 3)
    # ahead of the server's: its history went back under the evaluator, as under a worker's commit
    ahead = Evaluation(version=4, loss=0.5, accuracy=0.9, num_samples=10)
    refused(InvalidArgument, Reason.BAD_VERSION, validation.check_evaluation, ahead, 3)
    long_label = Evaluation(version=3, loss=0.5, accuracy=0.9, num_samples=10, dataset="d" * 257)
    refused(InvalidArgument, Reason.TOO_LONG, validation.check_evaluation, long_label, 3)
