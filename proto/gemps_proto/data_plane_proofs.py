"""The data plane's handshake proofs (DESIGN §3c): each end proves it holds a registration's ticket
without sending it.

A ticket is HMAC-SHA256 of a worker id and its client id under a key only the server (and the
replicas of its partition) hold (gemps_server/security.py, Tickets): the server can compute it,
the worker got it at Register over gRPC (TLS there authenticates the server), and no one else has
it. So on a data-plane connection

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
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

NONCE_BYTES = 32
PROOF_BYTES = hashlib.sha256().digest_size
_CONTEXT = b"gemps data plane 2 "


def nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def address(port: int, local_socket: str = "") -> str:
    """What a server's proof binds: the local socket's name when the connection is to it, else
    the TCP port (as Register and Status announce them)."""
    return f"local:{local_socket}" if local_socket else f"tcp:{port}"


def server_proof(ticket: bytes, client_nonce: bytes, server_nonce: bytes, where: str) -> bytes:
    return _mac(ticket, b"server", client_nonce, server_nonce, where.encode("utf-8", "surrogateescape"))


def client_proof(ticket: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return _mac(ticket, b"client", client_nonce, server_nonce)


def matches(presented: bytes, expected: bytes) -> bool:
    """Constant time: a wrong proof says nothing of how much of it was right."""
    return hmac.compare_digest(presented, expected)


def _mac(ticket: bytes, *parts: bytes) -> bytes:
    # Each part with its length: no two sequences of parts make the same message.
    message = _CONTEXT + b"".join(len(part).to_bytes(4, "big") + part for part in parts)
    return hmac.new(ticket, message, hashlib.sha256).digest()
