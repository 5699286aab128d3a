"""The etcd a replicated Ray job's driver may start for its replicas' elections, as the driver
sees it: anything that starts, stops (and restarts), says its endpoint and hands out the client
credentials its replicas need; and how a replica's actor turns those credentials into files for
its server."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

#: the server option each credential's file is given as
CREDENTIAL_OPTIONS = {"ca": "etcd_ca", "cert": "etcd_cert", "key": "etcd_key"}


class Etcd(Protocol):
    """An etcd the driver starts for a replicated job (gemps_server.replication.local_etcd.LocalEtcd:
    this package does not import the server, so `gemps ray` hands it over as `start_etcd`)."""

    endpoint: str

    def start(self) -> object: ...

    def stop(self) -> None: ...

    def client_pems(self) -> dict[str, str]:
        """The PEM texts a client needs ("ca", "cert", "key"); {} when it takes anyone."""
        ...

    def running(self) -> bool: ...

    def restart(self) -> None:
        """Start it again after it died, on its data, endpoint and credentials (OSError: not back)."""
        ...


#: makes an etcd whose clients reach it at the host it is given (the driver's address)
StartEtcd = Callable[[str], Etcd]


def write_credentials(pems: Mapping[str, str]) -> tuple[Path, dict[str, str]]:
    """The driver's etcd credentials as files on this node, for the server's command line (which
    names files, never the secrets): a new 0700 folder of 0600 files; (the folder, the server
    options naming them)."""
    folder = Path(tempfile.mkdtemp(prefix="gemps-etcd-access-"))  # 0700
    options = {}
    for name, option in CREDENTIAL_OPTIONS.items():
        path = folder / f"{name}.pem"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as file:
            file.write(pems[name])
        options[option] = str(path)
    return folder, options
