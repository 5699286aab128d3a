"""How the replicas reach etcd (config/coordination.py): options that need each other, refused in
one line each, the GEMPS_ETCD_* variables, and what the etcd client makes of them."""

from __future__ import annotations

import re
import shutil
import stat
from pathlib import Path

import pytest
from gemps_cli import environment, server

from gemps_server.config import CoordinationOptions
from gemps_server.config_log import REDACTED, effective_values
from gemps_server.replication.etcd_client import EtcdAccess, EtcdEndpoints
from gemps_worker.on_ray.etcd import write_credentials
from tests.helpers import server_config


@pytest.fixture
def pems(tmp_path: Path) -> dict[str, str]:
    files = {}
    for name in ("etcd_ca", "etcd_cert", "etcd_key"):
        (tmp_path / f"{name}.pem").write_text("PEM")
        files[name] = str(tmp_path / f"{name}.pem")
    return files


def test_options_that_need_each_other(pems: dict[str, str], tmp_path: Path) -> None:
    assert CoordinationOptions().problems() == []
    assert CoordinationOptions(etcd_cert=pems["etcd_cert"]).problems() == [
        "etcd_cert and etcd_key go together: give both or neither"
    ]
    assert CoordinationOptions(etcd_user="trainer").problems() == [
        "etcd_user 'trainer' needs a password: etcd_password_file or GEMPS_ETCD_PASSWORD"
    ]
    assert CoordinationOptions(etcd_password="s3cret").problems() == ["an etcd password needs etcd_user"]
    secret = tmp_path / "password"
    secret.write_text("s3cret\n")
    both = CoordinationOptions(etcd_user="u", etcd_password="s", etcd_password_file=str(secret))
    assert both.problems() == ["give etcd_password (GEMPS_ETCD_PASSWORD) or etcd_password_file, not both"]
    assert CoordinationOptions(etcd_ca="/nowhere/ca.pem").problems() == [
        "etcd_ca '/nowhere/ca.pem' is not a readable file"
    ]
    assert CoordinationOptions(etcd_user="u", etcd_password_file=str(secret)).etcd_secret() == "s3cret"


def test_checks_with_the_endpoints_are_the_server_configs(pems: dict[str, str]) -> None:
    with pytest.raises(ValueError, match=re.escape("etcd endpoint 'http://e:2379' is plain http, but etcd_ca/")):
        server_config(replicas=2, etcd="http://e:2379", **pems)
    with pytest.raises(ValueError, match=re.escape("etcd_ca, etcd_cert: for an etcd that --etcd names")):
        server_config(replicas=2, **pems)  # the supervisor would start a private etcd and ignore them
    config = server_config(replicas=2, etcd="https://e:2379,f:2379", **pems)
    assert EtcdAccess.of(config) == EtcdAccess(pems["etcd_ca"], pems["etcd_cert"], pems["etcd_key"])


def test_the_variables_set_them(pems: dict[str, str]) -> None:
    environ = {
        "GEMPS_ETCD": "https://e:2379",
        "GEMPS_REPLICAS": "2",
        "GEMPS_ETCD_CA": pems["etcd_ca"],
        "GEMPS_ETCD_CERT": pems["etcd_cert"],
        "GEMPS_ETCD_KEY": pems["etcd_key"],
        "GEMPS_ETCD_USER": "trainer",
        "GEMPS_ETCD_PASSWORD": "s3cret",
    }
    config = server.parse_config([], environ=environ)
    assert EtcdAccess.of(config) == EtcdAccess(
        pems["etcd_ca"], pems["etcd_cert"], pems["etcd_key"], "trainer", "s3cret"
    )
    assert set(environ) <= environment.known_options()


def test_a_bare_endpoint_means_https_with_certificates(pems: dict[str, str]) -> None:
    access = EtcdAccess(pems["etcd_ca"], pems["etcd_cert"], pems["etcd_key"])
    endpoints = EtcdEndpoints("e:2379,http://f:2379", 1.0, access)
    try:
        assert [client.base_url for client in endpoints._clients] == ["https://e:2379", "http://f:2379"]
        session = endpoints._clients[0].session
        assert session.verify == pems["etcd_ca"] and session.cert == (pems["etcd_cert"], pems["etcd_key"])
        assert not session.trust_env  # REQUESTS_CA_BUNDLE must not replace etcd_ca
    finally:
        endpoints.close()


def test_a_ray_replica_gets_the_drivers_etcd_credentials_as_private_files() -> None:
    """`gemps ray`'s private etcd admits holders of its client certificate: a replica on another
    node is sent the PEM texts and its actor writes them where only it may read them."""
    pems = {"ca": "CA PEM", "cert": "CERT PEM", "key": "KEY PEM"}
    folder, options = write_credentials(pems)
    try:
        assert set(options) == {"etcd_ca", "etcd_cert", "etcd_key"}
        assert Path(options["etcd_key"]).read_text() == "KEY PEM"
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert all(stat.S_IMODE(Path(path).stat().st_mode) == 0o600 for path in options.values())
    finally:
        shutil.rmtree(folder)


def test_the_password_is_never_logged() -> None:
    config = server.parse_config([], environ={"GEMPS_ETCD_USER": "trainer", "GEMPS_ETCD_PASSWORD": "s3cret"})
    values = effective_values(config)
    assert values["etcd_password"] == REDACTED and values["etcd_user"] == "trainer"
