"""What the service sees of replication: one narrow port (`Replicas`), its null object
(`NoReplicas`) and the asyncio adapter that waits on it (`acknowledged`).

A replicated partition's primary answers workers, and acknowledges a commit only once its
backups applied it (DESIGN §3d); `gemps_server.replication` implements the port, and
`replication.layer()` composes it with the server. Without replicas the null object answers for
this process alone: always primary, every commit acknowledged at once, no replication record. The
service never asks which of the two it holds (as the state never asks which journal it has:
domain/journal.py's NoJournal).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Protocol

from gemps_proto.status import ReplicationStatus

# Called with a commit's outcome once it may be acknowledged (None) or must not be (the error).
Done = Callable[[BaseException | None], None]


class Replicas(Protocol):
    """A replicated partition's say in what this process answers."""

    def require_primary(self) -> None:
        """Unavailable (reason not_primary) unless this replica is its partition's primary now."""
        ...

    def status(self) -> ReplicationStatus | None:
        """Its role, epoch and backups now (Status, metrics); None: not replicated."""
        ...

    def when_replicated(self, position: int, done: Done) -> None:
        """`done(None)` once every in-sync replica applied journal `position`; `done(error)` when
        it may not be acknowledged (this replica lost its primacy). From any thread."""
        ...


class NoReplicas:
    """One replica: this process answers alone, and a commit applied is a commit acknowledged."""

    def require_primary(self) -> None:
        return None

    def status(self) -> ReplicationStatus | None:
        return None

    def when_replicated(self, position: int, done: Done) -> None:
        done(None)


# Stateless: one null object serves every service.
NO_REPLICAS = NoReplicas()


async def acknowledged(replicas: Replicas, position: int) -> None:
    """Wait until `replicas` acknowledged journal `position`; its refusal raised.

    The port answers from whichever thread learns the outcome (a backup's acknowledgement arrives
    on the forwarder's): the answer is handed to this loop. One given at once on the loop's own
    thread (NoReplicas, a position already acknowledged) settles here, with no trip through it.
    """
    loop = asyncio.get_running_loop()
    on_loop = threading.get_ident()
    replicated: asyncio.Future[None] = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if replicated.done():
            return
        if error is None:
            replicated.set_result(None)
        else:
            replicated.set_exception(error)

    def done(error: BaseException | None) -> None:
        if threading.get_ident() == on_loop:
            settle(error)
            return
        with contextlib.suppress(RuntimeError):  # loop closed: the server is stopping
            loop.call_soon_threadsafe(settle, error)

    replicas.when_replicated(position, done)
    await replicated
