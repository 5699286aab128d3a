"""The journal: every change of the state, in the order the applier made it (DESIGN §3d).

A replica that applies the same entries in the same order through the same code holds the same
θ, rule state, workers and ledger, bit for bit: every commit rule is deterministic. So the entries
record what the state decided, not only what was asked: the worker id a registration was given
and the worker it displaced, the workers an expiry evicted (a backup's clock must not decide
those). Refusals and retries answered from the ledger change nothing and are not journalled.

The state appends on the applier thread, inside the operation: an implementation must take what
it needs of an entry before returning (a commit's payload may live in a buffer the wire reuses).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from gemps_proto.schema import ParameterSpec
from gemps_proto.tensor_codec import EncodedBuffers, EncodedTensor
from gemps_server.domain.records import Commit


@dataclass(frozen=True)
class Joined:
    """A registration as applied: `initial` (and `initial_buffers`) only when it initialised θ."""

    worker_id: str
    name: str
    client_id: str
    spec: Sequence[ParameterSpec]
    buffer_spec: Sequence[ParameterSpec] = ()
    initial: EncodedTensor | None = None
    initial_buffers: EncodedBuffers | None = None
    displaced: str = ""  # the idle worker it replaced in a full registry ("" none)
    job: str = ""  # with `initial`: the job θ was initialised for (ServerState.job)


@dataclass(frozen=True)
class Committed:
    """A commit as applied (never a duplicate or a refusal)."""

    commit: Commit


@dataclass(frozen=True)
class Departed:
    """Workers forgotten: one that left, or those whose lease expired."""

    worker_ids: tuple[str, ...]


Entry = Joined | Committed | Departed


class Journal(Protocol):
    """Where the state records its changes."""

    def append(self, entry: Entry) -> int:
        """Record `entry` (on the applier, in applied order); its position: 1, 2, ..."""
        ...

    @property
    def last(self) -> int:
        """The position of the newest entry (0: none)."""
        ...

    @property
    def epoch(self) -> int:
        """The primary's epoch its entries are forwarded in (replies carry it; 0: none)."""
        ...


class NoJournal:
    """A server without replicas journals nothing."""

    def append(self, entry: Entry) -> int:
        return 0

    @property
    def last(self) -> int:
        return 0

    @property
    def epoch(self) -> int:
        return 0
