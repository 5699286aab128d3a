"""The handshake proofs of both planes, one MAC for both: each end of a connection proves it
holds a key without sending it or anything it could be replayed from.

A proof is HMAC-SHA256 under the key of the plane's context label and the proof's parts, each
with its length (4 bytes, big-endian): no two sequences of parts make the same message, and the
labels (fixed, neither a prefix of the other, a version in each) keep a proof of one plane or
version from ever being one of another. Each proof binds fresh nonces of both ends (no replay),
a label of its direction or role (no reflection) and the address the server was reached at (no
relay). Presented proofs are compared in constant time.

**The data plane** (DESIGN §3c): each end proves it holds a registration's ticket. A ticket is
HMAC-SHA256 of a worker id and its client id under a key only the server (and the replicas of its
partition) hold (gemps_server/security.py, Tickets): the server can compute it, the worker got it
at Register over gRPC (TLS there authenticates the server), and no one else has it. So on a
data-plane connection

    client -> CHALLENGE  worker id, client nonce
    server -> answer     server nonce, MAC(ticket, "server", client nonce, server nonce, address)
    client -> HELLO      MAC(ticket, "client", client nonce, server nonce)   (only if the answer checks)
    server -> welcome

A process that took a dead server's socket name or port cannot answer (it has no ticket), and the
client sends it nothing it could use: no ticket, no proof (which is only good for that process's
own nonce, and never sent), no shared memory. The labels keep one direction's MAC from being
replayed as the other's; the address (what the server announced, and the client dialed: its
local socket's name or its TCP port) keeps a proof made by one replica at its own address from
being relayed as another's.

**The replicas** (DESIGN §3d; the exchange is gemps_server/replication/handshake.py's): primary
and backup each prove they know the job's replication key, with a MAC of the prover's role and
name, the partition, the epoch, the primary's replication address as the backup dialled it, and
both nonces; the primary then sends the data plane's ticket key sealed: XOR a MAC of the same
session under its own purpose, which only the two ends can derive.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

NONCE_BYTES = 32
PROOF_BYTES = hashlib.sha256().digest_size
DATA_PLANE = b"gemps data plane 2 "
# 2: this MAC (the first replicas' handshake had a MAC of its own, without a label).
REPLICATION = b"gemps replication 2 "
PRIMARY_ROLE, BACKUP_ROLE = "primary", "backup"


def nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def mac(key: bytes, context: bytes, *parts: bytes | str) -> bytes:
    """HMAC-SHA256 under `key` of `context` and `parts` (text as UTF-8), each part with its length."""
    encoded = [part.encode("utf-8", "surrogateescape") if isinstance(part, str) else part for part in parts]
    message = context + b"".join(len(part).to_bytes(4, "big") + part for part in encoded)
    return hmac.new(key, message, hashlib.sha256).digest()


def matches(presented: bytes, expected: bytes) -> bool:
    """Constant time: a wrong proof says nothing of how much of it was right."""
    return hmac.compare_digest(presented, expected)


# -- the data plane ---------------------------------------------------------------------------


def address(port: int, local_socket: str = "") -> str:
    """What a server's proof binds: the local socket's name when the connection is to it, else
    the TCP port (as Register and Status announce them)."""
    return f"local:{local_socket}" if local_socket else f"tcp:{port}"


def server_proof(ticket: bytes, client_nonce: bytes, server_nonce: bytes, where: str) -> bytes:
    return mac(ticket, DATA_PLANE, b"server", client_nonce, server_nonce, where)


def client_proof(ticket: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return mac(ticket, DATA_PLANE, b"client", client_nonce, server_nonce)


# -- the replicas -----------------------------------------------------------------------------


def replica_admission(key: bytes, partition: int, epoch: int, primary_address: str, name: str, nonce: bytes) -> bytes:
    """A backup's hello's admission proof: that it holds the job's key, before the handshake's
    challenge (whose proofs bind both nonces); the primary takes it once per nonce."""
    return mac(key, REPLICATION, "admit", str(partition), str(epoch), primary_address, name, nonce)


@dataclass(frozen=True)
class ReplicaSession:
    """One replication connection's handshake: what both ends derive their proofs and the seal from."""

    key: bytes
    partition: int
    epoch: int
    primary_address: str
    backup_nonce: bytes
    primary_nonce: bytes

    def _mac(self, purpose: str, *more: str) -> bytes:
        head = (purpose, str(self.partition), str(self.epoch), self.primary_address, *more)
        return mac(self.key, REPLICATION, *head, self.backup_nonce, self.primary_nonce)

    def proof(self, role: str, name: str) -> bytes:
        return self._mac("proof", role, name)

    def seal(self, secret: bytes) -> str:
        """`secret` (at most 32 bytes) XOR a pad only the two ends can derive, as hex."""
        pad = self._mac("seal")
        if len(secret) > len(pad):
            raise ValueError(f"a sealed secret holds at most {len(pad)} bytes")
        return bytes(a ^ b for a, b in zip(secret, pad, strict=False)).hex()

    def unseal(self, sealed: str) -> bytes:
        return bytes.fromhex(self.seal(bytes.fromhex(sealed)))
