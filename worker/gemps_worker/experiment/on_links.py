"""Training runs across a link of a chosen rate (`gemps experiment --link 100mbit`, issue 47): the
server on one simulated host, the worker pools and the observer on another, the two cables shaped
to the rate (gemps_worker.simulated_hosts: network namespaces, tc tbf; root only). What a run then
measures is time to accuracy where θ's bytes cost what they cost between machines.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from gemps_worker.processes import GEMPS_COMMAND
from gemps_worker.simulated_hosts import SimulatedNetwork, inside, rate_bits_per_second, unavailable_reason


@dataclass(frozen=True)
class ServerPlacement:
    """Where a run's server starts: the command that launches `gemps`, and the address it binds and
    the workers dial."""

    command: tuple[str, ...] = tuple(GEMPS_COMMAND)
    host: str = "127.0.0.1"


#: the server beside the workers, on this machine's loopback
LOCAL = ServerPlacement()


def link_problem(rate: str) -> str | None:
    """Why runs across a link of `rate` cannot be made here (one line), or None when they can."""
    try:
        rate_bits_per_second(rate)
    except ValueError as error:
        return str(error)
    return unavailable_reason()


@contextlib.contextmanager
def between_hosts(rate: str) -> Iterator[ServerPlacement]:
    """Two simulated hosts cabled at `rate`; this process moves into the workers' one for the block
    (its worker pools and observer start there: call it before any thread that opens sockets), and
    the server's placement is yielded. RuntimeError naming why where the hosts cannot be made."""
    problem = link_problem(rate)
    if problem is not None:
        raise RuntimeError(f"runs across a link of {rate}: {problem}")
    with SimulatedNetwork(rate) as network:
        server, workers = network.add_host("server"), network.add_host("workers")
        with inside(workers.namespace):
            yield ServerPlacement(tuple(server.command(GEMPS_COMMAND)), server.address)
