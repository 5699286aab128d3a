"""Two `gemps server` processes on one machine, each given only its own --port (issue 43, item 8):
the ports beside gRPC's (data plane, replication, metrics) follow --port, so the second starts
where it used to stop at the first's data port, and each serves the data plane on its own; `ps`
tells them apart by their titles (item 6)."""

from __future__ import annotations

import argparse
import functools
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from gemps_cli import server as server_command

import gemps
from gemps_server.config.listen import DATA_PORT_OFFSET, METRICS_PORT_OFFSET, REPLICATION_PORT_OFFSET
from gemps_worker.processes import GEMPS_COMMAND, launch, wait_for_port_file
from tests.helpers import port_free, scrape_series, settled, wait_for
from tests.reserved_ports import SIDE_BY_SIDE_GRPC

STARTUP_SECONDS = 60.0


def command_line(pid: int) -> str:
    """What `ps -o args=` shows of process `pid` (its argv memory: the title, padded)."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()


def wait_for_title(pid: int, title: str) -> None:
    """Until process `pid` shows `title` (set once it serves: just after its port file)."""
    wait_for(lambda: command_line(pid) == title, 10, title)


def grpc_ports(count: int) -> list[int]:
    """`count` consecutive gRPC ports whose followers (data, replication, metrics) are all free now:
    in a band the suite keeps out of the ephemeral range (tests/reserved_ports.py), where the metrics
    port 9109 + (port - 50051) is a port too."""
    for _ in range(200):
        first = random.randrange(SIDE_BY_SIDE_GRPC.start, SIDE_BY_SIDE_GRPC.stop - count)
        ports = range(first, first + count)
        offsets = (0, DATA_PORT_OFFSET, REPLICATION_PORT_OFFSET, METRICS_PORT_OFFSET)
        if all(port_free(port + offset) for port in ports for offset in offsets):
            return list(ports)
    pytest.fail("no free run of ports")


class Servers:
    """`gemps server --port P` processes with every other port at its default."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.processes: list[subprocess.Popen[bytes]] = []

    def start(self, port: int, *argv: str) -> tuple[subprocess.Popen[bytes], list[int]]:
        port_file = self.folder / f"{port}.port"
        command = [*GEMPS_COMMAND, "server", "--port", str(port), "--port-file", str(port_file), *argv]
        process = launch(command, port_file, log_path=self.folder / f"{port}.log")
        self.processes.append(process)
        return process, wait_for_port_file(process, port_file, timeout=STARTUP_SECONDS, poll_seconds=0.05)

    def log(self, port: int) -> str:
        return (self.folder / f"{port}.log").read_text()

    def stop(self) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Servers]:
    running = Servers(tmp_path)
    yield running
    running.stop()


def test_two_servers_with_default_ports_both_serve_the_data_plane(servers: Servers) -> None:
    ports = grpc_ports(2)
    for port in ports:
        # TCP only: the data port itself is what must not collide (the Unix socket is per process).
        process, (grpc_port, metrics_port) = servers.start(port, "--shared-memory", "off")
        assert (grpc_port, metrics_port) == (port, port + METRICS_PORT_OFFSET)
        # Told apart in `ps` too (item 6): the title names the port, not `python3 -m gemps_cli`.
        wait_for_title(process.pid, f"gemps server :{port}")
        # The title took argv's room only: the environment a server started with is still readable.
        assert b"PATH=" in Path(f"/proc/{process.pid}/environ").read_bytes()
        assert f"data_port={port + DATA_PORT_OFFSET} " in servers.log(port)
    for port in ports:
        with gemps.Client(f"127.0.0.1:{port}", plane="data") as client:
            client.register({"w": np.zeros(8, np.float32)})
            assert client.planes == ["data"]
            assert client.commit(np.ones(8, np.float32)).version == 1
        url = f"http://127.0.0.1:{port + METRICS_PORT_OFFSET}/metrics"
        assert settled(functools.partial(data_plane_commits, url), [1.0]) == [1.0]


def data_plane_commits(url: str) -> list[float]:
    """The counts of the data plane's Commit calls on the /metrics page at `url`."""
    series = scrape_series(url)
    return [v for name, v in series.items() if "Commit" in name and 'plane="data"' in name and "_count{" in name]


def test_an_explicit_data_port_in_use_is_still_a_clear_error(servers: Servers) -> None:
    first, second = grpc_ports(2)
    servers.start(first)
    with pytest.raises(Exception, match="exited with 2"):
        servers.start(second, "--data-port", str(first + DATA_PORT_OFFSET))
    assert f"data plane: cannot listen on 127.0.0.1:{first + DATA_PORT_OFFSET}: Address already in use" in servers.log(
        second
    )


def test_help_says_what_the_followed_defaults_are() -> None:
    parser = argparse.ArgumentParser(prog="gemps server")
    server_command.add_arguments(parser)
    text = " ".join(parser.format_help().split())
    for default in ("default --port + 1000;", "default --port + 2000;", "default 9109 + (--port - 50051);"):
        assert default in text
    assert "default -2" not in text  # the marker the value holds is not what a user reads
