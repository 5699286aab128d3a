"""The replication listener against peers that are not gemps replicas (DESIGN §3b, memory before
trust): before a peer's handshake is done it can make a replica hold a handshake's bytes, for
CONNECT_SECONDS, on one of MAX_GREETINGS connections (MAX_GREETINGS_PER_ADDRESS from one address),
and nothing more; replication goes on.
A real primary (in this process, with a real etcd) and raw sockets."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time

import numpy as np

import gemps
from gemps_server.replication.follower import CONNECT_SECONDS
from gemps_server.replication.greetings import MAX_GREETINGS, MAX_GREETINGS_PER_ADDRESS
from gemps_server.replication.local_etcd import LocalEtcd
from tests.helpers import InProcessServer
from tests.integration.conftest import StartServer
from tests.integration.test_replicas import replica_options, wait_replicated
from tests.replica_reports import report_fresh

PREFIX = struct.Struct("<IQ")  # a replication frame's: header bytes, body bytes


def lone_primary(start_server: StartServer, etcd: LocalEtcd, job: str) -> InProcessServer:
    """Replica 0 of 2, once it is primary (no backup: the raw sockets are the only peers)."""
    report_fresh(etcd.endpoint, job, replicas=2)  # a fresh job elects once every replica reported
    primary = start_server(rule="downpour", **replica_options(etcd, 0, job))
    wait_replicated([primary])
    return primary


def dial(server: InProcessServer) -> socket.socket:
    port = server.server.replication_port
    assert port > 0
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def still_open(sock: socket.socket) -> bool:
    """Whether the replica has not closed `sock` (whatever it sent first read), without waiting."""
    sock.setblocking(False)
    try:
        while sock.recv(65536):
            pass
    except BlockingIOError:
        return True
    except ConnectionResetError:
        return False
    return False


def closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the replica closed `sock` (reading whatever it sent first); None if it was
    still open after `seconds`."""
    started = time.monotonic()
    sock.settimeout(0.1)
    while time.monotonic() - started < seconds:
        try:
            if not sock.recv(65536):
                return time.monotonic() - started
        except TimeoutError:
            continue
        except ConnectionResetError:
            return time.monotonic() - started
    return None


def test_a_frame_claiming_a_huge_body_before_any_hello_is_refused_at_its_prefix(
    start_server: StartServer, etcd: LocalEtcd
) -> None:
    primary = lone_primary(start_server, etcd, "huge")
    with dial(primary) as sock:
        sock.sendall(PREFIX.pack(64, 1 << 39))  # 512 GiB to follow, it says
        assert closed_within(sock, 3.0) is not None, "the replica waited for a body no hello has"


def test_a_hello_trickled_byte_by_byte_is_cut_off_after_connect_seconds(
    start_server: StartServer, etcd: LocalEtcd
) -> None:
    primary = lone_primary(start_server, etcd, "trickle")
    with dial(primary) as sock:
        sock.sendall(PREFIX.pack(4000, 0))
        started, closed = time.monotonic(), False
        while time.monotonic() - started < CONNECT_SECONDS + 5:
            try:
                sock.sendall(b" ")  # a byte at a time: every read succeeds, the hello never ends
            except OSError:
                closed = True
                break
            if closed_within(sock, 0.5) is not None:
                closed = True
                break
        waited = time.monotonic() - started
    assert closed, f"a hello trickled for {waited:.1f} s was still being read"
    assert waited < CONNECT_SECONDS + 2


def test_connections_past_the_greeting_budget_are_closed_and_a_backup_still_joins(
    start_server: StartServer, etcd: LocalEtcd
) -> None:
    primary = lone_primary(start_server, etcd, "flood")
    dialled = time.monotonic()
    silent = [dial(primary) for _ in range(MAX_GREETINGS + 1)]
    try:
        # Each accepted, and those past its address's places closed at once: awaited, but only until
        # the greeting timeout (CONNECT_SECONDS from its accept, after `dialled`) could close them
        # instead (a 0.5 s sleep here assumed the replica had got through them by then).
        kept = silent
        while len(kept) > MAX_GREETINGS_PER_ADDRESS and time.monotonic() < dialled + CONNECT_SECONDS - 0.5:
            time.sleep(0.05)
            kept = [sock for sock in kept if still_open(sock)]
        assert len(kept) <= MAX_GREETINGS_PER_ADDRESS, f"{len(kept)} connections kept from one address"
    finally:
        for sock in silent:
            sock.close()
    backup = start_server(rule="downpour", **replica_options(etcd, 1, "flood"))
    assert wait_replicated([primary, backup]) is primary
    with gemps.Client(primary.target, name="w") as client:
        client.register({"w": np.zeros(10, np.float32)})
        assert client.commit(np.ones(10, np.float32), kind="update").epochs[0] > 0


def test_a_flood_from_several_addresses_does_not_keep_a_backup_out(start_server: StartServer, etcd: LocalEtcd) -> None:
    """Issue 61 item 11: from 6 source addresses, with no credential, silent connections held
    every greeting slot and a backup stayed out for the whole flood. Each address is held to its
    own share, and the slots outnumber what a few addresses can hold: the backup joins meanwhile."""
    primary = lone_primary(start_server, etcd, "flood-6")
    port = primary.server.replication_port
    stop = threading.Event()

    floods = [threading.Thread(target=flood, args=(port, stop, f"127.0.0.{i // 2}"), daemon=True) for i in range(4, 16)]
    for thread in floods:
        thread.start()
    try:
        time.sleep(1.0)  # the flood holds what it can
        backup = start_server(rule="downpour", **replica_options(etcd, 1, "flood-6"))
        assert wait_replicated([primary, backup], timeout=20) is primary
    finally:
        stop.set()
        for thread in floods:
            thread.join(10)


def flood(port: int, stop: threading.Event, source: str, dialled: list[int] | None = None) -> None:
    """Take every greeting place `source` frees, at once, silently, until `stop` (counting the
    connections made in `dialled`)."""
    held: list[socket.socket] = []
    while not stop.is_set():
        with contextlib.suppress(OSError):
            held.append(socket.create_connection(("127.0.0.1", port), timeout=2, source_address=(source, 0)))
            if dialled is not None:
                dialled[0] += 1
        kept = []
        for sock in held:  # the ones the replica closed (refused, displaced, timed out) let go; the rest kept
            if open_still(sock):
                kept.append(sock)
            else:
                sock.close()
        held = kept
    for sock in held:
        sock.close()


def open_still(sock: socket.socket) -> bool:
    """Whether the peer has not closed `sock` (without waiting)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def test_a_flood_from_the_backups_own_address_does_not_keep_it_out(start_server: StartServer, etcd: LocalEtcd) -> None:
    """Issue 61 item 11: from the backup's own address, 16 threads that take every place the
    address frees kept it out of sync for the whole flood. A newcomer now displaces one of its
    address's connections, and the backup's leaves its place once its hello proves the job's key:
    it joins during the flood."""
    primary = lone_primary(start_server, etcd, "flood-own")
    port = primary.server.replication_port
    stop = threading.Event()
    dialled = [0]

    # silent connections from 127.0.0.1, the in-process backup's address
    floods = [threading.Thread(target=flood, args=(port, stop, "127.0.0.1", dialled), daemon=True) for _ in range(16)]
    for thread in floods:
        thread.start()
    try:
        time.sleep(1.0)
        before = dialled[0]
        backup = start_server(rule="downpour", **replica_options(etcd, 1, "flood-own"))
        assert wait_replicated([primary, backup], timeout=20) is primary
        # The flood went on (more than one dial per thread) while the backup joined; how many it
        # made depends on how fast the join was and the machine's load (98 beside a loaded suite).
        assert dialled[0] - before > 16, "the flood did not go on while the backup joined"
    finally:
        stop.set()
        for thread in floods:
            thread.join(10)
