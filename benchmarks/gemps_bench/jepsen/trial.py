"""One trial end to end: the rig up (with a second job when the plan has one), workers committing,
the plan's faults applied at their times, everything healed, each job's verdict
(gemps_bench.jepsen.check)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gemps_bench.jepsen.check import Safety, check, primaries_seen, promotions
from gemps_bench.jepsen.plan import FIRST_JOB, SECOND_JOB, SECOND_JOB_REPLICAS, Plan, Step
from gemps_bench.jepsen.rig import Heal, Rig, only
from gemps_worker.simulated_hosts import Host, SimulatedNetwork


@dataclass(frozen=True)
class TrialOptions:
    workers: int = 3
    second_job_workers: int = 1  # the second job's counting workers (with a plan that has one)
    parameters: int = 20_000  # float32 each: an 80 kB commit
    warmup: float = 2.0  # seconds of commits before the first fault
    settle: float = 30.0  # seconds the replicas may take to settle once everything is healed
    quiet: float = 2.0  # seconds of commits once settled, before the workers stop
    wedge_after: float = 10.0  # seconds of safe time without an acknowledgement: a worker wedged


class Schedule:
    """Applies a plan's steps to a rig, resolving roles to hosts; records each fault."""

    def __init__(self, rig: Rig, seed: int) -> None:
        self.rig, self.rng = rig, random.Random(seed)
        self.faults: dict[int, dict[str, Any]] = {}
        self.heals: dict[int, Heal] = {}
        # Each job's primary the monitor last showed, when a step looked (or before the first fault:
        # one fault's resolution must not wait for a primary while a later fault's heal is due).
        self.last_primary: dict[str, Host | None] = {job: self.primary(job) for job in rig.jobs}

    def busy(self) -> set[str]:
        return {self.faults[fault]["host"] for fault in self.heals}

    def resolve(self, role: str, job: str = FIRST_JOB, wait: float = 10.0) -> Host | None:
        """The host `role` (of job `job`) names now, if it is not under another fault. With no primary known now
        (an election under way) the primary is the one last seen: after etcd is wiped no replica
        becomes primary until every one reports, so waiting for one here (as this did, up to 10 s)
        also held back the heal of a paused backup queued behind this step, and with it the
        election: a fresh clone's suite left the stale-wipe trial's primary pause without a host
        and its workers waiting 10 s. Only before any primary was seen is one waited for, up to
        `wait` seconds."""
        busy = self.busy()
        if role == "etcd":
            return None if "e" in busy else self.rig.etcd_host
        deadline = time.monotonic() + wait
        # Views from after the fault's start: a backup promoted a moment ago is the primary now (the
        # CI's pinned trial once SIGKILLed, as `kill:backup`, a replica primary for 0.35 s).
        primary = self.primary(job, self.rig.fresh_views(job, time.time(), silenced=busy))
        while primary is None and self.last_primary[job] is None and role == "primary" and time.monotonic() < deadline:
            time.sleep(0.1)
            primary = self.primary(job)
        self.last_primary[job] = primary = primary or self.last_primary[job]
        if role == "primary":
            return primary if primary is not None and primary.name not in busy else None
        backups = [h for h in self.rig.jobs[job].replica_hosts if h is not primary and h.name not in busy]
        return self.rng.choice(backups) if backups else None

    def primary(self, job: str, views: Mapping[str, Mapping[str, Any] | None] | None = None) -> Host | None:
        """Job `job`'s replica the monitor last saw as primary (the newest epoch's, if several), in
        `views` (default: the monitor's last line)."""
        views = self.rig.latest_views(job) if views is None else views
        primaries = sorted((v["epoch"], target) for target, v in views.items() if v and v.get("role") == "primary")
        return self.rig.host_of(primaries[-1][1]) if primaries else None

    def step(self, step: Step) -> None:
        now = time.time()
        if step.kind == "heal":
            heal = self.heals.pop(step.fault, None)
            if heal is not None:
                heal()
                self.faults[step.fault]["end"] = now
            return
        host = self.resolve(step.role, step.job)
        record: dict[str, Any] = {"id": step.fault, "kind": step.kind, "role": step.role, "job": step.job}
        record["at"] = step.at
        if host is None:
            self.faults[step.fault] = {**record, "host": None, "skipped": "no such host free of other faults"}
            return
        heal = self.rig.apply(step.kind, host)
        self.faults[step.fault] = {**record, "host": host.name, "start": now, "end": now}
        if step.kind != "wipe":
            self.heals[step.fault] = heal

    def heal_all(self) -> None:
        for fault in sorted(self.heals):
            self.step(Step(0.0, fault, "heal", ""))


def settled(views: Mapping[str, Mapping[str, Any] | None], replicas: int, since: float = 0.0) -> bool:
    """One primary, every other replica its backup, in sync and caught up (each said so after `since`)."""
    if any(v is None or v["at"] <= since for v in views.values()):
        return False
    primaries = [v for v in views.values() if v and v.get("role") == "primary"]
    backups = [v for v in views.values() if v and v.get("role") == "backup"]
    if len(primaries) != 1 or len(backups) != replicas - 1:
        return False
    listed = primaries[0]["backups"]
    return len(listed) == replicas - 1 and all(in_sync and lag == 0 for _, in_sync, lag in listed)


def wait_until(condition: Callable[[], bool], timeout: float) -> float | None:
    """Seconds until `condition()` held; None when not within `timeout`."""
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        if condition():
            return round(time.monotonic() - began, 2)
        time.sleep(0.25)
    return None


def run_trial(
    plan: Plan, folder: Path, options: TrialOptions, env: Mapping[str, str], say: Callable[[str], None] = print
) -> dict[str, Any]:
    """Run `plan` on fresh simulated hosts (logs and data in `folder`); the trial's record."""
    with SimulatedNetwork() as network:
        rig = Rig(network, folder, env)
        rig.add_job(FIRST_JOB, plan.replicas)
        if plan.second_job:
            rig.add_job(SECOND_JOB, SECOND_JOB_REPLICAS)
        try:
            return _run(rig, plan, options, say)
        finally:
            rig.close()


def _all_settled(rig: Rig, since: float) -> bool:
    return all(settled(rig.latest_views(name), len(job.replica_hosts), since) for name, job in rig.jobs.items())


def _start(rig: Rig, options: TrialOptions) -> None:
    """etcd, every job's replicas (all at once: a fresh job elects its first primary once all its
    replicas started), the monitor and the workers."""
    rig.start_etcd()
    replicas = [(job, index) for job in rig.jobs.values() for index in range(len(job.replica_hosts))]
    with ThreadPoolExecutor(len(replicas)) as pool:
        list(pool.map(lambda replica: replica[0].start_replica(replica[1]), replicas))
    with ThreadPoolExecutor(len(rig.jobs)) as pool:
        list(pool.map(lambda job: job.settle(), rig.jobs.values()))
    rig.start_monitor()
    rig.start_workers({FIRST_JOB: options.workers, SECOND_JOB: options.second_job_workers}, options.parameters)


def _run(rig: Rig, plan: Plan, options: TrialOptions, say: Callable[[str], None]) -> dict[str, Any]:
    _start(rig, options)
    time.sleep(options.warmup)
    schedule = Schedule(rig, plan.seed)
    began = time.time()
    for step in plan.steps:
        time.sleep(max(0.0, began + step.at - time.time()))
        schedule.step(step)
        if step.kind != "heal":
            fault = schedule.faults[step.fault]
            say(f"  {step.at:6.2f} s  {step.label} -> {fault['host'] or 'skipped'}")
    schedule.heal_all()
    healed = time.time()
    settled_s = wait_until(lambda: _all_settled(rig, healed), options.settle)
    # Every worker acknowledged again (or, after wedge_after seconds, wedged: the checker says so).
    resumed_s = wait_until(lambda: rig.acknowledged_since(healed), options.wedge_after + 1.0)
    say(f"  healed; settled after {settled_s} s, every worker acknowledged again after {resumed_s} s")
    time.sleep(options.quiet)
    histories = rig.stop_workers()
    stopped = time.time()
    wait_until(lambda: _all_settled(rig, stopped), 10.0)  # the backups apply the last
    observed = {name: job.observe() for name, job in rig.jobs.items()}
    timeline = rig.stop_monitor()
    faults = sorted(schedule.faults.values(), key=lambda f: f["at"])
    verdicts = {
        name: _verdict(rig, name, histories[name], observed[name], timeline, faults, options) for name in rig.jobs
    }
    for fault in faults:  # times relative to the first fault, for reading
        fault.update({k: round(fault[k] - began, 2) for k in ("start", "end") if k in fault})
    for name, verdict in verdicts.items():
        # Each worker's waits of a second or more (the last: from its last acknowledgement to its
        # end), relative to the first fault: what recovery and wedges were read from.
        verdict["long_waits"] = [
            [
                [round(a - began, 2), round(b - began, 2)]
                for a, b in [*h["stalls"], [h["last_ack"] or h["started"], h["ended"]]]
                if b - a >= 1
            ]
            for h in histories[name]
        ]
    record = {
        "seed": plan.seed, "replicas": plan.replicas, "plan": plan.to_json(), "faults": faults,
        "healed_at_s": round(healed - began, 2), "settled_after_heal_s": settled_s,
        "resumed_after_heal_s": resumed_s, "verdict": verdicts[FIRST_JOB],
    }  # fmt: skip
    if plan.second_job:
        second = {"replicas": SECOND_JOB_REPLICAS, "workers": options.second_job_workers}
        record["second_job"] = {**second, "verdict": verdicts[SECOND_JOB]}
    return record


def _verdict(
    rig: Rig,
    name: str,
    histories: list[dict[str, Any]],
    observed: dict[str, Any] | None,
    timeline: list[dict[str, Any]],
    faults: list[dict[str, Any]],
    options: TrialOptions,
) -> dict[str, Any]:
    """Job `name`'s verdict: its workers' histories against its replicas' views, logs and θ, under
    the faults on its replicas and etcd."""
    job = rig.jobs[name]
    hosts = {target: rig.host_of(target).name for target in job.targets}
    mine = [{"t": line["t"], "views": only(line["views"], hosts)} for line in timeline]
    own_faults = [fault for fault in faults if fault["job"] == name or fault["role"] == "etcd"]
    start = min(float(h["started"]) for h in histories)
    end = max(float(h["ended"]) for h in histories)
    safety = Safety(own_faults, mine, hosts, start, end)
    final = mine[-1]["views"] if mine else {}
    own = job.targets if len(rig.jobs) > 1 else None  # with another job: what was acknowledged elsewhere
    return check(histories, observed, final, safety, own_faults, promotions(job.logs()), options.wedge_after,
                 primaries_seen(mine, hosts), own)  # fmt: skip
