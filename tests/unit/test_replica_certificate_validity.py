"""A replica does not lead its partition with a certificate out of its validity (issue 61, item 4):
one whose certificate had expired won its partition's election, and its backup, which refuses that
certificate, could then never join it."""

from __future__ import annotations

import datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from gemps_server.replication.credentials import Credential, validity

NOW = datetime.datetime.now(datetime.UTC)
DAY = datetime.timedelta(days=1)


def certificate(folder: Path, not_before: datetime.datetime, not_after: datetime.datetime) -> str:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "replica")])
    signed = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(not_before).not_valid_after(not_after)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    path = folder / f"cert-{not_before:%Y%m%d}-{not_after:%Y%m%d}.pem"
    path.write_bytes(signed.public_bytes(serialization.Encoding.PEM))
    return str(path)


def credential_of(path: str) -> Credential:
    return Credential(b"k" * 32, certificate=path, valid=validity(path))


def test_an_expired_certificate_is_unfit_to_lead_and_says_when(tmp_path: Path) -> None:
    expired = certificate(tmp_path, NOW - 30 * DAY, NOW - DAY)
    why = credential_of(expired).unfit()
    assert "expired at" in why and expired in why and f"{(NOW - DAY):%Y-%m-%d}" in why


def test_a_certificate_not_valid_yet_is_unfit_and_a_valid_one_fit(tmp_path: Path) -> None:
    assert "not valid before" in credential_of(certificate(tmp_path, NOW + DAY, NOW + 30 * DAY)).unfit()
    valid = credential_of(certificate(tmp_path, NOW - DAY, NOW + DAY))
    assert valid.unfit() == ""
    assert "expired" in valid.unfit(NOW + 2 * DAY)  # read at each campaign, not once at start
    assert Credential(b"k" * 32).unfit() == ""  # without TLS there is no certificate to expire
