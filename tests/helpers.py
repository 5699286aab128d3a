"""What the tests share: waiting, free ports, reading /metrics, and a server in this process.

`InProcessServer` runs the real ParameterServer (real gRPC, real port, real applier thread) on
a background event loop in the test process, like hivemind's background-server fixtures: fast
to start and open to inspection (`.server.state`). Tests where the process boundary is the point
(signals, restarts, a server without torch) use gemps_worker.cluster.ServerProcess instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar, TypeVar

import numpy as np
import pytest
from prometheus_client import disable_created_metrics
from prometheus_client.parser import text_string_to_metric_families

from gemps.client import Client
from gemps_proto.schema import TrainingConfig
from gemps_proto.schema_proto import tensor_from_proto, tensor_to_proto
from gemps_proto.tensor_codec import EncodedTensor
from gemps_server import logs
from gemps_server.app import ParameterServer
from gemps_server.config import ServerConfig
from gemps_server.domain.journal import Entry
from gemps_server.domain.rules import rule_catalog, with_rule_defaults
from tests.reserved_ports import TEST_PORTS

#: how many xdist workers' shares TEST_PORTS is cut into (more workers wrap around: still distinct
#: from the ephemeral range, only no longer from each other's)
PORT_SHARES = 16
# Each run walks its share from a place of its own: two pytest sessions on one host (a helper's
# beside the suite) have the same xdist worker names, and from one start they picked the same
# numbers in the same order, each taking the other's between pick and bind.
_next_port = itertools.count(os.getpid())


def free_port(*aliases: str) -> int:
    """A TCP port free right now on loopback, for a test that needs the number up front (a server
    restarted on its port, a command line): from this xdist worker's share of a band the suite keeps
    out of the ephemeral range (tests/reserved_ports.py), so no other test's connection is given it
    between pick and bind, nor while a restarted server is down, and no other worker picks it.
    `aliases`: loopback addresses (127.0.0.2) where the test binds the same number too, a relay for a
    server that advertises that address: free there as well. A number the kernel picked for
    127.0.0.1 is no such port: on an alias it may be any test's connection's (a flood dialling from
    127.0.0.2 takes thousands) or another worker's relay (EADDRINUSE in a fresh clone's suite)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    share_size = len(TEST_PORTS) // PORT_SHARES
    share_start = TEST_PORTS.start + (int(worker) if worker.isdigit() else 0) % PORT_SHARES * share_size
    for _ in range(share_size):
        port = share_start + next(_next_port) % share_size
        if all(port_free(port, host) for host in ("127.0.0.1", *aliases)):
            return port
    pytest.fail(f"no free port in {share_start}-{share_start + share_size - 1}")


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether `port` can be bound on `host` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


T = TypeVar("T")
TRAINING_FIELDS = frozenset(f.name for f in dataclasses.fields(TrainingConfig))


def training_names() -> frozenset[str]:
    """The names `gemps server` takes for the training config: its fields and every option a
    registered rule declares (a test's rule included while registered)."""
    return TRAINING_FIELDS | {option.name for option in rule_catalog().declared()}


def wait_for(
    condition: Callable[[], T | None],
    timeout: float = 30.0,
    what: str = "condition",
    poll: float = 0.05,
    *,
    tolerate: tuple[type[Exception], ...] = (),
    explain: Callable[[], str] | None = None,
) -> T:
    """Poll `condition` until it returns something truthy, and return that; fail at the deadline.

    Exceptions of the `tolerate` types count as "not yet" (a service still starting); `explain()`
    adds context (logs) to the failure.
    """
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while True:
        try:
            value = condition()
        except tolerate as error:
            value, last = None, error
        if value:
            return value
        if time.monotonic() > deadline:
            detail = f" (last error: {last!r})" if last is not None else ""
            pytest.fail(
                f"timed out after {timeout:g}s waiting for {what}{detail}" + (f"\n{explain()}" if explain else "")
            )
        time.sleep(poll)


def settled(read: Callable[[], T], expected: T, timeout: float = 10.0) -> T:
    """`read()` once it gives `expected`, else its value at the deadline. A server counts a call
    once the call's reply has left, so a client can hold the reply before the count moves."""
    deadline = time.monotonic() + timeout
    while (value := read()) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def gemps_export(*source: str, out: Path) -> subprocess.CompletedProcess[str]:
    """`gemps export SOURCE... --out OUT` in a process of its own, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "gemps_cli", "export", *source, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def scrape(url: str, timeout: float = 5.0) -> dict[str, float]:
    """A /metrics page as {sample name: value summed over its label sets}."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        text = response.read().decode()
    totals: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] += sample.value
    return dict(totals)


def scrape_series(url: str, timeout: float = 10.0) -> dict[str, float]:
    """A /metrics page as {series as written (`name{label="value"}`): value}."""
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        lines = reply.read().decode().splitlines()
    return {
        name: float(value)
        for line in lines
        if line and not line.startswith("#")
        for name, _, value in [line.rpartition(" ")]
    }


#: what the tests' replicas of one job prove themselves to each other with (--replication-secret-file)
TEST_REPLICATION_SECRET = "gemps-tests-replication-secret-0123456789"


def replication_secret_file() -> str:
    """A file holding TEST_REPLICATION_SECRET, 0600 (written whole: parallel runs may share it)."""
    path = Path(tempfile.gettempdir()) / f"gemps-tests-{os.getuid()}.secret"
    if not path.exists() or path.read_text() != TEST_REPLICATION_SECRET:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(TEST_REPLICATION_SECRET)
        tmp.chmod(0o600)
        tmp.replace(path)
    return str(path)


def server_config(**options: Any) -> ServerConfig:
    """A ServerConfig from flat option names, as `gemps server` takes them (`rule=`, `lease_ttl=`)."""
    training = {name: options.pop(name) for name in list(options) if name in training_names()}
    options.setdefault("memory_claims_dir", os.environ.get("GEMPS_MEMORY_CLAIMS_DIR", "auto"))  # conftest.py's
    return ServerConfig(training=TrainingConfig.from_flat(training), **options)


class InProcessServer:
    """`with InProcessServer(rule="gem") as server: server.target` (options as in server_config).

    Its log lines (text format) are kept for `log()`; while any runs, the gemps.server logger
    logs at INFO. Two at once in one test share their log lines; the level is restored when the
    last of them stops, in whatever order they stop (a test may stop a replica first).
    """

    _running: ClassVar[int] = 0  # servers of this class started and not yet stopped
    _level_before: ClassVar[int] = logging.NOTSET  # the logger's level before the first started

    def __init__(self, config: ServerConfig | None = None, **options: Any) -> None:
        """From `config` as given (a command's, parsed: its ports its own), or else from `options`."""
        if config is not None and options:
            raise TypeError(f"InProcessServer: a config or options, not both ({sorted(options)})")
        defaults = {"host": "127.0.0.1", "port": 0, "metrics_port": 0, "data_port": 0}
        self.config = config if config is not None else server_config(**{**defaults, **options})
        self.server = ParameterServer(self.config)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="in-process-server", daemon=True)
        self._log = io.StringIO()
        self._handler = logging.StreamHandler(self._log)
        self._handler.setFormatter(logs.formatter("text"))
        self._logger = logging.getLogger("gemps.server")
        self.stopped = False

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def metrics_port(self) -> int:
        return self.server.metrics_port

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> InProcessServer:
        disable_created_metrics()  # as `gemps server` does
        self._logger.addHandler(self._handler)
        if InProcessServer._running == 0:
            InProcessServer._level_before = self._logger.level
        InProcessServer._running += 1
        self._logger.setLevel(logging.INFO)
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self.server.start(), self._loop).result(timeout=30)
        except BaseException:
            self.stopped = True  # nothing to stop gracefully; leave the loop and the logger as found
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            self._release_logger()
            raise
        return self

    def stop(self, grace: float = 0.0) -> None:
        """Graceful shutdown (final checkpoint included), then the loop and its thread end."""
        if self.stopped:
            return
        self.stopped = True
        try:
            asyncio.run_coroutine_threadsafe(self.server.stop(grace), self._loop).result(timeout=60)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            self._loop.close()
            self._release_logger()

    def _release_logger(self) -> None:
        self._logger.removeHandler(self._handler)
        InProcessServer._running -= 1
        if InProcessServer._running == 0:
            self._logger.setLevel(InProcessServer._level_before)

    def log(self) -> str:
        return self._log.getvalue()

    def __enter__(self) -> InProcessServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def encoded(values: np.ndarray) -> EncodedTensor:
    """Values as a request would carry them (float32 wire bytes), for the state's methods."""
    return tensor_from_proto(tensor_to_proto(values))


def training(rule: str = "gem", **changes: Any) -> TrainingConfig:
    """The default training config with `rule` and other changes: fields (learning_rate=...) or the
    rule's options (momentum=...; one the rule does not take is refused where the rule is made)."""
    return TrainingConfig.from_flat({"rule": rule, **changes})


def rule_option(config: TrainingConfig, name: str) -> float:
    """The value of the rule's option `name` in `config` (its default where the config sets none)."""
    return with_rule_defaults(config).rule_options[name]


def start_partitions(start: Callable[..., InProcessServer], count: int, **options: Any) -> list[InProcessServer]:
    """`count` in-process servers holding the partitions of one θ, in θ order (workers reach
    partition 0; it announces the others at ":PORT", i.e. on the host workers reached it at).
    `count` 1 is a plain server. `start` is the start_server fixture (it stops them)."""
    if count == 1:
        return [start(**options)]
    common = {**options, "partitions": count}
    others = [start(**common, partition_index=index) for index in range(1, count)]
    addresses = ",".join(["", *(f":{server.port}" for server in others)])
    return [start(**common, partition_index=0, partition_addresses=addresses), *others]


class CommitLoops:
    """Clients committing `payload` in threads, as fast as replies come, until `stop()`: each
    registers `parameters` first and leaves at the end. `acked[i]` counts client i's acknowledged
    commits and `versions[i]` the versions its replies carried; `failures` collects what any raised."""

    def __init__(
        self,
        clients: list[Client],
        parameters: dict[str, np.ndarray],
        payload: np.ndarray | Callable[[], np.ndarray],  # or what makes each commit's
        kind: str = "gradient",
    ) -> None:
        self.clients = clients
        self.acked = [0] * len(clients)
        self.versions: list[list[int]] = [[] for _ in clients]
        self.epochs: list[list[int]] = [[] for _ in clients]  # of the primary that acknowledged (replicas)
        self.failures: list[BaseException] = []
        self._stop = threading.Event()
        self._parameters, self._payload, self._kind = parameters, payload, kind
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(len(clients))]

    def start(self) -> CommitLoops:
        for thread in self._threads:
            thread.start()
        return self

    def _run(self, index: int) -> None:
        client = self.clients[index]
        try:
            client.register(self._parameters)
            while not self._stop.is_set():
                payload = self._payload() if callable(self._payload) else self._payload
                committed = client.commit(payload, kind=self._kind)
                self.versions[index].append(committed.version)
                self.epochs[index].append(committed.epochs[0] if committed.epochs else 0)
                self.acked[index] += 1
            client.leave()
        except BaseException as error:  # reported by the test through `failures`
            self.failures.append(error)

    def wait_each(self, more: int, timeout: float, what: str) -> None:
        """Until every client has `more` acknowledged commits than now; fails at once, with what
        they raised, when a client failed (a test reading state next would otherwise read it early)."""
        baseline = list(self.acked)
        wait_for(
            lambda: all(a >= b + more for a, b in zip(self.acked, baseline, strict=True)) or self.failures,
            timeout,
            what,
        )
        if self.failures:
            pytest.fail(f"a client failed while waiting for {what}: {self.failures!r}")

    def stop(self, timeout: float = 60.0) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout)


def server_outcome(folder: Path, *argv: str, timeout: float = 120) -> tuple[int | None, list[str]]:
    """Run `gemps server ARGV` until it exits or serves (writes its port file, in `folder`): its
    exit status (None: it served, and was then stopped) and the lines of its output."""
    port_file, log = folder / "outcome.port", folder / "outcome.log"
    port_file.unlink(missing_ok=True)
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "gemps_cli", "server", "--port-file", str(port_file), *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        wait_for(lambda: process.poll() is not None or port_file.exists(), timeout, "the server to exit or serve")
    finally:
        serving = process.poll() is None
        if serving:  # stopped gracefully: a supervisor takes its partitions with it
            process.terminate()
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    return (None if serving else process.returncode), log.read_text().splitlines()


class KeptJournal:
    """A journal that keeps its entries in a list (a replicated primary's stands in)."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []

    def append(self, entry: Entry) -> int:
        self.entries.append(entry)
        return len(self.entries)

    @property
    def last(self) -> int:
        return len(self.entries)

    @property
    def epoch(self) -> int:
        return 1


def stop_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP `pid` and wait until every thread of it has stopped: the stop is asynchronous, and
    under load a thread ran on (and answered a request) after kill() had returned."""

    def states() -> set[str]:
        found = set()
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
                found.add((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        return found

    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: states() <= {"T", "t"}, timeout=timeout, what=f"every thread of {pid} stopped")
