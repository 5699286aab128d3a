"""A backup's side of the replication handshake, spoken by tests' peers (real frames on real
sockets): the key credentials.py derives, an admission at a real primary's door, and a join that
proves the key to it."""

from __future__ import annotations

import hashlib
import hmac
import socket
import time

from gemps_server.replication.credentials import Credential
from gemps_server.replication.follower import CONNECT_SECONDS
from gemps_server.replication.handshake import Handshake
from tests.helpers import TEST_REPLICATION_SECRET, InProcessServer


def key_of(secret: str, job: str) -> bytes:
    """The key credentials.py derives (HMAC of the job's name under the secret)."""
    return hmac.new(secret.encode(), b"gemps-replication-v1\0" + job.encode(), hashlib.sha256).digest()


def handshake_of(
    primary: InProcessServer, secret: str = TEST_REPLICATION_SECRET, job: str = "", replicas: int = 0
) -> Handshake:
    """A backup's handshake of `primary`'s partition (of `replicas`, default the primary's) holding
    the key `secret` derives for `job` (default the primary's)."""
    config = primary.server.config
    key = key_of(secret, job or config.job)
    return Handshake(Credential(key), config.partition, replicas or config.replicas)


def knocked(
    primary: InProcessServer, name: str, secret: str = TEST_REPLICATION_SECRET, job: str = "", replicas: int = 0
) -> socket.socket:
    """A connection to `primary`'s replication listener whose door opened to the admission of
    backup `name` (holding the key of `secret` and `job`, as one of `replicas`: handshake_of): its
    hello comes next. handshake.Refused when it did not open."""
    status = primary.server.replication.status()
    assert status is not None
    port = primary.server.replication_port
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        deadline = time.monotonic() + CONNECT_SECONDS
        handshake_of(primary, secret, job, replicas).knock(sock, name, status.epoch, f"127.0.0.1:{port}", deadline)
    except BaseException:
        sock.close()
        raise
    return sock


def joined(
    primary: InProcessServer, name: str, incarnation: str = "i", secret: str = TEST_REPLICATION_SECRET
) -> tuple[socket.socket, bytes]:
    """Dial `primary`'s replication listener as backup `name` and prove `secret`: the socket, past
    the handshake (the seed comes next, or a REFUSED frame), and the ticket key it welcomed us
    with. handshake.Refused when the primary refuses the name or the proof."""
    replication = primary.server.replication
    status = replication.status()
    assert status is not None
    port = primary.server.replication_port
    hello = {"name": name, "incarnation": incarnation, "address": "127.0.0.1:1", "replication": "127.0.0.1:2"}
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        deadline = time.monotonic() + CONNECT_SECONDS
        return handshake_of(primary, secret).join(sock, hello, status.epoch, status.name, f"127.0.0.1:{port}", deadline)
    except BaseException:
        sock.close()
        raise
