"""A gemps cluster on this machine: a server process, worker processes, observers, torn down together.

One harness for everything that runs gemps locally: the demo, the experiment runs, the chaos
tests and the benchmarks. Servers start on free ports and say so through a port file (written
last, via a rename); every process logs to its own file; leaving the `with` block stops the
workers (SIGTERM, then SIGKILL), closes the observers and stops the server gracefully.

    with LocalCluster(Path("runs/x"), server={"rule": "gem"}) as cluster:
        cluster.start_worker("worker-0", dataset="digits", epochs=2)
        status = cluster.observer().status()
        cluster.wait_workers()

Nothing here imports torch or the server: processes are started by command line (`python -m
gemps_cli ...`), options become flags by gemps.options' naming.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from gemps.client import Client
from gemps.options import to_argv
from gemps_worker.processes import GEMPS_COMMAND, ChildExitedError, launch, wait_for_port_file

POLL_SECONDS = 0.02


def free_port() -> int:
    """A TCP port free right now on loopback, for programs that cannot bind port 0 and report it
    (another process could take it first: rare)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def worker_argv(target: str, **options: object) -> list[str]:
    """`gemps worker --server TARGET --option value ...` (WorkerOptions fields as keywords)."""
    return [*GEMPS_COMMAND, "worker", "--server", target, *to_argv(options)]


class ChildProcess:
    """A child process that tells it is ready by writing a port file: one number per line.

    Subclasses give the command line (`command(port_file)`); `start()` waits for the file and
    returns its numbers, or raises with the child's log when it exits or times out first.
    """

    def __init__(self, *, log_path: Path | None = None, startup_timeout: float = 30.0, name: str = "child") -> None:
        self._dir = tempfile.TemporaryDirectory(prefix=f"gemps-{name}-")
        self.port_file = Path(self._dir.name) / "port"
        self.log_path = log_path or Path(self._dir.name) / f"{name}.log"
        self.startup_timeout = startup_timeout
        self.name = name
        self._process: subprocess.Popen[bytes] | None = None

    def command(self, port_file: Path) -> list[str]:
        raise NotImplementedError

    @property
    def pid(self) -> int:
        assert self._process is not None, "not started"
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return None if self._process is None else self._process.poll()

    def start_process(self) -> list[int]:
        """Start the child and wait for its port file; returns the numbers in it."""
        self._process = launch(self.command(self.port_file), self.port_file, log_path=self.log_path)
        try:
            return wait_for_port_file(
                self._process, self.port_file, timeout=self.startup_timeout, poll_seconds=POLL_SECONDS
            )
        except ChildExitedError as exited:
            raise RuntimeError(f"{self.name} exited with {exited.returncode}:\n{self.log()}") from None
        except TimeoutError:
            self.stop()
            raise TimeoutError(f"{self.name} not ready after {self.startup_timeout}s:\n{self.log()}") from None

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM (a graceful shutdown), then SIGKILL after `timeout`; returns the exit code."""
        process = self._process
        if process is None:
            return None
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        return process.returncode

    def kill(self) -> None:
        """SIGKILL: no shutdown, no final checkpoint."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()


class ServerProcess(ChildProcess):
    """`gemps server` as a child process; `with ServerProcess(rule="gem") as server: server.target`.

    Options are ServerConfig field names (`lease_ttl=2.0` becomes `--lease-ttl 2.0`). The gRPC
    and metrics ports default to 0 (free ports); the child reports them through its port file.
    `command` replaces how the server is launched (default: this interpreter, `-m gemps_cli`).
    """

    def __init__(
        self,
        *,
        log_path: Path | None = None,
        startup_timeout: float = 30.0,
        command: Sequence[str] = GEMPS_COMMAND,
        **options: object,
    ) -> None:
        super().__init__(log_path=log_path, startup_timeout=startup_timeout, name="server")
        self.options: dict[str, object] = {"host": "127.0.0.1", "port": 0, "metrics_port": 0, "data_port": 0, **options}
        self.launcher = tuple(command)
        self.port = 0
        self.metrics_port = -1

    @property
    def target(self) -> str:
        """host:port to dial: the address it binds (loopback when it binds every address)."""
        host = str(self.options["host"])
        return f"{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:{self.port}"

    def command(self, port_file: Path) -> list[str]:
        return [*self.launcher, "server", "--port-file", str(port_file), *to_argv(self.options)]

    def start(self) -> ServerProcess:
        self.port, self.metrics_port = self.start_process()
        return self

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class LocalCluster:
    """A server, worker processes and observer clients on this machine (a context manager).

    `folder` gets the logs: server.log (server-N.log after restarts) and NAME.log per process.
    """

    def __init__(
        self,
        folder: Path,
        *,
        server: Mapping[str, object] | None = None,
        server_command: Sequence[str] = GEMPS_COMMAND,
        stop_timeout: float = 30.0,
    ) -> None:
        self.folder = folder
        self.server_options = dict(server or {})
        self.server_command = tuple(server_command)
        self.stop_timeout = stop_timeout
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.servers: list[ServerProcess] = []  # the first, then one per restart
        self._observers: list[Client] = []

    @property
    def server(self) -> ServerProcess:
        return self.servers[-1]

    @property
    def target(self) -> str:
        return self.server.target

    def start_server(self, **overrides: object) -> ServerProcess:
        name = "server" if not self.servers else f"server-{len(self.servers)}"
        options: dict[str, Any] = {**self.server_options, **overrides}
        server = ServerProcess(log_path=self.folder / f"{name}.log", command=self.server_command, **options)
        self.servers.append(server)
        return server.start()

    def start_process(self, name: str, argv: Sequence[str]) -> subprocess.Popen[bytes]:
        """Any process of the run (a worker, a pool of worker loops), logging to NAME.log."""
        if name in self.processes:
            raise ValueError(f"a process named {name!r} is already part of this cluster")
        with open(self.folder / f"{name}.log", "wb") as log:
            process = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT)
        self.processes[name] = process
        return process

    def start_worker(self, name: str, **options: object) -> subprocess.Popen[bytes]:
        """A `gemps worker` process of this cluster; `options` are WorkerOptions fields."""
        return self.start_process(name, worker_argv(self.target, name=name, **options))

    def observer(self, **client_options: object) -> Client:
        """A Client of the current server that holds no lease (closed with the cluster)."""
        client = Client(self.target, **client_options)  # type: ignore[arg-type]
        self._observers.append(client)
        return client

    def running(self) -> bool:
        return any(process.poll() is None for process in self.processes.values())

    def wait_processes(self, timeout: float | None = None, poll: Callable[[], None] | None = None) -> dict[str, int]:
        """Wait until every process has exited (calling `poll` between looks); their exit codes."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.running():
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"processes still running after {timeout}s: {sorted(self.alive())}")
            if poll is not None:
                poll()
            time.sleep(POLL_SECONDS if poll is None else 0.0)
        return {name: process.returncode for name, process in self.processes.items()}

    def alive(self) -> list[str]:
        return [name for name, process in self.processes.items() if process.poll() is None]

    def failed(self) -> list[str]:
        """Processes that exited with a non-zero status."""
        return [name for name, process in self.processes.items() if process.poll() not in (None, 0)]

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text(errors="replace")

    def __enter__(self) -> LocalCluster:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.start_server()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop_processes()
        for client in self._observers:
            client.close()
        for server in self.servers:
            server.close()

    def stop_processes(self) -> None:
        """SIGTERM every process still running (they finish their step and leave), then SIGKILL
        what is left after `stop_timeout`."""
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout
        for process in self.processes.values():
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
