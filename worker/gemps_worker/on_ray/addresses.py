"""Where a job's partitions are now, when Ray restarts one on another node (on fresh ports).

- Partition 0's server announces the layout from a file in its folder (`gemps server
  --partition-addresses @FILE`, read again whenever it changes). Its actor is the file's only
  writer: at its start, and whenever the driver tells it a partition moved (`announce`). One
  writer needs no lock, and the driver, which may run off the cluster (Ray Client), never
  touches a node's files. A worker whose call to a moved partition fails asks partition 0 for
  the layout again (gemps.following) and follows it.
- Partition 0 itself is found again through its actor: the workers and the evaluator get a
  `PartitionZero` resolver, which asks the actor where its server listens now; Ray sends the
  question to the restarted actor wherever it landed. No file, so no storage every node sees is
  needed for that.
- Replicated partitions (--replicas R): a partition's address is its replicas' joined by "|"
  (gemps.resolver.REPLICA_SEPARATOR) in the layout, which each replica of partition 0 announces
  from its own file; partition 0 itself is found through `PartitionZeroReplicas`, which goes
  round its replicas' actors as gemps.resolver.Replicas goes round a fixed set.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import ray.exceptions

from gemps.resolver import REPLICA_SEPARATOR
from gemps.retry import RetryPolicy

ADDRESSES_FILE = "addresses"
#: Seconds a worker waits for partition 0's actor to say where it is. The call waits for the actor
#: while Ray restarts it (a lost node: noticed, the bundle placed again, the server restored from its
#: checkpoint, up to a minute under load), and one whose restarts are spent fails at once, so the
#: wait is long: at 10 s a worker restarted beside a moving partition 0 failed the job for good.
RESOLVE_TIMEOUT = 120.0
#: The SDK's default rides out 20 to 40 s; a node loss takes Ray about 14 s to notice, then the
#: partition's bundle is placed again and its server restarts: about a minute of retries.
NODE_LOSS_RETRY = RetryPolicy(max_attempts=30, initial_backoff=0.1, max_backoff=4.0)
#: seconds a worker waits for one replica's actor: one on a lost node does not answer until Ray
#: restarts it, and the next replica (the one etcd promotes) should be tried well before that
REPLICA_RESOLVE_TIMEOUT = 2.0


def replica_set(targets: list[str]) -> str:
    """A replicated partition's address: each replica's HOST:PORT, joined by "|"."""
    return REPLICA_SEPARATOR.join(targets)


def layout(targets: list[str]) -> str:
    """`--partition-addresses` for partition 0: "" (itself, reached at the worker's target), then
    the others' HOST:PORT."""
    return ",".join(["", *targets[1:]])


def write_addresses(path: Path, addresses: str) -> None:
    """Replace the file in one step: partition 0's server never reads half of it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(addresses + "\n")
    tmp.replace(path)


@dataclass(frozen=True)
class PartitionZero:
    """A gemps.resolver.Resolver: where partition 0's server listens now, asked of its actor."""

    actor: Any  # the PartitionServer actor of partition 0
    timeout: float = RESOLVE_TIMEOUT

    def resolve(self) -> str:
        target: str = ray.get(self.actor.endpoint.remote(), timeout=self.timeout).target
        return target


class PartitionZeroReplicas:
    """A gemps.resolver.Resolver for a replicated partition 0: each `resolve()` names the next
    replica, round the set (the client asks again only when the one it had failed or refused:
    not the primary), at the address its actor gives now, or the last one known when the actor
    does not answer within `timeout` (its node lost: that address fails and the next is tried)."""

    def __init__(self, actors: list[Any], targets: list[str], timeout: float = REPLICA_RESOLVE_TIMEOUT) -> None:
        self.actors, self.known, self.timeout = list(actors), list(targets), timeout
        self._next = 0

    def resolve(self) -> str:
        replica = self._next % len(self.actors)
        self._next += 1
        with contextlib.suppress(ray.exceptions.RayError):  # GetTimeoutError among them: keep the last known
            self.known[replica] = ray.get(self.actors[replica].endpoint.remote(), timeout=self.timeout).target
        return self.known[replica]

    def __repr__(self) -> str:
        return f"PartitionZeroReplicas({replica_set(self.known)!r})"
