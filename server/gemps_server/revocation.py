"""Certificates the operator has revoked (`--tls-crl`, issue 61 item 4; issue 77 item 6): a
certificate revocation list of `--tls-client-ca`, checked on every TLS listener that takes client
certificates (gRPC, the data plane, the replication stream, both of its ends).

TLS alone accepts any certificate the CA signed until it expires; a stolen worker's or replica's
key stays good for as long. The CRL file (PEM, one or more lists, or one DER list), each list
signed by a certificate of the CA bundle (an intermediate CA's list: that CA's certificate in the
bundle), is read at start (a file that is not one refuses the start, naming it) and read again
when it changes, so a revocation takes effect without a restart. A change is seen by the file's
size, mtime, ctime, inode and device, looked at no more than once a second; and while its last
change is under RACY_SECONDS old, by its bytes too: a list rewritten in place, the same size,
within one tick of the file system's clock changes none of the others. A changed file that
cannot be used keeps the lists read before, with a WARNING: a typo never un-revokes anything. A
list past its nextUpdate is still used, with a WARNING (the operator's publisher stopped: failing
every client would be worse).

A peer is refused when any certificate of its path to the CA is revoked: its own, or an
intermediate CA's (by the root's list), whether the peer presented the intermediate or the bundle
holds it. Each is looked up by (issuer, serial number), as RFC 5280 defines a revocation, the
issuer compared as a name (not as its DER: a list may encode its issuer's name with other string
types than the certificates do). Python's ssl could check a CRL in the handshake too, but only
one loaded into a context once, and grpcio takes none at all, so the check is ours, after each
handshake and again on each call or request (wire/, replication/): a connection open before a
revocation is refused at its next call.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from gemps_server.logs import event

log = logging.getLogger("gemps.server")

#: seconds between looks at the file's size, times and inode
RECHECK_SECONDS = 1.0
#: a file changed less than this long ago (its mtime or ctime) may change again within the same
#: tick of its file system's clock (a second on some, two on FAT) with nothing of its stamp
#: changing: until then each look compares its bytes too
RACY_SECONDS = 2.0
#: peers' certificates kept parsed (then forgotten all at once)
PEERS_KEPT = 4096
#: certificates of a peer's path looked at, its own included
PATH_DEPTH = 8
PEM_CRL = b"-----BEGIN X509 CRL-----"

Key = tuple[x509.Name, int]  # a certificate's issuer and serial number


@dataclass(frozen=True)
class _Link:
    """One certificate of a peer's path to the CA."""

    key: Key
    subject: str
    serial: int


@dataclass(frozen=True)
class _Peer:
    path: tuple[_Link, ...]  # its own certificate first, then each issuer's, as far as they are known


class Stamp(NamedTuple):
    size: int
    mtime_ns: int
    ctime_ns: int
    inode: int
    device: int

    @property
    def changed(self) -> float:
        """When the file last changed (seconds since the epoch)."""
        return max(self.mtime_ns, self.ctime_ns) / 1e9


@dataclass(frozen=True)
class _Lists:
    """What the file said when it was last read well."""

    revoked: dict[Key, datetime.datetime]  # when each was revoked
    stale_after: datetime.datetime | None  # the earliest nextUpdate
    digest: bytes  # of the file's bytes


class Revocations:
    """The CRL file at `path`, of the CA bundle at `ca`; `refusal(*certificates)` is thread-safe."""

    def __init__(
        self,
        path: str,
        ca: str,
        clock: Callable[[], float] = time.monotonic,
        *,
        wall: Callable[[], float] = time.time,
        stamp: Callable[[str], Stamp | None] | None = None,
    ) -> None:
        self.path = path
        self._issuers = _certificates(Path(ca).read_bytes())
        self._clock, self._wall, self._stamp_of = clock, wall, stamp or _stamp
        self._lock = threading.Lock()
        self._stamp = self._stamp_of(path)
        self._racy = self._is_racy(self._stamp)
        self._lists = self._read()  # ValueError at start: the server does not start
        self._look_at = clock() + RECHECK_SECONDS
        self._stale_warned = False
        self._peers: dict[tuple[bytes | None, ...], _Peer | None] = {}

    def refusal(self, *certificates: bytes | None) -> str:
        """Why a peer presenting `certificates` is refused ('' when it is not): its own first (DER
        or PEM, which may go on with its chain), then what it presented of its chain (each DER, or
        PEM holding one or more). No certificate: '' (the listener's own rule decides: mutual TLS
        requires one)."""
        if not certificates or not certificates[0]:
            return ""
        lists = self._current()
        peer = self._peers.get(certificates)
        if peer is None:
            peer = self._peers[certificates] = self._peer(certificates)
            if len(self._peers) > PEERS_KEPT:  # a peer is parsed once, not on each of its calls
                self._peers.clear()
        if peer is None:
            return "the peer's certificate cannot be read"
        own = peer.path[0]
        for depth, link in enumerate(peer.path):
            since = lists.revoked.get(link.key)
            if since is None:
                continue
            which = f"certificate {own.subject} (serial {own.serial:#x})"
            if depth:
                which += f" was issued under {link.subject} (serial {link.serial:#x}), which"
            return f"{which} was revoked at {since:%Y-%m-%d %H:%M:%S} UTC (the server's --tls-crl {self.path})"
        return ""

    def _peer(self, presented: tuple[bytes | None, ...]) -> _Peer | None:
        """A peer's path: its certificate, then each issuer's, from the CA bundle first (as
        OpenSSL looks, trusted first) then from what it presented, each checked to have signed
        the one before (two CAs may share a name)."""
        try:
            certificates = [certificate for blob in presented if blob for certificate in _parsed(blob)]
        except ValueError:
            return None
        if not certificates:
            return None
        path, candidates = [certificates[0]], [*self._issuers, *certificates[1:]]
        while len(path) < PATH_DEPTH and path[-1].issuer != path[-1].subject:  # not a root yet
            issuer = next((c for c in candidates if c not in path and _issued_by(path[-1], c)), None)
            if issuer is None:
                break
            path.append(issuer)
        return _Peer(
            tuple(_Link((c.issuer, c.serial_number), c.subject.rfc4514_string()[:120], c.serial_number) for c in path)
        )

    def _current(self) -> _Lists:
        now = self._clock()
        if now >= self._look_at:
            with self._lock:
                if now >= self._look_at:
                    self._look_at = now + RECHECK_SECONDS
                    self._reread_if_changed()
        return self._lists

    def _is_racy(self, stamp: Stamp | None) -> bool:
        return stamp is not None and self._wall() - stamp.changed < RACY_SECONDS

    def _reread_if_changed(self) -> None:
        stamp = self._stamp_of(self.path)
        if stamp != self._stamp or self._racy:
            self._stamp, self._racy = stamp, self._is_racy(stamp)  # before reading: a later change is seen
            try:
                lists = self._read()
            except (OSError, ValueError) as error:
                event(log, "CRL not re-read: the lists read before stay in force", level=logging.WARNING,
                      crl=self.path, error=str(error))  # fmt: skip
                return
            if lists.digest != self._lists.digest:
                self._lists, self._stale_warned = lists, False
                event(log, "CRL re-read", crl=self.path, revoked=len(lists.revoked))
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
        revoked: dict[Key, datetime.datetime] = {}
        stale: list[datetime.datetime] = []
        for crl in _crls(data, self.path):
            self._check_signed(crl)
            for entry in crl:
                revoked[(crl.issuer, entry.serial_number)] = entry.revocation_date_utc
            if crl.next_update_utc is not None:
                stale.append(crl.next_update_utc)
        return _Lists(revoked, min(stale, default=None), hashlib.sha256(data).digest())

    def _check_signed(self, crl: x509.CertificateRevocationList) -> None:
        for issuer in self._issuers:
            if issuer.subject != crl.issuer:
                continue
            key = issuer.public_key()
            if isinstance(key, (ec.EllipticCurvePublicKey, rsa.RSAPublicKey)):
                try:
                    if crl.is_signature_valid(key):
                        return
                except (InvalidSignature, TypeError, ValueError):
                    pass
        raise ValueError(
            f"tls_crl {self.path}: the list of {crl.issuer.rfc4514_string()[:120]} is not signed by a "
            "certificate of --tls-client-ca (an intermediate CA's list needs that CA's certificate in the bundle)"
        )


@functools.cache
def revocations_for(crl: str, ca: str) -> Revocations:
    """The process's one Revocations of `crl` (of the CA bundle `ca`): every listener shares it."""
    return Revocations(crl, ca)


def _stamp(path: str) -> Stamp | None:
    try:
        found = os.stat(path)
    except OSError:
        return None
    return Stamp(found.st_size, found.st_mtime_ns, found.st_ctime_ns, found.st_ino, found.st_dev)


def _issued_by(certificate: x509.Certificate, issuer: x509.Certificate) -> bool:
    if certificate.issuer != issuer.subject:
        return False
    try:
        certificate.verify_directly_issued_by(issuer)
    except (InvalidSignature, TypeError, ValueError):
        return False
    return True


def _parsed(blob: bytes) -> list[x509.Certificate]:
    """The certificates of one PEM blob (one or more) or one DER certificate; ValueError if none."""
    if blob.lstrip().startswith(b"-----BEGIN"):
        return x509.load_pem_x509_certificates(blob)
    return [x509.load_der_x509_certificate(blob)]


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
