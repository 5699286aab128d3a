"""etcd as a real, secured, supervised dependency (issue 41, items 1 and 5): the private etcd of
`gemps server --replicas 2` admits the job's processes alone (TLS with the job's own client
certificate, client and peer ports alike; its files unreadable to other users), is started again
on the same data when it dies, and an external etcd is reached with TLS certificates or an etcd
user, wrong ones refused at start in a line naming the option. Real etcd, real processes."""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import signal
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import pytest
import requests
from etcd3gw.client import Etcd3Client
from etcd3gw.exceptions import Etcd3Exception

import gemps
from gemps_server.replication.etcd_client import CoordinationUnavailable, EtcdAccess, EtcdEndpoints
from gemps_server.replication.etcd_tls import issue
from gemps_server.replication.status import PRIMARY
from gemps_worker.cluster import ServerProcess
from tests.etcd_server import etcd_server
from tests.helpers import CommitLoops, replication_secret_file, wait_for
from tests.integration.conftest import StartServerProcess
from tests.replica_reports import report_fresh
from tests.slow_proxy import slow_proxy

LEASE = 1.0
PARAMETERS = 100


@dataclass(frozen=True)
class EtcdChild:
    """The etcd a supervisor started, as its process table shows it."""

    pid: int
    flags: dict[str, str]  # --name=value

    @property
    def url(self) -> str:
        return self.flags["--listen-client-urls"]

    @property
    def access(self) -> EtcdAccess:
        """The job's credentials, read from where the supervisor keeps them (as a child of it does)."""
        ca = self.flags.get("--trusted-ca-file", "")
        if not ca:
            return EtcdAccess()
        folder = Path(ca).parent
        return EtcdAccess(ca, str(folder / "client.pem"), str(folder / "client.key"))


def etcd_child(parent: int) -> EtcdChild | None:
    """The etcd process whose parent is `parent` (None: none now)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue  # gone meanwhile
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and Path(argv[0]).name == "etcd":
            flags = dict(arg.split("=", 1) for arg in argv[1:] if arg.startswith("--") and "=" in arg)
            return EtcdChild(int(entry.name), flags)
    return None


def supervisor(start: StartServerProcess, job: str) -> tuple[ServerProcess, EtcdChild, str]:
    """`gemps server --replicas 2` with its private etcd: (the supervisor, its etcd, the workers' target)."""
    server = start(rule="downpour", replicas=2, job=job, replication_port=0, replica_lease=LEASE, replica_timeout=2.0)
    etcd = etcd_child(server.pid)
    assert etcd is not None, server.log()
    found = re.search(r"workers: --server '([^']+)'", server.log())
    assert found is not None, server.log()
    return server, etcd, found.group(1)


def unverified(url: str, path: str, body: dict[str, str]) -> int:
    """POST to etcd's gateway with no client certificate (and not checking etcd's): the status."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    request = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=5, context=context if url.startswith("https") else None) as reply:
        return int(reply.status)


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def reaches(url: str, path: str, body: dict[str, str]) -> bool:
    """Whether a request without the job's credentials is answered 200, over https or http."""
    for scheme in ("https", "http"):
        try:
            if unverified(re.sub("^https?", scheme, url), path, body) == 200:
                return True
        except OSError:
            continue
    return False


def test_only_the_jobs_processes_reach_the_private_etcd(start_server_process: StartServerProcess) -> None:
    """A local process without the job's client certificate reads no key, writes none and cannot
    pose as a peer (item 1: a local user rewrote the primary key); run as `nobody`, it cannot even
    read the certificate files or list etcd's folder. The job's processes reach it all along."""
    _, etcd, target = supervisor(start_server_process, "private")
    prefix = "/gemps/private/partition/0/"
    mine = EtcdEndpoints(etcd.url, 2.0, etcd.access)
    try:

        def elected() -> bool:  # the job's keys are there, read with the job's credentials
            keys = mine.call("read", lambda client: client.get_prefix(prefix))
            return any(meta["key"].decode().endswith("/primary") for _, meta in keys)

        wait_for(elected, 30, "the primary's key", tolerate=(CoordinationUnavailable,))
    finally:
        mine.close()

    read = {"key": b64(f"{prefix}primary")}
    assert not reaches(etcd.url, "/v3/kv/range", read)
    assert not reaches(etcd.url, "/v3/kv/put", {"key": b64(f"{prefix}primary"), "value": b64("attacker:1")})
    peer = etcd.flags["--listen-peer-urls"]
    assert not any(reaches(peer, path, {}) for path in ("/members", "/raft/probing", "/version"))
    where = urlsplit(etcd.url)
    assert where.hostname is not None and where.port is not None
    for protocol in ("http", "https"):  # etcd3gw as a stranger would use it
        stranger = Etcd3Client(where.hostname, where.port, protocol, api_path="/v3/", timeout=2)
        stranger.session.verify = False
        with pytest.raises(Etcd3Exception):
            stranger.get(f"{prefix}primary")

    # Another local user: the files that would let it in are not its to read.
    files = etcd.access
    script = (
        "import json, os, sys, ssl, urllib.request\n"
        "out = {}\n"
        "for name in sys.argv[2:]:\n"
        "    try:\n"
        "        open(name).read(); out[name] = 'read'\n"
        "    except OSError as error:\n"
        "        out[name] = type(error).__name__\n"
        "context = ssl.create_default_context(); context.check_hostname = False; context.verify_mode = ssl.CERT_NONE\n"
        "for url in (sys.argv[1], sys.argv[1].replace('https', 'http')):\n"
        "    try:\n"
        "        body = json.dumps({'key': 'L2dlbXBz'}).encode()\n"
        "        request = urllib.request.Request(url + '/v3/kv/range', data=body, method='POST')\n"
        "        urllib.request.urlopen(request, timeout=5, context=context if url.startswith('https') else None)\n"
        "        out[url] = 'answered'\n"
        "    except OSError as error:\n"
        "        out[url] = type(error).__name__\n"
        "print(json.dumps(out))\n"
    )
    folder = Path(files.ca).parent.parent if files.ca else Path(etcd.flags["--data-dir"]).parent
    names = [str(folder / "etcd.log"), *(path for path in (files.ca, files.cert, files.key) if path)]
    ran = subprocess.run(
        ["runuser", "-u", "nobody", "--", "/usr/bin/python3", "-c", script, etcd.url, *names],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    seen = json.loads(ran.stdout)
    assert seen[etcd.url] != "answered" and seen[etcd.url.replace("https", "http")] != "answered", seen
    assert all(seen[name] == "PermissionError" for name in names), seen
    assert not os.stat(folder).st_mode & 0o077, oct(os.stat(folder).st_mode)  # 0700
    # The job itself unharmed: one of its replicas is primary (asked of each: a backup says backup).
    wait_for(lambda: primary_of(target), 30, "a primary", tolerate=(AssertionError,))


def test_a_killed_private_etcd_is_started_again_on_its_data(start_server_process: StartServerProcess) -> None:
    """SIGKILL of the private etcd under a running `gemps server --replicas 2` (item 5: nothing
    restarted it, the partition stayed unavailable): it is started again on the same data
    directory, ports and certificates, with a WARNING, a key written before is still there, and
    commits are acknowledged again within seconds, none lost."""
    server, etcd, target = supervisor(start_server_process, "restart")
    mine = EtcdEndpoints(etcd.url, 2.0, etcd.access)
    client = gemps.Client(target, name="w0", timeout=10)
    loops = CommitLoops([client], {"w": np.zeros(PARAMETERS, np.float32)}, np.ones(PARAMETERS, np.float32), "update")
    loops.start()
    try:
        mine.call("write", lambda etcd: etcd.put("/gemps/restart/marker", "kept"))
        loops.wait_each(5, 60, "commits before etcd is killed")
        os.kill(etcd.pid, signal.SIGKILL)
        killed = time.monotonic()

        def restarted() -> EtcdChild | None:
            child = etcd_child(server.pid)
            return child if child is not None and child.pid != etcd.pid else None

        again = wait_for(restarted, 20, "the private etcd started again", explain=server.log)
        back = time.monotonic() - killed
        assert again.flags == etcd.flags  # the same data directory, ports and certificates
        # Past every lease granted before the kill: commits acknowledged from here on were under a
        # lease the primary renewed at the etcd started again (it reconnected by itself).
        time.sleep(max(0.0, killed + 3 * LEASE - time.monotonic()))
        loops.wait_each(5, 30, "commits after etcd came back")
        resumed = time.monotonic() - killed
        marker = wait_for(
            lambda: mine.call("read", lambda etcd: etcd.get("/gemps/restart/marker")),
            10,
            "the marker read",
            tolerate=(CoordinationUnavailable,),
        )
    finally:
        loops.stop()
        mine.close()
    assert marker == [b"kept"]
    assert not loops.failures, loops.failures
    status, theta = primary_state(target)
    assert theta.min() == theta.max() == status.version == sum(loops.acked), (theta.max(), status, sum(loops.acked))
    warnings = [line for line in server.log().splitlines() if "private etcd exited" in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0], warnings
    print(
        f"private etcd SIGKILLed: back as pid {again.pid} after {back:.2f} s; 5 more commits {resumed:.1f} s after "
        "the kill; "
        f"{sum(loops.acked)} acknowledged, all applied once"
    )
    assert resumed < 20


def primary_of(target: str) -> str:
    """The address among `target`'s ("A|B") whose replica says it is primary."""
    for address in target.split("|"):
        with gemps.Client(address, timeout=10) as observer:
            replication = observer.status().replication
        if replication is not None and replication.role == PRIMARY:
            return address
    raise AssertionError(f"no primary among {target}")


def primary_state(target: str) -> tuple[gemps.ServerStatus, np.ndarray]:
    """The primary's status and θ, asked of it (a backup's status may lag it)."""
    with gemps.Client(primary_of(target), timeout=10) as observer:
        return observer.status(), observer.pull().flat


def lone_replica(etcd_url: str, job: str, *, access: EtcdAccess | None = None, **options: Any) -> ServerProcess:
    """Replica 0 of a replicated partition on `etcd_url` (started: RuntimeError with its log when
    it exits); its partner is reported fresh through `access` (a fresh job elects once every
    replica reported)."""
    if access is not None:
        report_fresh(etcd_url, job, replicas=2, access=access)
    server = ServerProcess(
        rule="downpour",
        replicas=2,
        replica_index=0,
        etcd=etcd_url,
        job=job,
        replication_port=0,
        replica_lease=LEASE,
        startup_timeout=60,
        replication_secret_file=replication_secret_file(),
        **options,
    )
    try:
        return server.start()
    except BaseException:
        server.close()
        raise


def becomes_primary(server: ServerProcess) -> None:
    def role() -> str:
        with gemps.Client(server.target, timeout=5) as client:
            replication = client.status().replication
        return "" if replication is None else replication.role

    wait_for(lambda: role() == PRIMARY, 30, "the replica elected through etcd", explain=server.log)


def test_an_external_etcd_with_client_certificates(tmp_path: Path) -> None:
    """An etcd that requires client certificates: reached with --etcd-ca/--etcd-cert/--etcd-key;
    without the CA, with a certificate another CA signed, or over plain http, the replica refuses
    to start with a line naming what to give."""
    with etcd_server(secure=True) as etcd:
        access = etcd.access
        server = lone_replica(
            etcd.endpoint, "tls", access=access, etcd_ca=access.ca, etcd_cert=access.cert, etcd_key=access.key
        )
        try:
            becomes_primary(server)
        finally:
            server.close()
        rogue = issue(tmp_path / "rogue", ["127.0.0.1"])
        refusals: dict[str, dict[str, Any]] = {
            "give the CA that signed it: etcd_ca": {"etcd_cert": access.cert, "etcd_key": access.key},
            "refused etcd_cert": {
                "etcd_ca": access.ca,
                "etcd_cert": str(rogue.client_cert),
                "etcd_key": str(rogue.client_key),
            },
            "requires a client certificate: give etcd_cert": {"etcd_ca": access.ca},
        }
        for expected, options in refusals.items():
            with pytest.raises(RuntimeError, match=re.escape(expected)):
                lone_replica(etcd.endpoint, "tls", **options).close()
        plain = etcd.endpoint.replace("https", "http")
        with pytest.raises(RuntimeError, match=re.escape("give an https:// endpoint and etcd_ca")):
            lone_replica(plain, "tls").close()
        # An etcd slow to answer (a loaded machine: CI's once took past the lease's third, the
        # election's request timeout) is still told apart from one not answering yet.
        with (
            slow_proxy(urlsplit_address(plain), delay=1.0) as port,
            pytest.raises(RuntimeError, match=re.escape("give an https:// endpoint and etcd_ca")),
        ):
            lone_replica(f"http://127.0.0.1:{port}", "tls").close()


def urlsplit_address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None, url
    return parts.hostname, parts.port


def gateway(url: str, path: str, body: dict[str, Any], token: str = "") -> dict[str, Any]:
    reply = requests.post(f"{url}/v3/{path}", json=body, headers={"Authorization": token} if token else {}, timeout=5)
    assert reply.status_code == 200, reply.text
    answer: dict[str, Any] = reply.json()
    return answer


def enable_auth(url: str, user: str, password: str) -> None:
    """etcd's auth on, with `user` allowed to read and write /gemps/ only (and root, to enable it)."""
    for name, secret in (("root", "root-secret"), (user, password)):
        gateway(url, "auth/role/add", {"name": name})
        gateway(url, "auth/user/add", {"name": name, "password": secret})
        gateway(url, "auth/user/grant", {"user": name, "role": name})
    perm = {"permType": "READWRITE", "key": b64("/gemps/"), "range_end": b64("/gemps0")}
    gateway(url, "auth/role/grant", {"name": user, "perm": perm})
    gateway(url, "auth/enable", {})


def test_an_external_etcd_with_a_user_and_password(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """etcd's auth enabled: the replica authenticates as --etcd-user with GEMPS_ETCD_PASSWORD (or
    --etcd-password-file) and is elected; a wrong password, or none, is refused at start naming
    the options; a token etcd forgot is replaced without a word."""
    with etcd_server() as etcd:
        enable_auth(etcd.endpoint, "trainer", "s3cret")
        monkeypatch.setenv("GEMPS_ETCD_PASSWORD", "s3cret")
        trainer = EtcdAccess(user="trainer", password="s3cret")
        server = lone_replica(etcd.endpoint, "users", access=trainer, etcd_user="trainer")
        try:
            becomes_primary(server)
        finally:
            server.close()
        monkeypatch.delenv("GEMPS_ETCD_PASSWORD")
        wrong = tmp_path / "password"
        wrong.write_text("guess\n")
        with pytest.raises(RuntimeError, match=re.escape("etcd refused user 'trainer' (etcd_user, etcd_password")):
            lone_replica(etcd.endpoint, "users", etcd_user="trainer", etcd_password_file=str(wrong)).close()
        with pytest.raises(RuntimeError, match=re.escape("its auth is enabled: give etcd_user")):
            lone_replica(etcd.endpoint, "users").close()

        endpoints = EtcdEndpoints(etcd.endpoint, 2.0, EtcdAccess(user="trainer", password="s3cret"))
        try:
            endpoints.call("write", lambda client: client.put("/gemps/users/x", "1"))
            token = _token_of(endpoints)
            # Auth turned off and on again: etcd forgets every token it gave (as when they expire).
            root = gateway(etcd.endpoint, "auth/authenticate", {"name": "root", "password": "root-secret"})["token"]
            gateway(etcd.endpoint, "auth/disable", {}, token=str(root))
            gateway(etcd.endpoint, "auth/enable", {})
            assert refused(etcd.endpoint, token)
            assert endpoints.call("read", lambda client: client.get("/gemps/users/x")) == [b"1"]  # a new token
        finally:
            endpoints.close()


def _token_of(endpoints: EtcdEndpoints) -> str:
    """The token the endpoints' session holds (its auth's)."""
    auth = endpoints._clients[0].session.auth
    token = getattr(auth, "_token", "")
    assert token, "no token fetched"
    return str(token)


def refused(url: str, token: str) -> bool:
    """Whether etcd refuses `token` now."""
    reply = requests.post(f"{url}/v3/kv/range", json={"key": b64("/gemps/users/x")}, headers={"Authorization": token})
    return reply.status_code == 401


def test_local_etcd_restart_keeps_its_folder() -> None:
    """restart() after a crash: the same folder and endpoint; stop() then removes the folder."""
    with etcd_server(secure=True) as etcd:
        folder, endpoint = etcd.data_dir, etcd.endpoint
        os.kill(etcd.pid, signal.SIGKILL)
        wait_for(lambda: not etcd.running(), 10, "etcd dead")
        etcd.restart()
        assert etcd.running() and etcd.data_dir == folder and etcd.endpoint == endpoint
    assert folder is not None and not folder.exists()


def test_the_ray_drivers_private_etcd_is_started_again(caplog: pytest.LogCaptureFixture) -> None:
    """`gemps ray`'s driver watches its private etcd as the supervisor does: a dead one is started
    again on its data and endpoint at the driver's next look (no cluster needed for that part)."""
    pytest.importorskip("ray")
    from gemps_cli.ray_job import private_etcd

    from gemps_worker.on_ray import RayJob, RayJobOptions

    job = RayJob(RayJobOptions(replicas=2), start_etcd=private_etcd)
    etcd = private_etcd("127.0.0.1")
    job.etcd = etcd.start()  # as the job's start() does, at the address Ray knows the driver by
    try:
        folder, endpoint = etcd.data_dir, etcd.endpoint
        os.kill(etcd.pid, signal.SIGKILL)
        wait_for(lambda: not etcd.running(), 10, "etcd dead")
        with caplog.at_level(logging.WARNING, logger="gemps.ray"):
            job.watch_etcd()
        assert etcd.running() and etcd.data_dir == folder and etcd.endpoint == endpoint
        assert "the private etcd exited; starting it again" in caplog.text
    finally:
        etcd.stop()
