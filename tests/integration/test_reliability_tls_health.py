"""deploy/healthcheck.py against TLS and mutual-TLS servers (issue 15, item 11a): it speaks TLS
when the server does, from the same GEMPS_* variables, so a TLS-enabled server becomes healthy."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import StartServer
from tests.pki import Issued, issue, issue_ca

HEALTHCHECK = Path(__file__).resolve().parents[2] / "deploy" / "healthcheck.py"


def run_healthcheck(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {key: value for key, value in os.environ.items() if not key.startswith("GEMPS_")}
    return subprocess.run(
        [sys.executable, str(HEALTHCHECK), *args], capture_output=True, text=True, timeout=30, env={**clean, **env}
    )


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> tuple[Issued, Issued]:
    """A CA and a server certificate it signed (for 127.0.0.1 and localhost)."""
    directory = tmp_path_factory.mktemp("health-pki")
    ca, signer = issue_ca(directory, "health-ca")
    return ca, issue(directory, "server", signer, server=True)


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
def test_the_container_healthcheck_speaks_tls_to_a_tls_server(
    start_server: StartServer, certificates: tuple[Issued, Issued], mutual: bool
) -> None:
    ca, server_cert = certificates
    options = {"tls_cert": str(server_cert.cert), "tls_key": str(server_cert.key)}
    if mutual:
        options["tls_client_ca"] = str(ca.cert)
    server = start_server(**options)
    # The server container's own environment: what `gemps server` reads, plus the CA to trust.
    env = {"GEMPS_PORT": str(server.port), "GEMPS_TLS_CA": str(ca.cert)}
    env.update({f"GEMPS_{key.upper()}": value for key, value in options.items()})
    own = run_healthcheck(env=env)
    assert own.returncode == 0 and "SERVING" in own.stdout, own.stdout + own.stderr
    plaintext = run_healthcheck("--target", server.target, "--timeout", "2", env={})
    assert plaintext.returncode == 1  # the check really is over TLS
    if not mutual:  # a worker's view: the SDK's variables
        upstream = run_healthcheck("--upstream", env={"GEMPS_SERVER": server.target, "GEMPS_TLS_CA": str(ca.cert)})
        assert upstream.returncode == 0, upstream.stdout + upstream.stderr
