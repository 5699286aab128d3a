"""How long a replicated partition takes to fail over, and to take a restarted replica back, as the
model grows (`gemps bench --failover`; issue 79, item 2: "restart and failover time at 100M").

Per size: two replicas of one partition on this machine (an etcd of their own elects the primary),
every option at its default but what replication needs; one worker (the SDK, as a user's worker)
registers a model of that size and commits a pre-made gradient. Then the primary is killed
(SIGKILL: no goodbye), and the run times, from the kill:

- `promoted_s`: until the survivor's Status says it is primary (its lease had to run out);
- `resumed_s`: until the worker's next commit is acknowledged (the SDK retries it at the survivor);

and, once the killed replica is started again on its ports (an empty process: its θ comes from
the primary), `rejoined_s`: until it is the primary's backup, in sync with nothing to catch up
(seeded with θ and the worker's GEM state). `registered_s` (the worker's registration: θ sent to
the primary and replicated) and the commit's median round trip before the kill give the scale.
Every figure is one run's; the machine is shared, so they are wall-clock times, not ratios.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import gemps
from gemps_bench.loadgen import pre_made_gradient
from gemps_bench.replica_security import replica_security
from gemps_bench.replica_servers import replicated
from gemps_bench.suite import available_bytes, progress
from gemps_proto.status import PRIMARY
from gemps_server.replication import LocalEtcd
from gemps_worker.cluster import ServerProcess

JOB = "failover-bench"
COMMITS_BEFORE = 5  # commits acknowledged before the kill: the round trip's scale
# A replica's bytes at size P: θ, the one worker's GEM state (8 bytes a parameter), the pooled
# buffers; twice over (two replicas), and the worker's own (gradient, θ's copy).
BYTES_PER_PARAMETER = 2 * 28 + 16
SETTLE_TIMEOUT = 600.0  # seconds for an election, a registration or a seeding at the largest sizes


@dataclass(frozen=True)
class FailoverSpec:
    sizes: tuple[int, ...] = (1_000_000, 10_000_000, 100_000_000)

    def __post_init__(self) -> None:
        too_big = [size for size in self.sizes if size * BYTES_PER_PARAMETER > 0.6 * available_bytes()]
        if too_big:
            raise ValueError(
                f"sizes {', '.join(f'{size:,}' for size in too_big)} need more than 60 % of this host's "
                f"{available_bytes() / 2**30:.1f} GiB available (about {BYTES_PER_PARAMETER} bytes a parameter)"
            )


class _Pair:
    """Two replicas of one partition and the etcd that elects between them."""

    def __init__(self, stack: contextlib.ExitStack, logs: Path) -> None:
        self.stack, self.logs = stack, logs
        etcd = stack.enter_context(LocalEtcd())
        # One host's memory for both (as `gemps server --replicas 2` shares it): else the first one's
        # budget claims all of it, and the survivor of a failover admits no new worker.
        self.options: dict[str, Any] = {"replicas": 2, "etcd": etcd.endpoint, "job": JOB, "memory_share": 2}
        self.options |= {"metrics_port": -1}
        if etcd.access is not None:
            self.options |= {"etcd_ca": etcd.access.ca, "etcd_cert": etcd.access.cert, "etcd_key": etcd.access.key}
        self.options |= replica_security(logs / "security", tls=False).server_options(2)  # the job's secret
        self.servers = [self._start(index, {"replication_port": 0}) for index in range(2)]
        self.targets = [server.target for server in self.servers]

    def _start(self, index: int, ports: dict[str, Any], attempt: int = 0) -> ServerProcess:
        server = ServerProcess(
            log_path=self.logs / f"r{index}-{attempt}.log", replica_index=index, **self.options, **ports
        )
        return self.stack.enter_context(server)

    def kill(self, index: int) -> None:
        os.kill(self.servers[index].pid, signal.SIGKILL)

    def restart(self, index: int) -> None:
        """Start replica `index` again on the ports it had (the worker's list names them)."""
        ports = {"port": self.servers[index].port, "replication_port": 0}  # its peer finds it through etcd
        self.servers[index] = self._start(index, ports, attempt=1)


def _primary_in(target: str, deadline: float) -> float | None:
    """Seconds until `target`'s Status says primary (polled every 50 ms), None at the deadline."""
    began = time.monotonic()
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception), gemps.Client(target, timeout=5) as client:
            replication = client.status().replication
            if replication is not None and replication.role == PRIMARY:
                return time.monotonic() - began
        time.sleep(0.05)
    return None


def measure(size: int, logs: Path) -> dict[str, Any]:
    """One size's run (module docstring): its figures, seconds."""
    figures: dict[str, Any] = {"num_parameters": size}
    with contextlib.ExitStack() as stack:
        began = time.monotonic()
        pair = _Pair(stack, logs)
        primary = replicated(pair.targets, timeout=SETTLE_TIMEOUT)
        figures["settled_s"] = time.monotonic() - began
        client = stack.enter_context(gemps.Client("|".join(pair.targets), name="failover", job=JOB))
        began = time.monotonic()
        client.register({"theta": np.zeros(size, dtype=np.float32)})
        figures["registered_s"] = time.monotonic() - began
        gradient = pre_made_gradient(size, seed=0)
        round_trips = []
        for _ in range(COMMITS_BEFORE):
            began = time.monotonic()
            client.commit(gradient)
            round_trips.append(time.monotonic() - began)
        figures["commit_round_trip_s"] = statistics.median(round_trips)
        survivor = pair.targets[1 - primary]
        promoted: list[float | None] = []
        killed = time.monotonic()
        watch = threading.Thread(target=lambda: promoted.append(_primary_in(survivor, killed + SETTLE_TIMEOUT)))
        pair.kill(primary)
        watch.start()
        client.commit(gradient)
        figures["resumed_s"] = time.monotonic() - killed
        watch.join()
        figures["promoted_s"] = promoted[0]
        began = time.monotonic()
        pair.restart(primary)
        replicated(pair.targets, timeout=SETTLE_TIMEOUT)
        figures["rejoined_s"] = time.monotonic() - began
        client.commit(gradient)  # the pair serves on, the restarted replica its backup
    return figures


def run_failover(spec: FailoverSpec, out: Path) -> dict[str, Any]:
    """Every size of `spec`, smallest first; the results (also written to `out`, JSON, as they come)."""
    data: dict[str, Any] = {"mode": "failover", "host": {"cpus": os.cpu_count()}, "runs": []}
    for size in sorted(spec.sizes):
        logs = out.parent / "failover-logs" / f"{size}"  # the replicas' logs, kept: a failover's story
        shutil.rmtree(logs, ignore_errors=True)
        logs.mkdir(parents=True)
        figures = measure(size, logs)
        data["runs"].append(figures)
        out.write_text(json.dumps(data, indent=1) + "\n")
        progress(
            f"P={size:>11,}: registered {figures['registered_s']:.1f} s, failed over (commits resumed) in "
            f"{figures['resumed_s']:.1f} s, promoted in {figures['promoted_s']:.1f} s, "
            f"a restarted replica back in sync in {figures['rejoined_s']:.1f} s"
        )
    return data


def table(data: dict[str, Any]) -> list[str]:
    """The run as a markdown table, a row a size."""
    rows = [
        "| parameters | registration s | commit round trip s | primary killed: commits resumed s | survivor "
        "primary s | restarted replica in sync s |",
        "|---|---|---|---|---|---|",
    ]
    for run in data["runs"]:
        promoted = run["promoted_s"]
        rows.append(
            f"| {run['num_parameters']:,} | {run['registered_s']:.2f} | {run['commit_round_trip_s']:.3f} | "
            f"{run['resumed_s']:.2f} | {'-' if promoted is None else f'{promoted:.2f}'} | {run['rejoined_s']:.2f} |"
        )
    return rows
