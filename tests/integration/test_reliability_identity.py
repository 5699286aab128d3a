"""Who a request comes from, and which history a version counts in (issue 15, items 7 and 11c, d):
commits are deduplicated per client, not by request id alone; a client holds one registration;
"unchanged" is only said for a version of the same history."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from gemps_proto.reasons import METADATA_KEY
from gemps_proto.schema_proto import tensor_to_proto
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from gemps_server.domain.rules.gem import GemRule
from tests.helpers import InProcessServer
from tests.integration.conftest import NUM_PARAMETERS, SPEC, StartServer, open_stub

INITIAL = np.linspace(-1, 1, NUM_PARAMETERS, dtype=np.float32)


def register(stub: pb_grpc.ParameterServerStub, client_id: str = "") -> pb.RegisterResponse:
    return stub.Register(
        pb.RegisterRequest(spec=SPEC, initial_parameters=tensor_to_proto(INITIAL), client_id=client_id)
    )


def commit(stub: pb_grpc.ParameterServerStub, worker_id: str, request_id: str, value: float = 1.0) -> pb.CommitResponse:
    return stub.Commit(
        pb.CommitRequest(
            worker_id=worker_id,
            base_version=0,
            kind=pb.PAYLOAD_KIND_GRADIENT,
            payload=tensor_to_proto(np.full(NUM_PARAMETERS, value, np.float32)),
            request_id=request_id,
        )
    )


def applied(stub: pb_grpc.ParameterServerStub) -> int:
    return int(stub.Status(pb.StatusRequest()).commits_applied)


@pytest.mark.parametrize("client_ids", [("", ""), ("client-a", "client-b")], ids=["no-client-id", "client-ids"])
def test_two_workers_counting_request_ids_alike_each_get_every_commit_applied(
    server: InProcessServer, client_ids: tuple[str, str]
) -> None:
    stub = open_stub(server.target)
    workers = [register(stub, client_id).worker_id for client_id in client_ids]
    versions = [commit(stub, worker, f"step-{step}").version for step in range(1, 6) for worker in workers]
    assert sorted(versions) == list(range(1, 11))  # each acknowledged commit moved θ once
    assert applied(stub) == 10


def test_a_retry_is_deduplicated_after_the_client_registers_again(server: InProcessServer) -> None:
    stub = open_stub(server.target)
    first = register(stub, "client-a").worker_id
    original = commit(stub, first, "step-1")
    stub.Leave(pb.LeaveRequest(worker_id=first))  # or its lease ran out: its worker id is gone
    again = register(stub, "client-a").worker_id
    retry = commit(stub, again, "step-1")
    assert (retry.version, retry.staleness) == (original.version, original.staleness)
    assert applied(stub) == 1
    assert commit(stub, again, "step-2").version == 2


def test_a_retry_is_deduplicated_across_a_restart_from_a_checkpoint(start_server: StartServer, tmp_path: Path) -> None:
    server = start_server(checkpoint_dir=str(tmp_path))
    stub = open_stub(server.target)
    worker = register(stub, "client-a").worker_id
    commit(stub, worker, "step-1")
    server.stop()  # the final checkpoint holds the receipt
    restarted = start_server(checkpoint_dir=str(tmp_path))
    stub = open_stub(restarted.target)
    other = register(stub, "client-b").worker_id
    assert commit(stub, other, "step-1").version == 2  # another client's step-1 is its own
    again = register(stub, "client-a").worker_id
    assert commit(stub, again, "step-1").version == 2  # answered from the receipt, not applied
    assert applied(stub) == 2


def test_a_retried_register_leaves_no_orphan_holding_rule_state(server: InProcessServer) -> None:
    stub = open_stub(server.target)
    first = register(stub, "client-a").worker_id
    second = register(stub, "client-a").worker_id  # the first reply was lost: the client retried
    assert first != second
    assert stub.Status(pb.StatusRequest()).active_workers == 1
    rule = server.server.state.core.rule
    assert isinstance(rule, GemRule) and list(rule._workers) == [second]
    with pytest.raises(grpc.RpcError) as refused:
        commit(stub, first, "step-1")
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    register(stub, "client-b")  # another client is another worker
    assert stub.Status(pb.StatusRequest()).active_workers == 2


def test_a_client_id_with_controls_is_refused(server: InProcessServer) -> None:
    stub = open_stub(server.target)
    with pytest.raises(grpc.RpcError) as refused:
        register(stub, "client\na")
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    metadata: Any = refused.value.trailing_metadata()
    assert dict(metadata or ())[METADATA_KEY] == "bad_client_id"


def pull(stub: pb_grpc.ParameterServerStub, version: int, history: str) -> pb.PullResponse:
    return stub.Pull(pb.PullRequest(known_version=version, known_history=history))


def test_unchanged_is_said_only_for_a_version_of_the_same_history(start_server: StartServer) -> None:
    """An unregistered reader holds version 2 of one server; another server (a restart without
    the commits since its checkpoint, say) reaches version 2 with other values: not "unchanged"."""
    before, after = start_server(), start_server()
    reader_view: pb.PullResponse | None = None
    for server, value in ((before, 1.0), (after, -1.0)):
        stub = open_stub(server.target)
        worker = register(stub).worker_id
        for step in range(2):
            commit(stub, worker, f"step-{step}", value)
        if reader_view is None:
            reader_view = pull(stub, -1, "")
            assert reader_view.version == 2 and reader_view.history
            assert pull(stub, 2, reader_view.history).unchanged  # same server: nothing to send
    assert reader_view is not None
    stub = open_stub(after.target)
    reply = pull(stub, reader_view.version, reader_view.history)
    assert reply.version == 2 and not reply.unchanged
    assert reply.parameters.data != reader_view.parameters.data
    assert reply.history and reply.history != reader_view.history
    assert not pull(stub, 2, "").unchanged  # no history: never "unchanged"
