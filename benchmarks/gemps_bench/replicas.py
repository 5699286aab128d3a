"""The cost of replication (issue 35, DESIGN §3d): gemps with R replicas of its one partition
against R = 1, same clients, same rule (gem), in one run.

Each run starts fresh servers: R = 1 is a plain `gemps server`; R > 1 is R `gemps server
--replicas R --replica-index r` processes and an etcd that elects the primary. The clients get
every replica ("A|B") as a worker does, and the load starts once one replica is primary and every
other one is its backup, in sync and caught up. Runs alternate between the replica counts (1, 2,
2, 1, 1, 2, ...: drift on a shared machine falls on both), each repeated; a cell's figure is the
median over its repetitions, and "vs R=1" is the median of each repetition's own ratio.

Over loopback everything runs on this machine (etcd a private one: LocalEtcd). With a link rate
(`gemps bench --replicas 1,2 --link 1gbit`) each replica is a simulated host of its own, the
workers (and etcd) are a third; the replicas are also cabled to each other directly (a second
link each, at the same rate, routed for their addresses only), so a backup's journal stream has
a link of its own and the primary's cable carries only its workers' traffic, as with a
replication network between machines.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gemps
from gemps_bench.cross_host import DATA_PORT, LOAD_GRACE, PORT, CrossHostSpec, link_figures, rate_bits_per_second
from gemps_bench.gemps_load import GempsClientFactory
from gemps_bench.loadgen import LoadPlan, run_load
from gemps_bench.results import LoadResult
from gemps_bench.suite import FULL, QUICK, available_bytes, progress
from gemps_server.replication.local_etcd import LocalEtcd, find_etcd
from gemps_server.replication.status import BACKUP, PRIMARY
from gemps_worker.cluster import ServerProcess
from gemps_worker.processes import GEMPS_COMMAND
from gemps_worker.simulated_hosts import Host, SimulatedNetwork

REPLICATION_PORT = 52051  # each replica host's (between hosts every replica has its own address)
ETCD_PORT = 2379
SETTLE_TIMEOUT = 60.0  # seconds for an election and the backups' seeding
LEASE = 3.0  # --replica-lease: the default
REPLICA_TIMEOUT = 30.0  # --replica-timeout: long, so a backup slowed by a busy machine stays in sync


@dataclass(frozen=True)
class ReplicasSpec:
    replicas: tuple[int, ...] = (1, 2)
    sizes: tuple[int, ...] = (1_000_000, 10_000_000)
    clients: int = 8
    repeats: int = 4
    link: str | None = None  # a tc rate: between simulated hosts; None: over loopback
    quick: bool = False  # the quick suite's seconds per run (CI), else the full suite's
    # A folder: after each size's repetitions, one more run of the largest R (not counted) with
    # py-spy recording every replica's process, raw samples to PROFILE/replicas-R-P-ROLE.txt.
    profile: Path | None = None

    def __post_init__(self) -> None:
        if not self.replicas or min(self.replicas) < 1 or max(self.replicas) > 3:
            raise ValueError(f"replica counts must be 1..3: {self.replicas}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1: {self.repeats}")
        if self.link is not None:
            rate_bits_per_second(self.link)

    def seconds(self, size: int) -> tuple[float, float]:
        """Warm-up and window: the suite's; between hosts, the cross-host bench's (longer from 10M)."""
        if self.link is not None:
            return CrossHostSpec(self.link, quick=self.quick).seconds(size)
        return (QUICK if self.quick else FULL).seconds(size)

    def order(self, repeat: int) -> tuple[int, ...]:
        """The replica counts in repetition `repeat`'s order: as given, then reversed, and so on."""
        return self.replicas if repeat % 2 == 0 else self.replicas[::-1]

    @property
    def mode(self) -> str:
        return ("loopback" if self.link is None else f"cross-host {self.link}") + (" quick" if self.quick else "")


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
    argv = [sys.executable, "-m", "gemps_bench.replicas", "--wait", "|".join(targets)]
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

    def __init__(self, spec: ReplicasSpec, logs: Path, stack: contextlib.ExitStack) -> None:
        self.spec, self.logs, self.stack = spec, logs, stack
        self._etcd: LocalEtcd | None = None

    def etcd(self) -> str:
        if self._etcd is None:
            self._etcd = self.stack.enter_context(LocalEtcd())
        return self._etcd.endpoint

    def measure(self, replicas: int, plan: LoadPlan, job: str, profile: Path | None = None) -> LoadResult:
        etcd = self.etcd() if replicas > 1 else ""
        with contextlib.ExitStack() as stack:
            servers = [
                stack.enter_context(
                    ServerProcess(
                        log_path=self.logs / f"{job}-r{index}.log",
                        replication_port=0,
                        **_server_options(plan.clients),
                        **_replica_options(replicas, index, etcd, job),
                    )
                )
                for index in range(replicas)
            ]
            targets = [server.target for server in servers]
            primary = replicated(targets) if replicas > 1 else 0
            pids = _primary_first([server.pid for server in servers], primary)
            factory = GempsClientFactory("|".join(targets), plan.num_parameters)
            with _recording(pids, plan, profile):
                return run_load("gemps", factory, plan, pids)


class CrossHostReplicas:
    """Replica hosts r0 .. r{R-1} on links of the spec's rate, cabled to each other directly too;
    the workers' host (with etcd) on a link of the same rate: its traffic goes to the primary only."""

    def __init__(self, network: SimulatedNetwork, spec: ReplicasSpec, logs: Path) -> None:
        assert spec.link is not None
        self.spec, self.logs = spec, logs
        self.hosts = [network.add_host(f"r{i}") for i in range(max(spec.replicas))]
        self.clients = network.add_host("workers")
        pairs = [(a, b) for a in range(len(self.hosts)) for b in range(a + 1, len(self.hosts))]
        self.cables = [
            network.direct_cable(self.hosts[a], self.hosts[b], pair, spec.link) for pair, (a, b) in enumerate(pairs)
        ]
        self._etcd: subprocess.Popen[bytes] | None = None
        self.etcd_data: Path | None = None

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
                )
                servers.append(stack.enter_context(server))
            targets = [f"{host.address}:{PORT}" for host in self.hosts[:replicas]]
            primary = _replicated_in(self.clients, targets) if replicas > 1 else 0
            pids = _primary_first([server.pid for server in servers], primary)
            before = self.direct_bytes()
            with _recording(pids, plan, profile):
                result = _load_in(self.clients, "|".join(targets), plan, pids)
            # Over the whole load (warm-up and tail too): that the journal took the direct cables.
            result.extra["direct_cable_bytes"] = self.direct_bytes() - before
            return result

    def direct_bytes(self) -> int:
        """Bytes sent so far over the replicas' direct cables, both ends of each."""
        return sum(sent_bytes(host, device) for cable in self.cables for host, device in cable)


def sent_bytes(host: Host, device: str) -> int:
    """Bytes `device` inside `host` has sent."""
    found = subprocess.run(
        ["ip", "-n", host.namespace, "-s", "-j", "link", "show", "dev", device],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(json.loads(found.stdout)[0]["stats64"]["tx"]["bytes"])


def _load_in(host: Host, target: str, plan: LoadPlan, pids: Sequence[int]) -> LoadResult:
    """The cross-host bench's load process (gemps' clients) inside `host`."""
    argv = [
        *(sys.executable, "-m", "gemps_bench.cross_host", "--system", "gemps", "--target", target),
        *("--size", str(plan.num_parameters), "--clients", str(plan.clients)),
        *("--warmup", str(plan.warmup), "--window", str(plan.duration)),
        *("--server-pids", ",".join(str(pid) for pid in pids)),
    ]
    done = subprocess.run(
        host.command(argv), capture_output=True, text=True, timeout=plan.warmup + plan.duration + LOAD_GRACE
    )
    if done.returncode != 0:
        raise RuntimeError(f"the load process exited with {done.returncode}: {done.stderr[-2000:]}")
    return LoadResult(**json.loads(done.stdout.splitlines()[-1]))


@contextlib.contextmanager
def _recording(pids: Sequence[int], plan: LoadPlan, profile: Path | None) -> Iterator[None]:
    """With `profile` (a file name's stem): py-spy on each of `pids` (the primary first) for the
    load's warm-up and window, raw samples by thread to STEM-primary.txt, STEM-backup1.txt, ..."""
    if profile is None:
        yield
        return
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    seconds = str(max(1, int(plan.warmup + plan.duration)))
    recorders = []
    for index, pid in enumerate(pids):
        raw = profile.with_name(f"{profile.name}-{'primary' if index == 0 else f'backup{index}'}.txt")
        command = [spy, "record", "--pid", str(pid), "--duration", seconds, "--rate", "100"]
        command += ["--threads", "--native", "--format", "raw", "--output", str(raw)]
        recorders.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
    try:
        yield
    finally:
        for recorder in recorders:
            try:
                recorder.wait(timeout=30)
            except subprocess.TimeoutExpired:
                recorder.kill()
                recorder.wait()


def _primary_first(pids: list[int], primary: int) -> list[int]:
    return [pids[primary], *(pid for index, pid in enumerate(pids) if index != primary)]


def replica_figures(result: LoadResult, replicas: int) -> dict[str, Any]:
    """The primary's and the backups' CPU milliseconds per commit (the load measured each serving
    process as one entry of server_child_cpu_seconds, the primary first; with R = 1, the server)."""
    commits = result.commits
    if replicas == 1:
        primary = result.server_cpu_ms_per_commit
        backups: list[float] = []
    elif result.server_child_cpu_seconds and commits:
        primary, *rest = (1e3 * seconds / commits for seconds in result.server_child_cpu_seconds)
        backups = list(rest)
    else:
        primary, backups = math.nan, []
    return {
        "replicas": replicas,
        "primary_cpu_ms_per_commit": primary,
        "backup_cpu_ms_per_commit": max(backups) if backups else None,
    }


def _median(values: Sequence[float | None]) -> float:
    found = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return statistics.median(found) if found else math.nan


def summarize(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (P, R): medians over the repetitions of commits/s and of the primary's and backup's CPU
    per commit, and the ratio to R = 1: the median of each repetition's own ratio (its R run over
    the R = 1 run of the same repetition), with their least and greatest."""
    cells: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for run in runs:
        cells.setdefault((run["num_parameters"], run["replicas"]), []).append(run)
    rows = []
    for (size, replicas), found in sorted(cells.items()):
        single = {run["repeat"]: run for run in cells.get((size, 1), [])}
        ratios = [
            run["commits_per_second"] / single[run["repeat"]]["commits_per_second"]
            for run in found
            if run["repeat"] in single and single[run["repeat"]]["commits_per_second"] > 0
        ]
        rows.append(
            {
                "num_parameters": size,
                "replicas": replicas,
                "repeats": len(found),
                "commits_per_second": _median([run["commits_per_second"] for run in found]),
                "commits_per_second_each": [run["commits_per_second"] for run in found],
                "vs_single": statistics.median(ratios) if ratios else math.nan,
                "vs_single_range": [min(ratios), max(ratios)] if ratios else None,
                "primary_cpu_ms_per_commit": _median([run["primary_cpu_ms_per_commit"] for run in found]),
                "backup_cpu_ms_per_commit": _median([run["backup_cpu_ms_per_commit"] for run in found]),
                "client_cpu_ms_per_commit": _median([run["client_cpu_ms_per_commit"] for run in found]),
                "latency_p50_ms": _median([run["latency_p50_ms"] for run in found]),
                "machine_busy_fraction": _median([run.get("machine_busy_fraction") for run in found]),
            }
        )
    return rows


def run_replicas(spec: ReplicasSpec, out: Path) -> dict[str, Any]:
    """Every run of `spec`; the results (also written to `out`, JSON): each run, and the summary."""
    data: dict[str, Any] = {
        "mode": "replicas " + spec.mode,
        "rate": spec.link,
        "clients": spec.clients,
        "replica_counts": list(spec.replicas),
        "repeats": spec.repeats,
        "host": {"cpus": os.cpu_count(), "available_bytes": available_bytes(), "python": sys.version.split()[0]},
        "runs": [],
        "skipped": [],
        "summary": [],
    }
    logs = out.with_suffix(".logs")  # every server's log, kept: a slow run's story is in them
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    with contextlib.ExitStack() as stack:
        if spec.link is None:
            bench: LoopbackReplicas | CrossHostReplicas = LoopbackReplicas(spec, logs, stack)
        else:
            network = stack.enter_context(SimulatedNetwork(spec.link))
            bench = CrossHostReplicas(network, spec, logs)
            stack.callback(bench.close)
            progress(f"{len(bench.hosts)} replica hosts and the workers' host at {spec.link}, replicas cabled directly")
        for size in spec.sizes:
            warmup, window = spec.seconds(size)
            plan = LoadPlan(size, spec.clients, window, warmup)
            for repeat in range(spec.repeats):
                for replicas in spec.order(repeat):
                    _run_one(bench, spec, data, plan, replicas, repeat, logs)
                    data["summary"] = summarize(data["runs"])
                    _save(data, out)
            if spec.profile is not None:
                _profile(bench, spec.profile, data, plan, max(spec.replicas))
                _save(data, out)
    data["summary"] = summarize(data["runs"])
    _save(data, out)
    return data


def _run_one(
    bench: LoopbackReplicas | CrossHostReplicas,
    spec: ReplicasSpec,
    data: dict[str, Any],
    plan: LoadPlan,
    replicas: int,
    repeat: int,
    logs: Path,
) -> None:
    cell = {"system": "gemps", "replicas": replicas, "repeat": repeat}
    cell |= {"num_parameters": plan.num_parameters, "clients": plan.clients}
    job = f"bench-p{plan.num_parameters}-r{replicas}-{repeat}"
    try:
        result = bench.measure(replicas, plan, job)
    except Exception as error:  # a run failing is a finding, not a reason to lose the others
        progress(f"R={replicas} P={plan.num_parameters:,} #{repeat} failed: {error}")
        data["skipped"].append(cell | {"why": str(error), "log": _log_tail(logs, job)})
        return
    summary = result.summary() | replica_figures(result, replicas) | {"repeat": repeat}
    if spec.link is not None:
        summary |= link_figures("gemps", 1, result, spec.link)
    data["runs"].append(summary)
    backup = summary["backup_cpu_ms_per_commit"]
    progress(
        f"R={replicas} P={plan.num_parameters:>10,} #{repeat}: {summary['commits_per_second']:8.2f} commits/s, "
        f"primary {summary['primary_cpu_ms_per_commit']:.2f} ms/commit"
        + (f", backup {backup:.2f}" if backup is not None else "")
    )


def _profile(
    bench: LoopbackReplicas | CrossHostReplicas, folder: Path, data: dict[str, Any], plan: LoadPlan, replicas: int
) -> None:
    """One more run of `replicas` under py-spy (not counted: the sampling costs CPU)."""
    folder.mkdir(parents=True, exist_ok=True)
    stem = folder / f"replicas-{replicas}-{plan.num_parameters}"
    job = f"profile-p{plan.num_parameters}-r{replicas}"
    try:
        result = bench.measure(replicas, plan, job, profile=stem)
    except Exception as error:
        progress(f"profile R={replicas} P={plan.num_parameters:,} failed: {error}")
        return
    summary = result.summary() | replica_figures(result, replicas) | {"raw": str(stem) + "-*.txt"}
    data.setdefault("profiled", []).append(summary)
    progress(
        f"profiled R={replicas} P={plan.num_parameters:,}: {summary['commits_per_second']:.2f} commits/s, {stem}-*.txt"
    )


def _log_tail(logs: Path, job: str) -> str:
    tails = [f"{path.name}: {path.read_text(errors='replace')[-600:]}" for path in sorted(logs.glob(f"{job}-*.log"))]
    return "\n".join(tails)


def _save(data: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=float) + "\n")


def main(argv: Sequence[str] | None = None) -> None:
    """Inside a simulated host: wait for the replicas to settle, print the primary's index."""
    parser = argparse.ArgumentParser(description="wait for replicas (run by gemps bench --replicas --link)")
    parser.add_argument("--wait", required=True, help="the replicas' targets, A|B")
    args = parser.parse_args(argv)
    print(replicated(args.wait.split("|")))


if __name__ == "__main__":
    main()
