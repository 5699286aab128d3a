"""What a job needs from gemps, projected from measured per-commit costs (`gemps plan`, issue 79).

Sans-IO: a `Job` and a `Calibration` in, a `Plan` out; nothing here runs or reads anything. The
calibration is `gemps bench` cells (CPU per commit against the parameters a process handles, peak
memory against the parameters it holds) joined by straight segments, made by `fit` from a
results.json; the default one is this project's run written down in docs/PERFORMANCE.md ("The
cost of a commit as the model grows").

The model, per commit of a job of N parameters over K partitions (each a process with a core):
- the busiest partition spends s(N/K) of CPU, a worker c(N), each a measured curve; a commit holds
  its partition h(N/K) >= s(N/K): over TCP the partition also waits for the worker's side of the
  exchange (at 100M on loopback a third longer than its CPU), measured as the bench's latency
  per client where its clients queue there;
- the bytes are N times the encoding's bytes per value each way, split over the K partitions;
- a worker's cycle is its H local steps (H·S) plus the commit's time: its own CPU and the
  partition's (or the hold, where longer), the bytes over its link up and down (no overlap of the
  steps and the commit: a bound on the waiting);
- commits/s is the least of what the workers offer (W per cycle), what the busiest partition
  applies (one commit per hold), what each partition's link carries (each direction its own: a
  commit's bytes up, the reply's down) and, on loopback (no --link: every process on one host, as
  `gemps bench` runs), what the host's cores do for servers and clients.
That closed-loop minimum overstates commits/s near the knee, where workers queue at the server.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

#: bytes a value takes on the wire: int8 and int4 codes carry a float32 scale per 256 values
ENCODING_BYTES = {"float32": 4.0, "bfloat16": 2.0, "int8": 1.0 + 4 / 256, "int4": 0.5 + 4 / 256}
#: a worker's GEM state on the server, bytes per parameter (DESIGN §1a): m_i and s_i in float32, or
#: 8-bit codes with their scales; DOWNPOUR keeps none
STATE_BYTES_PER_WORKER = {"gem": 8.0, "gem-compact": 2.25, "downpour": 0.0}
#: the compact state's two copies of θ that its workers share, bytes per parameter
SHARED_STATE_BYTES = {"gem": 0.0, "gem-compact": 8.0, "downpour": 0.0}
RULES = tuple(STATE_BYTES_PER_WORKER)
TARGET_WAIT = 0.1  # local steps are chosen so that a worker waits at most this share of its time
HEADROOM = 1.25  # the partitions apply at least this many times what the workers offer
MAX_LOCAL_STEPS = 64
MAX_PARTITIONS = 64


@dataclass(frozen=True)
class Curve:
    """A cost measured at some sizes (parameters -> seconds or bytes): straight between them, and
    past either end along the nearest segment; one point alone scales with the size. Measured
    costs are not straight lines: int8 codes cost 8.9 ns a parameter at 1M and 18 at 100M."""

    points: tuple[tuple[float, float], ...]  # (parameters, cost), by parameters

    @classmethod
    def line(cls, fixed: float, per_parameter: float) -> Curve:
        return cls(((0.0, fixed), (1.0, fixed + per_parameter)))

    def at(self, parameters: float) -> float:
        if len(self.points) == 1:
            size, cost = self.points[0]
            return cost * parameters / size
        sizes = [size for size, _ in self.points]
        right = min(max(bisect.bisect_left(sizes, parameters), 1), len(sizes) - 1)
        (x0, y0), (x1, y1) = self.points[right - 1], self.points[right]
        return max(0.0, y0 + (y1 - y0) * (parameters - x0) / (x1 - x0))


@dataclass(frozen=True)
class PathCost:
    """One commit path's measured costs: a rule with its state, an encoding."""

    server_cpu: Curve  # seconds of one partition's CPU per commit, by the parameters it holds
    client_cpu: Curve  # seconds of a worker's CPU per commit (its SDK: codes, copies, sockets)
    server_memory: Curve  # bytes a partition holds beyond its workers' state, by its parameters
    # seconds a commit holds its partition, by the parameters it holds: at least its CPU; over TCP
    # also the partition's waits for the worker's side of the exchange, which its CPU leaves out
    server_hold: Curve | None = None  # None: its CPU


@dataclass(frozen=True)
class Calibration:
    """Costs by path name, "RULE/ENCODING" through shared memory, "RULE/ENCODING+tcp" over TCP
    (e.g. "gem/float32", "downpour/int8+tcp"), and where they were measured."""

    paths: Mapping[str, PathCost]
    source: str

    def path(self, rule: str, encoding: str, *, tcp: bool) -> str:
        """The measured path nearest to this one: itself, else the encoding under GEM (codes cost
        more CPU than any rule: int8 both ways is 4-9x float32's), else the rule's float32, else
        GEM's (the encoding's bytes still count; its codes' CPU is then not); each over TCP
        ("+tcp": between hosts) where that was measured, else through shared memory."""
        names = (f"{rule}/{encoding}", f"gem/{encoding}", f"{rule}/float32", "gem/float32")
        ways = [way for name in names for way in ((f"{name}+tcp", name) if tcp else (name,))]
        for way in ways:
            if way in self.paths:
                return way
        raise ValueError(f"the calibration ({self.source}) measured none of gem/float32, {rule}/{encoding}")


@dataclass(frozen=True)
class Job:
    parameters: int
    workers: int
    step_seconds: float = 0.0  # a worker's time per local step (0: workers that only commit)
    link_bytes_per_second: float | None = None  # every host's link; None: loopback, one host
    worker_link_bytes_per_second: float | None = None  # a worker's host's link, where not the same
    rule: str = "gem"
    encoding: str = "float32"
    partitions: int | None = None  # None: the fewest that keep up, up to MAX_PARTITIONS
    local_steps: int | None = None  # None: the fewest that keep the wait under TARGET_WAIT
    host_cores: int = 2  # on loopback: the cores servers and workers share
    shared_memory: bool | None = None  # None: on one host (no link) through shared memory, else TCP

    def problems(self) -> list[str]:
        found = []
        if self.parameters < 1:
            found.append(f"--params must be at least 1, not {self.parameters}")
        if self.workers < 1:
            found.append(f"--workers must be at least 1, not {self.workers}")
        if not (self.step_seconds >= 0 and math.isfinite(self.step_seconds)):
            found.append(f"--step-seconds must be a finite number >= 0, not {self.step_seconds}")
        if self.link_bytes_per_second is not None and not self.link_bytes_per_second > 0:
            found.append(f"--link must be a positive rate, not {self.link_bytes_per_second}")
        if self.worker_link_bytes_per_second is not None and not (
            self.worker_link_bytes_per_second > 0 and self.link_bytes_per_second is not None
        ):
            found.append(
                f"--worker-link must be a positive rate, given with --link, not {self.worker_link_bytes_per_second}"
            )
        if self.rule not in RULES:
            found.append(f"--rule must be one of {', '.join(RULES)}, not {self.rule!r}")
        if self.encoding not in ENCODING_BYTES:
            found.append(f"--encoding must be one of {', '.join(ENCODING_BYTES)}, not {self.encoding!r}")
        if self.partitions is not None and not 1 <= self.partitions <= MAX_PARTITIONS:
            found.append(f"--partitions must be within 1-{MAX_PARTITIONS}, not {self.partitions}")
        if self.local_steps is not None and not 1 <= self.local_steps <= MAX_LOCAL_STEPS:
            found.append(f"--local-steps must be within 1-{MAX_LOCAL_STEPS}, not {self.local_steps}")
        if self.host_cores < 1:
            found.append(f"--host-cores must be at least 1, not {self.host_cores}")
        return found


@dataclass(frozen=True)
class Plan:
    partitions: int
    local_steps: int
    server_cores: int
    server_memory_bytes: int  # all partitions together
    commits_per_s: float
    # Between hosts, the same where the workers' transfers fall into step (all upload, then all
    # download: each direction's link shared by every commit, then idle while the other is busy):
    # measured so from 10M up with workers that only commit (docs/guides/sizing.md); on one host
    # the same as commits_per_s
    commits_per_s_in_step: float
    waiting_share: float  # of a worker's time, waiting for its commit (1 with no step time: it only commits)
    limited_by: str  # what sets commits_per_s: workers, partition, link, host cores
    headroom: float  # what the servers could apply over what the workers offer
    commit_bytes: int  # a commit's bytes up (the reply as much again)
    seconds_per_commit: dict[str, float] = field(default_factory=dict)  # the cycle's parts
    path: str = ""  # the measured path whose costs were used ("RULE/ENCODING")
    calibration: str = ""

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def plan(job: Job, calibration: Calibration) -> Plan:
    """The fewest local steps that keep a worker's wait within TARGET_WAIT (local steps cost
    convergence), each with the fewest partitions that apply what the workers offer with HEADROOM
    to spare (a partition costs a server core; more than that shaves only the server's share of a
    commit); the job's own where it gave them. When none keeps the wait so (workers that only
    commit always wait), the one that waits least."""
    problems = job.problems()
    if problems:
        raise ValueError("; ".join(problems))
    step_choices = [job.local_steps] if job.local_steps else range(1, MAX_LOCAL_STEPS + 1)
    partition_choices = [job.partitions] if job.partitions else range(1, MAX_PARTITIONS + 1)
    least: Plan | None = None
    for local_steps in step_choices:
        candidates = [_project(job, calibration, partitions, local_steps) for partitions in partition_choices]
        keeping_up = [candidate for candidate in candidates if candidate.headroom >= HEADROOM]
        chosen = keeping_up[0] if keeping_up else max(candidates, key=lambda candidate: candidate.commits_per_s)
        if chosen.waiting_share <= TARGET_WAIT:
            return chosen
        if least is None or chosen.waiting_share < least.waiting_share - 1e-9:
            least = chosen
    assert least is not None
    return least


def _project(job: Job, calibration: Calibration, partitions: int, local_steps: int) -> Plan:
    shared_memory = job.link_bytes_per_second is None if job.shared_memory is None else job.shared_memory
    path = calibration.path(job.rule, job.encoding, tcp=not shared_memory)
    cost = calibration.paths[path]
    share = job.parameters / partitions
    server = cost.server_cpu.at(share)
    hold = server if cost.server_hold is None else max(server, cost.server_hold.at(share))
    client = cost.client_cpu.at(job.parameters)
    commit_bytes = job.parameters * ENCODING_BYTES[job.encoding]
    transfer = 0.0  # a commit's bytes up and the reply's down: the slower of the worker's link and a partition's
    if job.link_bytes_per_second is not None:
        worker_link = job.worker_link_bytes_per_second or job.link_bytes_per_second
        transfer = 2 * max(commit_bytes / worker_link, commit_bytes / partitions / job.link_bytes_per_second)
    compute = local_steps * job.step_seconds
    cycle = compute + max(client + server, hold) + transfer
    limits = {"workers": job.workers / cycle, "partition": 1.0 / hold}
    if job.link_bytes_per_second is not None:  # each partition's host: its share of every commit, each way
        limits["link"] = job.link_bytes_per_second / (commit_bytes / partitions)
    else:  # one host: its cores run the partitions' and the workers' CPU
        limits["host cores"] = job.host_cores / (partitions * server + client)
    limited_by = min(limits, key=lambda name: limits[name])
    commits_per_s = limits[limited_by]
    servers = min(rate for name, rate in limits.items() if name != "workers")  # what the servers apply
    in_step = commits_per_s
    if job.link_bytes_per_second is not None:  # every worker's commit and reply at the same moments
        in_step = min(commits_per_s, job.link_bytes_per_second / (2 * commit_bytes / partitions))
    waiting = 0.0 if compute == 0 else max(0.0, 1.0 - compute * commits_per_s / job.workers)
    state = STATE_BYTES_PER_WORKER[job.rule] * job.workers + SHARED_STATE_BYTES[job.rule]
    memory = partitions * cost.server_memory.at(share) + state * job.parameters
    return Plan(
        partitions=partitions,
        local_steps=local_steps,
        server_cores=partitions,
        server_memory_bytes=int(memory),
        commits_per_s=commits_per_s,
        commits_per_s_in_step=in_step,
        waiting_share=waiting if compute else 1.0,
        limited_by=limited_by,
        headroom=servers / limits["workers"],
        commit_bytes=int(commit_bytes),
        seconds_per_commit={
            "local steps": compute,
            "client CPU": client,
            "transfer": transfer,
            "server CPU": server,
            "server hold": hold,
        },
        path=path,
        calibration=calibration.source,
    )


# -- calibration from `gemps bench` results ---------------------------------------------------------


def fit(runs: Iterable[Mapping[str, Any]], source: str) -> Calibration:
    """A calibration from bench runs (results.json's "runs"): per path, straight lines through the
    busiest partition's server CPU, the client CPU and the server's peak memory (less its workers'
    GEM state) against the parameters a partition holds, and the hold: a commit's median latency
    over the clients that queue for it (the bench's closed loop), at least the partition's CPU."""
    points: dict[str, list[tuple[float, float, float, float, float, float]]] = {}
    for run in runs:
        path = path_of(run)
        if path is None:
            continue
        partitions = int(run.get("partitions") or 1)
        share = run["num_parameters"] / partitions
        busiest = run.get("busiest_partition_cpu_ms_per_commit", math.nan)
        if busiest is None or math.isnan(busiest):  # one process: the server's own
            busiest = run["server_cpu_ms_per_commit"]
        rule = path.split("/")[0]  # the workers' GEM state is the rule's, not a line of the fit
        state = (STATE_BYTES_PER_WORKER[rule] * run["clients"] + SHARED_STATE_BYTES[rule]) * run["num_parameters"]
        memory = (run["server_peak_rss_bytes"] - state) / partitions
        client = run["client_cpu_ms_per_commit"] / 1e3  # a worker's, by the whole model
        hold = max(busiest, run["latency_p50_ms"] / run["clients"]) / 1e3
        points.setdefault(path, []).append((share, busiest / 1e3, run["num_parameters"], client, memory, hold))
    return Calibration({path: _fit_path(values) for path, values in points.items()}, source)


def path_of(run: Mapping[str, Any]) -> str | None:
    """ "RULE/ENCODING" of a gemps run the calibration can use (float32 or int8, over the data plane)."""
    if not str(run.get("system", "")).startswith("gemps") or run.get("wire_dtype", "float32") != "float32":
        return None
    if run.get("plane", "auto") != "auto" or run.get("noise_window", 0) or run.get("gem_kernel", "auto") != "auto":
        return None
    compression = str(run.get("compression", "none"))
    if str(run.get("reply_compression", compression)) != compression:  # codes one way only: no path of ours
        return None
    rule = "gem-compact" if run.get("gem_state") == "compact" else str(run.get("rule", "gem"))
    if rule not in RULES:
        return None
    transport = "" if run.get("shared_memory", True) else "+tcp"
    return f"{rule}/{'float32' if compression == 'none' else compression}{transport}"


def _fit_path(values: list[tuple[float, float, float, float, float, float]]) -> PathCost:
    shares, busiest, sizes, client, memory, hold = (list(column) for column in zip(*values, strict=True))
    return PathCost(
        server_cpu=_curve(shares, busiest),
        client_cpu=_curve(sizes, client),
        server_memory=_curve(shares, memory),
        server_hold=_curve(shares, hold),
    )


def _curve(xs: list[float], ys: list[float]) -> Curve:
    """Through the mean of the costs measured at each size."""
    by_size: dict[float, list[float]] = {}
    for x, y in zip(xs, ys, strict=True):
        by_size.setdefault(x, []).append(y)
    return Curve(tuple((x, sum(found) / len(found)) for x, found in sorted(by_size.items())))
