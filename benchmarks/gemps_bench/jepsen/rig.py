"""One trial's machines on simulated hosts: etcd on host `e`, each job's replicas on hosts of their
own (gemps_bench.jepsen.job: job A's replica r on host `r<r>`, a second job's on `b-r<r>`), every
worker and the monitor on host `w`; and the faults of a plan (gemps_bench.jepsen.plan) applied to them.

Every fault returns its heal. A replica killed is started again by its job; etcd killed is
started again on its data, etcd wiped on an empty data directory. Both jobs share one token (a
0600 file): the workers present it, and replicas started alone prove themselves to each other with
it (issue 41). One token is what lets a worker of one job reach the other's servers at all, as in
one cluster of one team: with a token per job the other job's server would refuse it before
anything names a job.
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

from gemps_bench.jepsen.job import Job, Site
from gemps_bench.jepsen.plan import FIRST_JOB, SLOW_RATE
from gemps_server.replication import find_etcd
from gemps_worker.simulated_hosts import DEFAULT_RATE, INTERFACE, Host, SimulatedNetwork

ETCD_PORT = 2379
#: seconds a fault waits at most for every replica's answer newer than its start (the monitor's period: 0.25 s)
FRESH_WAIT = 1.0
#: each job's name in etcd and its hosts' and files' prefix
JOB_NAMES = {FIRST_JOB: ("jepsen", "")}
Heal = Callable[[], None]
Views = dict[str, dict[str, Any] | None]


class Rig:
    """The hosts of one trial: etcd, the workers' host, and the jobs added (`add_job`); logs and
    data go to `folder`."""

    def __init__(self, network: SimulatedNetwork, folder: Path, env: Mapping[str, str]) -> None:
        token_file = folder / "token"
        token_file.write_text(secrets.token_hex(16))
        token_file.chmod(0o600)
        self.network, self.folder = network, folder
        self.etcd_host = network.add_host("e")
        self.workers_host = network.add_host("w")
        env = {**env, "GEMPS_AUTH_TOKEN_FILE": str(token_file)}  # every client here: workers, monitor
        etcd = f"http://{self.etcd_host.address}:{ETCD_PORT}"
        self.site = Site(network, folder, env, token_file, etcd, self.workers_host)
        self.jobs: dict[str, Job] = {}
        self.etcd_data = folder / "etcd-0"
        self.monitor: subprocess.Popen[bytes] | None = None

    def add_job(self, name: str, replicas: int) -> Job:
        """Job `name` (FIRST_JOB: "jepsen" in etcd, hosts r0...; another: "jepsen-<name>", hosts <name>-r0...)."""
        etcd_job, prefix = JOB_NAMES.get(name, (f"jepsen-{name.lower()}", f"{name.lower()}-"))
        self.jobs[name] = job = Job(self.site, name, replicas, etcd_job, prefix)
        return job

    @property
    def targets(self) -> list[str]:
        """Every job's replicas."""
        return [target for job in self.jobs.values() for target in job.targets]

    def host_of(self, target: str) -> Host:
        return next(host for job in self.jobs.values() if (host := job.host_of(target)) is not None)

    def job_of(self, host: Host) -> Job:
        return next(job for job in self.jobs.values() if host in job.replica_hosts)

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
        if self.site.on_workers_host([sys.executable, "-c", probe], timeout=wait + 10).returncode != 0:
            raise RuntimeError(f"etcd did not answer: {(self.folder / 'etcd.log').read_text()[-1000:]}")

    def wipe_etcd(self) -> None:
        """etcd killed and started again empty: every key, lease and revision gone."""
        self.etcd_host.kill()
        self.etcd_data = self.folder / f"etcd-{len(list(self.folder.glob('etcd-*')))}"
        self.start_etcd()

    # -- workers and monitor -----------------------------------------------------------------------

    def start_monitor(self) -> None:
        """One monitor of every job's replicas (fewer processes than one per job)."""
        out, stop = str(self.folder / "monitor.jsonl"), str(self.folder / "stop-monitor")
        targets = "|".join(self.targets)
        argv = self.site.python("gemps_bench.jepsen.monitor", "--targets", targets, "--out", out, "--stop-file", stop)
        self.monitor = self.workers_host.start(argv, log_path=self.folder / "monitor.log", env=self.site.env)

    def start_workers(self, counts: Mapping[str, int], parameters: int, timeout: float = 90.0) -> None:
        """`counts[name]` counting workers of each job; with two jobs each one's replica list ends
        with the other job's primary (as the monitor shows it now): the address a failover's
        worker would find answering PRIMARY."""
        foreign = {name: self.other_primary(name) for name in self.jobs} if len(self.jobs) > 1 else {}
        for name, job in self.jobs.items():
            job.start_workers(counts[name], parameters, foreign.get(name, ""))
        deadline = time.monotonic() + timeout
        while not all(job.registered() for job in self.jobs.values()):
            if time.monotonic() > deadline:
                logs = "\n".join(job.worker_logs() for job in self.jobs.values())
                raise RuntimeError(f"the workers did not register:\n{logs}")
            time.sleep(0.1)

    def other_primary(self, name: str, wait: float = 30.0) -> str:
        """The primary of a job other than `name`, once the monitor shows one (within `wait` s)."""
        others = [target for other, job in self.jobs.items() if other != name for target in job.targets]
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            views = self.latest_views()
            primaries = sorted((v["epoch"], t) for t in others if (v := views.get(t)) and v.get("role") == "primary")
            if primaries:
                return primaries[-1][1]
            time.sleep(0.1)
        raise RuntimeError(f"no primary of a job other than {name} within {wait} s: {self.latest_views()}")

    def acknowledged_since(self, since: float) -> bool:
        """Whether every worker of every job was acknowledged after `since` (a time.time())."""
        return all(job.acknowledged_since(since) for job in self.jobs.values())

    def stop_workers(self, grace: float = 20.0) -> dict[str, list[dict[str, Any]]]:
        """Every job's workers' histories, by job."""
        (self.folder / "stop").write_text("stop\n")
        deadline = time.monotonic() + grace
        return {name: job.wait_for_workers(deadline) for name, job in self.jobs.items()}

    def stop_monitor(self) -> list[dict[str, Any]]:
        (self.folder / "stop-monitor").write_text("stop\n")
        if self.monitor is not None:
            self.monitor.wait(30)
        lines = (self.folder / "monitor.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def latest_views(self, job: str | None = None) -> Views:
        """The monitor's last line's views (every replica's, or job `job`'s; null when it does not answer)."""
        with contextlib.suppress(FileNotFoundError, IndexError, ValueError):
            views: Views = json.loads((self.folder / "monitor.jsonl").read_text().splitlines()[-1])["views"]
            return views if job is None else only(views, self.jobs[job].targets)
        return {}

    def fresh_views(self, job: str, after: float, silenced: Collection[str] = (), wait: float = FRESH_WAIT) -> Views:
        """Job `job`'s views once each of its replicas has answered since `after` (a time from
        time.time()) but those on the `silenced` hosts (under a fault), or after `wait` seconds: a
        view can be half a second old, and a replica promoted meanwhile shows as a candidate in it."""
        deadline = time.monotonic() + wait
        while True:
            views = self.latest_views(job)
            waited_for = [v for target, v in views.items() if self.host_of(target).name not in silenced]
            if all(v is None or v["at"] >= after for v in waited_for) or time.monotonic() >= deadline:
                return views
            time.sleep(0.05)

    # -- faults ----------------------------------------------------------------------------------

    def apply(self, kind: str, host: Host) -> Heal:
        """Start fault `kind` (a plan.MENU key) on `host`; returns its heal."""
        if kind == "kill":
            host.kill()
            if host is self.etcd_host:
                return self.start_etcd
            job = self.job_of(host)
            job.kill(host)
            return lambda: job.restart(host)
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

    def shape(self, host: Host, rate: str) -> None:
        """Change `host`'s link (both ends) to `rate`."""
        for namespace, device in ((host.namespace, INTERFACE), (self.network.switch, host.switch_port)):
            _tc("ip", "netns", "exec", namespace, "tc", "qdisc", "change", "dev", device, "root", "tbf",
                "rate", rate, "burst", "1mb", "latency", "50ms")  # fmt: skip

    def close(self) -> None:
        for job in self.jobs.values():
            job.close()
        shutil.rmtree(self.etcd_data, ignore_errors=True)


def only(views: Mapping[str, dict[str, Any] | None], targets: Collection[str]) -> Views:
    """The views of `targets` alone (one job's replicas)."""
    return {target: view for target, view in views.items() if target in targets}


def _signal(pids: list[int], number: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, number)


def _tc(*argv: str) -> None:
    done = subprocess.run(list(argv), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
