"""`gemps status --server 'A|B'` against servers that lie (issue 41, item 7): real gRPC servers on
real ports whose Status is written by hand. It sent the token to a third address a backup named as
its primary, printed a server's terminal escape sequences, and failed while A was dead instead
of trying B."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from gemps_cli.main import main as gemps_main

from gemps_proto import schema_proto, versions
from gemps_proto.schema import TrainingConfig
from gemps_proto.status import BACKUP, PRIMARY, ReplicationStatus, ServerStatus, WorkerStatus
from gemps_proto.v1 import parameter_server_pb2 as pb
from tests.helpers import free_port

SERVICE = pb.DESCRIPTOR.services_by_name["ParameterServer"].full_name
TOKEN = "s3cret-token"
# Retitles the terminal, turns the text red, clears the screen: what a server may put in a string.
ESCAPES = "\x1b]0;pwned\x07", "\x1b[31m", "\x1b[2J", "\x9b1m", "\x07", "\r"


class FakeServer:
    """A gRPC server on a free port whose Status answers `status` (its only method); it keeps the
    metadata of every call it got (`calls`)."""

    def __init__(self, status: ServerStatus) -> None:
        self.status = status
        self.calls: list[dict[str, str]] = []
        self.port = free_port()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        status_handler = grpc.unary_unary_rpc_method_handler(
            self.Status,
            request_deserializer=pb.StatusRequest.FromString,
            response_serializer=pb.StatusResponse.SerializeToString,
        )
        methods = {"Status": status_handler}
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, methods),))
        self._server.add_insecure_port(f"127.0.0.1:{self.port}")
        self._lock = threading.Lock()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusResponse:
        with self._lock:
            self.calls.append({key: str(value) for key, value in context.invocation_metadata()})
        return schema_proto.status_to_proto(self.status)


def status_of(replication: ReplicationStatus, worker_name: str = "w0") -> ServerStatus:
    return ServerStatus(
        initialized=True, version=7, active_workers=1, num_parameters=10, config=TrainingConfig(),
        commits_applied=7, commits_rejected=0, spec=(), uptime_seconds=3.0, last_evaluation=None,
        workers=(WorkerStatus(worker_name, 0, 7, 0.5, 0.5),), replication=replication, versions=versions.THIS,
    )  # fmt: skip


@pytest.fixture
def serve() -> Iterator[Callable[[ServerStatus], FakeServer]]:
    started: list[Any] = []

    def start(status: ServerStatus) -> FakeServer:
        server = FakeServer(status)
        server._server.start()
        started.append(server._server)
        return server

    yield start
    for server in started:
        server.stop(None)


def gemps_status(target: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = gemps_main(["status", "--server", target, "--token", TOKEN, "--timeout", "3"])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_the_token_goes_to_no_address_a_backup_names(
    serve: Callable[[ServerStatus], FakeServer], capsys: pytest.CaptureFixture[str]
) -> None:
    """B, the address given, is a backup naming a third address, C, as its primary (etcd rewritten
    by an attacker, say): B's own view is shown, and C never hears from `gemps status`."""
    third = serve(status_of(ReplicationStatus("r9", PRIMARY, epoch=9, replicas=2)))
    backup = serve(status_of(ReplicationStatus("r1", BACKUP, epoch=8, replicas=2, primary=third.target)))
    code, out = gemps_status(backup.target, capsys)
    assert code == 0, out
    assert f"backup r1, epoch 8, follows {third.target}" in out
    assert backup.calls and all(call.get("authorization") == f"Bearer {TOKEN}" for call in backup.calls)
    assert third.calls == []


def test_status_tries_each_address_given_in_order(
    serve: Callable[[ServerStatus], FakeServer], capsys: pytest.CaptureFixture[str]
) -> None:
    """A is dead (nothing listens on its port): B answers."""
    primary = serve(status_of(ReplicationStatus("r1", PRIMARY, epoch=8, replicas=2)))
    dead = f"127.0.0.1:{free_port()}"
    code, out = gemps_status(f"{dead}|{primary.target}", capsys)
    assert code == 0, out
    assert f"answered: {primary.target}" in out and "primary r1, epoch 8" in out


def test_a_primary_named_among_the_addresses_given_is_asked(
    serve: Callable[[ServerStatus], FakeServer], capsys: pytest.CaptureFixture[str]
) -> None:
    primary = serve(status_of(ReplicationStatus("r0", PRIMARY, epoch=8, replicas=2)))
    backup = serve(status_of(ReplicationStatus("r1", BACKUP, epoch=8, replicas=2, primary=primary.target)))
    code, out = gemps_status(f"{backup.target}|{primary.target}", capsys)
    assert code == 0, out
    assert f"primary r0, epoch 8, 1/2 replicas live UNDER-REPLICATED (at {primary.target}" in out


def test_status_prints_no_control_character_a_server_sent(
    serve: Callable[[ServerStatus], FakeServer], capsys: pytest.CaptureFixture[str]
) -> None:
    hostile = "".join(ESCAPES)
    replication = ReplicationStatus(f"r1{hostile}", BACKUP, epoch=8, replicas=2, primary=f"x{hostile}:1")
    server = serve(status_of(replication, worker_name=f"w{hostile}0"))
    code, out = gemps_status(server.target, capsys)
    assert code == 0, out
    assert "backup r1, epoch 8, follows x:1" in out and " w0 " in out
    controls = {char for char in out if (ord(char) < 32 and char != "\n") or 0x7F <= ord(char) <= 0x9F}
    assert not controls, sorted(controls)


def test_status_names_every_address_that_did_not_answer(capsys: pytest.CaptureFixture[str]) -> None:
    dead = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    code, out = gemps_status("|".join(dead), capsys)
    assert code == 1
    assert all(address in out for address in dead), out
