"""What the actors of a gemps job on Ray hand back to the driver: plain, picklable records."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gemps.records import GradientNoise
from gemps.resolver import Resolver


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
    replica: int = 0  # which replica of the partition (--replicas R: 0..R-1)

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class WorkerContext:
    """What a user's training function gets, in its worker actor: pass `target` to gemps.Client
    (and `stop` as Client(stop=...)), the client to RemoteOptimizer or RemoteModel; return when
    `stop` is set."""

    server: str  # partition 0's address when the worker started: the one address a worker needs
    index: int  # this worker, 0..workers-1 (the server assigns data shards itself, at Register)
    workers: int
    node_id: str
    stop: threading.Event
    target: Resolver  # partition 0's address now: follows it when Ray moves it to another node


@dataclass(frozen=True)
class WorkerOutcome:
    index: int
    node_id: str
    commits: int  # acknowledged in this actor's last life (a restarted worker starts its budget again)
    final_version: int
    stopped_early: bool
    diverged: bool = False
    value: Any = None  # what a user's training function returned
    first_commit: float = 0.0  # unix time of this life's first acknowledged commit (0: none, or a user's function)
    # The life that ran it: a restarted worker can finish between two of the driver's looks, which
    # then learns of its restart from here.
    life: ActorPlace | None = None


@dataclass(frozen=True)
class ActorPlace:
    """Where one life of an actor runs: a restarted actor has a new pid, and a new node when its
    node was lost."""

    node_id: str
    address: str  # the node's, as Ray knows it
    metrics_port: int  # -1: none
    pid: int

    @property
    def life(self) -> tuple[str, int]:
        return self.node_id, self.pid


@dataclass(frozen=True)
class ActorRestart:
    """A new life of one of the job's actors, as the driver saw it."""

    actor: str  # "worker 2", "evaluator", "partition 1"
    seen: float  # unix time the driver first saw the new life
    node_id: str
    previous_node_id: str
    node_lost: bool  # its previous node had been lost (else its process died there)


@dataclass(frozen=True)
class NodeLoss:
    """A Ray node the job ran on, marked dead by Ray (its raylet stopped answering)."""

    seen: float  # unix time the driver saw it dead
    node_id: str
    held: tuple[str, ...]  # the job's actors last seen on it


@dataclass(frozen=True)
class PrimaryChange:
    """A replicated partition's primary, as the driver's samples saw it change (etcd decides)."""

    seen: float  # unix time of the first sample that found it primary
    partition: int
    replica: int  # the primary now
    node_id: str
    previous: int  # the primary before (-1: none seen yet)
    epoch: int  # etcd's: its key's creation revision


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
