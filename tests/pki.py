"""A test CA that issues certificates and revocation lists (issue 61, item 4: --tls-crl)."""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

NOW = datetime.datetime.now(datetime.UTC)


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path


def _write(directory: Path, name: str, certificate: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Issued:
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return Issued(cert_path, key_path)


def _certificate(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
    *,
    ca: bool = False,
    server: bool = False,
    serial: int | None = None,
) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    issuer_name, issuer_key = issuer if issuer is not None else (name, key)
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(serial or x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
    return builder.sign(issuer_key, hashes.SHA256())


Signer = tuple[x509.Name, ec.EllipticCurvePrivateKey]


def issue_ca(directory: Path, name: str, parent: Signer | None = None) -> tuple[Issued, Signer]:
    """A CA's certificate: self-signed (a root), or signed by `parent` (an intermediate)."""
    key = ec.generate_private_key(ec.SECP256R1())
    certificate = _certificate(name, key, parent, ca=True)
    return _write(directory, name, certificate, key), (certificate.subject, key)


def issue(directory: Path, name: str, ca: Signer, server: bool = False, serial: int | None = None) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    return _write(directory, name, _certificate(name, key, ca, server=server, serial=serial), key)


@dataclass
class Authority:
    """A CA in `folder`: `issue(name)` a certificate it signs, `revoke(path, *certs)` a CRL;
    with `parent`, an intermediate CA that `parent` signed (its certificates then present the
    intermediate's too: `issue` writes the chain)."""

    folder: Path
    name: str = "gemps-test-ca"
    parent: Authority | None = None

    def __post_init__(self) -> None:
        self.ca, self._signer = issue_ca(self.folder, self.name, self.parent.signer if self.parent else None)

    def issue(self, name: str, server: bool = False, serial: int | None = None) -> Issued:
        issued = issue(self.folder, name, self._signer, server=server, serial=serial)
        if self.parent is not None:  # the leaf, then the intermediate: what a client presents
            issued.cert.write_bytes(issued.cert.read_bytes() + self.ca.cert.read_bytes())
        return issued

    @property
    def signer(self) -> Signer:
        """The CA's name and key (a test that signs something of its own)."""
        return self._signer

    def intermediate(self, name: str) -> Authority:
        """An intermediate CA this one signs."""
        return Authority(self.folder, name, self)

    def revoke(
        self, path: Path, *revoked: Issued, der: bool = False, next_update: datetime.datetime | None = None
    ) -> Path:
        """Write a CRL of this CA listing `revoked` to `path` (whole, then renamed: as a publisher
        would) and return it."""
        partial = path.with_name(path.name + ".new")
        partial.write_bytes(self.crl(*revoked, der=der, next_update=next_update))
        os.replace(partial, path)
        return path

    def crl(self, *revoked: Issued, der: bool = False, next_update: datetime.datetime | None = None) -> bytes:
        """A CRL of this CA listing `revoked` (their first certificate: the leaf)."""
        issuer, key = self._signer
        builder = (
            x509.CertificateRevocationListBuilder()
            .issuer_name(issuer)
            .last_update(NOW - datetime.timedelta(hours=2))
            .next_update(next_update or NOW + datetime.timedelta(days=1))
        )
        for certificate in revoked:
            serial = x509.load_pem_x509_certificate(certificate.cert.read_bytes()).serial_number
            entry = x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(NOW).build()
            builder = builder.add_revoked_certificate(entry)
        crl = builder.sign(key, hashes.SHA256())
        return crl.public_bytes(serialization.Encoding.DER if der else serialization.Encoding.PEM)


def serial_of(certificate: Issued) -> int:
    return x509.load_pem_x509_certificate(certificate.cert.read_bytes()).serial_number
