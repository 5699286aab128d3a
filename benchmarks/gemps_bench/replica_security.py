"""What the servers of a `gemps bench --replicas` run prove themselves with: the job's replication
secret (a 0600 file: replicas started one by one need one), and with `--tls` a CA and one
certificate made here, which every server presents (to workers, and to the other replicas both
ways: --tls-client-ca is the CA) and every client presents too (GEMPS_TLS_* for the SDK)."""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ReplicaSecurity:
    secret_file: Path
    cert: Path | None = None  # with TLS: the certificate every process presents, its key, their CA
    key: Path | None = None
    ca: Path | None = None

    def server_options(self, replicas: int) -> dict[str, Any]:
        options: dict[str, Any] = {"replication_secret_file": str(self.secret_file)} if replicas > 1 else {}
        if self.cert is not None:
            options |= {"tls_cert": str(self.cert), "tls_key": str(self.key), "tls_client_ca": str(self.ca)}
        return options

    @contextlib.contextmanager
    def clients(self) -> Iterator[None]:
        """The SDK's TLS for every client made meanwhile, here or in a child process."""
        if self.cert is None:
            yield
            return
        changed = {"GEMPS_TLS_CA": str(self.ca), "GEMPS_TLS_CLIENT_CERT": str(self.cert)}
        changed["GEMPS_TLS_CLIENT_KEY"] = str(self.key)
        before = {name: os.environ.get(name) for name in changed}
        os.environ.update(changed)
        try:
            yield
        finally:
            for name, value in before.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def replica_security(folder: Path, tls: bool, addresses: Sequence[str] = ("127.0.0.1",)) -> ReplicaSecurity:
    """A fresh secret in `folder`; with `tls`, a CA and a certificate for `addresses` (and localhost)."""
    folder.mkdir(parents=True, exist_ok=True)
    secret = folder / "replication.secret"
    secret.unlink(missing_ok=True)
    descriptor = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(secrets.token_hex(32))
    if not tls:
        return ReplicaSecurity(secret)
    return ReplicaSecurity(secret, *_certificates(folder, addresses))


def _certificates(folder: Path, addresses: Sequence[str]) -> tuple[Path, Path, Path]:
    """(certificate, key, CA) as PEM files; `cryptography` is a development dependency."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def certificate(name: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name, signer: Any, ca: bool) -> Any:
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            names = [x509.DNSName("localhost"), *(x509.IPAddress(ipaddress.ip_address(a)) for a in addresses)]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gemps-bench-ca")])
    ca_cert = certificate("gemps-bench-ca", ca_key, ca_name, ca_key, ca=True)
    cert = certificate("gemps-bench-replica", key, ca_name, ca_key, ca=False)
    paths = folder / "replica.pem", folder / "replica.key", folder / "ca.pem"
    paths[0].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    paths[1].chmod(0o600)
    paths[2].write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    return paths
