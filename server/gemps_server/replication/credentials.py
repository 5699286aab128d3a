"""What the replicas of a job prove themselves to each other with (DESIGN §3d): a key derived from
a shared secret, and with TLS the certificates both sides present.

The secret is --replication-secret-file (or GEMPS_REPLICATION_SECRET), else the workers'
--auth-token; `gemps server --replicas R` on one machine generates one for its replicas
(`with_generated_secret`: a 0600 file in the supervisor's private directory). It never crosses
the network: the replicas' handshake (handshake.py) proves knowledge of a key derived from it. A
replica started alone without either is refused at start (its replication port would be open).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import hmac
import os
import secrets
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509

from gemps_server.config import ServerConfig
from gemps_server.config.replication import MIN_SECRET_BYTES
from gemps_server.replication.tls_stream import SerialSSLSocket
from gemps_server.revocation import Revocations
from gemps_server.security import revocations, tls_context

SECRET_FILE = "replication.secret"


@dataclass(frozen=True)
class Credential:
    """The job's replication key (HMAC-SHA256 of the job's name under the secret: a secret shared by
    two jobs admits no replica of one into the other) and, with TLS, the contexts of both sides."""

    key: bytes
    server_tls: ssl.SSLContext | None = None
    client_tls: ssl.SSLContext | None = None
    certificate: str = ""  # with TLS: the certificate this replica presents, and when it is valid
    valid: tuple[datetime.datetime, datetime.datetime] | None = None
    revocations: Revocations | None = None  # --tls-crl: certificates neither side accepts from the other
    presented: bytes = b""  # with TLS: the certificate (PEM, its chain after it if the file has one) it presents

    def unfit(self, now: datetime.datetime | None = None) -> str:
        """Why this replica must not lead its partition now ('' when it may): a certificate out of
        its validity or revoked by --tls-crl, which every backup would refuse, so none could ever
        join it (issue 61)."""
        now = now or datetime.datetime.now(datetime.UTC)
        if self.valid is not None and now >= self.valid[1]:
            return f"its certificate {self.certificate} expired at {self.valid[1]:%Y-%m-%d %H:%M:%S} UTC"
        if self.valid is not None and now < self.valid[0]:
            return f"its certificate {self.certificate} is not valid before {self.valid[0]:%Y-%m-%d %H:%M:%S} UTC"
        return self.revoked()

    def revoked(self) -> str:
        """Why --tls-crl revokes the certificate this replica presents, or a CA of its chain ('' if
        it does not): every backup would refuse it, so a primary steps down (coordinator.py). The
        certificate read at start: its TLS contexts present that one, whatever the file holds now."""
        if self.revocations is None or not self.presented:
            return ""
        revoked = self.revocations.refusal(self.presented)
        return f"its own {revoked}" if revoked else ""


def credential(config: ServerConfig) -> Credential:
    """This replica's credential; ValueError naming the option when there is none to use."""
    if config.replication_secret_file or config.replication_secret:
        where = (
            f"replication_secret_file {config.replication_secret_file}"
            if config.replication_secret_file
            else "replication_secret"
        )
        secret = (
            Path(config.replication_secret_file).read_bytes().strip()
            if config.replication_secret_file
            else config.replication_secret.encode()
        )
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"{where}: at least {MIN_SECRET_BYTES} bytes (e.g. openssl rand -hex 32)")
    else:
        secret = config.token().encode()
    if not secret:
        raise ValueError("replicas need a credential: give --replication-secret-file or --auth-token")
    key = hmac.new(secret, b"gemps-replication-v1\0" + config.job.encode(), hashlib.sha256).digest()
    if not config.tls:
        return Credential(key)
    # Every replica presents its --tls-cert both ways; both chain to --tls-client-ca. A peer's name
    # is the handshake's (bound to the secret), not the certificate's host name.
    server = tls_context(config.tls_cert, config.tls_key, config.tls_client_ca)
    server.num_tickets = 0  # no session tickets: nothing to resume, nothing sent after the handshake
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.minimum_version = ssl.TLSVersion.TLSv1_2
    client.load_cert_chain(config.tls_cert, config.tls_key)
    client.load_verify_locations(cafile=config.tls_client_ca)
    client.check_hostname = False
    client.verify_mode = ssl.CERT_REQUIRED
    for context in (server, client):
        context.sslsocket_class = SerialSSLSocket  # a reader and a writer thread share each stream
    revoked = revocations(config.tls_crl, config.tls_client_ca)
    presented = Path(config.tls_cert).read_bytes()
    return Credential(key, server, client, config.tls_cert, validity(config.tls_cert), revoked, presented)


def validity(certificate: str) -> tuple[datetime.datetime, datetime.datetime]:
    """When the (first) certificate of a PEM file is valid: not before, not after (UTC)."""
    parsed = x509.load_pem_x509_certificate(Path(certificate).read_bytes())
    return parsed.not_valid_before_utc, parsed.not_valid_after_utc


def with_generated_secret(config: ServerConfig, folder: Path) -> ServerConfig:
    """`config` for a supervisor running every replica here: a fresh secret in a 0600 file in its
    private `folder` (unless one was given), which its replicas read."""
    if config.replicas <= 1 or config.replica_index >= 0 or config.replication_secret_file or config.replication_secret:
        return config
    path = folder / SECRET_FILE
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(secrets.token_hex(32) + "\n")
    return dataclasses.replace(config, replication_secret_file=str(path))
