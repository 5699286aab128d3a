"""What a server without replicas or a revocation list imports as it starts: not cryptography, requests
or etcd3gw (the replicas', etcd's and the CRL reader's), nor the SDK's client and its transports. They
were a quarter of its start-up's CPU (1.08 s to 0.83 s to its port, old and new trees alternating),
paid by every server a supervisor, a container or a restart starts. A real `gemps server`, started
as a user starts it, with Python's own record of its imports, answers a status call first."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import grpc

from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from tests.helpers import wait_for

NOT_WANTED = ("cryptography", "requests", "etcd3gw", "gemps.client", "gemps.data_plane_transport")


def imported_by_a_plain_server(tmp_path: Path) -> set[str]:
    port_file, record = tmp_path / "port", tmp_path / "imports.log"
    argv = [sys.executable, "-X", "importtime", "-m", "gemps_cli", "server", "--port", "0", "--port-file"]
    argv.append(str(port_file))
    with open(record, "wb") as err:
        server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL)

    def ended_or_serving() -> bool:
        return server.poll() is not None or (port_file.exists() and bool(port_file.read_text().strip()))

    try:
        wait_for(ended_or_serving, 60, "serving")
        assert server.poll() is None, record.read_text()[-3000:]
        port = port_file.read_text().split()[0]  # then the data plane's
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            status = pb_grpc.ParameterServerStub(channel).Status(pb.StatusRequest(), timeout=30)
        assert status.version == 0
    finally:
        server.terminate()
        assert server.wait(60) == 0
    # "import time: self | cumulative | name", the name indented by its depth
    return {match.group(1) for match in re.finditer(r"^import time:[^|]*\|[^|]*\| +(\S+)$", record.read_text(), re.M)}


def test_a_plain_server_starts_without_the_replicas_crl_or_client_modules(tmp_path: Path) -> None:
    imported = imported_by_a_plain_server(tmp_path)
    assert "gemps_server.app" in imported and "grpc" in imported  # the record is the server's
    unwanted = sorted(name for name in imported if name.split(".")[0] in NOT_WANTED or name in NOT_WANTED)
    assert unwanted == [], unwanted


def test_the_packages_names_still_come_when_asked() -> None:
    code = (
        "import gemps, gemps_server.replication as r; from gemps.client import Client; "
        "from gemps_server.replication import local_etcd, credentials, metrics; "
        "assert gemps.Client is Client and 'Client' in dir(gemps) and set(gemps.__all__) <= set(dir(gemps)); "
        "assert r.LocalEtcd is local_etcd.LocalEtcd and r.find_etcd is local_etcd.find_etcd; "
        "assert r.with_generated_secret is credentials.with_generated_secret; "
        "assert r.ReplicationCollector is metrics.ReplicationCollector and set(r.__all__) <= set(dir(r))\n"
        "for module, name in ((gemps, 'Clients'), (r, 'LocalEtcds')):\n"
        "    try:\n"
        "        getattr(module, name)\n"
        "    except AttributeError as error:\n"
        "        assert f\"has no attribute '{name}'\" in str(error), error\n"
        "    else:\n"
        "        raise AssertionError(name)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
