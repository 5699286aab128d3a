"""One trial's machines on simulated hosts: etcd on host `e`, replica r on host `r<r>`, the workers
and the monitor on host `w`; and the faults of a plan (gemps_bench.jepsen.plan) applied to them.

Every fault returns its heal. A replica killed is started again as a fresh process on its host (a
machine rebooted, its disk kept: each replica host has a checkpoint directory of its own, since
the simulated hosts share one filesystem); etcd killed is started again on its data, etcd wiped
on an empty data directory. The job has a token (a 0600 file): the workers present it,
and replicas started alone prove themselves to each other with it (issue 41).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

from gemps_bench.jepsen.plan import SLOW_RATE
from gemps_server.replication import find_etcd
from gemps_worker.cluster import ServerProcess
from gemps_worker.processes import GEMPS_COMMAND
from gemps_worker.simulated_hosts import DEFAULT_RATE, INTERFACE, Host, SimulatedNetwork

PORT, DATA_PORT, REPLICATION_PORT, ETCD_PORT = 50051, 51051, 52051, 2379
LEASE, REPLICA_TIMEOUT = 2.0, 2.0  # --replica-lease, --replica-timeout (seconds)
#: seconds a fault waits at most for every replica's answer newer than its start (the monitor's period: 0.25 s)
FRESH_WAIT = 1.0
Heal = Callable[[], None]


class Rig:
    """The hosts of one trial, with `replicas` replicas of job `job`; logs and data go to `folder`."""

    def __init__(self, network: SimulatedNetwork, folder: Path, replicas: int, env: Mapping[str, str]) -> None:
        self.token_file = folder / "token"
        self.token_file.write_text(secrets.token_hex(16))
        self.token_file.chmod(0o600)
        self.network, self.folder = network, folder
        self.env = {**env, "GEMPS_AUTH_TOKEN_FILE": str(self.token_file)}  # every client here: workers, monitor
        self.etcd_host = network.add_host("e")
        self.replica_hosts = [network.add_host(f"r{index}") for index in range(replicas)]
        self.workers_host = network.add_host("w")
        self.servers: dict[str, ServerProcess] = {}
        self.incarnations: dict[str, int] = {}
        self.etcd_data = folder / "etcd-0"
        self.workers: list[subprocess.Popen[bytes]] = []
        self.monitor: subprocess.Popen[bytes] | None = None

    @property
    def targets(self) -> list[str]:
        return [f"{host.address}:{PORT}" for host in self.replica_hosts]

    @property
    def target(self) -> str:
        return "|".join(self.targets)

    def host_of(self, target: str) -> Host:
        return next(host for host in self.replica_hosts if f"{host.address}:{PORT}" == target)

    def python(self, module: str, *args: str) -> list[str]:
        return [sys.executable, "-m", module, *args]

    def on_workers_host(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        command = self.workers_host.command(argv)
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=self.env)

    # -- etcd ------------------------------------------------------------------------------------

    def start_etcd(self, wait: float = 30.0) -> None:
        url = f"http://{self.etcd_host.address}"
        argv = [find_etcd(), "--name=e", f"--data-dir={self.etcd_data}",
                f"--listen-client-urls={url}:{ETCD_PORT}", f"--advertise-client-urls={url}:{ETCD_PORT}",
                f"--listen-peer-urls={url}:2380", f"--initial-advertise-peer-urls={url}:2380",
                f"--initial-cluster=e={url}:2380", "--initial-cluster-state=new", "--log-level=error"]  # fmt: skip
        self.etcd_host.start(argv, log_path=self.folder / "etcd.log")
        probe = (
            "import sys, time, urllib.request\n"
            f"for _ in range({int(wait * 20)}):\n"
            "    try:\n"
            f"        urllib.request.urlopen('{url}:{ETCD_PORT}/health', timeout=1).read(); sys.exit(0)\n"
            "    except OSError:\n"
            "        time.sleep(0.05)\n"
            "sys.exit(1)\n"
        )
        if self.on_workers_host([sys.executable, "-c", probe], timeout=wait + 10).returncode != 0:
            raise RuntimeError(f"etcd did not answer: {(self.folder / 'etcd.log').read_text()[-1000:]}")

    def wipe_etcd(self) -> None:
        """etcd killed and started again empty: every key, lease and revision gone."""
        self.etcd_host.kill()
        self.etcd_data = self.folder / f"etcd-{len(list(self.folder.glob('etcd-*')))}"
        self.start_etcd()

    # -- replicas --------------------------------------------------------------------------------

    def start_replica(self, index: int) -> ServerProcess:
        host = self.replica_hosts[index]
        incarnation = self.incarnations.get(host.name, -1) + 1
        self.incarnations[host.name] = incarnation
        server = ServerProcess(
            log_path=self.folder / f"{host.name}-{incarnation}.log",
            command=host.command(GEMPS_COMMAND),
            host=host.address, port=PORT, data_port=DATA_PORT, rule="downpour", num_shards=8,
            replicas=len(self.replica_hosts), replica_index=index, job="jepsen", log_format="json",
            auth_token_file=str(self.token_file), checkpoint_dir=str(self.folder / f"{host.name}-disk"),
            etcd=f"http://{self.etcd_host.address}:{ETCD_PORT}", metrics_port=-1,
            replication_port=REPLICATION_PORT, replica_lease=LEASE, replica_timeout=REPLICA_TIMEOUT,
        )  # fmt: skip
        self.servers[host.name] = server.start()
        return server

    def settle(self, timeout: float = 60.0) -> None:
        """Wait until one replica is primary and every other its backup, in sync and caught up."""
        argv = self.python("gemps_bench.replica_servers", "--wait", self.target)
        done = self.on_workers_host(argv, timeout=timeout + 30)
        if done.returncode != 0:
            raise RuntimeError(f"the replicas did not settle: {done.stderr[-2000:]}")

    # -- workers and monitor -----------------------------------------------------------------------

    def start_monitor(self) -> None:
        out, stop = str(self.folder / "monitor.jsonl"), str(self.folder / "stop-monitor")
        argv = self.python("gemps_bench.jepsen.monitor", "--targets", self.target, "--out", out, "--stop-file", stop)
        self.monitor = self.workers_host.start(argv, log_path=self.folder / "monitor.log", env=self.env)

    def start_workers(self, count: int, parameters: int, timeout: float = 90.0) -> None:
        for index in range(count):
            argv = self.python("gemps_bench.jepsen.client", "--target", self.target, "--name", f"w{index}",
                               "--parameters", str(parameters), "--out", str(self.folder / f"w{index}.json"),
                               "--stop-file", str(self.folder / "stop"))  # fmt: skip
            log = self.folder / f"w{index}.log"
            self.workers.append(self.workers_host.start(argv, log_path=log, env={**self.env, "PYTHONUNBUFFERED": "1"}))
        deadline = time.monotonic() + timeout
        while not all((self.folder / f"w{index}.json.ready").exists() for index in range(count)):
            if time.monotonic() > deadline or any(worker.poll() is not None for worker in self.workers):
                logs = "\n".join((self.folder / f"w{i}.log").read_text()[-800:] for i in range(count))
                raise RuntimeError(f"the workers did not register:\n{logs}")
            time.sleep(0.1)

    def acknowledged_since(self, since: float) -> bool:
        """Whether every worker was acknowledged after `since` (a time.time())."""
        for index in range(len(self.workers)):
            try:
                if float((self.folder / f"w{index}.json.ack").read_text()) <= since:
                    return False
            except (FileNotFoundError, ValueError):
                return False
        return True

    def stop_workers(self, grace: float = 20.0) -> list[dict[str, Any]]:
        (self.folder / "stop").write_text("stop\n")
        deadline = time.monotonic() + grace
        for worker in self.workers:
            try:
                worker.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:  # a commit still retrying: SIGTERM ends its wait
                worker.terminate()
                worker.wait(30)
        return [json.loads((self.folder / f"w{i}.json").read_text()) for i in range(len(self.workers))]

    def stop_monitor(self) -> list[dict[str, Any]]:
        (self.folder / "stop-monitor").write_text("stop\n")
        if self.monitor is not None:
            self.monitor.wait(30)
        lines = (self.folder / "monitor.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def latest_views(self) -> dict[str, dict[str, Any] | None]:
        """The monitor's last line's views (every replica's, null when it does not answer)."""
        with contextlib.suppress(FileNotFoundError, IndexError, ValueError):
            views: dict[str, dict[str, Any] | None] = json.loads(
                (self.folder / "monitor.jsonl").read_text().splitlines()[-1]
            )["views"]
            return views
        return {}

    def fresh_views(
        self, after: float, silenced: Collection[str] = (), wait: float = FRESH_WAIT
    ) -> dict[str, dict[str, Any] | None]:
        """The monitor's views once every replica has answered since `after` (a time from
        time.time()) but those on the `silenced` hosts (under a fault), or after `wait` seconds: a
        view can be half a second old, and a replica promoted meanwhile shows as a candidate in it."""
        deadline = time.monotonic() + wait
        while True:
            views = self.latest_views()
            waited_for = [v for target, v in views.items() if self.host_of(target).name not in silenced]
            if all(v is None or v["at"] >= after for v in waited_for) or time.monotonic() >= deadline:
                return views
            time.sleep(0.05)

    def observe(self) -> dict[str, Any] | None:
        """The primary's version and θ's range, or None when no primary answers."""
        done = self.on_workers_host(self.python("gemps_bench.jepsen.client", "--observe", "--target", self.target), 90)
        return json.loads(done.stdout) if done.returncode == 0 else None

    # -- faults ----------------------------------------------------------------------------------

    def apply(self, kind: str, host: Host) -> Heal:
        """Start fault `kind` (a plan.MENU key) on `host`; returns its heal."""
        if kind == "kill":
            host.kill()
            if host is self.etcd_host:
                return self.start_etcd
            index = self.replica_hosts.index(host)
            self.servers[host.name].kill()
            return lambda: self._restart(index)
        if kind == "pause":
            pids = host.pids()
            _signal(pids, signal.SIGSTOP)
            return lambda: _signal(pids, signal.SIGCONT)
        if kind == "part":
            self.network.cut(host)
            return lambda: self.network.heal(host)
        if kind == "part-etcd":
            self.network.cut_between(host, self.etcd_host)
            return lambda: self.network.heal_between(host, self.etcd_host)
        if kind == "slow":
            self.shape(host, SLOW_RATE)
            return lambda: self.shape(host, DEFAULT_RATE)
        if kind == "wipe":
            self.wipe_etcd()
            return lambda: None
        raise ValueError(f"unknown fault {kind!r}")

    def _restart(self, index: int) -> None:
        self.servers[self.replica_hosts[index].name].close()
        self.start_replica(index)

    def shape(self, host: Host, rate: str) -> None:
        """Change `host`'s link (both ends) to `rate`."""
        for namespace, device in ((host.namespace, INTERFACE), (self.network.switch, host.switch_port)):
            _tc("ip", "netns", "exec", namespace, "tc", "qdisc", "change", "dev", device, "root", "tbf",
                "rate", rate, "burst", "1mb", "latency", "50ms")  # fmt: skip

    def logs(self) -> dict[str, str]:
        """Every replica's log files by host name, oldest incarnation first."""
        return {
            host.name: "".join(
                (self.folder / f"{host.name}-{n}.log").read_text(errors="replace")
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
        shutil.rmtree(self.etcd_data, ignore_errors=True)


def _signal(pids: list[int], number: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, number)


def _tc(*argv: str) -> None:
    done = subprocess.run(list(argv), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
