"""The one proof module of both planes (gemps_proto/proofs.py): one length-prefixed MAC under a
context label per plane. The data plane's bytes are those of data-plane version 2 as before; the
replicas' handshake has the label of its version 2 (its MAC's bytes changed)."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac

from gemps_proto import proofs
from gemps_proto.proofs import BACKUP_ROLE, PRIMARY_ROLE, ReplicaSession

KEY, CLIENT_NONCE, SERVER_NONCE = b"k" * 32, b"c" * 32, b"s" * 32


def reference(key: bytes, context: bytes, *parts: bytes) -> bytes:
    """The MAC as specified: the label, then each part after its 4-byte big-endian length."""
    message = context + b"".join(len(part).to_bytes(4, "big") + part for part in parts)
    return hmac.new(key, message, hashlib.sha256).digest()


def test_the_data_planes_proofs_keep_their_bytes() -> None:
    where = proofs.address(7000)
    assert proofs.server_proof(KEY, CLIENT_NONCE, SERVER_NONCE, where) == reference(
        KEY, b"gemps data plane 2 ", b"server", CLIENT_NONCE, SERVER_NONCE, b"tcp:7000"
    )
    assert proofs.client_proof(KEY, CLIENT_NONCE, SERVER_NONCE) == reference(
        KEY, b"gemps data plane 2 ", b"client", CLIENT_NONCE, SERVER_NONCE
    )


def test_a_replicas_proof_binds_role_name_partition_epoch_address_and_both_nonces() -> None:
    session = ReplicaSession(KEY, 1, 7, "10.0.0.1:9000", b"b" * 32, b"p" * 32)
    expected = reference(
        KEY, proofs.REPLICATION, b"proof", b"1", b"7", b"10.0.0.1:9000", b"primary", b"n", b"b" * 32, b"p" * 32
    )
    assert session.proof(PRIMARY_ROLE, "n") == expected
    others = [
        session.proof(BACKUP_ROLE, "n"),  # the other role: no reflection
        session.proof(PRIMARY_ROLE, "m"),
        dataclasses.replace(session, partition=2).proof(PRIMARY_ROLE, "n"),
        dataclasses.replace(session, epoch=8).proof(PRIMARY_ROLE, "n"),
        dataclasses.replace(session, primary_address="10.0.0.2:9000").proof(PRIMARY_ROLE, "n"),  # no relay
        dataclasses.replace(session, backup_nonce=b"x" * 32).proof(PRIMARY_ROLE, "n"),  # no replay
        dataclasses.replace(session, primary_nonce=b"x" * 32).proof(PRIMARY_ROLE, "n"),
        dataclasses.replace(session, key=b"j" * 32).proof(PRIMARY_ROLE, "n"),
    ]
    assert len({expected, *others}) == len(others) + 1
    assert all(len(proof) == proofs.PROOF_BYTES for proof in others)


def test_the_planes_labels_keep_their_proofs_apart() -> None:
    assert proofs.mac(KEY, proofs.DATA_PLANE, b"x") != proofs.mac(KEY, proofs.REPLICATION, b"x")
    assert not proofs.DATA_PLANE.startswith(proofs.REPLICATION) and not proofs.REPLICATION.startswith(proofs.DATA_PLANE)
    assert proofs.mac(KEY, proofs.REPLICATION, "é") == proofs.mac(KEY, proofs.REPLICATION, "é".encode())
    assert proofs.mac(KEY, b"", b"ab", b"c") != proofs.mac(KEY, b"", b"a", b"bc")  # parts keep their bounds
    assert proofs.matches(b"same", b"same") and not proofs.matches(b"same", b"sane")
    assert len(proofs.nonce()) == proofs.NONCE_BYTES and proofs.nonce() != proofs.nonce()
