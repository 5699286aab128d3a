"""Replicas trust no peer that has not proved the job's credential (issue 41, items 1-3): a peer
without it is no backup, whatever token it holds; a fake primary is not followed; neither the
credential nor the workers' token nor the data-plane ticket key crosses the stream readable; a
flood of connections from one address keeps no backup out and writes few lines; a replica started
alone without a credential refuses to start. Real primaries and backups (in this process) on a
real etcd; the attackers are raw sockets, a recording relay, and a fake primary elected in etcd."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

import gemps
from gemps_server.domain import images
from gemps_server.replication import frames, image_codec
from gemps_server.replication.election import Election, Member, partition_prefix
from gemps_server.replication.layer import Replicated
from gemps_server.replication.local_etcd import LocalEtcd
from tests.helpers import TEST_REPLICATION_SECRET, InProcessServer, free_port, server_outcome, wait_for
from tests.integration.conftest import StartServer
from tests.integration.test_replicas import replica_options, status_of, wait_replicated
from tests.replica_reports import report_fresh

TOKEN = "workers-bearer-token-0123456789abcdef"
PARAMETERS = 64


def ticket_key(server: InProcessServer) -> bytes:
    return cast(Replicated, server.server.replication).replica._tickets.key


def commit_some(server: InProcessServer, count: int, **client: Any) -> None:
    with gemps.Client(server.target, name="w", **client) as worker:
        worker.register({"w": np.zeros(PARAMETERS, np.float32)})
        for _ in range(count):
            worker.commit(np.ones(PARAMETERS, np.float32), kind="update")


# -- a peer without the credential ----------------------------------------------------------------


def old_hello(epoch: int, token: str) -> frames.Frame:
    """A hello as a backup sent it before the handshake: name, epoch and the token in clear."""
    who = {"name": "partition-0-replica-1", "incarnation": "x", "address": "127.0.0.1:1", "replication": "127.0.0.1:2"}
    return frames.Frame(frames.HELLO, dict(who, token=token, epoch=epoch))


def answers(sock: socket.socket, seconds: float = 5.0) -> list[str]:
    """The kinds of the frames the peer sent until it closed the connection or went quiet."""
    kinds = []
    sock.settimeout(seconds)
    with contextlib.suppress(OSError):
        while True:
            kinds.append(frames.receive(sock).kind)
    return kinds


@pytest.mark.parametrize("workers_token", [False, True], ids=["no-token", "holding-the-workers-token"])
def test_a_peer_without_the_credential_is_no_backup(
    start_server: StartServer, etcd: LocalEtcd, workers_token: bool
) -> None:
    """Before: without --auth-token anyone reaching the port was seeded with θ and the ticket key;
    with it, anyone holding the workers' token was. Now the replication secret alone admits."""
    job = f"intruder{int(workers_token)}"
    token = {"auth_token": TOKEN} if workers_token else {}
    report_fresh(etcd.endpoint, job, replicas=2)  # a fresh job elects once every replica reported
    primary = start_server(rule="downpour", **replica_options(etcd, 0, job, **token))
    wait_replicated([primary])
    port = primary.server.replication_port
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        frames.send(sock, old_hello(status_of(primary).epoch, TOKEN if workers_token else ""))
        kinds = answers(sock)
    assert frames.SEED not in kinds and frames.WELCOME not in kinds, kinds
    assert status_of(primary).backups == ()


# -- what crosses the stream -----------------------------------------------------------------------


class Relay:
    """Listens at `listen`, forwards each connection to `to`, and keeps every byte that crossed."""

    def __init__(self, listen: tuple[str, int], to: tuple[str, int]) -> None:
        self.to = to
        self.sent = bytearray()  # backup -> primary
        self.received = bytearray()  # primary -> backup
        self._lock = threading.Lock()
        self._listener = socket.create_server(listen)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                inner, _ = self._listener.accept()
                outer = socket.create_connection(self.to)
                threading.Thread(target=self._pump, args=(inner, outer, self.sent), daemon=True).start()
                threading.Thread(target=self._pump, args=(outer, inner, self.received), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, record: bytearray) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(1 << 16):
                with self._lock:
                    record += data
                sink.sendall(data)
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._listener.close()


@contextlib.contextmanager
def relayed_pair(
    start_server: StartServer, etcd: LocalEtcd, job: str, **options: Any
) -> Iterator[tuple[Relay, list[InProcessServer]]]:
    """A primary that advertises its replication port on 127.0.0.2, where a relay records what
    crosses to it from 127.0.0.1, and its backup, in sync through the relay. The port is from the
    suite's reserved band (free_port), as the relay binds its number on the alias too."""
    report_fresh(etcd.endpoint, job, replicas=2)  # a fresh job elects once every replica reported
    listen = {"advertise_host": "127.0.0.2", "replication_port": free_port("127.0.0.2")}
    primary = start_server(rule="downpour", **replica_options(etcd, 0, job, **listen, **options))
    wait_replicated([primary])
    port = primary.server.replication_port
    relay = Relay(("127.0.0.2", port), ("127.0.0.1", port))
    try:
        backup = start_server(rule="downpour", **replica_options(etcd, 1, job, **options))
        wait_replicated([primary, backup])
        yield relay, [primary, backup]
    finally:
        relay.close()


def test_nothing_secret_crosses_the_stream_readable(start_server: StartServer, etcd: LocalEtcd) -> None:
    """Before: the hello carried the workers' token and each seed the ticket key, in clear."""
    with relayed_pair(start_server, etcd, "wiretap", auth_token=TOKEN) as (relay, (primary, backup)):
        commit_some(primary, 5, token=TOKEN)
        wait_replicated([primary, backup])
        assert backup.server.state.core.version == 5  # the stream works through the relay
        key = ticket_key(primary)
        assert ticket_key(backup) == key  # the backup adopted the primary's key, sealed
        stream = bytes(relay.sent + relay.received)
    assert stream, "nothing crossed the relay"
    for secret in (TOKEN.encode(), TEST_REPLICATION_SECRET.encode(), key, key.hex().encode()):
        assert secret not in stream


# -- a fake primary ----------------------------------------------------------------------------------


def seed_of(server: InProcessServer) -> bytes:
    inner = server.server
    take = functools.partial(images.take, inner.state)
    image = asyncio.run_coroutine_threadsafe(inner.applier.submit(take), server._loop).result(30)
    return bytes(image_codec.encode(image))


class FakePrimary:
    """Elected in etcd as partition 0's primary (it holds no credential); to each backup that dials
    it, it opens its door whatever the admission, sends `reply` frames (a seed of its own θ among
    them), and keeps what the backup sent."""

    def __init__(self, etcd: LocalEtcd, job: str, replies: list[frames.Frame]) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        port = self._listener.getsockname()[1]
        me = Member("partition-0-replica-0", secrets.token_hex(8), "127.0.0.1:1", f"127.0.0.1:{port}")
        self.election = Election(etcd.endpoint, partition_prefix(job, 0), me, lease_seconds=60)
        self.epoch = self.election.campaign()
        assert self.epoch is not None
        self.replies = [frames.Frame(f.kind, dict(f.header, epoch=self.epoch), f.blobs) for f in replies]
        self.heard = bytearray()
        self.served = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                sock, _ = self._listener.accept()
                with sock, contextlib.suppress(OSError):
                    sock.settimeout(5)
                    self.heard += sock.recv(1 << 16)
                    sock.sendall(frames.DOOR_OPEN)
                    for reply in self.replies:
                        frames.send(sock, reply)
                    time.sleep(0.5)  # time to read it all
                self.served += 1

    def close(self) -> None:
        self._listener.close()
        self.election.close()


@pytest.mark.parametrize("opening", ["seed", "forged-challenge"])
def test_a_fake_primary_is_not_followed(start_server: StartServer, etcd: LocalEtcd, opening: str) -> None:
    """Before: a backup sent its token to whatever address etcd named, and adopted its seed."""
    source = start_server(rule="downpour")
    with gemps.Client(source.target, name="evil") as client:
        client.register({"w": np.zeros(PARAMETERS, np.float32)})
        client.commit(np.full(PARAMETERS, 666, np.float32), kind="update")
    seed = frames.Frame(frames.SEED, {"position": 0, "tickets": "00" * 32}, [seed_of(source)])
    forged = frames.Frame("challenge", {"nonce": "11" * 32, "proof": "22" * 32})  # a proof made up
    job = f"fake-{opening}"
    fake = FakePrimary(etcd, job, [seed] if opening == "seed" else [forged, seed])
    try:
        backup = start_server(rule="downpour", **replica_options(etcd, 1, job, auth_token=TOKEN))
        # It dials, is not convinced, and dials again: the first seed was read (or refused) by then.
        wait_for(lambda: fake.served >= 2 or backup.server.state.core.version > 0, 30, "a second dial")
        assert backup.server.state.core.version == 0, "the backup adopted a fake primary's state"
        assert "seeded" not in backup.log()
        assert TOKEN.encode() not in fake.heard and TEST_REPLICATION_SECRET.encode() not in fake.heard
    finally:
        fake.close()


# -- a flood from one address ------------------------------------------------------------------------


def flood(port: int, stop: threading.Event) -> None:
    """Connections from 127.0.0.5 that never say a word, dialled again as soon as one is closed."""
    while not stop.is_set():
        with contextlib.suppress(OSError), socket.socket() as sock:
            sock.bind(("127.0.0.5", 0))
            sock.connect(("127.0.0.1", port))
            sock.settimeout(0.2)
            while not stop.is_set():
                try:
                    if not sock.recv(1):
                        break
                except TimeoutError:
                    continue


def test_a_flood_of_silent_connections_from_one_address_keeps_no_backup_out(
    start_server: StartServer, etcd: LocalEtcd
) -> None:
    """Before: 16 threads holding the 8 hello slots kept a backup out, with a warning per try."""
    report_fresh(etcd.endpoint, "flood1", replicas=2)  # a fresh job elects once every replica reported
    primary = start_server(rule="downpour", **replica_options(etcd, 0, "flood1"))
    wait_replicated([primary])
    stop = threading.Event()
    flooders = [threading.Thread(target=flood, args=(primary.server.replication_port, stop)) for _ in range(16)]
    for thread in flooders:
        thread.start()
    try:
        time.sleep(1.0)  # the flood holds every place it can
        started = time.monotonic()
        backup = start_server(rule="downpour", **replica_options(etcd, 1, "flood1"))
        wait_replicated([primary, backup], timeout=20)
        commit_some(primary, 3)
        wait_replicated([primary, backup], timeout=20)
        flooded = time.monotonic() - started
    finally:
        stop.set()
        for thread in flooders:
            thread.join()
    refusals = [line for line in primary.log().splitlines() if "replication connection refused" in line]
    # At most one line a second for each kind of refusal (and the 1 s before the backup started).
    assert len(refusals) <= flooded + 3, f"{len(refusals)} lines in {flooded:.1f} s"


# -- a replica started alone ---------------------------------------------------------------------------


def test_a_replica_started_alone_without_a_credential_refuses_to_start(tmp_path: Path) -> None:
    argv = ["--replicas", "2", "--replica-index", "0", "--etcd", "http://127.0.0.1:9", "--job", "alone"]
    code, lines = server_outcome(tmp_path, *argv, "--port", "0", "--data-port", "0", "--metrics-port", "-1", timeout=30)
    assert code == 2, lines
    assert any("--replication-secret-file" in line for line in lines), lines
