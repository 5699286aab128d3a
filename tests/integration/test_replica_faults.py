"""Replicated partitions between machines, Jepsen-style (issue 35): two replicas of one partition
on hosts of their own, etcd on a third, counting workers on a fourth (simulated hosts: network
namespaces cabled to one switch), and faults under them: the primary's machine dies, cables are
cut and healed.

The workers' commits count themselves (tests/counting_worker.py: updates of ones under
`downpour`), so the final primary's version is the number of commits applied, which must lie
between the commits acknowledged and those plus the ones that ended in doubt: nothing
acknowledged is lost, nothing applied twice, whichever replica acknowledged it. Needs root:
without it each test is skipped with one line. The figures are in docs/RELIABILITY.md.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gemps_proto.status import BACKUP, CANDIDATE, PRIMARY
from gemps_worker.cluster import ServerProcess
from gemps_worker.processes import GEMPS_COMMAND
from gemps_worker.simulated_hosts import Host, SimulatedNetwork
from tests.counting_fleet import CountingFleet
from tests.counting_worker import check_exactly_once, check_one_primary_per_epoch, resumed_after
from tests.helpers import replication_secret_file, wait_for

PORT, DATA_PORT, REPLICATION_PORT, ETCD_PORT = 50051, 51051, 52051, 2379
LEASE, TIMEOUT = 2.0, 2.0  # seconds: --replica-lease, --replica-timeout
#: what the tests hold training to: acknowledged again this long after a fault at most
RESUMES_WITHIN = 15.0


@dataclass
class ReplicatedRun:
    """Replicas 0 and 1 of one partition on hosts r0 and r1, etcd on host e, workers on host w."""

    network: SimulatedNetwork
    folder: Path
    etcd_host: Host
    replica_hosts: list[Host]
    workers_host: Host
    servers: dict[str, ServerProcess] = field(default_factory=dict)

    @property
    def target(self) -> str:
        return "|".join(f"{host.address}:{PORT}" for host in self.replica_hosts)

    def start_etcd(self) -> None:
        url = f"http://{self.etcd_host.address}"
        argv = ["etcd", "--name=e", f"--data-dir={self.folder / 'etcd'}",
                f"--listen-client-urls={url}:{ETCD_PORT}", f"--advertise-client-urls={url}:{ETCD_PORT}",
                f"--listen-peer-urls={url}:2380", f"--initial-advertise-peer-urls={url}:2380",
                f"--initial-cluster=e={url}:2380", "--initial-cluster-state=new", "--log-level=error"]  # fmt: skip
        self.etcd_host.start(argv, log_path=self.folder / "etcd.log")
        probe = f"import urllib.request; urllib.request.urlopen('{url}:{ETCD_PORT}/health', timeout=1)"
        wait_for(lambda: self.on_workers_host([sys.executable, "-c", probe]).returncode == 0, 30, "etcd on its host")

    def start_replica(self, index: int, host: Host) -> ServerProcess:
        server = ServerProcess(
            log_path=self.folder / f"r{index}-{host.name}.log",
            command=host.command(GEMPS_COMMAND),
            host=host.address, port=PORT, data_port=DATA_PORT, rule="downpour", num_shards=8,
            replicas=2, replica_index=index, etcd=f"http://{self.etcd_host.address}:{ETCD_PORT}", job="faults",
            replication_port=REPLICATION_PORT, replica_lease=LEASE, replica_timeout=TIMEOUT,
            replication_secret_file=replication_secret_file(),
        )  # fmt: skip
        self.servers[host.name] = server.start()
        return server

    def on_workers_host(self, argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.workers_host.command(argv), capture_output=True, text=True, timeout=timeout)

    def replication(self, host: Host) -> dict[str, Any]:
        """What the replica on `host` says of replication (role "" when it does not answer)."""
        argv = [sys.executable, "-m", "tests.counting_worker", "--replication", "--target", f"{host.address}:{PORT}"]
        answered = self.on_workers_host(argv, timeout=30)
        return json.loads(answered.stdout) if answered.returncode == 0 else {"role": ""}

    def primary(self) -> Host:
        """The replica host that is primary, once one is and the other is its in-sync backup."""
        found: list[Host] = []

        def settled() -> bool:
            views = {host.name: self.replication(host) for host in self.replica_hosts}
            primaries = [h for h in self.replica_hosts if views[h.name]["role"] == "primary"]
            if len(primaries) != 1:
                return False
            backups = views[primaries[0].name]["backups"]
            found[:] = primaries
            return len(backups) == 1 and backups[0]["in_sync"]

        wait_for(settled, 60, "a primary with its backup in sync", explain=self.logs)
        return found[0]

    @functools.cached_property
    def workers(self) -> CountingFleet:
        return CountingFleet(self.workers_host, self.folder, self.target)

    def start_workers(self, count: int, parameters: int = 20_000, timeout: float = 60.0) -> None:
        """`count` counting workers, each call's deadline `timeout` (the SDK's default: a dead
        server is noticed by keepalives, not by deadlines)."""
        self.workers.start(count, parameters=parameters, timeout=timeout).wait_registered(90, explain=self.logs)

    def finish(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Stop the workers; their records and what the primary applied."""
        return self.workers.finish()

    def logs(self) -> str:
        return "\n".join(f"== {path.name}\n{path.read_text()[-3000:]}" for path in sorted(self.folder.glob("*.log")))


def start_replicated(network: SimulatedNetwork, folder: Path) -> ReplicatedRun:
    hosts = [network.add_host("r0"), network.add_host("r1")]
    run = ReplicatedRun(network, folder, network.add_host("e"), hosts, network.add_host("w"))
    run.start_etcd()
    for index, host in enumerate(hosts):
        run.start_replica(index, host)
    return run


def other(run: ReplicatedRun, host: Host) -> Host:
    return next(h for h in run.replica_hosts if h is not host)


def test_the_primarys_machine_dying_loses_no_acknowledged_commit(network: SimulatedNetwork, tmp_path: Path) -> None:
    """8 workers commit; the primary's machine dies (cable gone, every process SIGKILLed: no FIN,
    no RST): the backup is promoted, every acknowledged commit is in its θ exactly once, and
    training resumes within RESUMES_WITHIN seconds."""
    run = start_replicated(network, tmp_path)
    primary = run.primary()
    run.start_workers(8)
    time.sleep(3.0)
    network.cut(primary)
    primary.kill()
    died = time.time()
    time.sleep(12.0)
    records, observed = run.finish()
    applied = check_exactly_once(records, observed)
    assert len(check_one_primary_per_epoch(records)) == 2  # the first primary's epoch, then the survivor's
    recovery = resumed_after(records, died)
    survivor = run.replication(other(run, primary))
    assert survivor["role"] == "primary", survivor
    print(f"primary's machine died: {applied[0]} applied, none lost or twice; resumed {recovery:.2f} s after")
    assert recovery < RESUMES_WITHIN


@pytest.mark.parametrize("alone", [False, True], ids=["cables", "links"])
def test_cuts_give_one_primary_per_epoch_and_the_old_primary_rejoins(
    network: SimulatedNetwork, tmp_path: Path, alone: bool
) -> None:
    """Primary and backup are parted, then healed; then the primary and etcd, then healed.

    - cables: the backup's cable is cut (the primary drops it and goes on alone), healed (re-seeded),
      then the primary's (cut off from etcd, its backup and its workers: the backup is promoted,
      the old primary stops acknowledging when its lease runs out), healed.
    - links, partitions of the network rather than of a machine (every host keeps its cable): the
      backup no longer hears the primary but still reaches etcd and the workers, and must not be
      promoted (the primary drops it from the in-sync set first); then the primary no longer hears
      etcd while its workers and backup still reach it: it answers them, but as a replica that is
      not primary, and the backup takes over.

    Either way the old primary rejoins as a backup and catches up, one replica acknowledges per
    epoch, nothing acknowledged is lost, nothing applied twice."""
    run = start_replicated(network, tmp_path)
    primary = run.primary()
    backup = other(run, primary)

    def part(host: Host, far: Host) -> Callable[[], None]:
        """Part `host` from `far` alone (links), or pull `host`'s cable (cables); returns the heal."""
        if alone:
            network.cut_between(host, far)
            return lambda: network.heal_between(host, far)
        network.cut(host)
        return lambda: network.heal(host)

    unreachable = ""  # the role run.replication reports for a replica it cannot reach
    run.start_workers(3)
    time.sleep(2.0)
    heal = part(backup, primary)
    apart = time.time()
    time.sleep(8.0)
    during = run.replication(primary)
    assert during["role"] == "primary" and not any(b["in_sync"] for b in during["backups"]), during
    assert run.replication(backup)["role"] == (BACKUP if alone else unreachable)  # never promoted
    heal()
    assert run.primary() is primary  # the backup re-seeded and in sync again; the primary never changed
    epoch = during["epoch"]
    heal = part(primary, run.etcd_host)
    cut = time.time()
    time.sleep(8.0)
    promoted, fenced = run.replication(backup), run.replication(primary)
    assert promoted["role"] == PRIMARY and promoted["epoch"] > epoch, promoted
    assert fenced["role"] == (CANDIDATE if alone else unreachable), fenced  # answers, not as primary
    heal()
    assert run.primary() is backup  # the old primary is its backup now, in sync
    time.sleep(2.0)
    records, observed = run.finish()
    applied = check_exactly_once(records, observed)
    epochs = check_one_primary_per_epoch(records)
    assert epochs == {str(epoch): [f"{primary.address}:{PORT}"], str(promoted["epoch"]): [f"{backup.address}:{PORT}"]}
    dropped, recovery = resumed_after(records, apart, until=cut), resumed_after(records, cut)
    print(
        f"{'links' if alone else 'cables'} cut and healed: {applied[0]} applied, none lost or twice; resumed "
        f"{dropped:.2f} s after primary and backup were parted (the backup dropped), {recovery:.2f} s after the "
        "primary and etcd were"
    )
    assert max(dropped, recovery) < RESUMES_WITHIN
