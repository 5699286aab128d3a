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

Under a rule of rounds (`adamw`: θ moves once the round's gradients are in) the workers go in step
instead: a round is every worker's H steps and its commit, the busiest partition taking the W
commits in turn (h(N/K) each, θ sent back to each worker included) and the round's step t(N/K)
once, and the bytes each way (a worker's own over its link; the partition's link carries all W);
commits/s is W a round. t is measured on the rule alone (gemps_bench.round_step) and taken out of
the bench's per-commit costs, which share it among the bench's n clients.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

#: bytes a value takes on the wire: int8 and int4 codes carry a float32 scale per 256 values
ENCODING_BYTES = {"float32": 4.0, "bfloat16": 2.0, "int8": 1.0 + 4 / 256, "int4": 0.5 + 4 / 256}
#: what the server holds for each worker, bytes per parameter: GEM's state (DESIGN §1a), m_i and s_i
#: in float32 or 8-bit codes with their scales; DOWNPOUR none; under AdamW's rounds θ once a worker,
#: where its pull's reply is written: its shared memory, which the server maps (3.7-3.9 bytes measured
#: from 2 workers to 16, 2026-12-02), or over TCP a pooled buffer (the pool bounded: from 8 workers
#: on the server held no more, so there the line is an upper bound)
STATE_BYTES_PER_WORKER = {"gem": 8.0, "gem-compact": 2.25, "downpour": 0.0, "adamw": 4.0}
#: state the workers share, bytes per parameter: the compact state's two copies of θ; AdamW's two
#: moments and the round's sum of gradients
SHARED_STATE_BYTES = {"gem": 0.0, "gem-compact": 8.0, "downpour": 0.0, "adamw": 12.0}
RULES = tuple(STATE_BYTES_PER_WORKER)
#: rules that move θ a round of commits at a time: their workers go in step
ROUND_RULES = ("adamw",)
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
    # under a rule of rounds: seconds of the round's step, once a round, by the parameters it holds
    round_step: Curve | None = None


@dataclass(frozen=True)
class Calibration:
    """Costs by path name, "RULE/ENCODING" through shared memory, "RULE/ENCODING+tcp" over TCP
    (e.g. "gem/float32", "downpour/int8+tcp"), and where they were measured."""

    paths: Mapping[str, PathCost]
    source: str

    def path(self, rule: str, encoding: str, *, tcp: bool) -> str:
        """The measured path nearest to this one: itself, else the encoding under GEM (codes cost
        more CPU than any rule: int8 both ways is 1.9-3.8x float32's compiled, 4-9x in numpy), else
        the rule's float32, else GEM's (the encoding's bytes still count; its codes' CPU is then
        not); each over TCP ("+tcp": between hosts) where that was measured, else through shared
        memory."""
        rounds = rule in ROUND_RULES  # another rule's costs say nothing of a round's
        names = (f"{rule}/{encoding}", f"{rule}/float32") if rounds else (
            f"{rule}/{encoding}", f"gem/{encoding}", f"{rule}/float32", "gem/float32"
        )  # fmt: skip
        ways = [way for name in names for way in ((f"{name}+tcp", name) if tcp else (name,))]
        for way in ways:
            if way in self.paths:
                return way
        if rounds:
            raise ValueError(
                f"the calibration ({self.source}) measured no {rule} path: "
                f"`gemps bench --systems gemps-{rule},gemps-{rule}-tcp` measures it; "
                "--calibration takes its results.json"
            )
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
    # under rounds a gradient a commit (the recipe); windows of H steps (`--outer-rate`) when asked
    step_choices = [job.local_steps or 1] if job.rule in ROUND_RULES else (
        [job.local_steps] if job.local_steps else range(1, MAX_LOCAL_STEPS + 1)
    )  # fmt: skip
    partition_choices = [job.partitions] if job.partitions else range(1, MAX_PARTITIONS + 1)
    least: Plan | None = None
    project = _project_rounds if job.rule in ROUND_RULES else _project
    for local_steps in step_choices:
        candidates = [project(job, calibration, partitions, local_steps) for partitions in partition_choices]
        keeping_up = [candidate for candidate in candidates if candidate.headroom >= HEADROOM]
        chosen = keeping_up[0] if keeping_up else max(candidates, key=lambda candidate: candidate.commits_per_s)
        if chosen.waiting_share <= TARGET_WAIT:
            return chosen
        if least is None or chosen.waiting_share < least.waiting_share - 1e-9:
            least = chosen
    assert least is not None
    return least


@dataclass(frozen=True)
class _Commit:
    """One commit's costs for a job split over some partitions: the measured path's, at its sizes."""

    path: str
    server: float  # the busiest partition's CPU
    hold: float  # how long it holds that partition: at least its CPU
    client: float  # a worker's CPU
    bytes: float  # each way
    # its bytes up and the reply's down over the worker's link, and over each partition's link (which
    # carries its share of `transfers` commits at once)
    worker_transfer: float
    partition_transfer: float
    memory: int  # every partition's, with the rule's state
    round_step: float  # under a rule of rounds, the busiest partition's step, once a round

    @property
    def transfer(self) -> float:
        """Both ways, at the slower of the two links."""
        return max(self.worker_transfer, self.partition_transfer)

    @classmethod
    def of(cls, job: Job, calibration: Calibration, partitions: int, transfers: int = 1) -> _Commit:
        """`transfers`: the commits a partition's link carries at once (under rounds, every worker's)."""
        shared_memory = job.link_bytes_per_second is None if job.shared_memory is None else job.shared_memory
        path = calibration.path(job.rule, job.encoding, tcp=not shared_memory)
        cost = calibration.paths[path]
        share = job.parameters / partitions
        server = cost.server_cpu.at(share)
        commit_bytes = job.parameters * ENCODING_BYTES[job.encoding]
        worker_transfer = partition_transfer = 0.0
        if job.link_bytes_per_second is not None:
            worker_transfer = 2 * commit_bytes / (job.worker_link_bytes_per_second or job.link_bytes_per_second)
            partition_transfer = 2 * transfers * commit_bytes / partitions / job.link_bytes_per_second
        state = STATE_BYTES_PER_WORKER[job.rule] * job.workers + SHARED_STATE_BYTES[job.rule]
        return cls(
            path=path,
            server=server,
            hold=server if cost.server_hold is None else max(server, cost.server_hold.at(share)),
            client=cost.client_cpu.at(job.parameters),
            bytes=commit_bytes,
            worker_transfer=worker_transfer,
            partition_transfer=partition_transfer,
            memory=int(partitions * cost.server_memory.at(share) + state * job.parameters),
            round_step=0.0 if cost.round_step is None else cost.round_step.at(share),
        )


def _project(job: Job, calibration: Calibration, partitions: int, local_steps: int) -> Plan:
    commit = _Commit.of(job, calibration, partitions)
    server, hold, client, transfer = commit.server, commit.hold, commit.client, commit.transfer
    compute = local_steps * job.step_seconds
    cycle = compute + max(client + server, hold) + transfer
    limits = {"workers": job.workers / cycle, "partition": 1.0 / hold}
    if job.link_bytes_per_second is not None:  # each partition's host: its share of every commit, each way
        limits["link"] = job.link_bytes_per_second / (commit.bytes / partitions)
    else:  # one host: its cores run the partitions' and the workers' CPU
        limits["host cores"] = job.host_cores / (partitions * server + client)
    limited_by = min(limits, key=lambda name: limits[name])
    commits_per_s = limits[limited_by]
    servers = min(rate for name, rate in limits.items() if name != "workers")  # what the servers apply
    in_step = commits_per_s
    if job.link_bytes_per_second is not None:  # every worker's commit and reply at the same moments
        in_step = min(commits_per_s, job.link_bytes_per_second / (2 * commit.bytes / partitions))
    waiting = 0.0 if compute == 0 else max(0.0, 1.0 - compute * commits_per_s / job.workers)
    parts = {"local steps": compute, "client CPU": client, "transfer": transfer, "server CPU": server}
    return _plan(commit, calibration, partitions, local_steps, commits_per_s, in_step, waiting if compute else 1.0,
                 limited_by, servers / limits["workers"], parts | {"server hold": hold})  # fmt: skip


def _project_rounds(job: Job, calibration: Calibration, partitions: int, local_steps: int) -> Plan:
    """A round in step: every worker's steps and commit, then the busiest partition takes the W
    commits in turn and the round's step, and each worker gets θ back; the next round starts then."""
    commit = _Commit.of(job, calibration, partitions, transfers=job.workers)
    compute = local_steps * job.step_seconds
    partition = job.workers * commit.hold + commit.round_step
    parts = {"workers": compute + commit.client, "partition": partition, "link": commit.transfer}
    seconds = sum(parts.values())
    if job.link_bytes_per_second is None:  # one host: its cores run the partitions' and the workers' CPU
        cpu = job.workers * commit.client + partitions * (job.workers * commit.server + commit.round_step)
        parts["host cores"] = cpu / job.host_cores
        seconds = max(seconds, parts["host cores"])
    limited_by = max(parts, key=lambda name: parts[name])  # the largest part of a round, or the cores
    commits_per_s = job.workers / seconds
    waiting = 1.0 - compute / seconds if compute else 1.0
    seconds_per_commit = {
        "local steps": compute, "client CPU": commit.client, "transfer": commit.transfer,
        "server CPU": commit.server, "server hold": commit.hold, "round step": commit.round_step,
    }  # fmt: skip
    # headroom: the workers' own part of a round (their steps, CPU and link) against the partitions'
    # (their commits, the step and their links), as if the two were not in step
    workers_part = compute + commit.client + commit.worker_transfer
    headroom = workers_part / (partition + commit.partition_transfer)
    return _plan(commit, calibration, partitions, local_steps, commits_per_s, commits_per_s, waiting, limited_by,
                 headroom, seconds_per_commit)  # fmt: skip


def _plan(
    commit: _Commit,
    calibration: Calibration,
    partitions: int,
    local_steps: int,
    commits_per_s: float,
    in_step: float,
    waiting: float,
    limited_by: str,
    headroom: float,
    seconds_per_commit: dict[str, float],
) -> Plan:
    return Plan(
        partitions=partitions,
        local_steps=local_steps,
        server_cores=partitions,
        server_memory_bytes=commit.memory,
        commits_per_s=commits_per_s,
        commits_per_s_in_step=in_step,
        waiting_share=waiting,
        limited_by=limited_by,
        headroom=headroom,
        commit_bytes=int(commit.bytes),
        seconds_per_commit=seconds_per_commit,
        path=commit.path,
        calibration=calibration.source,
    )


# -- calibration from `gemps bench` results ---------------------------------------------------------


def fit(runs: Iterable[Mapping[str, Any]], source: str) -> Calibration:
    """A calibration from bench runs (results.json's "runs"): per path, straight lines through the
    busiest partition's server CPU, the client CPU and the server's peak memory (less its workers'
    GEM state) against the parameters a partition holds, and the hold: a commit's median latency
    over the clients that queue for it (the bench's closed loop), at least the partition's CPU.
    Under a rule of rounds, its step too (the run's `round_step_ms`), taken out of the commits' costs:
    a round of the bench's n clients is n commits and one step, and its time n over the commits/s."""
    points: dict[str, list[tuple[float, ...]]] = {}
    for run in runs:
        path = path_of(run)
        rule = "" if path is None else path.split("/")[0]  # the workers' GEM state is the rule's, not a line
        if path is None or (rule in ROUND_RULES and "round_step_ms" not in run):  # a round's step unmeasured
            continue
        partitions = int(run.get("partitions") or 1)
        share = run["num_parameters"] / partitions
        busiest = run.get("busiest_partition_cpu_ms_per_commit", math.nan)
        if busiest is None or math.isnan(busiest):  # one process: the server's own
            busiest = run["server_cpu_ms_per_commit"]
        state = (STATE_BYTES_PER_WORKER[rule] * run["clients"] + SHARED_STATE_BYTES[rule]) * run["num_parameters"]
        memory = (run["server_peak_rss_bytes"] - state) / partitions
        client = run["client_cpu_ms_per_commit"] / 1e3  # a worker's, by the whole model
        busiest, latency, clients, step = busiest / 1e3, run["latency_p50_ms"] / 1e3, run["clients"], 0.0
        if rule in ROUND_RULES:  # a round: every client's commit, the step, a client's own CPU (in and out)
            # (its clients' latencies are two modes, the closing commit's short: a round is n commits' time)
            step = run["round_step_ms"] / 1e3
            busiest, latency = busiest - step / clients, clients / run["commits_per_second"] - step - client
        hold = max(busiest, latency / clients)
        points.setdefault(path, []).append((share, busiest, run["num_parameters"], client, memory, hold, step))
    return Calibration(
        {path: _fit_path(values, path.split("/")[0] in ROUND_RULES) for path, values in points.items()}, source
    )


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


def _fit_path(values: list[tuple[float, ...]], rounds: bool) -> PathCost:
    shares, busiest, sizes, client, memory, hold, step = (list(column) for column in zip(*values, strict=True))
    return PathCost(
        server_cpu=_curve(shares, busiest),
        client_cpu=_curve(sizes, client),
        server_memory=_curve(shares, memory),
        server_hold=_curve(shares, hold),
        round_step=_curve(shares, step) if rounds else None,
    )


def _curve(xs: list[float], ys: list[float]) -> Curve:
    """Through the mean of the costs measured at each size."""
    by_size: dict[float, list[float]] = {}
    for x, y in zip(xs, ys, strict=True):
        by_size.setdefault(x, []).append(y)
    return Curve(tuple((x, sum(found) / len(found)) for x, found in sorted(by_size.items())))
