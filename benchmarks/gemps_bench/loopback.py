"""A benchmark's server in a child process on a free loopback port (the echo ceilings, the
transport candidates): `with SomeServer() as server: server.target`."""

from __future__ import annotations

from types import TracebackType
from typing import TypeVar

from gemps_worker.cluster import ChildProcess

S = TypeVar("S", bound="LoopbackServer")


class LoopbackServer(ChildProcess):
    """Subclasses give `command(port_file)`: a child that binds `address` (127.0.0.1 unless a
    subclass serves elsewhere) on a free port and writes it to the port file. Killed on leaving
    the block."""

    def __init__(self, name: str, address: str = "127.0.0.1") -> None:
        super().__init__(name=name)
        self.address = address
        self.port = 0

    @property
    def target(self) -> str:
        return f"{self.address}:{self.port}"

    def __enter__(self: S) -> S:
        (self.port,) = self.start_process()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.kill()
        self.close()
