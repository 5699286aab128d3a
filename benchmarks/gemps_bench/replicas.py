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

Here: the spec and its runs in order, their results written as they come. The servers of a run
and the wait for them to settle: gemps_bench.replica_servers; the load on them and what it
measures beside: gemps_bench.replica_load; each run's figures and their summary:
gemps_bench.replica_figures.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gemps_bench.cross_host import CrossHostSpec, link_figures
from gemps_bench.loadgen import LoadPlan
from gemps_bench.replica_figures import replica_figures, summarize
from gemps_bench.replica_security import replica_security
from gemps_bench.replica_servers import CrossHostReplicas, LoopbackReplicas
from gemps_bench.suite import FULL, QUICK, available_bytes, progress
from gemps_worker.simulated_hosts import SimulatedNetwork, rate_bits_per_second


@dataclass(frozen=True)
class ReplicasSpec:
    replicas: tuple[int, ...] = (1, 2)
    sizes: tuple[int, ...] = (1_000_000, 10_000_000)
    clients: int = 8
    repeats: int = 4
    link: str | None = None  # a tc rate: between simulated hosts; None: over loopback
    quick: bool = False  # the quick suite's seconds per run (CI), else the full suite's
    # Every server and client on TLS (mutual: one CA), the replication stream inside it too.
    tls: bool = False
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
        where = "loopback" if self.link is None else f"cross-host {self.link}"
        return where + (" tls" if self.tls else "") + (" quick" if self.quick else "")


def run_replicas(spec: ReplicasSpec, out: Path) -> dict[str, Any]:
    """Every run of `spec`; the results (also written to `out`, JSON): each run, and the summary."""
    data: dict[str, Any] = {
        "mode": "replicas " + spec.mode,
        "rate": spec.link,
        "tls": spec.tls,
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
            bench: LoopbackReplicas | CrossHostReplicas = LoopbackReplicas(logs, stack)
        else:
            network = stack.enter_context(SimulatedNetwork(spec.link))
            bench = CrossHostReplicas(network, spec.link, max(spec.replicas), logs)
            stack.callback(bench.close)
            progress(f"{len(bench.hosts)} replica hosts and the workers' host at {spec.link}, replicas cabled directly")
        if spec.tls:
            addresses = ["127.0.0.1", *(host.address for host in getattr(bench, "hosts", ()))]
            bench.security = replica_security(logs / "security", True, addresses)
        stack.enter_context(bench.security.clients())
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
