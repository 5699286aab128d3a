from __future__ import annotations

import numpy as np
import pytest

from gemps.retry import RetryPolicy
from gemps_proto import tensor_codec
from gemps_proto.schema_proto import tensor_from_proto, tensor_to_proto
from gemps_proto.status import RecentCommits, WorkerStatus
from gemps_proto.tensor_codec import TensorDecodeError, all_finite
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_server.domain.errors import NotFound, ResourceExhausted
from gemps_server.domain.rules import ApplyStats
from gemps_server.domain.workers import WorkerRegistry


def test_round_trip_is_exact_and_little_endian() -> None:
    values = np.array([[1.5, -0.0], [np.float32(1e-38), 3.4e38]], dtype=np.float32)
    tensor = tensor_to_proto(values)
    assert tensor.data[:4] == b"\x00\x00\xc0\x3f"  # 1.5 in little-endian IEEE 754
    np.testing.assert_array_equal(tensor_from_proto(tensor).decode(), values)


def test_big_endian_and_float64_inputs_are_converted() -> None:
    for values in (np.arange(3, dtype=">f4"), np.arange(3, dtype=np.float64)):
        np.testing.assert_array_equal(tensor_from_proto(tensor_to_proto(values)).decode(), [0, 1, 2])


def test_decode_errors_say_what_is_wrong() -> None:
    with pytest.raises(TensorDecodeError, match="7 bytes of data but shape \\[2\\] of DTYPE_FLOAT32 needs 8"):
        tensor_from_proto(pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2], data=b"1234567")).decode()
    with pytest.raises(TensorDecodeError, match="unsupported dtype"):
        tensor_from_proto(pb.Tensor(dtype=pb.DTYPE_UNSPECIFIED, shape=[0])).decode()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_all_finite(bad: float) -> None:
    values = np.full(1000, 3e38, np.float32)  # large but finite: the float64 sum cannot overflow
    assert all_finite(values)
    values[517] = bad
    assert not all_finite(values)


def test_registry_reuses_lowest_free_slot_and_enforces_limit() -> None:
    registry = WorkerRegistry(max_workers=3, lease_ttl=10)
    a, b, c = (registry.add(n) for n in "abc")
    assert [a.slot, b.slot, c.slot] == [0, 1, 2]
    with pytest.raises(ResourceExhausted):
        registry.add("d")
    registry.remove(b.worker_id)
    assert registry.add("e").slot == 1


def test_registry_expires_silent_workers() -> None:
    now = [0.0]
    registry = WorkerRegistry(max_workers=4, lease_ttl=10, clock=lambda: now[0])
    quiet, busy = registry.add("quiet"), registry.add("busy")
    now[0] = 8.0
    registry.touch(busy.worker_id)
    now[0] = 11.0
    assert registry.expired() == [quiet.worker_id]
    registry.remove(quiet.worker_id)
    with pytest.raises(NotFound, match="register again"):
        registry.get(quiet.worker_id)


def test_the_registry_lists_each_worker_with_how_long_ago_it_was_seen() -> None:
    """Issue 37, item 4: Status lists the workers by shard, each with the age of its last request
    (its lease) and of its last commit, so that one that ended without leaving shows."""
    now = [100.0]
    registry = WorkerRegistry(max_workers=4, lease_ttl=60, clock=lambda: now[0])
    gone, busy = registry.add("gone"), registry.add("")
    now[0] = 130.0
    for staleness in (0, 1, 5):
        registry.committed(busy, staleness, loss=2.0, num_samples=32, stats=ApplyStats.constant(1.0))
    now[0] = 142.5
    registry.touch(busy.worker_id)  # a pull: seen, not committed
    # Issue 43, item 7: and each one's commits of the last minute (since it registered): rate, staleness.
    assert registry.listing() == (
        WorkerStatus("gone", 0, 0, 42.5, 42.5, RecentCommits(seconds=42.5)),
        WorkerStatus("", 1, 3, 0.0, 12.5, RecentCommits(42.5, 3, 96, 3, 2.0, staleness=2.0, scaling_mean=1.0)),
    )
    assert registry.listing()[1].recent.rate == pytest.approx(3 / 42.5)
    registry.remove(gone.worker_id)
    assert [worker.shard for worker in registry.listing()] == [1]


def test_retry_backoff_grows_and_is_capped() -> None:
    import random

    delays = list(RetryPolicy(max_attempts=6, initial_backoff=0.1, max_backoff=0.4).delays(random.Random(0)))
    assert len(delays) == 5
    assert all(0 <= d <= cap for d, cap in zip(delays, [0.1, 0.2, 0.4, 0.4, 0.4], strict=True))


def test_the_codecs_dtype_numbers_are_the_protos() -> None:
    """The codec knows gemps.v1.DType by number (so the server's domain imports no protobuf)."""
    assert {pb.DType.Name(value): value for value in pb.DType.values()} == {
        name: value for value, name in tensor_codec.DTYPE_NAMES.items()
    }
    assert (tensor_codec.FLOAT32, tensor_codec.BFLOAT16) == (pb.DTYPE_FLOAT32, pb.DTYPE_BFLOAT16)
