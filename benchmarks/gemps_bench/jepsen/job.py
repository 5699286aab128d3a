"""One job of a trial: its replicas, each on a simulated host of its own, and its counting workers
(gemps_bench.jepsen.client) on the trial's workers host.

A trial runs job A; with a second job (issue 77, item 1) job B runs beside it, under another etcd
job name, on hosts, checkpoint disks and files of its own (named with its prefix), sharing etcd,
the token and the workers host. A worker's replica list may then end with one address of the
other job (`foreign`), as a stale list or a reused pod address would: never first, since a
worker's first registration trusts whoever answers as primary (the job's identity is fixed then:
DESIGN §3d, "One job, one θ"). A replica killed is started again as a fresh process on its host
(a machine rebooted, its disk kept: each replica host has a checkpoint directory of its own,
since the simulated hosts share one filesystem).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gemps_worker.cluster import ServerProcess
from gemps_worker.processes import GEMPS_COMMAND
from gemps_worker.simulated_hosts import Host, SimulatedNetwork

PORT, DATA_PORT, REPLICATION_PORT = 50051, 51051, 52051
LEASE, REPLICA_TIMEOUT = 2.0, 2.0  # --replica-lease, --replica-timeout (seconds)


@dataclass(frozen=True)
class Site:
    """What a trial's jobs share: the network, the folder of logs and data, every client's
    environment (the token's file named in it), the token's file, etcd's URL, the workers' host."""

    network: SimulatedNetwork
    folder: Path
    env: Mapping[str, str]
    token_file: Path
    etcd: str
    workers_host: Host

    def python(self, module: str, *args: str) -> list[str]:
        return [sys.executable, "-m", module, *args]

    def on_workers_host(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        command = self.workers_host.command(argv)
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=self.env)


class Job:
    """Job `name`'s `replicas` replicas (etcd job `etcd_job`) and workers; its hosts and files are
    named with `prefix` ("" for job A: a single-job trial's names, as before the second job)."""

    def __init__(self, site: Site, name: str, replicas: int, etcd_job: str, prefix: str = "") -> None:
        self.site, self.name, self.etcd_job, self.prefix = site, name, etcd_job, prefix
        self.replica_hosts = [site.network.add_host(f"{prefix}r{index}") for index in range(replicas)]
        self.servers: dict[str, ServerProcess] = {}
        self.incarnations: dict[str, int] = {}
        self.workers: list[subprocess.Popen[bytes]] = []

    @property
    def targets(self) -> list[str]:
        return [f"{host.address}:{PORT}" for host in self.replica_hosts]

    @property
    def target(self) -> str:
        return "|".join(self.targets)

    def host_of(self, target: str) -> Host | None:
        return next((host for host in self.replica_hosts if f"{host.address}:{PORT}" == target), None)

    def _file(self, name: str) -> Path:
        return self.site.folder / f"{self.prefix}{name}"

    # -- replicas --------------------------------------------------------------------------------

    def start_replica(self, index: int) -> ServerProcess:
        host = self.replica_hosts[index]
        incarnation = self.incarnations.get(host.name, -1) + 1
        self.incarnations[host.name] = incarnation
        server = ServerProcess(
            log_path=self.site.folder / f"{host.name}-{incarnation}.log",
            command=host.command(GEMPS_COMMAND),
            host=host.address, port=PORT, data_port=DATA_PORT, rule="downpour", num_shards=8,
            replicas=len(self.replica_hosts), replica_index=index, job=self.etcd_job, log_format="json",
            auth_token_file=str(self.site.token_file), checkpoint_dir=str(self.site.folder / f"{host.name}-disk"),
            etcd=self.site.etcd, metrics_port=-1,
            replication_port=REPLICATION_PORT, replica_lease=LEASE, replica_timeout=REPLICA_TIMEOUT,
        )  # fmt: skip
        self.servers[host.name] = server.start()
        return server

    def kill(self, host: Host) -> None:
        """The replica on `host` (every process there already SIGKILLed) reaped."""
        self.servers[host.name].kill()

    def restart(self, host: Host) -> None:
        self.servers[host.name].close()
        self.start_replica(self.replica_hosts.index(host))

    def settle(self, timeout: float = 60.0) -> None:
        """Wait until one replica is primary and every other its backup, in sync and caught up."""
        argv = self.site.python("gemps_bench.replica_servers", "--wait", self.target)
        done = self.site.on_workers_host(argv, timeout=timeout + 30)
        if done.returncode != 0:
            raise RuntimeError(f"job {self.name}'s replicas did not settle: {done.stderr[-2000:]}")

    # -- workers ---------------------------------------------------------------------------------

    def start_workers(self, count: int, parameters: int, foreign: str = "") -> None:
        """`count` counting workers, their replica list this job's replicas, then `foreign` if given."""
        target = "|".join(filter(None, [self.target, foreign]))
        for index in range(count):
            # Named: a worker registering while its job has no primary is refused by the other's
            # (seed 7 before: one registered there, its commits all in the other job's θ).
            argv = self.site.python("gemps_bench.jepsen.client", "--target", target, "--name", f"{self.prefix}w{index}",
                                    "--job", self.etcd_job,
                                    "--parameters", str(parameters), "--out", str(self._file(f"w{index}.json")),
                                    "--stop-file", str(self.site.folder / "stop"))  # fmt: skip
            env = {**self.site.env, "PYTHONUNBUFFERED": "1"}
            self.workers.append(self.site.workers_host.start(argv, log_path=self._file(f"w{index}.log"), env=env))

    def registered(self) -> bool:
        """Whether every worker has registered; RuntimeError when one ended before it did."""
        if all(self._file(f"w{index}.json.ready").exists() for index in range(len(self.workers))):
            return True
        if any(worker.poll() is not None for worker in self.workers):
            raise RuntimeError(f"a worker of job {self.name} ended before registering:\n{self.worker_logs()}")
        return False

    def worker_logs(self) -> str:
        return "\n".join(self._file(f"w{i}.log").read_text()[-800:] for i in range(len(self.workers)))

    def acknowledged_since(self, since: float) -> bool:
        """Whether every worker was acknowledged after `since` (a time.time())."""
        for index in range(len(self.workers)):
            try:
                if float(self._file(f"w{index}.json.ack").read_text()) <= since:
                    return False
            except (FileNotFoundError, ValueError):
                return False
        return True

    def wait_for_workers(self, deadline: float) -> list[dict[str, Any]]:
        """The workers' histories, once each ended (the stop file written); SIGTERM after `deadline`
        (a time.monotonic()): a commit still retrying ends its wait."""
        for worker in self.workers:
            try:
                worker.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.terminate()
                worker.wait(30)
        return [json.loads(self._file(f"w{i}.json").read_text()) for i in range(len(self.workers))]

    def observe(self) -> dict[str, Any] | None:
        """The primary's version and θ's range, or None when no primary answers."""
        argv = self.site.python("gemps_bench.jepsen.client", "--observe", "--target", self.target)
        done = self.site.on_workers_host(argv, 90)
        return json.loads(done.stdout) if done.returncode == 0 else None

    def logs(self) -> dict[str, str]:
        """Every replica's log files by host name, oldest incarnation first."""
        return {
            host.name: "".join(
                (self.site.folder / f"{host.name}-{n}.log").read_text(errors="replace")
                for n in range(self.incarnations.get(host.name, -1) + 1)
            )
            for host in self.replica_hosts
        }

    def close(self) -> None:
        for worker in self.workers:
            if worker.poll() is None:
                worker.kill()
        for server in self.servers.values():
            server.kill()
            server.close()
