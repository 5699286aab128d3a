"""Workers carry on through a failover under the same id, with their GEM state (issue 41, item 6).

A replica that is not primary answers every worker's call `not_primary`, before it looks the worker
up: a backup not seeded yet knows no worker, and its `unknown_worker` (or `not_initialized`) sent
every worker to register again under a new id, its m_i and s_i started over. Real etcd, real
replicas on real ports; raw data-plane frames and gRPC calls where the answer itself is the point.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

import gemps
from gemps_proto.reasons import METADATA_KEY, Reason
from gemps_proto.status import BACKUP, PRIMARY
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_server.replication.local_etcd import LocalEtcd
from gemps_worker.cluster import ServerProcess
from gemps_worker.processes import GEMPS_COMMAND
from gemps_worker.simulated_hosts import Host, SimulatedNetwork
from tests.data_plane_client import DataPlaneClient
from tests.helpers import free_port, replication_secret_file, scrape_series, wait_for
from tests.integration.conftest import StartServer, StartServerProcess, open_stub
from tests.integration.test_replica_faults import (
    DATA_PORT,
    ETCD_PORT,
    LEASE,
    PORT,
    REPLICATION_PORT,
    ReplicatedRun,
)
from tests.integration.test_replicas import PARAMETERS, replica_options, role_of, wait_replicated


def reason_of(error: grpc.RpcError) -> str:
    assert isinstance(error, grpc.Call)
    return next((str(value) for key, value in error.trailing_metadata() or () if key == METADATA_KEY), "")


def test_a_backup_answers_every_worker_call_not_primary_whoever_the_worker_is(
    start_server: StartServer, etcd: LocalEtcd
) -> None:
    """At a backup: a HELLO with a registered worker's ticket, or with a worker it does not know
    (as at a backup not seeded yet), is refused `not_primary` (it was accepted, and `unknown_worker`,
    which made the SDK register again); so are gRPC commits and pulls of an unknown worker."""
    servers = [start_server(rule="gem", **replica_options(etcd, index, "hello")) for index in range(2)]
    primary = wait_replicated(servers)
    backup = next(server for server in servers if server is not primary)
    with gemps.Client("|".join(server.target for server in servers), name="w") as client:
        client.register({"w": np.zeros(PARAMETERS, np.float32)})
        registration = client.registration
        assert registration is not None and registration.data_plane is not None
        wait_replicated(servers)  # the backup knows the worker
        with gemps.Client(backup.target, timeout=5) as observer:
            announced = observer.status().data_plane
        assert announced is not None
        for worker_id, ticket in ((registration.worker_id, registration.data_plane.ticket), ("nobody", b"x" * 32)):
            with DataPlaneClient(announced.port) as raw:
                refusal = raw.hello(worker_id, ticket).error
            assert refusal is not None, f"a backup accepted the HELLO of {worker_id}"
            assert (refusal.reason, refusal.code) == (Reason.NOT_PRIMARY.value, grpc.StatusCode.UNAVAILABLE.value[0])
    series = scrape_series(f"http://127.0.0.1:{backup.metrics_port}/metrics")
    counted = [v for k, v in series.items() if k.startswith('gemps_data_plane_refusals_total{reason="not_primary"')]
    assert counted == [2]  # counted as what they are (the backup's one series: its replica label)
    stub = open_stub(backup.target)
    for call in (
        lambda: stub.Pull(pb.PullRequest(worker_id="nobody", known_version=-1)),
        lambda: stub.Commit(pb.CommitRequest(worker_id="nobody", base_version=0)),
    ):
        with pytest.raises(grpc.RpcError) as refused:
            call()
        assert reason_of(refused.value) == Reason.NOT_PRIMARY.value


def under_replicated(observer: gemps.Client) -> bool:
    replication = observer.status().replication
    assert replication is not None
    return replication.under_replicated


def test_a_worker_whose_replica_restarted_under_it_keeps_its_id(
    start_server_process: StartServerProcess, etcd: LocalEtcd
) -> None:
    """The primary is SIGKILLed and restarted on its address (not seeded yet) before the worker's
    next commit: going round the replicas during the failover, the worker reaches it. Its HELLO
    was answered `unknown_worker` there, and the worker registered again under a new id (its GEM
    state started over; 3 runs of 3 on the previous code); now `not_primary`, and the worker goes
    on at the promoted backup under its id."""
    ports = [free_port(), free_port()]

    def start(index: int) -> ServerProcess:
        return start_server_process(**replica_options(etcd, index, "restarted", rule="gem", port=ports[index]))

    servers = [start(0), start(1)]
    targets = [server.target for server in servers]
    wait_for(lambda: sorted(role_of(t) for t in targets) == [BACKUP, PRIMARY], 30, "a primary and a backup")
    first = next(index for index in range(2) if role_of(targets[index]) == PRIMARY)
    with gemps.Client("|".join(targets), name="w", timeout=5) as client:
        client.register({"w": np.zeros(PARAMETERS, np.float32)})
        for _ in range(3):
            client.commit(np.ones(PARAMETERS, np.float32))
        registered = client.worker_id
        with gemps.Client(targets[first], timeout=5) as observer:
            wait_for(lambda: not under_replicated(observer), 30, "the backup in sync")
        os.kill(servers[first].pid, signal.SIGKILL)
        start(first)
        restarted = "the restarted replica answering, a backup"
        wait_for(lambda: role_of(targets[first]) == BACKUP, 30, restarted, tolerate=(gemps.GempsError,))
        client.commit(np.ones(PARAMETERS, np.float32))
        assert client.worker_id == registered
        with gemps.Client(targets[1 - first], timeout=5) as observer:
            status = observer.status()  # before the worker leaves
    assert status.replication is not None and status.replication.role == PRIMARY
    assert status.active_workers == 1  # nobody registered again


class TimeoutRun(ReplicatedRun):
    """test_replica_faults' run, its replicas under GEM with a --replica-timeout long enough that
    a backup cut off from its primary stays in sync for the whole test."""

    def start_replica(self, index: int, host: Host) -> ServerProcess:
        server = ServerProcess(
            log_path=self.folder / f"r{index}-{host.name}.log",
            command=host.command(GEMPS_COMMAND),
            host=host.address, port=PORT, data_port=DATA_PORT, rule="gem", replicas=2, replica_index=index,
            etcd=f"http://{self.etcd_host.address}:{ETCD_PORT}", job="resync", replication_port=REPLICATION_PORT,
            replica_lease=LEASE, replica_timeout=60.0, replication_secret_file=replication_secret_file(),
        )  # fmt: skip
        self.servers[host.name] = server.start()
        return server


class Driver:
    """A worker on the workers' host (tests/failover_driver.py), one command at a time."""

    def __init__(self, run: ReplicatedRun, name: str) -> None:
        argv = [sys.executable, "-m", "tests.failover_driver", "--target", run.target, "--name", name]
        self.process = subprocess.Popen(
            run.workers_host.command(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def send(self, command: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def reply(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line, f"the worker ended (exit status {self.process.poll()})"
        answered: dict[str, Any] = json.loads(line)
        return answered

    def call(self, command: str) -> dict[str, Any]:
        self.send(command)
        return self.reply()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.send("quit")
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def test_workers_keep_their_ids_and_resynchronise_when_the_new_primary_is_behind(
    network: SimulatedNetwork, tmp_path: Path
) -> None:
    """Worker x pulls a version the primary applied but could not acknowledge (its backup cut
    off), then the primary's machine dies: the backup, promoted, is a version behind what x holds.
    x's next commit was refused `base_version ... ahead` at every attempt; now the SDK pulls and
    commits again, under the same worker id (the new primary has x's registration and GEM state
    from the stream: no new registration). y, whose commit it was, died with it in doubt."""
    hosts = [network.add_host("r0"), network.add_host("r1")]
    run = TimeoutRun(network, tmp_path, network.add_host("e"), hosts, network.add_host("w"))
    run.start_etcd()
    for index, host in enumerate(hosts):
        run.start_replica(index, host)
    primary = run.primary()
    backup = next(host for host in hosts if host is not primary)
    x, y = Driver(run, "x"), Driver(run, "y")
    try:
        registered = {name: driver.call("register")["worker_id"] for name, driver in (("x", x), ("y", y))}
        for driver in (x, x, y):
            assert "error" not in driver.call("commit")
        run.primary()  # the backup caught up
        held = x.call("pull")["version"]
        network.cut_between(primary, backup)
        y.send("commit")  # applied by the primary, never acknowledged: its backup does not hear it
        wait_for(lambda: x.call("pull")["version"] == held + 1, 30, "x holding the unacknowledged version")
        y.process.kill()  # its commit, in doubt, is not retried at the new primary: it stays behind x
        network.cut(primary)
        primary.kill()
        network.heal_between(primary, backup)
        after = x.call("commit")
        assert "error" not in after, after
        assert after["worker_id"] == registered["x"]
        assert after["version"] == held + 1  # x's commit, on the new primary's θ (version held)
        status = x.call("status")
        assert status["role"] == PRIMARY, status
        assert status["active_workers"] == 2, status  # nobody registered again
        assert x.call("pull")["worker_id"] == registered["x"]
    finally:
        x.close()
        y.close()
