"""The Jepsen suite's plans and checker (gemps_bench.jepsen) on made-up histories: what each
violation looks like to it, and what it must not call one."""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import pytest
from gemps_bench.jepsen.check import Safety, check, epochs, primaries_seen, promotions, recovery, wedged
from gemps_bench.jepsen.plan import LONG_PAUSE, SECOND_JOB_MENU, draw
from gemps_bench.jepsen.report import clean, summary, table, totals
from gemps_bench.jepsen.trial import Schedule

from gemps_worker.simulated_hosts import Host

HOSTS = {"A:1": "r0", "B:1": "r1"}  # target -> host


def history(acknowledged: int = 10, in_doubt: int = 0, **fields: Any) -> dict[str, Any]:
    """A worker acknowledged by r0 under epoch 5 from t=0 to t=10, unless `fields` say otherwise."""
    base = {"started": 0.0, "acknowledged": acknowledged, "in_doubt": in_doubt, "runs": [[5, "A:1", 0.1, 10.0, 10]],
            "stalls": [], "errors": {}, "last_ack": 10.0, "ended": 10.0}  # fmt: skip
    return {**base, **fields}


def line(t: float, in_sync: bool, primary: str = "A:1") -> dict[str, Any]:
    """A monitor line: `primary` primary under epoch 5, the other its backup (in sync or not)."""
    backup = next(target for target in HOSTS if target != primary)
    listed = [[HOSTS[backup], in_sync, 0]]
    views = {
        primary: {"name": HOSTS[primary], "role": "primary", "epoch": 5, "version": 1, "backups": listed, "at": t},
        backup: {"name": HOSTS[backup], "role": "backup", "epoch": 5, "version": 1, "at": t},
    }
    return {"t": t, "views": views}


def fault(kind: str, host: str, start: float, end: float, id: int = 0) -> dict[str, Any]:
    return {"id": id, "kind": kind, "role": "x", "host": host, "start": start, "end": end}


def verdict(histories: list[dict[str, Any]], version: int) -> dict[str, Any]:
    safety = Safety([], [line(0.0, True)], HOSTS, 0.0, 10.0)
    observed = {"version": version, "theta_min": float(version), "theta_max": float(version)}
    return check(histories, observed, {"A:1": {"version": version}}, safety, [], [])


def test_acknowledged_commits_missing_from_theta_are_lost_and_extra_ones_applied_twice() -> None:
    assert verdict([history(10), history(10)], 20)["ok"]
    lost = verdict([history(10), history(10)], 17)
    assert (lost["lost"], lost["applied_twice"], lost["ok"]) == (3, 0, False)
    twice = verdict([history(10, in_doubt=1), history(10)], 23)
    assert (twice["lost"], twice["applied_twice"], twice["ok"]) == (0, 2, False)
    assert verdict([history(10, in_doubt=3)], 13)["ok"]  # every commit in doubt may have been applied


def test_an_epoch_held_by_two_replicas_or_given_twice_is_reported() -> None:
    split = history(runs=[[5, "A:1", 0.0, 1.0, 5], [5, "B:1", 2.0, 3.0, 5]])
    assert epochs([split], [])["two_primaries"] == {"5": ["ack A:1", "ack B:1"]}
    stale = history(runs=[[5, "A:1", 0.0, 1.0, 5], [7, "B:1", 2.0, 3.0, 5], [5, "A:1", 4.0, 5.0, 5]])
    assert epochs([stale], [])["stale_acks"] == [5]
    promoted = [{"t": 1.0, "host": "r0", "epoch": 5}, {"t": 2.0, "host": "r1", "epoch": 9},
                {"t": 3.0, "host": "r1", "epoch": 5}]  # fmt: skip
    found = epochs([history()], promoted)
    assert found["reused"] == [5] and found["two_primaries"] == {"5": ["ack A:1", "log r0", "log r1"]}
    assert epochs([history()], promoted[:2]) == {"two_primaries": {}, "stale_acks": [], "reused": [], "promotions": 2}
    said = primaries_seen([line(1.0, True), line(2.0, True, primary="B:1")], HOSTS)
    assert said == {(5, "r0"), (5, "r1")}
    assert epochs([history()], promoted[:2], said)["two_primaries"] == {
        "5": ["ack A:1", "log r0", "status r0", "status r1"]
    }


def test_promotions_are_read_from_the_servers_json_logs() -> None:
    log = (
        'not json\n{"time": "2026-01-01T00:00:01.500Z", "event": "primary", "replica": "p-0", "epoch": 3}\n'
        '{"time": "2026-01-01T00:00:02.000Z", "event": "lost primacy", "epoch": 3}\n'
    )
    assert [(p["host"], p["epoch"]) for p in promotions({"r0": log, "r1": ""})] == [("r0", 3)]


def test_a_safe_primary_exists_while_etcd_and_a_replica_in_sync_are_up() -> None:
    timeline = [line(0.0, True), line(3.0, False)]  # the backup dropped at t=3
    paused_primary_early = Safety([fault("pause", "r0", 1.0, 2.0)], timeline, HOSTS, 0.0, 10.0)
    assert paused_primary_early.safe_seconds(1.0, 2.0) > 0.9  # the backup in sync could take over
    paused_primary_late = Safety([fault("pause", "r0", 4.0, 6.0)], timeline, HOSTS, 0.0, 10.0)
    assert paused_primary_late.safe_seconds(4.0, 6.0) == 0.0  # nobody else holds every commit
    assert paused_primary_late.first_safe(4.0) == pytest.approx(6.0)
    etcd_down = Safety([fault("kill", "e", 1.0, 2.0)], timeline, HOSTS, 0.0, 10.0)
    assert etcd_down.safe_seconds(1.0, 2.0) == 0.0
    slowed = Safety([fault("slow", "r0", 1.0, 2.0)], timeline, HOSTS, 0.0, 10.0)
    assert slowed.safe_seconds(1.0, 2.0) > 0.9


def test_recovery_counts_from_when_a_safe_primary_exists_and_waits_past_the_fault_are_wedged() -> None:
    timeline = [line(0.0, True)]
    faults = [fault("kill", "e", 2.0, 4.0, id=1), fault("pause", "r0", 6.0, 7.0, id=2)]
    safety = Safety(faults, timeline, HOSTS, 0.0, 30.0)
    resumed = history(stalls=[[1.9, 5.0], [5.9, 8.5]], last_ack=30.0, ended=30.0)
    found = recovery(faults, [resumed], safety)
    assert [(r["fault"], r["safe_after_s"], r["resumed_s"]) for r in found] == [(1, 2.0, 1.0), (2, 0.0, 2.5)]
    never = history(stalls=[], last_ack=5.0, ended=30.0)
    assert [r["resumed_s"] for r in recovery(faults, [never], safety)] == [0.0, None]
    assert [w["worker"] for w in wedged([resumed, never], safety, 10.0)] == [1]  # 25 s without, all safe
    across = [fault("kill", "r0", 6.2, 9.0, id=3), fault("wipe", "e", 7.4, 7.4, id=4)]
    found = recovery(across, [history(stalls=[[6.15, 8.3]], last_ack=30.0)], Safety(across, timeline, HOSTS, 0, 30))
    assert [r["resumed_s"] for r in found] == [2.1, 0.9]  # a wait past the next fault's start still counts
    etcd_dead = Safety([fault("kill", "e", 4.0, 30.0)], timeline, HOSTS, 0.0, 30.0)
    assert wedged([never], etcd_dead, 10.0) == []  # no safe primary: waiting is all it could do


def test_plans_are_drawn_from_their_seed_and_stale_wipe_lags_wipes_then_pauses() -> None:
    assert draw(7) == draw(7) and draw(7) != draw(8)
    plan = draw(3, episodes=1, stale_wipe=1.0)
    steps = [(step.kind, step.role) for step in plan.steps]
    assert steps[1:] == [("wipe", "etcd"), ("pause", "primary"), ("heal", "backup"), ("heal", "primary")]
    assert steps[0] in {("pause", "backup"), ("slow", "backup")}
    assert plan.steps[1].at - plan.steps[0].at > 2.0  # past the replica timeout: the backup was dropped


def test_a_long_pause_of_the_primary_ends_a_plan_and_leaves_its_episodes_as_they_were() -> None:
    """Issue 61 item 1: the suite's trials end with the primary paused 30-40 s."""
    plain, paused = draw(5, episodes=3), draw(5, episodes=3, long_pause=LONG_PAUSE)
    assert paused.steps[: len(plain.steps)] == plain.steps
    pause, heal = paused.steps[len(plain.steps) :]
    assert (pause.kind, pause.role, heal.kind, heal.role) == ("pause", "primary", "heal", "primary")
    assert LONG_PAUSE[0] >= 30 and LONG_PAUSE[0] <= heal.at - pause.at <= LONG_PAUSE[1]
    assert pause.at > max(step.at for step in plain.steps)  # alone: after every episode is healed


def test_a_second_jobs_faults_are_drawn_last_and_leave_the_first_jobs_as_they_were() -> None:
    """Issue 77 item 1: job B's faults (its primary or backup killed, paused, parted) come after
    every draw of job A's, at times anywhere in A's faults, numbered apart from them."""
    for seed in range(1, 21):
        alone, beside = draw(seed, long_pause=LONG_PAUSE), draw(seed, long_pause=LONG_PAUSE, second_job=2)
        assert [step for step in beside.steps if step.job == "A"] == list(alone.steps)
        assert (alone.second_job, beside.second_job, beside.replicas) == (False, True, alone.replicas)
        theirs = [step for step in beside.steps if step.job == "B"]
        starts = [step for step in theirs if step.kind != "heal"]
        assert len(starts) == 2 and len(theirs) == 4  # each healed
        assert all(step.role in SECOND_JOB_MENU[step.kind] for step in starts)
        assert {step.fault for step in theirs}.isdisjoint(step.fault for step in alone.steps)
        assert all(0 <= step.at <= alone.duration for step in starts)
    labels = draw(7, episodes=3, stale_wipe=0.0, second_job=2).kinds()
    assert [label for label in labels if "@" not in label] == draw(7, episodes=3, stale_wipe=0.0).kinds()
    assert sum(label.endswith("@B") for label in labels) == 2
    assert draw(7, second_job=0).second_job and draw(7, second_job=0).steps == draw(7).steps
    assert draw(7, second_job=1).to_json()["second_job"] is True


def test_a_jobs_theta_holding_more_than_its_workers_could_account_for_is_wrong_theta() -> None:
    """Job A's workers followed job B's primary (on their list) and were acknowledged there: A's
    θ lacks those commits (lost) and B's holds more than B's workers account for (wrong θ)."""
    safety = Safety([], [line(0.0, True)], HOSTS, 0.0, 10.0)

    def judged(histories: list[dict[str, Any]], version: int, own: list[str] | None) -> dict[str, Any]:
        observed = {"version": version, "theta_min": float(version), "theta_max": float(version)}
        return check(histories, observed, {"A:1": {"version": version}}, safety, [], [], own=own)

    strayed = history(10, runs=[[5, "A:1", 0.1, 5.0, 6], [3, "C:1", 5.1, 10.0, 4]])  # C:1: job B's primary
    job_a = judged([strayed], 6, own=list(HOSTS))
    assert (job_a["lost"], job_a["acknowledged_elsewhere"], job_a["wrong_theta"], job_a["ok"]) == (4, 4, 0, False)
    own_b = history(20, in_doubt=1, runs=[[4, "C:1", 0.1, 10.0, 20]])
    job_b = judged([own_b], 25, own=["C:1", "D:1"])
    assert (job_b["applied_twice"], job_b["wrong_theta"], job_b["lost"], job_b["ok"]) == (4, 4, 0, False)
    assert judged([own_b], 25, own=None)["wrong_theta"] == 0  # one job: applied twice
    fine = judged([history(10)], 10, own=list(HOSTS))
    assert (fine["wrong_theta"], fine["acknowledged_elsewhere"], fine["ok"]) == (0, 0, True)
    trial = {"seed": 1, "replicas": 2, "faults": [], "verdict": fine, "second_job": {"verdict": job_b}}
    assert not clean(trial) and clean({**trial, "second_job": {"verdict": fine}})
    assert "job A: ok" in summary(trial) and "job B: VIOLATION" in summary(trial)
    assert "WRONG θ: 4 commits more than its workers could account for" in summary(trial)
    found = totals([trial])
    assert (found["ok"], found["acknowledged"], found["wrong_theta"], found["trials_with_wrong_theta"]) == (0, 30, 4, 1)
    assert table([trial]).splitlines()[1].split()[:8] == ["1", "2", "30", "0", "4", "4", "0", "0"]
    said = summary({**trial, "verdict": job_a})
    assert "job A: VIOLATION" in said and "WRONG θ: 4 acknowledged by another job's server" in said


def test_the_report_sums_violations_and_recovery_by_fault() -> None:
    recovered = {"kind": "kill:primary", "safe_after_s": 0.0, "resumed_s": 2.0}
    trials = [
        {"seed": 1, "replicas": 2, "faults": [{"kind": "kill", "role": "primary", "host": "r0"}],
         "verdict": {**verdict([history(10)], 7), "recovery": [recovered]}},
        {"seed": 2, "replicas": 2, "faults": [], "verdict": {**verdict([history(10)], 10), "recovery": [
            {**recovered, "resumed_s": 4.0}, {**recovered, "resumed_s": None}]}},
        {"seed": 3, "replicas": 3, "plan": {}, "error": "RuntimeError('etcd did not answer')"},
    ]  # fmt: skip
    found = totals(trials)
    assert (found["trials"], found["ok"], found["rig_errors"], found["lost"], found["trials_with_lost"]) == (
        3,
        1,
        1,
        3,
        1,
    )
    assert found["recovery_by_fault"] == {"kill:primary": {"faults": 3, "never": 1, "median_s": 3.0, "max_s": 4.0}}
    lines = table(trials).splitlines()
    assert lines[1].split()[:6] == ["1", "2", "Kp", "10", "3", "0"] and "rig error" in lines[3]


def unelected(t: float) -> dict[str, Any]:
    """A monitor line after etcd lost its data: both replicas candidates, no primary."""
    views = {
        target: {"name": name, "role": "candidate", "epoch": 5, "version": 1, "at": t} for target, name in HOSTS.items()
    }
    return {"t": t, "views": views}


@dataclass
class Replicas:
    """A job's replica hosts, as Schedule reads them of a rig's job."""

    replica_hosts: list[Host]


@dataclass
class Views:
    """What Schedule reads of a rig: the monitor's latest views (`fresh`, when set: those it gives
    once every replica answered after a fault's start) and the hosts, of job A alone."""

    views: dict[str, dict[str, Any]]
    jobs: dict[str, Replicas] = field(
        default_factory=lambda: {
            "A": Replicas([Host(n, f"ns-{n}", f"10.0.0.{i}", n) for i, n in enumerate(("r0", "r1"))])
        }
    )
    etcd_host: Host = field(default_factory=lambda: Host("e", "ns-e", "10.0.0.9", "e"))
    fresh: dict[str, dict[str, Any]] | None = None

    def latest_views(self, job: str | None = None) -> dict[str, dict[str, Any]]:
        return self.views

    def fresh_views(self, job: str, after: float, silenced: Collection[str] = ()) -> dict[str, dict[str, Any]]:
        return self.views if self.fresh is None else self.fresh

    def host_of(self, target: str) -> Host:
        return next(host for host in self.jobs["A"].replica_hosts if host.name == HOSTS[target])


def test_with_no_primary_known_the_old_primary_is_faulted_at_once() -> None:
    """The stale-wipe sequence pauses the old primary 0.2 s after etcd is wiped. When the monitor
    had already seen it step down, the schedule waited 10 s for a primary that could not be
    elected (a paused backup's heal was queued behind that wait) and skipped the fault."""
    rig = Views(line(0.0, True)["views"])
    schedule = Schedule(rig, seed=1)  # type: ignore[arg-type]
    assert schedule.resolve("backup").name == "r1"  # type: ignore[union-attr]
    rig.views = unelected(1.0)["views"]  # etcd wiped: the primary stepped down
    began = time.monotonic()
    target = schedule.resolve("primary")
    assert target is not None and target.name == "r0"
    assert time.monotonic() - began < 1.0


def test_a_backup_promoted_a_moment_before_a_fault_is_faulted_as_the_primary() -> None:
    """The CI's pinned trial: r0 promoted 0.35 s before `kill:backup`, the monitor's last line still
    showing r1 primary and r0 its backup; the rig's views newer than the fault show r0 primary, so
    the backup is r1 (it SIGKILLed r0, alone in the in-sync set, and 107 commits went with it)."""
    stale = line(0.5, True, primary="B:1")["views"]  # half a second old: r1 still primary in it
    rig = Views(stale, fresh=line(1.0, False, primary="A:1")["views"])
    schedule = Schedule(rig, seed=1)  # type: ignore[arg-type]
    target = schedule.resolve("backup")
    assert target is not None and target.name == "r1"
