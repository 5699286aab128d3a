"""A trial's faults, drawn from a seed: which fault, on which role, when, and when it is healed.

Faults name a role (the primary, a backup, etcd), resolved to a host when the fault starts (the
primary then is whichever replica the monitor last saw as primary). Episodes start one after
another at random gaps and may overlap. Besides single faults the menu holds the sequence that lost
acknowledged commits in issue 41 (item 4), `stale-wipe`: a backup made to lag until it is dropped
from the in-sync set (paused, or its link slowed), etcd restarted empty, the lagging backup let go
on, and the old primary paused past its lease.

A plan may also run a second job (issue 77, item 1): job B, its own replicas under another etcd
job name, its workers' replica list holding one of job A's addresses and A's one of B's. Its
faults (SECOND_JOB_MENU, on B's primary or backup) are drawn after every draw of job A's, so a
seed's job-A faults are the same with or without it.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

#: fault kind -> the roles it may hit
#: kill: SIGKILL every process on the host (healed: started again; etcd on its data);
#: pause: SIGSTOP / SIGCONT; part: its cable pulled / plugged; part-etcd: parted from etcd's host
#: alone (iptables); slow: its link shaped to SLOW_RATE; wipe: etcd killed, its data removed,
#: started empty (nothing to heal).
MENU: dict[str, tuple[str, ...]] = {
    "kill": ("primary", "backup", "etcd"),
    "pause": ("primary", "backup", "etcd"),
    "part": ("primary", "backup", "etcd"),
    "part-etcd": ("primary", "backup"),
    "slow": ("backup",),
    "wipe": ("etcd",),
}
#: the faults drawn on the second job's replicas
SECOND_JOB_MENU: dict[str, tuple[str, ...]] = {kind: ("primary", "backup") for kind in ("kill", "pause", "part")}
FIRST_JOB, SECOND_JOB = "A", "B"
SECOND_JOB_REPLICAS = 2
INSTANT = frozenset({"wipe"})  # faults with nothing to heal
#: the suite's last episode (issue 61, item 1): the primary paused this long, far past its lease
#: (a long GC pause, swap, a frozen VM): workers must follow the backup it leaves behind
LONG_PAUSE = (30.0, 40.0)
SLOW_RATE = "400kbit"  # a backup on such a link falls behind any commit rate it is sent


@dataclass(frozen=True)
class Step:
    """At `at` seconds into the faults: start fault `fault` (`kind` on `role` of job `job`), or heal it."""

    at: float
    fault: int
    kind: str  # a MENU key, or "heal"
    role: str  # "primary", "backup", "etcd" (for a heal: the role of the fault it ends)
    job: str = FIRST_JOB  # whose primary or backup (etcd is both jobs')

    @property
    def label(self) -> str:
        """`kind:role`, with `@B` for a fault on the second job's replicas."""
        return f"{self.kind}:{self.role}" + ("" if self.job == FIRST_JOB else f"@{self.job}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Plan:
    seed: int
    replicas: int
    steps: tuple[Step, ...]
    second_job: bool = False  # whether job B runs beside job A (its R: SECOND_JOB_REPLICAS)

    @property
    def duration(self) -> float:
        return max((step.at for step in self.steps), default=0.0)

    def kinds(self) -> list[str]:
        """Each fault's label (`kind:role`, `@B` on the second job), in order (heals left out)."""
        return [step.label for step in self.steps if step.kind != "heal"]

    def to_json(self) -> dict[str, Any]:
        steps = [step.to_json() for step in self.steps]
        return {"seed": self.seed, "replicas": self.replicas, "second_job": self.second_job, "steps": steps}


@dataclass(frozen=True)
class Timing:
    """Seconds the plan is drawn in, from the replicas' own: a lease and the replica timeout."""

    lease: float = 2.0
    replica_timeout: float = 2.0
    hold: tuple[float, float] = (1.0, 5.0)  # how long a single fault lasts
    gap: tuple[float, float] = (1.0, 4.0)  # between two episodes' starts

    def between(self, rng: random.Random, span: tuple[float, float]) -> float:
        return round(rng.uniform(*span), 2)


def draw(
    seed: int,
    *,
    episodes: int = 4,
    replicas: tuple[int, ...] = (2,),
    stale_wipe: float = 0.2,
    timing: Timing | None = None,
    long_pause: tuple[float, float] | None = None,
    second_job: int | None = None,
) -> Plan:
    """The plan of seed `seed`: `episodes` episodes, each the stale-wipe sequence with probability
    `stale_wipe`, else one fault drawn uniformly from MENU's (kind, role) pairs; then, given
    `long_pause` (seconds, a range), the primary paused that long once they are all healed (drawn
    after them: the episodes before it are the seed's as without it); then, given `second_job`, a
    second job with that many faults, each drawn uniformly from SECOND_JOB_MENU's pairs at a time
    anywhere in job A's faults (the long pause included), drawn last for the same reason."""
    rng = random.Random(seed)
    timing = timing or Timing()
    count = rng.choice(replicas)
    pairs = [(kind, role) for kind, roles in MENU.items() for role in roles]
    steps: list[Step] = []
    start = 0.0
    for fault in range(episodes):
        ids = (fault * 10 + offset for offset in range(10))  # an episode's faults keep its number
        if rng.random() < stale_wipe:
            steps += _stale_wipe(rng, start, timing, ids)
        else:
            kind, role = rng.choice(pairs)
            steps += _single(next(ids), kind, role, start, timing.between(rng, timing.hold))
        start += timing.between(rng, timing.gap)
    if long_pause is not None:  # alone, once every episode is healed: a primary to pause, a backup to promote
        alone = max((step.at for step in steps), default=0.0) + timing.between(rng, timing.gap)
        steps += _single(episodes * 10, "pause", "primary", alone, timing.between(rng, long_pause))
    if second_job is not None:
        steps += _second_job(rng, second_job, first=(episodes + 1) * 10, timing=timing, steps=steps)
    return Plan(seed, count, tuple(sorted(steps, key=lambda step: step.at)), second_job is not None)


def _second_job(rng: random.Random, faults: int, first: int, timing: Timing, steps: list[Step]) -> list[Step]:
    """`faults` faults on job B's primary or backup, numbered from `first`, each starting anywhere
    in job A's faults: B's failovers overlap A's, so either job's workers may look at the other's
    primary while their own is away."""
    pairs = [(kind, role) for kind, roles in SECOND_JOB_MENU.items() for role in roles]
    span = max((step.at for step in steps), default=0.0)
    found: list[Step] = []
    for number in range(faults):
        kind, role = rng.choice(pairs)
        at, hold = timing.between(rng, (0.0, span)), timing.between(rng, timing.hold)
        found += _single(first + number, kind, role, at, hold, job=SECOND_JOB)
    return found


def _single(fault: int, kind: str, role: str, at: float, hold: float, job: str = FIRST_JOB) -> list[Step]:
    first = Step(round(at, 2), fault, kind, role, job)
    return [first] if kind in INSTANT else [first, Step(round(at + hold, 2), fault, "heal", role, job)]


def _stale_wipe(rng: random.Random, at: float, timing: Timing, ids: Any) -> list[Step]:
    """A backup lags (paused or slowed) until it is dropped from the in-sync set; etcd is wiped
    while it lags; the old primary pauses past its lease, and meanwhile the backup goes on."""
    lag, wipe, primary = next(ids), next(ids), next(ids)
    dropped = at + timing.replica_timeout + timing.between(rng, (1.0, 2.0))
    pause = timing.lease + timing.between(rng, (0.3, 1.0))
    return [
        Step(round(at, 2), lag, rng.choice(("pause", "slow")), "backup"),
        Step(round(dropped, 2), wipe, "wipe", "etcd"),
        Step(round(dropped + 0.2, 2), primary, "pause", "primary"),
        Step(round(dropped + 0.5, 2), lag, "heal", "backup"),
        Step(round(dropped + 0.2 + pause, 2), primary, "heal", "primary"),
    ]
