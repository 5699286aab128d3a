"""What the actors of a gemps job on Ray hand back to the driver: plain, picklable records."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gemps.records import GradientNoise


@dataclass(frozen=True)
class PartitionEndpoint:
    """Where one partition's server serves, and on which Ray node."""

    index: int
    node_id: str  # Ray's node id (hex)
    host: str
    port: int
    metrics_port: int
    pid: int  # of the server process, on its node
    starts: int  # 1, plus one per restart of the actor
    folder: str  # on its node: checkpoints, server.log, partition.json

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class WorkerContext:
    """What a user's training function gets, in its worker actor: pass `server` to RemoteOptimizer,
    RemoteModel or gemps.Client (and `stop` as Client(stop=...)); return when `stop` is set."""

    server: str  # partition 0's address: the one address a worker needs
    index: int  # this worker, 0..workers-1 (the server assigns data shards itself, at Register)
    workers: int
    node_id: str
    stop: threading.Event


@dataclass(frozen=True)
class WorkerOutcome:
    index: int
    node_id: str
    commits: int  # acknowledged in this actor's last life (a restarted worker starts its budget again)
    final_version: int
    stopped_early: bool
    diverged: bool = False
    value: Any = None  # what a user's training function returned


@dataclass(frozen=True)
class TimedEvaluation:
    time: float  # unix time
    version: int
    loss: float
    accuracy: float


@dataclass(frozen=True)
class StatusSample:
    time: float  # unix time
    version: int  # partition 0's
    active_workers: int
    gradient_noise: GradientNoise = field(default_factory=GradientNoise)  # all of θ's (Client.gradient_noise)


@dataclass(frozen=True)
class ExportedModel:
    """The central variable and buffers by name, as the server held them at `version`."""

    version: int
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
