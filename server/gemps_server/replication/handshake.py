"""The replicas' handshake (DESIGN §3d): before a primary takes an image for a backup, and before a
backup reads anything of a primary's state, each proves to the other that it knows the job's
replication key (credentials.py), without sending it or anything it could be replayed from.

    backup  -> primary  ADMISSION  in clear, before TLS: the epoch it dials, its replica index, a
                                   nonce, and the key's MAC of them and of the primary's address
                                   (the listener's door reads it: door.py)
    primary -> backup   DOOR_OPEN  or a REFUSED frame
    backup  -> primary  HELLO      its name (the one its admission proved), incarnation and
                                   addresses, the epoch, a nonce
    primary -> backup   CHALLENGE  the epoch, a nonce, the primary's proof
    backup  -> primary  PROOF      the backup's proof
    primary -> backup   WELCOME    the data-plane ticket key, sealed under this session

A proof (gemps_proto/proofs.py, the MAC the data plane's handshake uses too, under a label of
its own) is an HMAC under the key of the prover's role and name, the partition, the epoch, the
primary's replication address as the backup dialled it, and both nonces: fresh each connection
(no replay), one role's proof is no other's (no reflection), and a peer that relays a real
primary's handshake from another address (where etcd, rewritten, sent the backup) proves nothing.
A backup's name must be one of its partition's replicas other than the primary, so a peer holding
the key still cannot pose as the primary to it. The ticket key is XORed with an HMAC of the session
(the key, both nonces): a reader of the stream learns nothing of it. With TLS (mutual: both sides'
certificates chain to --tls-client-ca) all but the admission and the door's answer runs inside the
TLS session, as does the stream: the admission names no replica (an index), and an admission is
taken once (its nonce is remembered), so one read off the wire opens nothing.
"""

from __future__ import annotations

import collections
import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

from gemps_proto import proofs
from gemps_proto.proofs import BACKUP_ROLE, NONCE_BYTES, PRIMARY_ROLE, ReplicaSession
from gemps_server.replication import frames
from gemps_server.replication.credentials import Credential
from gemps_server.replication.tls_stream import SerialSSLSocket
from gemps_server.security import presented_by

#: admissions' nonces remembered (a replay of an older one than these is taken once more)
ADMITTED_NONCES_KEPT = 4096


class Refused(ConnectionError):
    """The peer may not take part: what it is told (a primary sends it in a REFUSED frame), and
    `reason`, the metric's word for it."""

    def __init__(self, message: str, reason: str = "refused") -> None:
        super().__init__(message)
        self.reason = reason


def member_name(partition: int, replica: int) -> str:
    """A replica's name: the handshake binds it to the key and the partition's replica indices."""
    return f"partition-{partition}-replica-{replica}"


def _nonce(header: dict[str, Any]) -> bytes:
    try:
        nonce = bytes.fromhex(str(header.get("nonce", "")))
    except ValueError:
        nonce = b""
    if len(nonce) != NONCE_BYTES:
        raise Refused("the hello carries no valid nonce: not a gemps replica of this version")
    return nonce


def _proof(header: dict[str, Any]) -> bytes:
    try:
        return bytes.fromhex(str(header.get("proof", "")))
    except ValueError:
        return b""


class Handshake:
    """The handshake of one replica of `partition` (of `replicas`) holding `credential`."""

    def __init__(self, credential: Credential, partition: int, replicas: int) -> None:
        self._credential = credential
        self.partition, self.replicas = partition, replicas
        self._lock = threading.Lock()
        self._admitted_nonces: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def unfit(self) -> str:
        """Why this replica must not lead now ('' when it may: Credential.unfit)."""
        return self._credential.unfit()

    def revoked(self) -> str:
        """Why this replica, primary, must step down now ('' when it need not: Credential.revoked)."""
        return self._credential.revoked()

    def _session(self, epoch: int, primary_address: str, backup_nonce: bytes, primary_nonce: bytes) -> ReplicaSession:
        return ReplicaSession(self._credential.key, self.partition, epoch, primary_address, backup_nonce, primary_nonce)

    def name_refusal(self, name: str, primary: str) -> str:
        """Why a hello's `name` may not be a backup of `primary` ('' when it may)."""
        # The names themselves, not what reads as their numbers ("partition-00-replica-1" is none).
        if name not in {member_name(self.partition, replica) for replica in range(self.replicas)}:
            return f"{name[:80]!r} is not a replica of partition {self.partition} (of {self.replicas})"
        if name == primary:
            return f"{name} is the primary's own name"
        return ""

    def admission(self, preamble: bytes, address: str, me: str) -> tuple[str, int]:
        """The door's check of an admission (frames.PREAMBLE) to the replica `me` listening at
        `address`: the name it proves and the epoch it dials. Refused (reason `unproven`: no
        proof; `refused`: a name that may not be a backup; `replayed`: taken before)."""
        _magic, epoch, index, nonce, proof = frames.PREAMBLE.unpack(preamble)
        name = member_name(self.partition, index)
        expected = proofs.replica_admission(self._credential.key, self.partition, epoch, address, name, nonce)
        if not proofs.matches(proof, expected):
            raise Refused(
                "no proof of the replication credential (--replication-secret-file / --auth-token) in its admission "
                f"to {address}",
                reason="unproven",
            )
        why = self.name_refusal(name, me)
        if why:
            raise Refused(why)
        with self._lock:
            if nonce in self._admitted_nonces:
                raise Refused("its admission was taken before: a replay", reason="replayed")
            self._admitted_nonces[nonce] = None
            if len(self._admitted_nonces) > ADMITTED_NONCES_KEPT:
                self._admitted_nonces.popitem(last=False)
        return name, epoch

    def _index(self, name: str) -> int:
        for replica in range(self.replicas):
            if member_name(self.partition, replica) == name:
                return replica
        raise Refused(f"{name[:80]!r} is not a replica of partition {self.partition} (of {self.replicas})")

    def certificate_check(self, sock: socket.socket, peer: str) -> Callable[[], str]:
        """Why the `peer` on `sock` is refused now: its certificate (or its chain's) is one the job's
        --tls-crl revokes ('' while it is not). Asked at the handshake, then again while the stream
        lasts (a revocation ends an open stream: forwarder.py, follower.py)."""
        revocations = self._credential.revocations
        presented = presented_by(sock) if isinstance(sock, ssl.SSLSocket) else ()
        if revocations is None or not presented:
            return _accepted

        def refusal() -> str:
            why = revocations.refusal(*presented)
            return f"the {peer}'s {why}" if why else ""

        return refusal

    def _certificate_refusal(self, sock: socket.socket, peer: str) -> str:
        return self.certificate_check(sock, peer)()

    # -- the primary's side ----------------------------------------------------------------------

    def admit(
        self,
        sock: socket.socket,
        me: str,
        address: str,
        epoch: int,
        ticket_key: bytes,
        deadline: float,
        refusal: Callable[[frames.Frame], str],
        admitted: str,
    ) -> tuple[socket.socket, dict[str, Any]]:
        """Take the handshake of the backup whose admission proved the name `admitted` (its door
        opened: door.py) on `sock` (TLS first, when the job runs it) by `deadline`, as the primary
        `me` of `epoch` listening at `address`: the (wrapped) socket and its hello.
        `refusal(hello)`: why this replica takes no backup now ('' if it does). Refused (the peer
        was told why) or another error: the socket is closed."""
        try:
            if self._credential.server_tls is not None:
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                sock = _serial(self._credential.server_tls.wrap_socket(sock, server_side=True))
            return sock, self._admitted(sock, me, address, epoch, ticket_key, deadline, refusal, admitted)
        except Refused as refused:
            with contextlib.suppress(OSError):
                frames.send(sock, frames.Frame(frames.REFUSED, {"reason": str(refused), "epoch": epoch}))
            sock.close()
            raise
        except BaseException:
            sock.close()
            raise

    def _admitted(
        self,
        sock: socket.socket,
        me: str,
        address: str,
        epoch: int,
        ticket_key: bytes,
        deadline: float,
        refusal: Callable[[frames.Frame], str],
        admitted: str,
    ) -> dict[str, Any]:
        hello = frames.receive(sock, max_header=frames.HELLO_HEADER_BYTES, max_body=0, deadline=deadline)
        if hello.kind != frames.HELLO:
            raise Refused("the first frame must be a hello")
        name = str(hello.header.get("name", ""))
        # (the certificate's check waits for the hello: a refusal sent before the peer's hello was
        # read would be lost to the reset that closing over unread bytes sends)
        why = self._certificate_refusal(sock, "backup") or refusal(hello) or self.name_refusal(name, me)
        if not why and name != admitted:
            why = f"its hello names {name[:80]!r}, not {admitted}, whom its admission proved"
        if why:
            raise Refused(why)
        session = self._session(epoch, address, _nonce(hello.header), proofs.nonce())
        challenge = {
            "epoch": epoch,
            "nonce": session.primary_nonce.hex(),
            "proof": session.proof(PRIMARY_ROLE, me).hex(),
        }
        frames.send(sock, frames.Frame(frames.CHALLENGE, challenge))
        answer = frames.receive(sock, max_header=frames.HELLO_HEADER_BYTES, max_body=0, deadline=deadline)
        expected = session.proof(BACKUP_ROLE, name)
        if answer.kind != frames.PROOF or not proofs.matches(_proof(answer.header), expected):
            raise Refused("no proof of the replication credential (--replication-secret-file / --auth-token)")
        frames.send(sock, frames.Frame(frames.WELCOME, {"epoch": epoch, "tickets": session.seal(ticket_key)}))
        return hello.header

    # -- a backup's side -------------------------------------------------------------------------

    def join(
        self, sock: socket.socket, hello: dict[str, Any], epoch: int, primary: str, address: str, deadline: float
    ) -> tuple[socket.socket, bytes]:
        """Prove this backup (`hello`: its name and addresses) to the primary named `primary` of
        `epoch` that it dialled at `address`, and have it prove itself first: the (wrapped) socket
        and the ticket key it sent. ConnectionError: a refusal, or a peer that proved nothing."""
        self.knock(sock, str(hello["name"]), epoch, address, deadline)
        if self._credential.client_tls is not None:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock = _serial(self._credential.client_tls.wrap_socket(sock))
            refused = self._certificate_refusal(sock, "primary")
            if refused:
                sock.close()
                raise Refused(refused)
        nonce = proofs.nonce()
        frames.send(sock, frames.Frame(frames.HELLO, dict(hello, epoch=epoch, nonce=nonce.hex())))
        challenge = frames.receive(sock, max_header=frames.HELLO_HEADER_BYTES, max_body=0, deadline=deadline)
        _refused(challenge)
        try:
            session = self._session(epoch, address, nonce, bytes.fromhex(str(challenge.header.get("nonce", ""))))
        except ValueError:
            raise Refused("the primary's challenge carries no nonce") from None
        proved = proofs.matches(_proof(challenge.header), session.proof(PRIMARY_ROLE, primary))
        if challenge.kind != frames.CHALLENGE or not proved or len(session.primary_nonce) != NONCE_BYTES:
            raise Refused(
                f"the primary at {address} did not prove it holds this job's replication credential: not followed"
            )
        frames.send(sock, frames.Frame(frames.PROOF, {"proof": session.proof(BACKUP_ROLE, str(hello["name"])).hex()}))
        welcome = frames.receive(sock, max_header=frames.HELLO_HEADER_BYTES, max_body=0, deadline=deadline)
        _refused(welcome)
        if welcome.kind != frames.WELCOME:
            raise Refused(f"expected the primary's welcome, not {welcome.kind!r}")
        return sock, session.unseal(str(welcome.header.get("tickets", "")))

    def knock(self, sock: socket.socket, name: str, epoch: int, address: str, deadline: float) -> None:
        """Show the door of the primary of `epoch` dialled at `address` this replica's admission as
        `name` (frames.PREAMBLE), and wait for it to open. Refused: it said why, or is no gemps
        primary (a door that answers with anything else)."""
        nonce = proofs.nonce()
        proof = proofs.replica_admission(self._credential.key, self.partition, epoch, address, name, nonce)
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        sock.sendall(frames.PREAMBLE.pack(frames.PREAMBLE_MAGIC, epoch, self._index(name), nonce, proof))
        try:
            answer = frames.door_answer(sock, deadline)
        except frames.StreamClosed as closed:
            raise Refused(f"the replica at {address} did not open its door ({closed}): not followed") from None
        if answer is not None:
            _refused(answer)
            raise Refused(f"the replica at {address} answered a {answer.kind!r} frame at its door: not followed")


def _accepted() -> str:
    return ""


def _serial(sock: ssl.SSLSocket) -> ssl.SSLSocket:
    """Its handshake done: safe for the forwarder's two threads (tls_stream.py)."""
    if isinstance(sock, SerialSSLSocket):
        sock.serialize()
    return sock


def _refused(frame: frames.Frame) -> None:
    if frame.kind == frames.REFUSED:
        raise Refused(f"refused by the primary: {str(frame.header.get('reason', ''))[:200]}")
