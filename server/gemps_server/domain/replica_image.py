"""What a partition's primary seeds a backup with: its whole state at one version (a ReplicaImage).

The backup adopts it (images.adopt) and then applies every later state change the primary
forwards through the same domain code, so both hold the same θ, rule state (global and per
worker), workers and commit ledger bit for bit: the backup can take over with the workers
carrying on (same worker ids, same GEM state, same exactly-once ledger). What is per process and
time-based is left out: a worker's last request and last commit are "now" on adoption, and no
initializer grace is running. The wire form is replication/image_codec.py's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from gemps_proto.schema import buffer_counts
from gemps_server.domain.ledger import LedgerImage
from gemps_server.domain.noise import NoiseImage
from gemps_server.domain.records import ALL_OF_THETA, PartitionOf, StateImage
from gemps_server.domain.workers import RegistryImage


@dataclass(frozen=True)
class ReplicaImage:
    """Everything a ServerState holds that a replica needs, consistent at one version.

    `state` is None while θ is not initialised (nobody registered yet): then nothing else is
    held. Its `receipts` stay empty: `ledger` holds them, in order, with what else the ledger
    keeps. `worker_rule_state` is the rule's state of each registered worker that has some
    (CommitRule.worker_state), by worker id; `theta_bound` the rule's bound on max |θ|
    (CommitRule.theta_bound). `history` names the primary's history of versions (ServerState's).
    Constructing an inconsistent image raises ValueError.
    """

    history: str
    partition: PartitionOf = ALL_OF_THETA
    state: StateImage | None = None
    workers: RegistryImage = field(default_factory=RegistryImage)
    worker_rule_state: Mapping[str, Mapping[str, np.ndarray]] = field(default_factory=dict)
    ledger: LedgerImage = field(default_factory=LedgerImage)
    noise: NoiseImage | None = None  # None: a fresh estimate
    theta_bound: float | None = None

    @property
    def initialized(self) -> bool:
        return self.state is not None

    @property
    def version(self) -> int:
        return 0 if self.state is None else self.state.version

    def __post_init__(self) -> None:
        state = self.state
        if state is None:
            held = self.workers.workers or self.worker_rule_state or self.ledger.last or self.ledger.legacy
            if held or self.noise is not None or self.theta_bound is not None:
                raise ValueError("an image of a server not initialised holds workers, receipts or rule state")
            return
        if state.partition != self.partition:
            raise ValueError(f"the image's state holds {state.partition}, the image says {self.partition}")
        if state.receipts:
            raise ValueError("a replica image keeps its receipts in `ledger`, not in its state")
        theta = state.theta
        start, stop = self.partition.bounds(state.total_parameters)
        if theta.dtype != np.float32 or theta.shape != (stop - start,):
            raise ValueError(f"θ must be flat float32 of {stop - start} values ({self.partition})")
        floats, integers = state.buffers.floats, state.buffers.integers
        if (
            floats.dtype != np.float32
            or integers.dtype != np.int64
            or (floats.size, integers.size) != buffer_counts(state.buffer_spec)
        ):
            raise ValueError("the buffers do not match their spec (float32 and int64 values, its counts)")
        unknown = set(self.worker_rule_state) - {worker.worker_id for worker in self.workers.workers}
        if unknown:
            raise ValueError(f"rule state of workers not registered: {sorted(unknown)[:3]}")
