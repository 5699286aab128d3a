"""The server's layers: the commit rule interface apart from the overflow helpers, and a commit's
reply written by the state, on the applier, through a writer the wire supplies."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from collections.abc import Callable

import numpy as np
import pytest

from gemps_proto.schema import ParameterSpec, PayloadKind
from gemps_proto.status import PRIMARY, BackupLag, ReplicationStatus
from gemps_proto.tensor_codec import BFLOAT16, FLOAT32, encode
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_server.config import ServerConfig
from gemps_server.domain.applier import Applier
from gemps_server.domain.records import Commit, CommitOutcome
from gemps_server.domain.rules import CommitRule, rule_class, rule_names
from gemps_server.domain.rules.overflow import OverflowGuard
from gemps_server.domain.state import ServerState
from gemps_server.domain.workers import WorkerRegistry
from gemps_server.metrics import ServerMetrics
from gemps_server.replicas import NoReplicas, Replicas
from gemps_server.service import ParameterService
from gemps_server.wire import messages
from gemps_server.wire.stream_buffers import Buffer
from tests.helpers import encoded, training

OVERFLOW_HELPERS = (
    "take_spare",
    "keep_spare",
    "checked",
    "peak_of",
    "remember_peak",
    "in_place_bound",
    "update_peak",
    "scaled",
    "scratch",
)
SPEC = (ParameterSpec("w", (5,)),)


def test_the_rule_interface_holds_no_overflow_helpers() -> None:
    interface = {name for name, _ in inspect.getmembers(CommitRule)}
    assert not interface & set(OVERFLOW_HELPERS)
    assert set(OVERFLOW_HELPERS) <= {name for name, _ in inspect.getmembers(OverflowGuard)}
    for name in rule_names():
        assert issubclass(rule_class(name), OverflowGuard), name
        assert issubclass(rule_class(name), CommitRule), name


def registered_state(rule: str = "downpour") -> tuple[ServerState, str]:
    state = ServerState(training(rule, learning_rate=0.5), WorkerRegistry(max_workers=4, lease_ttl=3600))
    registered = state.register("w", SPEC, encoded(np.arange(5, dtype=np.float32)))
    return state, registered.worker.worker_id


def test_the_reply_is_written_while_theta_holds_the_commits_version() -> None:
    state, worker = registered_state()
    seen: list[tuple[int, int, bytes]] = []

    def writer(outcome: CommitOutcome, theta: bytes | memoryview) -> str:
        seen.append((outcome.snapshot.version, state.core.version, bytes(theta)))
        return "reply"

    gradient = np.full(5, 2.0, np.float32)
    commit = Commit(worker_id=worker, base_version=0, kind=PayloadKind.GRADIENT.value, payload=encoded(gradient))
    outcome, reply = state.core.commit_and_reply(commit, writer)
    assert reply == "reply" and outcome.snapshot.version == 1
    expected = (np.arange(5, dtype=np.float32) - 0.5 * gradient).astype(np.float32)
    assert seen == [(1, 1, expected.tobytes())]
    # in the commit's reply dtype
    nothing = encoded(np.zeros(5, np.float32))
    update = Commit(worker_id=worker, base_version=1, kind=PayloadKind.UPDATE.value, payload=nothing)
    state.core.commit_and_reply(dataclasses.replace(update, reply_dtype=BFLOAT16), writer)
    assert seen[-1] == (2, 2, encode(expected, BFLOAT16))


def test_a_duplicates_reply_carries_the_current_theta() -> None:
    state, worker = registered_state()
    payload = encoded(np.ones(5, np.float32))
    commit = Commit(worker_id=worker, base_version=0, kind=PayloadKind.UPDATE.value, payload=payload, request_id="r1")
    state.core.commit_record(commit)
    state.core.commit_record(Commit(worker_id=worker, base_version=1, kind=PayloadKind.UPDATE.value, payload=payload))
    outcome, theta = state.core.commit_and_reply(commit, lambda outcome, theta: bytes(theta))
    assert outcome.duplicate and outcome.snapshot.version == 2
    assert theta == (np.arange(5, dtype=np.float32) + 2).tobytes()


@pytest.mark.parametrize("dtype", [FLOAT32, BFLOAT16])
def test_the_unary_writer_frames_the_commit_response(dtype: int) -> None:
    state, worker = registered_state()
    commit = Commit(
        worker_id=worker,
        base_version=0,
        kind=PayloadKind.UPDATE.value,
        payload=encoded(np.ones(5, np.float32)),
        reply_dtype=dtype,
    )
    outcome, reply = state.core.commit_and_reply(commit, messages.commit_reply(dtype, 5))
    response = pb.CommitResponse.FromString(reply)
    assert response.version == outcome.snapshot.version == 1
    assert response.parameters.dtype == dtype and list(response.parameters.shape) == [5]
    assert response.parameters.data == encode(np.arange(5, dtype=np.float32) + 1, dtype)


def test_the_stream_writer_copies_theta_into_the_streams_buffer() -> None:
    state, worker = registered_state()
    buffer = Buffer(np.empty(0, np.uint8))
    commit = Commit(worker_id=worker, base_version=0, kind=PayloadKind.UPDATE.value, payload=encoded(np.ones(5)))
    _, data = state.core.commit_and_reply(commit, messages.stream_commit_reply(buffer))
    assert bytes(data) == (np.arange(5, dtype=np.float32) + 1).tobytes()
    assert np.shares_memory(np.frombuffer(data, np.uint8), buffer.bytes)  # in the pooled buffer, not a new copy
    state.core.commit_record(
        Commit(worker_id=worker, base_version=1, kind=PayloadKind.UPDATE.value, payload=encoded(np.ones(5)))
    )
    assert bytes(data) == (np.arange(5, dtype=np.float32) + 1).tobytes()  # θ moved on; the reply did not


def test_the_buffer_writer_copies_nothing_when_the_rule_wrote_theta_there() -> None:
    """θ written by the commit into the buffer's own memory (`out=`, as the shared-memory route
    does): the writer hands back those bytes; the next reply from the buffer still copies."""
    state, worker = registered_state()
    buffer = Buffer(np.full(20, 0xFF, np.uint8))
    floats = buffer.bytes.view(np.float32)
    commit = Commit(worker_id=worker, base_version=0, kind=PayloadKind.UPDATE.value, payload=encoded(np.ones(5)))
    _, data = state.core.commit_and_reply(commit, messages.stream_commit_reply(buffer), out=floats)
    assert bytes(data) == (np.arange(5, dtype=np.float32) + 1).tobytes()
    assert np.frombuffer(data, np.uint8).ctypes.data == buffer.bytes.ctypes.data
    again = Commit(worker_id=worker, base_version=1, kind=PayloadKind.UPDATE.value, payload=encoded(np.ones(5)))
    _, data = state.core.commit_and_reply(again, messages.stream_commit_reply(buffer))
    assert bytes(data) == (np.arange(5, dtype=np.float32) + 2).tobytes()


class RecordedReplicas:
    """Replicas (gemps_server.replicas.Replicas) that answer Status with the records given, one per call."""

    def __init__(self, records: list[ReplicationStatus]) -> None:
        self.records = records

    def require_primary(self) -> None:
        return None

    def status(self) -> ReplicationStatus:
        return self.records.pop(0)

    def when_replicated(self, position: int, done: Callable[[BaseException | None], None]) -> None:
        done(None)


def test_status_carries_the_replication_record_the_replication_layer_provides() -> None:
    record = ReplicationStatus("r0", PRIMARY, epoch=2, replicas=2, backups=(BackupLag("r1", True, 0, 0.0),))
    later = ReplicationStatus("r0", PRIMARY, epoch=3, replicas=2)
    state = ServerState(training("downpour"), WorkerRegistry(max_workers=4, lease_ttl=3600))

    def service(replicas: Replicas) -> ParameterService:
        return ParameterService(ServerConfig(), state, Applier(), ServerMetrics(), replicas=replicas)

    replicated = service(RecordedReplicas([record, later]))
    assert asyncio.run(replicated.status()).replication == record  # asked at each Status, not once
    assert asyncio.run(replicated.status()).replication == later
    assert asyncio.run(service(NoReplicas()).status()).replication is None  # not replicated
