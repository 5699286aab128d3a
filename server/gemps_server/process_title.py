"""The server process's title: what `ps`, `top` and /proc/PID/cmdline show of it, so the
processes of a replicated or partitioned job tell apart at a glance (`gemps server partition 1
replica 0 primary :50051` rather than `python3 -m gemps_cli server`), the role kept current as a
replica becomes primary or backup."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

from gemps_server.config import ServerConfig

# How soon a change of role shows in the title: a failover takes a lease (seconds) anyway.
CHECK_SECONDS = 0.5


def server_title(config: ServerConfig, port: int, role: str = "") -> str:
    """`gemps server [partition I] [replica R] [ROLE] :PORT` (ROLE: primary, backup, candidate)."""
    words = ["gemps server"]
    if config.partitions > 1:
        words.append(f"partition {config.partition}")
    if config.replicas > 1:
        words.append(f"replica {config.replica}")
    if role:
        words.append(role.lower())
    return " ".join([*words, f":{port}"])


def supervisor_title(config: ServerConfig) -> str:
    """The process that runs a job's partitions and replicas, one child each."""
    counts = f"partitions {config.partitions}" if config.partitions > 1 else ""
    counts += (" " if counts else "") + (f"replicas {config.replicas}" if config.replicas > 1 else "")
    return f"gemps server supervisor {counts} :{config.port}"


def show(title: str) -> None:
    """Title this process `title`, in the room its command line had (a longer one is cut): the
    environment is left where it is (SPT_NOENV), so /proc/PID/environ still shows the GEMPS_*
    settings a server was started with, which operators and tools read."""
    os.environ.setdefault("SPT_NOENV", "1")  # read by setproctitle when it first sets a title
    import setproctitle

    setproctitle.setproctitle(title)


async def keep(config: ServerConfig, port: int, role: Callable[[], str]) -> None:
    """Show this server's title, with `role()` as it changes, until cancelled."""
    shown = ""
    while True:
        title = server_title(config, port, role())
        if title != shown:
            show(title)
            shown = title
        await asyncio.sleep(CHECK_SECONDS)
