"""What one load run measured, and the figures derived from it (shared by every system benchmarked)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


def jain_index(counts: Sequence[float]) -> float:
    """Jain's fairness index of per-client counts: 1 when all equal, 1/n when one client got everything."""
    values = np.asarray(counts, dtype=np.float64)
    if values.size == 0 or not values.any():
        return float("nan")
    return float(values.sum() ** 2 / (values.size * np.square(values).sum()))


def whole_count_ceiling(total: int, clients: int) -> float:
    """The highest Jain index whole per-client counts summing to `total` can reach: the fairest
    split gives some clients one commit more than the others. With a few commits per client in
    a window it is well below 1 (237 commits over 100 clients: 0.960), however fair the server."""
    if clients <= 0 or total <= 0:
        return float("nan")
    each, more = divmod(total, clients)
    return jain_index([each + 1] * more + [each] * (clients - more))


def share_in_window(began: float, done: float, begin: float, end: float) -> float:
    """How much of one round trip [began, done] lies inside the window [begin, end], from 0 to 1."""
    if done <= began:
        return 1.0 if begin <= done <= end else 0.0
    return max(0.0, min(done, end) - max(began, begin)) / (done - began)


@dataclass
class LoadResult:
    """One system under one load: `clients` concurrent clients committing P float32 parameters.

    Only commits that completed inside the measurement window (after warm-up) count.
    """

    system: str  # "gemps", "echo-unary", "echo-stream", "torch-rpc", "reference-p2p", ...
    num_parameters: int
    clients: int
    seconds: float  # length of the measurement window
    latencies: list[float]  # seconds per commit round trip, every commit in the window
    per_client_commits: list[int]  # commits each client completed in the window
    # The same, each round trip that straddles an edge of the window counted by its share inside:
    # what fairness is judged on (whole counts of a few commits each cannot all be equal).
    per_client_progress: list[float] | None = None
    server_peak_rss_bytes: int | None = None  # the serving process's peak resident memory
    # Of it, shared memory the clients attached and the server maps (theirs), at the window's end.
    server_shared_rss_bytes: int | None = None
    server_cpu_seconds: float | None = None  # CPU time the serving process used inside the window
    # The same for each of its child processes (a partitioned server's partitions), if any.
    server_child_cpu_seconds: list[float] | None = None
    staleness: list[int] | None = None  # per commit, where the system reports it
    client_cpu_seconds: float | None = None  # CPU time the client processes used inside the window
    # The most a client's process grew in resident memory from before its clients to its peak, per
    # client: what a worker holds for a model of this size (loadgen's client processes)
    client_peak_growth_bytes: int | None = None
    machine_busy_fraction: float | None = None  # of every core on the machine, busy inside the window
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def commits(self) -> int:
        return sum(self.per_client_commits)

    @property
    def commits_per_second(self) -> float:
        return self.commits / self.seconds if self.seconds > 0 else float("nan")

    def latency_percentile(self, q: float) -> float:
        return float(np.percentile(self.latencies, q)) if self.latencies else float("nan")

    @property
    def server_cpu_ms_per_commit(self) -> float:
        """The server's CPU milliseconds per commit: what a given load costs in cores."""
        if self.server_cpu_seconds is None or not self.commits:
            return float("nan")
        return 1e3 * self.server_cpu_seconds / self.commits

    @property
    def client_cpu_ms_per_commit(self) -> float:
        """The clients' CPU milliseconds per commit, all client processes together."""
        if self.client_cpu_seconds is None or not self.commits:
            return float("nan")
        return 1e3 * self.client_cpu_seconds / self.commits

    @property
    def busiest_child_cpu_ms_per_commit(self) -> float:
        """CPU milliseconds per commit of the busiest child process (a partition of θ): what one
        partition needs of its core per commit, so 1000 / this bounds the commits/s of K
        partitions that each have a core."""
        if not self.server_child_cpu_seconds or not self.commits:
            return float("nan")
        return 1e3 * max(self.server_child_cpu_seconds) / self.commits

    @property
    def fairness(self) -> float:
        """Jain's index of the clients' progress in the window (of whole commits where not recorded)."""
        return jain_index(self.per_client_progress or self.per_client_commits)

    @property
    def mean_staleness(self) -> float:
        return float(np.mean(self.staleness)) if self.staleness else float("nan")

    def summary(self) -> dict[str, Any]:
        """The derived figures (what tables and JSON report), without the raw samples."""
        return {
            "system": self.system,
            "num_parameters": self.num_parameters,
            "clients": self.clients,
            "seconds": self.seconds,
            "commits": self.commits,
            "commits_per_second": self.commits_per_second,
            "latency_p50_ms": 1e3 * self.latency_percentile(50),
            "latency_p99_ms": 1e3 * self.latency_percentile(99),
            "jain_index": self.fairness,
            "jain_index_whole_commits": jain_index(self.per_client_commits),
            "jain_index_whole_commits_ceiling": whole_count_ceiling(self.commits, self.clients),
            "mean_staleness": self.mean_staleness,
            "server_peak_rss_bytes": self.server_peak_rss_bytes,
            "server_shared_rss_bytes": self.server_shared_rss_bytes,
            "server_cpu_ms_per_commit": self.server_cpu_ms_per_commit,
            "client_cpu_ms_per_commit": self.client_cpu_ms_per_commit,
            "client_peak_growth_bytes": self.client_peak_growth_bytes,
            "busiest_partition_cpu_ms_per_commit": self.busiest_child_cpu_ms_per_commit,
            "machine_busy_fraction": self.machine_busy_fraction,
            "notes": self.notes,
            **self.extra,
        }
