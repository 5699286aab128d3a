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
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from gemps.retry import RetryPolicy

ADDRESSES_FILE = "addresses"
RESOLVE_TIMEOUT = 10.0  # seconds a worker waits for partition 0's actor to say where it is
#: The SDK's default rides out 20 to 40 s; a node loss takes Ray about 14 s to notice, then the
#: partition's bundle is placed again and its server restarts: about a minute of retries.
NODE_LOSS_RETRY = RetryPolicy(max_attempts=30, initial_backoff=0.1, max_backoff=4.0)


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
