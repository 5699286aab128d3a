"""A scenario of the emulated cluster: its workers and their CPU quotas, each worker's speed over
time, heavy-tailed pauses, kills with restarts, one coordinator kill, and the links.

A scenario is a JSON file (scenarios/*.json; docs/guides/alternatives.md documents every field):

    {"name": "b", "description": "one worker in 8 at a third of the speed",
     "workers": 8, "worker_cpu": 0.2, "coordinator_cpu": 0.3, "duration_s": {"digits": 90},
     "speed": [{"worker": 7, "at_s": 0, "factor": 0.333}],
     "pauses": {"distribution": "pareto", "every_s": 5.0, "scale_s": 0.3, "shape": 1.5, "max_s": 10.0},
     "kills": {"every_s": 60, "first_s": 20, "restart_after_s": 5},
     "coordinator_kill": {"at_s": 30, "restart_after_s": 5},
     "link": "100mbit"}

`Scenario.events(seed)` turns it into the one time line of fault events the rig applies from
outside the systems' processes, the same for every system of a seed.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gemps_worker.simulated_hosts import rate_bits_per_second

SCENARIOS_DIR = Path(__file__).with_name("scenarios")
DISTRIBUTIONS = ("pareto", "lognormal")


@dataclass(frozen=True)
class SpeedChange:
    worker: int
    at_s: float
    factor: float  # of the worker's quota: 1/3 is a third of the speed


@dataclass(frozen=True)
class Pauses:
    """Per worker, pauses (SIGSTOP ... SIGCONT of its processes) at exponential intervals of mean
    `every_s`, each lasting a draw of `distribution` with scale `scale_s` (Pareto: the minimum;
    lognormal: the median) and `shape` (Pareto's alpha; lognormal's sigma), at most `max_s`."""

    distribution: str
    every_s: float
    scale_s: float
    shape: float
    max_s: float = 30.0

    def duration(self, rng: np.random.Generator) -> float:
        if self.distribution == "pareto":
            drawn = self.scale_s * (1.0 + rng.pareto(self.shape))
        else:
            drawn = self.scale_s * math.exp(self.shape * rng.standard_normal())
        return float(min(drawn, self.max_s))


@dataclass(frozen=True)
class Kills:
    """Worker (k mod workers) SIGKILLed at first_s + k*every_s, started again restart_after_s later."""

    every_s: float
    first_s: float
    restart_after_s: float


@dataclass(frozen=True)
class CoordinatorKill:
    """The system's coordinator (gemps: the primary server; DDP: rank 0 and its rendezvous store;
    torchft: the Lighthouse) SIGKILLed once at at_s, started again restart_after_s later."""

    at_s: float
    restart_after_s: float


@dataclass(frozen=True)
class Event:
    """One thing the rig does at `at_s` seconds into the run: `action` on `target` (a worker's
    index, or -1: the coordinator), with its `value` (a speed factor)."""

    at_s: float
    action: str  # "speed", "stop", "cont", "kill", "restart"
    target: int
    value: float = 0.0


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    workers: int = 8
    worker_cpu: float = 0.2  # of one core, each worker (cgroup v1 cpu.cfs_quota_us / cfs_period_us)
    coordinator_cpu: float = 0.3  # the server / rendezvous / lighthouse group
    # charlm: its best systems reach the target in 70-130 s of scenario a (docs/RESULTS.md)
    duration_s: dict[str, float] = field(default_factory=lambda: {"digits": 90.0, "charlm": 200.0})
    speed: tuple[SpeedChange, ...] = ()
    pauses: Pauses | None = None
    kills: Kills | None = None
    coordinator_kill: CoordinatorKill | None = None
    link: str = "10gbit"  # each host's cable (tc tbf): 10gbit is as good as unshaped here

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError(f"scenario {self.name!r}: " + "; ".join(problems))

    def problems(self) -> list[str]:
        found = []
        if self.workers < 1:
            found.append(f"workers must be at least 1, not {self.workers}")
        total = self.workers * self.worker_cpu + self.coordinator_cpu
        cores = os.cpu_count() or 1
        if not 0 < self.worker_cpu <= 1 or not 0 < self.coordinator_cpu <= 1:
            found.append("worker_cpu and coordinator_cpu are fractions of one core, in (0, 1]")
        elif total > cores:
            found.append(f"quotas sum to {total:g} cores, more than this machine's {cores}")
        for change in self.speed:
            if not 0 <= change.worker < self.workers or change.factor <= 0 or change.at_s < 0:
                found.append(f"speed change {change}: needs a worker in [0, {self.workers}), factor > 0, at_s >= 0")
        if self.pauses is not None and self.pauses.distribution not in DISTRIBUTIONS:
            found.append(f"pauses.distribution {self.pauses.distribution!r}: choose from {', '.join(DISTRIBUTIONS)}")
        if self.kills is not None and self.kills.every_s <= 0:
            found.append("kills.every_s must be positive")
        try:
            rate_bits_per_second(self.link)
        except ValueError as error:
            found.append(str(error))
        return found

    def duration(self, workload: str) -> float:
        try:
            return float(self.duration_s[workload])
        except KeyError:
            raise ValueError(f"scenario {self.name!r} gives no duration_s for workload {workload!r}") from None

    def events(self, seed: int, duration: float) -> list[Event]:
        """Every fault event within `duration` seconds, in time order; pauses drawn from `seed`."""
        found = [Event(c.at_s, "speed", c.worker, c.factor) for c in self.speed]
        if self.pauses is not None:
            for worker in range(self.workers):
                rng = np.random.default_rng([seed, worker, 58])
                at = float(rng.exponential(self.pauses.every_s))
                while at < duration:
                    length = self.pauses.duration(rng)
                    found += [Event(at, "stop", worker), Event(at + length, "cont", worker)]
                    at += length + float(rng.exponential(self.pauses.every_s))
        if self.kills is not None:
            k, at = 0, self.kills.first_s
            while at < duration:
                worker = k % self.workers
                found += [Event(at, "kill", worker), Event(at + self.kills.restart_after_s, "restart", worker)]
                k, at = k + 1, at + self.kills.every_s
        if self.coordinator_kill is not None:
            kill = self.coordinator_kill
            found += [Event(kill.at_s, "kill", -1), Event(kill.at_s + kill.restart_after_s, "restart", -1)]
        return sorted((e for e in found if e.at_s < duration), key=lambda e: (e.at_s, e.action != "cont"))


def parse(raw: dict[str, Any], source: str = "scenario") -> Scenario:
    """A Scenario from a JSON object; ValueError naming the field that is wrong."""
    known = set(Scenario.__dataclass_fields__)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{source}: unknown fields {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    try:
        values = dict(raw)
        values["speed"] = tuple(SpeedChange(**change) for change in raw.get("speed", ()))
        for key, kind in (("pauses", Pauses), ("kills", Kills), ("coordinator_kill", CoordinatorKill)):
            if raw.get(key) is not None:
                values[key] = kind(**raw[key])
        return Scenario(**values)
    except (TypeError, ValueError) as error:  # a field missing or of the wrong kind; a value out of range
        raise ValueError(f"{source}: {error}") from None


def load(name_or_path: str) -> Scenario:
    """A shipped scenario by name (a..f) or a JSON file by path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = SCENARIOS_DIR / f"{name_or_path}.json"
    if not path.is_file():
        shipped = ", ".join(sorted(p.stem for p in SCENARIOS_DIR.glob("*.json")))
        raise ValueError(f"no scenario {name_or_path!r}: give a JSON file or one of {shipped}")
    return parse(json.loads(path.read_text()), str(path))
