"""A job's own certificate authority for its private etcd: only holders of the job's client
certificate reach it (etcd's --client-cert-auth), which is what keeps other local users - and on a
`gemps ray` job, other machines - from reading or rewriting who is primary.

Everything lives in one 0700 folder of 0600 files made at the job's start; nothing is reused
between jobs. The CA's key signs the two certificates and is then thrown away, so a stolen
folder cannot mint more.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

#: how long the certificates hold: longer than any job; a job is not expected to outlive it
VALIDITY = datetime.timedelta(days=3650)
_CLOCK_SKEW = datetime.timedelta(hours=1)  # machines of one Ray cluster need not agree to the second


@dataclass(frozen=True)
class EtcdTls:
    """The PEM files of one private etcd: its CA, the server's pair (also its peer pair) and the
    job's client pair."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def client_pems(self) -> dict[str, str]:
        """The client's files as text, for replicas on other machines ("ca", "cert", "key")."""
        return {
            "ca": self.ca.read_text(),
            "cert": self.client_cert.read_text(),
            "key": self.client_key.read_text(),
        }


def private_folder(path: Path) -> Path:
    """`path` made (or made again) readable by this user alone."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)  # mkdir's mode is masked by the umask, and an existing folder keeps its own
    return path


def write_private(path: Path, text: str | bytes) -> Path:
    """Write `text` to a file no one else may read, created 0600 (never briefly wider)."""
    data = text.encode() if isinstance(text, str) else text
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(data)
    path.chmod(0o600)  # an existing file keeps its mode through O_CREAT
    return path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(hosts: Iterable[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):  # in order, once each
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _pem(certificate: x509.Certificate) -> bytes:
    return certificate.public_bytes(serialization.Encoding.PEM)


def issue(folder: Path, hosts: Iterable[str], job: str = "gemps") -> EtcdTls:
    """A new CA, a server certificate for `hosts` (the addresses clients dial: an IP or a DNS name
    each) and a client certificate, written into `folder` (made 0700)."""
    private_folder(folder)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name(f"{job} private etcd CA")

    def certificate(
        subject: x509.Name, key: ec.EllipticCurvePrivateKey, *, ca: bool = False
    ) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _CLOCK_SKEW)
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )

    ca = certificate(ca_name, ca_key, ca=True).sign(ca_key, hashes.SHA256())
    server_key = ec.generate_private_key(ec.SECP256R1())
    # The server's pair is also a client's: etcd's HTTP gateway dials etcd's own gRPC port with it,
    # and the one member's peer listener requires it as a peer's.
    server = (
        certificate(_name(f"{job} etcd"), server_key)
        .add_extension(_san(hosts), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), False)
        .sign(ca_key, hashes.SHA256())
    )
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = (
        certificate(_name(f"{job} replica"), client_key)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), False)
        .sign(ca_key, hashes.SHA256())
    )
    return EtcdTls(
        ca=write_private(folder / "ca.pem", _pem(ca)),
        server_cert=write_private(folder / "server.pem", _pem(server)),
        server_key=write_private(folder / "server.key", _pem_key(server_key)),
        client_cert=write_private(folder / "client.pem", _pem(client)),
        client_key=write_private(folder / "client.key", _pem_key(client_key)),
    )
