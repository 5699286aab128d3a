"""--tls-crl's lists (issue 61, item 4): a revoked certificate is named and refused, a change to
the file takes effect without a restart, and a bad file never un-revokes anything."""

from __future__ import annotations

import datetime
import logging
from pathlib import Path

import pytest

from gemps_server.config.security import SecurityOptions
from gemps_server.revocation import RECHECK_SECONDS, Revocations
from tests.pki import NOW, Authority, serial_of


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def ca(tmp_path: Path) -> Authority:
    return Authority(tmp_path)


def test_a_revoked_certificate_is_refused_with_its_name_serial_and_the_list(ca: Authority, tmp_path: Path) -> None:
    stolen, honest = ca.issue("worker-7"), ca.issue("worker-8")
    crl = ca.revoke(tmp_path / "crl.pem", stolen)
    revocations = Revocations(str(crl), str(ca.ca.cert))
    why = revocations.refusal(stolen.cert.read_bytes())
    assert "CN=worker-7" in why and f"{serial_of(stolen):#x}" in why and str(crl) in why and "revoked at" in why
    assert revocations.refusal(honest.cert.read_bytes()) == ""
    assert revocations.refusal(None) == ""  # no certificate: mutual TLS itself decides


def test_a_der_list_works_as_a_pem_one(ca: Authority, tmp_path: Path) -> None:
    stolen = ca.issue("w")
    crl = ca.revoke(tmp_path / "crl.der", stolen, der=True)
    assert Revocations(str(crl), str(ca.ca.cert)).refusal(stolen.cert.read_bytes())


def test_a_change_to_the_file_takes_effect_without_a_restart(ca: Authority, tmp_path: Path) -> None:
    first, second = ca.issue("a"), ca.issue("b")
    clock = Clock()
    crl = ca.revoke(tmp_path / "crl.pem", first)
    revocations = Revocations(str(crl), str(ca.ca.cert), clock=clock)
    assert revocations.refusal(second.cert.read_bytes()) == ""
    ca.revoke(crl, first, second)
    assert revocations.refusal(second.cert.read_bytes()) == ""  # looked at once a second at most
    clock.now += RECHECK_SECONDS
    assert "CN=b" in revocations.refusal(second.cert.read_bytes())


def test_a_bad_file_keeps_what_was_revoked_and_says_so(
    ca: Authority, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stolen = ca.issue("stolen")
    clock = Clock()
    crl = ca.revoke(tmp_path / "crl.pem", stolen)
    revocations = Revocations(str(crl), str(ca.ca.cert), clock=clock)
    crl.write_text("-----BEGIN X509 CRL-----\nnot base64\n-----END X509 CRL-----\n")
    clock.now += RECHECK_SECONDS
    with caplog.at_level(logging.WARNING, logger="gemps.server"):
        assert revocations.refusal(stolen.cert.read_bytes())
    assert "CRL not re-read" in caplog.text and "not a certificate revocation list" in caplog.text
    crl.unlink()  # gone: the same
    clock.now += RECHECK_SECONDS
    assert revocations.refusal(stolen.cert.read_bytes())


def test_a_list_the_ca_did_not_sign_or_no_list_refuses_the_start(ca: Authority, tmp_path: Path) -> None:
    (tmp_path / "rogue").mkdir()
    rogue = Authority(tmp_path / "rogue", name="gemps-test-ca")  # the same name, another key
    forged = rogue.revoke(tmp_path / "forged.pem")
    with pytest.raises(ValueError, match="is not signed by a certificate of --tls-client-ca"):
        Revocations(str(forged), str(ca.ca.cert))
    (tmp_path / "text.pem").write_text("hello\n")
    with pytest.raises(ValueError, match=r"tls_crl .*text.pem: not a certificate revocation list"):
        Revocations(str(tmp_path / "text.pem"), str(ca.ca.cert))


def test_a_list_past_its_next_update_is_still_used_with_a_warning(
    ca: Authority, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stolen = ca.issue("s")
    clock = Clock()
    crl = ca.revoke(tmp_path / "crl.pem", stolen, next_update=NOW - datetime.timedelta(hours=1))
    revocations = Revocations(str(crl), str(ca.ca.cert), clock=clock)
    clock.now += RECHECK_SECONDS
    with caplog.at_level(logging.WARNING, logger="gemps.server"):
        assert revocations.refusal(stolen.cert.read_bytes())
    assert "CRL past its next update" in caplog.text


def test_the_option_needs_mutual_tls_and_a_file(tmp_path: Path) -> None:
    assert any("needs tls_client_ca" in p for p in SecurityOptions(tls_crl=str(tmp_path)).problems())
    missing = SecurityOptions(tls_cert="c", tls_key="k", tls_client_ca="ca", tls_crl=str(tmp_path / "none"))
    assert any("tls_crl" in p and "not a readable file" in p for p in missing.problems())
