"""Running the replicas of one partition for a run of `gemps bench --replicas` (gemps_bench.replicas):
fresh servers each run, over loopback or each on a simulated host of its own, and the wait until
one is primary and every other one its backup, in sync and caught up.

R = 1 is a plain `gemps server`; R > 1 is R `gemps server --replicas R --replica-index r`
processes and an etcd that elects the primary (the layouts: gemps_bench.replicas).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gemps
from gemps_bench.cross_host import DATA_PORT, PORT
from gemps_bench.gemps_load import GempsClientFactory
from gemps_bench.loadgen import LoadPlan, run_load
from gemps_bench.replica_load import load_in, primary_first, recording, sent_bytes
from gemps_bench.replica_security import replica_security
from gemps_bench.results import LoadResult
from gemps_proto.status import BACKUP, PRIMARY
from gemps_server.replication import LocalEtcd, find_etcd
from gemps_worker.cluster import ServerProcess
from gemps_worker.processes import GEMPS_COMMAND
from gemps_worker.simulated_hosts import Host, SimulatedNetwork

REPLICATION_PORT = 52051  # each replica host's (between hosts every replica has its own address)
ETCD_PORT = 2379
SETTLE_TIMEOUT = 60.0  # seconds for an election and the backups' seeding
LEASE = 3.0  # --replica-lease: the default
REPLICA_TIMEOUT = 30.0  # --replica-timeout: long, so a backup slowed by a busy machine stays in sync


def replicated(targets: Sequence[str], timeout: float = SETTLE_TIMEOUT) -> int:
    """Wait until one of `targets` is primary and every other one its backup, in sync with no lag;
    the primary's index. TimeoutError (with what each said last) when not within `timeout`."""
    deadline = time.monotonic() + timeout
    last: list[str] = []
    while time.monotonic() < deadline:
        last = []
        roles: list[str] = []
        settled_backups = False
        for target in targets:
            try:
                with gemps.Client(target, timeout=5) as client:
                    replication = client.status().replication
            except Exception as error:  # not up yet
                roles.append("")
                last.append(f"{target}: {type(error).__name__}")
                continue
            roles.append("" if replication is None else replication.role)
            last.append(f"{target}: {replication}")
            if replication is not None and replication.role == PRIMARY:
                backups = replication.backups
                settled_backups = len(backups) == len(targets) - 1 and all(
                    b.in_sync and b.lag_commits == 0 for b in backups
                )
        if roles.count(PRIMARY) == 1 and roles.count(BACKUP) == len(targets) - 1 and settled_backups:
            return roles.index(PRIMARY)
        time.sleep(0.2)
    raise TimeoutError(f"no primary with every backup in sync within {timeout:g} s: {'; '.join(last)}")


def _replicated_in(host: Host, targets: Sequence[str]) -> int:
    """`replicated` from inside `host` (the driver cannot reach a simulated host's addresses)."""
    argv = [sys.executable, "-m", "gemps_bench.replica_servers", "--wait", "|".join(targets)]
    done = subprocess.run(host.command(argv), capture_output=True, text=True, timeout=SETTLE_TIMEOUT + 30)
    if done.returncode != 0:
        raise RuntimeError(f"the replicas did not settle: {done.stderr[-2000:]}")
    return int(done.stdout.split()[-1])


def _replica_options(replicas: int, index: int, etcd: str, job: str) -> dict[str, Any]:
    if replicas == 1:
        return {}
    return {
        "replicas": replicas, "replica_index": index, "etcd": etcd, "job": job,
        "replica_lease": LEASE, "replica_timeout": REPLICA_TIMEOUT,
    }  # fmt: skip


def _server_options(clients: int) -> dict[str, Any]:
    return {"rule": "gem", "metrics_port": -1, "log_level": "warning", "max_workers": max(256, clients)}


class LoopbackReplicas:
    """Every replica on this machine, etcd a private one (started on first need)."""

    def __init__(self, logs: Path, stack: contextlib.ExitStack) -> None:
        self.logs, self.stack = logs, stack
        self._etcd: LocalEtcd | None = None
        self.security = replica_security(logs / "security", tls=False)  # --tls: replaced by the bench

    def etcd(self) -> str:
        if self._etcd is None:
            self._etcd = self.stack.enter_context(LocalEtcd())
        return self._etcd.endpoint

    def etcd_access(self) -> dict[str, Any]:
        """The private etcd admits holders of the job's client certificate: its files, as options."""
        access = self._etcd.access if self._etcd is not None else None
        return {} if access is None else {"etcd_ca": access.ca, "etcd_cert": access.cert, "etcd_key": access.key}

    def measure(self, replicas: int, plan: LoadPlan, job: str, profile: Path | None = None) -> LoadResult:
        etcd = self.etcd() if replicas > 1 else ""
        access: dict[str, Any] = self.etcd_access() if replicas > 1 else {}
        with contextlib.ExitStack() as stack:
            servers = [
                stack.enter_context(
                    ServerProcess(
                        log_path=self.logs / f"{job}-r{index}.log",
                        replication_port=0,
                        **_server_options(plan.clients),
                        **_replica_options(replicas, index, etcd, job),
                        **access,
                        **self.security.server_options(replicas),
                    )
                )
                for index in range(replicas)
            ]
            targets = [server.target for server in servers]
            primary = replicated(targets) if replicas > 1 else 0
            pids = primary_first([server.pid for server in servers], primary)
            factory = GempsClientFactory("|".join(targets), plan.num_parameters)
            with recording(pids, plan, profile):
                return run_load("gemps", factory, plan, pids)


class CrossHostReplicas:
    """Replica hosts r0 .. r{R-1} (R: `replicas`, the most a run starts) on links of rate `link`,
    cabled to each other directly too; the workers' host (with etcd) on a link of the same rate:
    its traffic goes to the primary only."""

    def __init__(self, network: SimulatedNetwork, link: str, replicas: int, logs: Path) -> None:
        self.logs = logs
        self.hosts = [network.add_host(f"r{i}") for i in range(replicas)]
        self.clients = network.add_host("workers")
        pairs = [(a, b) for a in range(len(self.hosts)) for b in range(a + 1, len(self.hosts))]
        self.cables = [
            network.direct_cable(self.hosts[a], self.hosts[b], pair, link) for pair, (a, b) in enumerate(pairs)
        ]
        self._etcd: subprocess.Popen[bytes] | None = None
        self.etcd_data: Path | None = None
        self.security = replica_security(logs / "security", tls=False)  # --tls: replaced by the bench

    def close(self) -> None:
        """Stop etcd (if started) and remove its data."""
        if self._etcd is not None:
            self._etcd.kill()
            self._etcd.wait()
        if self.etcd_data is not None:
            shutil.rmtree(self.etcd_data, ignore_errors=True)

    def etcd(self) -> str:
        endpoint = f"http://{self.clients.address}:{ETCD_PORT}"
        if self._etcd is None:
            data = self.etcd_data = Path(
                tempfile.mkdtemp(prefix="gemps-bench-etcd-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
            )
            peer = "http://127.0.0.1:2380"
            argv = [
                find_etcd(), "--name=bench", f"--data-dir={data / 'data'}",
                f"--listen-client-urls={endpoint}", f"--advertise-client-urls={endpoint}",
                f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=bench={peer}", "--initial-cluster-state=new", "--log-level=error",
            ]  # fmt: skip
            self._etcd = self.clients.start(argv, log_path=self.logs / "etcd.log")
            probe = (
                "import sys, time, urllib.request\n"
                "for _ in range(200):\n"
                "    try:\n"
                f"        urllib.request.urlopen('{endpoint}/health', timeout=1).read(); sys.exit(0)\n"
                "    except OSError:\n"
                "        time.sleep(0.05)\n"
                "sys.exit(1)\n"
            )
            if subprocess.run(self.clients.command([sys.executable, "-c", probe])).returncode != 0:
                raise RuntimeError(f"etcd did not answer on {endpoint}: {(self.logs / 'etcd.log').read_text()[-1000:]}")
        return endpoint

    def measure(self, replicas: int, plan: LoadPlan, job: str, profile: Path | None = None) -> LoadResult:
        etcd = self.etcd() if replicas > 1 else ""
        with contextlib.ExitStack() as stack:
            servers = []
            for index in range(replicas):
                host = self.hosts[index]
                options: dict[str, Any] = {"host": host.address, "port": PORT, "data_port": DATA_PORT}
                options |= {"replication_port": REPLICATION_PORT} if replicas > 1 else {}
                server = ServerProcess(
                    log_path=self.logs / f"{job}-r{index}.log",
                    command=host.command(GEMPS_COMMAND),
                    **options,
                    **_server_options(plan.clients),
                    **_replica_options(replicas, index, etcd, job),
                    **self.security.server_options(replicas),
                )
                servers.append(stack.enter_context(server))
            targets = [f"{host.address}:{PORT}" for host in self.hosts[:replicas]]
            primary = _replicated_in(self.clients, targets) if replicas > 1 else 0
            pids = primary_first([server.pid for server in servers], primary)
            before = self.direct_bytes()
            with recording(pids, plan, profile):
                result = load_in(self.clients, "|".join(targets), plan, pids)
            # Over the whole load (warm-up and tail too): that the journal took the direct cables.
            result.extra["direct_cable_bytes"] = self.direct_bytes() - before
            return result

    def direct_bytes(self) -> int:
        """Bytes sent so far over the replicas' direct cables, both ends of each."""
        return sum(sent_bytes(host, device) for cable in self.cables for host, device in cable)


def main(argv: Sequence[str] | None = None) -> None:
    """Inside a simulated host: wait for the replicas to settle, print the primary's index."""
    parser = argparse.ArgumentParser(description="wait for replicas (run by gemps bench --replicas --link)")
    parser.add_argument("--wait", required=True, help="the replicas' targets, A|B")
    args = parser.parse_args(argv)
    print(replicated(args.wait.split("|")))


if __name__ == "__main__":
    main()
