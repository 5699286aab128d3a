"""`gemps server --partitions K --replicas R` on one machine: one server process per partition
of θ and replica of it.

Partition i listens on the configured port + i (its data plane on the data port + i), keeps its checkpoints in
`<checkpoint_dir>/partition-<i>`, and logs as `gemps.server[partition i]`. The metrics port
serves every partition's metrics as one target (each sample labelled `partition="i"`, plus
`gemps_partition_up`); the partitions' own metrics listen on free loopback ports. Partitions 1..K-1
start first; partition 0 starts last, told where the others are (":PORT": the host a worker
reached partition 0 at), so a worker that can register has the whole layout. A partition that
dies is started again on its port, from its checkpoints (as Kubernetes restarts a pod); SIGTERM
or SIGINT stops them all gracefully. The exit status is the worst of the partitions'.

The partitions die with the supervisor (each is given its pid: gemps_server.supervision), and
the supervisor holds `<checkpoint_dir>/gemps.lock` while it runs, so a second supervisor on the same
directory is refused rather than started beside it (gemps_server.directory_lock).

With replicas (R > 1), replica r of partition i listens on the ports + i + r * K (replica 0 where a
partition without replicas would), keeps its checkpoints in `partition-<i>/replica-<r>`, and all
of them share one etcd: --etcd, or a private one this supervisor starts (replication/local_etcd.py,
a new job each run), which only the job's processes can reach (TLS with the job's own client
certificate, given to the replicas as --etcd-ca/--etcd-cert/--etcd-key files in its 0700 folder)
and which is started again, on the same data, when it dies. Workers are given every replica of a
partition: "host:P0|host:P1" (the layout partition 0 announces says so too), and go to whichever
is primary.

Children are configured through GEMPS_* variables (flags > variables > defaults in each), so a
token never appears on a command line.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from gemps.options import env_var, values_of
from gemps_proto.schema import partition_folder
from gemps_server.config import ServerConfig
from gemps_server.directory_lock import DirectoryLock
from gemps_server.replication import LocalEtcd, with_generated_secret
from gemps_worker.processes import GEMPS_COMMAND, ChildExitedError, launch, wait_for_port_file

log = logging.getLogger("gemps.partitions")

POLL_SECONDS = 0.1
STARTUP_TIMEOUT_SECONDS = 60.0
RESTART_DELAY_SECONDS = 1.0
# A partition that cannot start this many times in a row (exit 2: bad configuration, a port in
# use, an unusable checkpoint) stops the whole server rather than retrying forever.
MAX_FAILED_STARTS = 3
EXIT_CANNOT_START = 2


@dataclass
class PartitionProcess:
    """The child server process that holds one partition of θ, and where it serves."""

    index: int
    config: ServerConfig
    port_file: Path
    replica: int = 0
    process: subprocess.Popen[bytes] | None = None
    port: int = 0  # bound, once started: a restart reuses it (the layout names it)
    metrics_port: int = -1
    failed_starts: int = 0
    exit_codes: list[int] = field(default_factory=list)
    restart_at: float | None = None  # exited: started again at this time.monotonic()
    starting_since: float | None = None  # started again, its port file not written yet

    def environment(self) -> dict[str, str]:
        values = values_of(replace(self.config, port=self.port or self.config.port, port_file=str(self.port_file)))
        env = {key: value for key, value in os.environ.items() if not key.startswith("GEMPS_")}
        env.update({env_var(name): str(value) for name, value in values.items()})
        return env

    def start(self) -> None:
        self.process = launch([*GEMPS_COMMAND, "server"], self.port_file, env=self.environment())

    def metrics_text(self) -> str | None:
        """Its /metrics page; None while it does not answer (restarting)."""
        if self.metrics_port <= 0:
            return None
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2) as response:
                return str(response.read().decode())
        except OSError:
            return None

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_SECONDS) -> bool:
        """True once its port file is there; False if it exited first or `timeout` passed."""
        assert self.process is not None
        try:
            ports = wait_for_port_file(self.process, self.port_file, timeout=timeout, poll_seconds=POLL_SECONDS)
        except (ChildExitedError, TimeoutError):
            return False
        self.port, self.metrics_port = ports
        return True

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def ready_now(self) -> bool | None:
        """Without waiting: True once its port file is there, False if it exited first, else None."""
        if self.port_file.exists():
            self.port, self.metrics_port = (int(line) for line in self.port_file.read_text().split())
            return True
        return None if self.running() else False


def child_config(
    config: ServerConfig, index: int, addresses: str = "", replica: int = 0, etcd: str = ""
) -> ServerConfig:
    """Partition `index`'s (replica `replica`'s) configuration: its own ports and checkpoint
    directory (and for partition 0, the `addresses` of all, unless the operator gave them)."""

    def offset(port: int) -> int:
        return port + index + replica * config.partitions if port > 0 else port  # 0: any free port

    checkpoints = str(Path(config.checkpoint_dir) / partition_folder(index)) if config.checkpoint_dir else ""
    if checkpoints and config.replicas > 1:
        checkpoints = str(Path(checkpoints) / f"replica-{replica}")
    return replace(
        config,
        partition_index=index if config.partitions > 1 else -1,
        replica_index=replica if config.replicas > 1 else -1,
        etcd=etcd or config.etcd,
        port=offset(config.port),
        data_port=offset(config.data_port),
        replication_port=offset(config.replication_port),
        # Its metrics on a free loopback port: the supervisor serves them all on metrics_port.
        metrics_port=-1 if config.metrics_port < 0 else 0,
        metrics_host="127.0.0.1",
        checkpoint_dir=checkpoints,
        partition_addresses=config.partition_addresses or (addresses if index == 0 else ""),
        supervisor_pid=os.getpid(),  # it dies with this process
        # Each process admits its share of the host's memory, not all of it (issue 61, item 9).
        memory_share=config.memory_share * config.partitions * config.replicas,
    )


class PartitionMetrics:
    """Every partition's metrics as one Prometheus target: the families of each one's /metrics
    (its samples already labelled with its partition) merged by name, and `gemps_partition_up`."""

    def __init__(self, partitions: list[PartitionProcess]) -> None:
        self._partitions = partitions

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        replicated = any(partition.config.replicas > 1 for partition in self._partitions)
        labels = ["partition", "replica"] if replicated else ["partition"]
        up = GaugeMetricFamily("gemps_partition_up", "1 while the partition's server answers, else 0.", labels=labels)
        for partition in list(self._partitions):
            text = partition.metrics_text()
            values = [str(partition.index), str(partition.replica)] if replicated else [str(partition.index)]
            up.add_metric(values, 0 if text is None else 1)
            for family in text_string_to_metric_families(text or ""):
                merged = families.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type, family.unit)
                )
                merged.samples.extend(family.samples)
        yield from families.values()
        yield up


class PartitionSupervisor:
    def __init__(self, config: ServerConfig) -> None:
        partitioned = config.partitions > 1 and config.partition_index == -1
        replicated = config.replicas > 1 and config.replica_index == -1
        if not (partitioned or replicated):
            raise ValueError("the supervisor runs all partitions or replicas of a server (partitions or replicas >= 2)")
        self._dir = tempfile.TemporaryDirectory(prefix="gemps-partitions-")  # 0700: this user's alone
        # Replicas all started here share a secret generated for them (a 0600 file in it).
        self.config = config = with_generated_secret(config, Path(self._dir.name))
        self.partitions: list[PartitionProcess] = []  # in θ order, once started
        self._stopping = threading.Event()
        self.metrics_port = -1
        self._directory = DirectoryLock(config.checkpoint_dir) if config.checkpoint_dir else None
        self._etcd: LocalEtcd | None = None  # a private etcd, when replicas have none given

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        try:
            try:  # before any partition starts: a second supervisor is refused here, in one line
                self._hold_directory()
                self._serve_metrics()
            except OSError as error:
                log.error("cannot start: %s", error)
                return EXIT_CANNOT_START
            if not self._start_all():
                return self._stop_all() or EXIT_CANNOT_START
            self._say_where()  # before the port file: whoever waits on it finds the line logged
            self._write_port_file()
            while not self._stopping.wait(POLL_SECONDS):
                self._keep_etcd_alive()
                # Every partition each poll, none waited for: replicas that died together start
                # again together, and one dying while others start is seen at once (issue 61).
                if not all([self._tend(partition) for partition in self.partitions]):
                    self._stopping.set()
                    return self._stop_all() or EXIT_CANNOT_START
            return self._stop_all()
        finally:
            if self._etcd is not None:
                self._etcd.stop()
            self._dir.cleanup()
            if self._directory is not None:
                self._directory.release()

    def _hold_directory(self) -> None:
        """The checkpoint directory of every partition, for this supervisor alone."""
        if self._directory is None:
            return
        note = self._directory.acquire()
        if note is not None:
            log.warning("checkpoint directory %s: %s", self._directory.directory, note)

    def _start_all(self) -> bool:
        """Partitions 1..K-1 (each replica), then partition 0 told their ports; False if one could
        not start."""
        config, folder = self._with_private_etcd(self.config), Path(self._dir.name)
        etcd = config.etcd

        # All replicas, or the one this supervisor was given (a container holding one replica of
        # every partition: the others run elsewhere, and --partition-addresses names them).
        mine = range(config.replicas) if config.replica_index < 0 else [config.replica_index]

        def started(index: int, addresses: str = "") -> list[PartitionProcess]:
            replicas = [
                PartitionProcess(
                    index, child_config(config, index, addresses, r, etcd), folder / f"{index}-{r}.port", r
                )
                for r in mine
            ]
            for replica in replicas:
                replica.start()
            return replicas

        for index in range(1, config.partitions):
            self.partitions += started(index)
        if not all(partition.wait_ready() for partition in self.partitions):
            return False
        announced = [
            "|".join(f":{p.port}" for p in self.partitions if p.index == i) for i in range(1, config.partitions)
        ]
        first = started(0, ",".join(["", *announced]) if config.partitions > 1 else "")
        self.partitions[:0] = first
        return all(partition.wait_ready() for partition in first)

    # -- the private etcd ---------------------------------------------------------------------------

    def _with_private_etcd(self, config: ServerConfig) -> ServerConfig:
        """`config` as the replicas get it: with no --etcd, pointed at a private etcd started here
        for the job's life (its endpoint, CA and client certificate)."""
        if config.replicas == 1 or config.etcd:
            return config
        self._etcd = LocalEtcd().start()
        access = self._etcd.access
        log.info(
            "replicas decide their primary through a private etcd at %s (TLS, the job's certificate)",
            self._etcd.endpoint,
        )
        return replace(config, etcd=self._etcd.endpoint, etcd_ca=access.ca, etcd_cert=access.cert, etcd_key=access.key)

    def _keep_etcd_alive(self) -> None:
        """A private etcd that died is started again on its data, ports and certificates: the
        replicas' keys survive, and they reconnect by themselves. One that cannot come back (its
        port taken meanwhile) is tried again at the next poll."""
        etcd = self._etcd
        if etcd is None or etcd.running() or self._stopping.is_set():
            return
        log.warning(
            "the private etcd exited (status %s); starting it again on its data in %s", etcd.exit_code, etcd.data_dir
        )
        try:
            etcd.restart()
        except OSError as error:
            log.error("the private etcd did not start again (%s); trying again", error)
            self._stopping.wait(RESTART_DELAY_SECONDS)

    def workers_target(self, host: str = "127.0.0.1") -> str:
        """Where workers go: partition 0, every replica of it ("host:P0|host:P1")."""
        return "|".join(f"{host}:{p.port}" for p in self.partitions if p.index == 0)

    def _say_where(self) -> None:
        ports = ", ".join(str(partition.port) for partition in self.partitions)
        if self.config.replicas == 1:
            log.info("serving %d partitions on ports %s", len(self.partitions), ports)
            return
        log.info(
            "serving %d partitions x %d replicas on ports %s; workers: --server '%s'",
            self.config.partitions,
            self.config.replicas,
            ports,
            self.workers_target(),
        )

    def _tend(self, partition: PartitionProcess) -> bool:
        """One look at a partition: one that exited is started again RESTART_DELAY_SECONDS later, on
        its port; one starting is ready, or failed (or late) and tried again; False after too many
        failed starts in a row."""
        which = f"partition {partition.index}" + (f" replica {partition.replica}" if self.config.replicas > 1 else "")
        now = time.monotonic()
        if partition.starting_since is not None:
            ready = partition.ready_now()
            late = now - partition.starting_since > STARTUP_TIMEOUT_SECONDS
            if ready:
                partition.starting_since, partition.failed_starts = None, 0
                log.info("%s started again on port %d", which, partition.port)
            elif ready is False or late:
                partition.starting_since, partition.failed_starts = None, partition.failed_starts + 1
                if partition.failed_starts >= MAX_FAILED_STARTS:
                    log.error("%s failed to start %d times: stopping", which, partition.failed_starts)
                    return False
                if late and partition.process is not None:
                    partition.process.kill()
        if partition.starting_since is None and partition.restart_at is None and not partition.running():
            assert partition.process is not None
            code = partition.process.wait()
            partition.exit_codes.append(code)
            log.warning("%s exited with status %d; starting it again", which, code)
            partition.restart_at = now + RESTART_DELAY_SECONDS
        if partition.restart_at is not None and now >= partition.restart_at:
            partition.restart_at, partition.starting_since = None, now
            partition.start()
        return True

    def _stop_all(self) -> int:
        """SIGTERM every partition (each shuts down gracefully); the worst exit status."""
        for partition in self.partitions:
            if partition.running():
                assert partition.process is not None
                partition.process.send_signal(signal.SIGTERM)
        codes = []
        for partition in self.partitions:
            if partition.process is not None:
                codes.append(partition.process.wait())
        return max((code for code in codes if code > 0), default=0)

    def _serve_metrics(self) -> None:
        if self.config.metrics_port < 0:
            return
        registry = CollectorRegistry(auto_describe=True)
        registry.register(PartitionMetrics(self.partitions))
        host = self.config.metrics_host or self.config.host
        try:
            server, _thread = start_http_server(self.config.metrics_port, addr=host, registry=registry)
        except OSError as error:
            raise OSError(f"metrics: cannot listen on {host}:{self.config.metrics_port}: {error.strerror}") from None
        self.metrics_port = server.server_port

    def _write_port_file(self) -> None:
        """Partition 0's gRPC port, where workers go, and the metrics port (as one server writes them)."""
        if not self.config.port_file:
            return
        tmp = Path(self.config.port_file + ".tmp")
        tmp.write_text(f"{self.partitions[0].port}\n{self.metrics_port}\n")
        tmp.replace(self.config.port_file)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._stopping.set()
