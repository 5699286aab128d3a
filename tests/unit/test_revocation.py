"""--tls-crl's lists (issue 61, item 4): a revoked certificate is named and refused, a change to
the file takes effect without a restart, and a bad file never un-revokes anything."""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.name import _ASN1Type
from cryptography.x509.oid import NameOID
from gemps_cli.partitions import PartitionProcess, child_config
from gemps_cli.server import parse_config

from gemps_server.config.security import SecurityOptions
from gemps_server.revocation import RACY_SECONDS, RECHECK_SECONDS, Revocations, Stamp
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


def same_size_rewrite(crl: Path, make: Callable[[], bytes]) -> None:
    """Write `make()`'s list over `crl` in place (its inode kept), the same size as the list there
    (re-signed until it is: ECDSA signatures vary by a byte or two), and put its mtime back: what
    a rewrite within one tick of the file system's clock looks like."""
    before, old = crl.stat(), crl.read_bytes()
    data = make()
    for _ in range(200):
        if len(data) == len(old) and data != old:
            break
        data = make()
    assert len(data) == len(old)
    with crl.open("r+b") as file:
        file.write(data)
    os.utime(crl, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = crl.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)


def test_a_list_rewritten_in_place_within_the_same_tick_is_read_again(ca: Authority, tmp_path: Path) -> None:
    """Before: a change was seen by (size, mtime, inode) alone, so a list of the same size written
    over the old one within the same tick of the file's clock (1 s on some file systems) was never
    read: here the first list revoked a, the second revokes b instead."""
    first, second = ca.issue("a", serial=0x1A1A1A), ca.issue("b", serial=0x2B2B2B)
    clock = Clock()
    crl = ca.revoke(tmp_path / "crl.pem", first, der=True)
    revocations = Revocations(str(crl), str(ca.ca.cert), clock=clock)
    assert revocations.refusal(first.cert.read_bytes()) and not revocations.refusal(second.cert.read_bytes())
    same_size_rewrite(crl, lambda: ca.crl(second, der=True))
    clock.now += RECHECK_SECONDS
    assert "CN=b" in revocations.refusal(second.cert.read_bytes())
    assert revocations.refusal(first.cert.read_bytes()) == ""  # the new list alone is in force


def test_an_intermediate_cas_list_and_a_revoked_intermediate(ca: Authority, tmp_path: Path) -> None:
    """Several lists in one file: the root's and its intermediate's, each checked against its
    issuer in --tls-client-ca. A certificate the intermediate's list revokes is refused; so is
    every certificate an intermediate the root's list revokes signed, whether the peer presents
    the intermediate (its chain) or the bundle holds it. Before: only the leaf was looked at."""
    good, bad = ca.intermediate("intermediate-good"), ca.intermediate("intermediate-bad")
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(ca.ca.cert.read_bytes() + good.ca.cert.read_bytes() + bad.ca.cert.read_bytes())
    revoked_leaf, kept_leaf = good.issue("leaf-revoked"), good.issue("leaf-kept")
    under_bad = bad.issue("leaf-under-bad")
    crl = tmp_path / "crl.pem"
    crl.write_bytes(ca.crl(bad.ca) + good.crl(revoked_leaf))
    revocations = Revocations(str(crl), str(bundle))
    leaf_of = {issued: issued.cert.read_bytes().split(b"-----END CERTIFICATE-----")[0] + b"-----END CERTIFICATE-----\n"
               for issued in (revoked_leaf, kept_leaf, under_bad)}  # fmt: skip
    assert "CN=leaf-revoked" in revocations.refusal(revoked_leaf.cert.read_bytes())
    assert revocations.refusal(kept_leaf.cert.read_bytes()) == ""
    assert revocations.refusal(leaf_of[kept_leaf], good.ca.cert.read_bytes()) == ""
    through_chain = revocations.refusal(leaf_of[under_bad], bad.ca.cert.read_bytes())  # as gRPC shows it
    assert "CN=leaf-under-bad" in through_chain and "CN=intermediate-bad" in through_chain, through_chain
    assert "CN=intermediate-bad" in revocations.refusal(under_bad.cert.read_bytes())  # one PEM: leaf and chain
    assert "CN=intermediate-bad" in revocations.refusal(leaf_of[under_bad])  # the leaf alone: the bundle's


def test_a_list_of_an_intermediate_missing_from_the_bundle_refuses_the_start_saying_so(
    ca: Authority, tmp_path: Path
) -> None:
    intermediate = ca.intermediate("intermediate")
    crl = intermediate.revoke(tmp_path / "crl.pem", intermediate.issue("leaf"))
    with pytest.raises(ValueError, match="CN=intermediate is not signed by a certificate of --tls-client-ca") as no:
        Revocations(str(crl), str(ca.ca.cert))
    assert "an intermediate CA's list needs that CA's certificate in the bundle" in str(no.value)


def test_a_rewrite_that_changes_nothing_of_the_stamp_is_read_while_the_file_is_fresh(
    ca: Authority, tmp_path: Path
) -> None:
    """On a file system whose clock ticks once a second, a list rewritten in place, the same size,
    in the tick it was last written in leaves size, times and inode as they were: its bytes are
    compared at each look until its last change is RACY_SECONDS old; past that, only a changed
    stamp has the file read again (a large list is not read every second)."""
    first, second, third = ca.issue("a"), ca.issue("b"), ca.issue("c")
    crl = ca.revoke(tmp_path / "crl.pem", first)
    clock, wall = Clock(), Clock()
    wall.now = 1_000.0
    fixed = Stamp(crl.stat().st_size, int(wall.now * 1e9), int(wall.now * 1e9), 7, 1)
    revocations = Revocations(str(crl), str(ca.ca.cert), clock=clock, wall=wall, stamp=lambda path: fixed)
    crl.write_bytes(ca.crl(second))  # in place, the stamp as it was
    clock.now += RECHECK_SECONDS
    wall.now += RECHECK_SECONDS
    assert "CN=b" in revocations.refusal(second.cert.read_bytes())
    clock.now += RECHECK_SECONDS
    wall.now += RACY_SECONDS  # settled: looked at once more, then no longer read
    assert revocations.refusal(first.cert.read_bytes()) == ""
    crl.write_bytes(ca.crl(third))
    clock.now += RECHECK_SECONDS
    assert revocations.refusal(third.cert.read_bytes()) == ""  # the stamp alone says whether it changed


def test_an_issuer_name_encoded_otherwise_in_the_list_still_matches(ca: Authority, tmp_path: Path) -> None:
    """The list names its issuer with a PrintableString where the certificates have a UTF8String:
    the same name (RFC 5280), other DER. Before: looked up by the DER, it revoked nothing."""
    stolen = ca.issue("stolen")
    issuer, key = ca.signer
    printable = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca.name, _ASN1Type.PrintableString)])
    assert printable == issuer and printable.public_bytes() != issuer.public_bytes()
    entry = x509.RevokedCertificateBuilder().serial_number(serial_of(stolen)).revocation_date(NOW).build()
    crl = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(printable)
        .last_update(NOW - datetime.timedelta(hours=1))
        .next_update(NOW + datetime.timedelta(days=1))
        .add_revoked_certificate(entry)
        .sign(key, hashes.SHA256())
    )
    (tmp_path / "crl.pem").write_bytes(crl.public_bytes(serialization.Encoding.PEM))
    assert "CN=stolen" in Revocations(str(tmp_path / "crl.pem"), str(ca.ca.cert)).refusal(stolen.cert.read_bytes())


def test_the_supervisor_hands_the_list_to_every_replica_it_starts(ca: Authority, tmp_path: Path) -> None:
    """`gemps server --replicas 2 --tls-crl FILE`: each replica's process gets the option (its whole
    configuration goes through its environment, GEMPS_TLS_CRL among it) and reads it as given."""
    server = ca.issue("server", server=True)
    crl = ca.revoke(tmp_path / "crl.pem", ca.issue("w"))
    argv = ["--replicas", "2", "--tls-cert", str(server.cert), "--tls-key", str(server.key)]
    argv += ["--tls-client-ca", str(ca.ca.cert), "--tls-crl", str(crl), "--auth-token", "t" * 32]
    config = parse_config(argv, environ={})
    for replica in range(2):
        supervised = child_config(config, 0, replica=replica, etcd="http://127.0.0.1:2379")
        child = PartitionProcess(0, supervised, tmp_path / f"port-{replica}")
        environment = child.environment()
        assert environment["GEMPS_TLS_CRL"] == str(crl)
        assert parse_config([], environ=environment).tls_crl == str(crl)
