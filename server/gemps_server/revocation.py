"""Certificates the operator has revoked (`--tls-crl`, issue 61 item 4): a certificate revocation
list of `--tls-client-ca`, checked on every TLS listener that takes client certificates (gRPC,
the data plane, the replication stream, both of its ends).

TLS alone accepts any certificate the CA signed until it expires; a stolen worker's or replica's
key stays good for as long. The CRL file (PEM, one or more lists, or one DER list), each list
signed by a certificate of the CA bundle, is read at start (a file that is not one refuses the
start, naming it) and read again when it changes (size, mtime or inode, looked at no more than
once a second), so a revocation takes effect on the next call or connection without a restart. A
changed file that cannot be used keeps the lists read before, with a WARNING each time it changes:
a typo in the file never un-revokes anything. A list past its nextUpdate is still used, with a
WARNING (the operator's publisher stopped: failing every client would be worse).

The check is by (issuer, serial number), as RFC 5280 defines a revocation. Python's ssl could
check a CRL in the handshake too, but only one loaded into a context once; a re-read would need a
new context on every listener, and grpcio takes no CRL at all, so the check is ours, after each
handshake, the same on every listener.
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from gemps_server.logs import event

log = logging.getLogger("gemps.server")

#: seconds between looks at the file's size, mtime and inode
RECHECK_SECONDS = 1.0
#: peers' certificates kept parsed (then forgotten all at once)
PEERS_KEPT = 4096
PEM_CRL = b"-----BEGIN X509 CRL-----"


@dataclass(frozen=True)
class _Peer:
    key: tuple[bytes, int]  # (issuer's DER name, serial number)
    subject: str


def _peer(certificate: bytes) -> _Peer | None:
    try:
        if certificate.startswith(b"-----BEGIN"):
            parsed = x509.load_pem_x509_certificate(certificate)
        else:
            parsed = x509.load_der_x509_certificate(certificate)
    except ValueError:
        return None
    return _Peer((parsed.issuer.public_bytes(), parsed.serial_number), parsed.subject.rfc4514_string()[:120])


@dataclass(frozen=True)
class _Lists:
    """What the file said when it was last read well."""

    revoked: frozenset[tuple[bytes, int]]  # (issuer's DER name, serial number)
    since: dict[tuple[bytes, int], datetime.datetime]
    stale_after: datetime.datetime | None  # the earliest nextUpdate


class Revocations:
    """The CRL file at `path`, of the CA bundle at `ca`; `refusal(certificate)` is thread-safe."""

    def __init__(self, path: str, ca: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._issuers = _certificates(Path(ca).read_bytes())
        self._clock = clock
        self._lock = threading.Lock()
        self._stamp = _stamp(path)
        self._lists = self._read()  # ValueError at start: the server does not start
        self._look_at = clock() + RECHECK_SECONDS
        self._stale_warned = False
        self._peers: dict[bytes, _Peer | None] = {}

    def refusal(self, certificate: bytes | None) -> str:
        """Why a peer presenting `certificate` (its leaf, DER or PEM) is refused ('' when it is not)."""
        if not certificate:
            return ""  # no certificate: the listener's own rule (mutual TLS requires one) decides
        lists = self._current()
        peer = self._peers.get(certificate)
        if peer is None:
            peer = self._peers[certificate] = _peer(certificate)
            if len(self._peers) > PEERS_KEPT:  # a peer is parsed once, not on each of its calls
                self._peers.clear()
        if peer is None or peer.key not in lists.revoked:
            return "" if peer is not None else "the peer's certificate cannot be read"
        return (
            f"certificate {peer.subject} (serial {peer.key[1]:#x}) was revoked at "
            f"{lists.since[peer.key]:%Y-%m-%d %H:%M:%S} UTC (the server's --tls-crl {self.path})"
        )

    def _current(self) -> _Lists:
        now = self._clock()
        if now >= self._look_at:
            with self._lock:
                if now >= self._look_at:
                    self._look_at = now + RECHECK_SECONDS
                    self._reread_if_changed()
        return self._lists

    def _reread_if_changed(self) -> None:
        stamp = _stamp(self.path)
        if stamp != self._stamp:
            self._stamp = stamp
            try:
                self._lists = self._read()
            except (OSError, ValueError) as error:
                event(log, "CRL not re-read: the lists read before stay in force", level=logging.WARNING,
                      crl=self.path, error=str(error))  # fmt: skip
                return
            self._stale_warned = False
            event(log, "CRL re-read", crl=self.path, revoked=len(self._lists.revoked))
        stale = self._lists.stale_after
        if stale is not None and not self._stale_warned and datetime.datetime.now(datetime.UTC) > stale:
            self._stale_warned = True
            event(log, "CRL past its next update: still used; publish a fresh one", level=logging.WARNING,
                  crl=self.path, next_update=f"{stale:%Y-%m-%d %H:%M:%S} UTC")  # fmt: skip

    def _read(self) -> _Lists:
        """The file's lists, each checked against the CA bundle; ValueError naming what is wrong."""
        try:
            data = Path(self.path).read_bytes()
        except OSError as error:
            raise ValueError(f"tls_crl {self.path}: {error.strerror or error}") from None
        lists = _crls(data, self.path)
        revoked: dict[tuple[bytes, int], datetime.datetime] = {}
        stale: list[datetime.datetime] = []
        for crl in lists:
            issuer = self._issuer_of(crl)
            for entry in crl:
                revoked[(issuer, entry.serial_number)] = entry.revocation_date_utc
            if crl.next_update_utc is not None:
                stale.append(crl.next_update_utc)
        return _Lists(frozenset(revoked), revoked, min(stale, default=None))

    def _issuer_of(self, crl: x509.CertificateRevocationList) -> bytes:
        for issuer in self._issuers:
            if issuer.subject != crl.issuer:
                continue
            key = issuer.public_key()
            if isinstance(key, (ec.EllipticCurvePublicKey, rsa.RSAPublicKey)):
                try:
                    if crl.is_signature_valid(key):
                        return crl.issuer.public_bytes()
                except (InvalidSignature, TypeError, ValueError):
                    pass
        raise ValueError(
            f"tls_crl {self.path}: the list of {crl.issuer.rfc4514_string()[:120]} is not signed by a "
            "certificate of --tls-client-ca"
        )


@functools.cache
def revocations_for(crl: str, ca: str) -> Revocations:
    """The process's one Revocations of `crl` (of the CA bundle `ca`): every listener shares it."""
    return Revocations(crl, ca)


def _stamp(path: str) -> tuple[int, int, int] | None:
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_size, found.st_mtime_ns, found.st_ino


def _crls(data: bytes, path: str) -> list[x509.CertificateRevocationList]:
    try:
        if PEM_CRL not in data:
            return [x509.load_der_x509_crl(data)]
        blocks = data.split(PEM_CRL)[1:]
        return [x509.load_pem_x509_crl(PEM_CRL + block) for block in blocks]
    except ValueError:
        raise ValueError(f"tls_crl {path}: not a certificate revocation list (PEM or DER)") from None


def _certificates(bundle: bytes) -> list[x509.Certificate]:
    try:
        return x509.load_pem_x509_certificates(bundle)
    except ValueError:
        return []
