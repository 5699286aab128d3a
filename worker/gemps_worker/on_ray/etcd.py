"""The etcd a replicated Ray job's driver may start for its replicas' elections, as the driver
sees it: anything that starts, stops and says its endpoint."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class Etcd(Protocol):
    """An etcd the driver starts for a replicated job (gemps_server.replication.local_etcd.LocalEtcd:
    this package does not import the server, so `gemps ray` hands it over as `start_etcd`)."""

    endpoint: str

    def start(self) -> object: ...

    def stop(self) -> None: ...


#: makes an etcd whose clients reach it at the host it is given (the driver's address)
StartEtcd = Callable[[str], Etcd]
