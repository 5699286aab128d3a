"""Where the server is now: the address a client reaches partition 0 at, asked again when it moves.

A static address is the simple default (`gemps.Client("host:50051")`). When the server can move
(a partition restarted on another machine, on fresh ports), the client is handed something it can
ask again instead: a callable that returns the address, or an object with a `resolve()` method.
The client asks it when partition 0 stops answering; a partition other than 0 is found again
through partition 0, which re-announces the layout (DESIGN §3a).

    gemps.Client(lambda: lookup("gemps-partition-0"))         # a function of yours
    gemps.Client(PortFile("/run/gemps/port", host="10.0.0.5"))  # a server's `--port-file`

On Kubernetes the StatefulSet's DNS names already follow a moved pod: a static address is enough.

A replicated partition (`gemps server --replicas R`) is reached at any of its replicas:
"host1:50051|host2:50051". The one that is primary answers; the others refuse (`not_primary`),
and the client goes on to the next, round the set, until one answers (after a failover too).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable


@runtime_checkable
class Resolver(Protocol):
    """Anything that says where partition 0 (or the only server) can be reached now."""

    def resolve(self) -> str:
        """ "host:port" now; raise (any exception) when it cannot say: the client keeps the last."""
        ...


@dataclass(frozen=True)
class StaticAddress:
    """One address for good: the default, and what a plain string target means."""

    address: str

    def resolve(self) -> str:
        return self.address


@dataclass(frozen=True)
class Asking:
    """A function that returns the address (looked up in your service registry, say)."""

    ask: Callable[[], str]

    def resolve(self) -> str:
        return self.ask()


@dataclass(frozen=True)
class PortFile:
    """The gRPC port a `gemps server --port-file PATH` wrote (its first line), on `host`: a server
    that restarts on a free port (`--port 0`) is found again."""

    path: Path | str
    host: str = "127.0.0.1"

    def resolve(self) -> str:
        port = int(Path(self.path).read_text().split()[0])
        return f"{self.host}:{port}"


#: between the addresses of one partition's replicas, in a target or an announced layout
REPLICA_SEPARATOR = "|"


class Replicas:
    """A partition's replicas: each `resolve()` after the first names the next one, round the set
    (the client asks again only when the one it had failed or refused: not the primary)."""

    def __init__(self, addresses: Sequence[str]) -> None:
        if not addresses or any(not address for address in addresses):
            raise ValueError(f"replicas need an address each, not {list(addresses)!r}")
        self.addresses = tuple(addresses)
        self._next = 0

    @classmethod
    def parse(cls, target: str) -> Replicas:
        return cls(target.split(REPLICA_SEPARATOR))

    def resolve(self) -> str:
        address = self.addresses[self._next % len(self.addresses)]
        self._next += 1
        return address

    def prefer(self, address: str) -> None:
        """The next `resolve()` names `address`, one of the set (a replica found primary)."""
        self._next = self.addresses.index(address)

    def __repr__(self) -> str:
        return f"Replicas({REPLICA_SEPARATOR.join(self.addresses)!r})"


Target = str | Callable[[], str] | Resolver


def as_resolver(target: Target) -> Resolver:
    """The resolver a Client's `target` stands for."""
    if isinstance(target, str):
        return Replicas.parse(target) if REPLICA_SEPARATOR in target else StaticAddress(target)
    if isinstance(target, Resolver):
        return target
    if callable(target):
        return Asking(target)
    raise TypeError(f"target must be an address, a callable returning one or a Resolver, not {target!r}")
