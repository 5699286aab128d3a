"""The Ray actors of a gemps job: a partition's server, a worker, the held-out evaluator.

Plain classes: gemps_worker.on_ray.job makes them Ray actors (`ray.remote(...).options(...)`)
with their resources, placement and restart policy, so they stay readable and testable as
classes. Each runs on whichever node Ray placed it and reaches the others through gemps' own
protocol, never through Ray's object store: Ray places, restarts and collects; gemps trains.

Torch is imported only inside the worker and evaluator methods, so a driver without torch can
launch a job on a cluster that has it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future, wait
from pathlib import Path
from typing import Any

import ray

from gemps.client import Client
from gemps.records import ServerStatus
from gemps.resolver import Resolver, StaticAddress
from gemps.retry import RetryPolicy
from gemps_proto import schema
from gemps_worker.cluster import ServerProcess
from gemps_worker.on_ray.addresses import ADDRESSES_FILE, NODE_LOSS_RETRY, write_addresses
from gemps_worker.on_ray.etcd import write_credentials
from gemps_worker.on_ray.records import (
    ActorPlace,
    ExportedModel,
    PartitionEndpoint,
    TimedEvaluation,
    WorkerContext,
    WorkerOutcome,
)
from gemps_worker.on_ray.tether import TetheredServer, earlier_ports, exit_with_raylet, life_of, stop_earlier
from gemps_worker.signals import configure_logging

log = logging.getLogger("gemps.ray")

TrainFunction = Callable[[WorkerContext], Any]

#: a partition's record of its job, node, ports and starts, in its folder: a restarted actor of the
#: same job on the same node serves on the same ports, which the layout and the workers already
#: name; on another node (its node lost) on fresh ones, which partition 0 then announces (a later
#: job over the same --work-dir resumes from the checkpoints there, on fresh ports)
STATE_FILE = "partition.json"
SERVER_LOG = "server.log"
START_ATTEMPTS = 5  # a restart may find its port held a moment longer by the server that died
START_RETRY_SECONDS = 1.0
OBSERVER_RETRY = RetryPolicy(max_attempts=3, initial_backoff=0.1, max_backoff=1.0)


def node_id() -> str:
    return str(ray.get_runtime_context().get_node_id())


def node_address() -> str:
    """This node's IP address as Ray knows it: where the others reach what runs here."""
    return str(ray.util.get_node_ip_address())


def restarted() -> bool:
    """This actor is a restart by Ray (the property warns about Ray's own use of an old API)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)


def this_life(metrics_port: int) -> ActorPlace:
    """Where this actor runs now: the driver tells a restarted actor by its new (node, pid)."""
    return ActorPlace(node_id(), node_address(), metrics_port, os.getpid())


def partition_folder(work_dir: str, job: str, index: int, replica: int = -1) -> Path:
    """Partition `index`'s folder on this node: checkpoints (so `gemps export WORK_DIR` assembles
    θ where the folders share storage), its server's log and its state file; a replica's is
    replica-<r> inside it (as `gemps server --replicas R` keeps them)."""
    root = Path(work_dir) if work_dir else Path(tempfile.gettempdir()) / "gemps-ray" / job
    folder = root / schema.partition_folder(index)
    return folder if replica < 0 else folder / f"replica-{replica}"


class PartitionServer:
    """One partition of θ: the real `gemps server` process on this actor's node, with its
    checkpoint folder and its own free gRPC, data-plane and metrics ports.

    Partition 0 is told the others' addresses (`addresses`, full HOST:PORT: they run on other
    nodes) and announces them from its addresses file, which `announce` rewrites when one moved.
    When the server exits by itself, the actor exits with it and Ray restarts the actor
    (`max_restarts`), which starts the server again on the same ports from its newest checkpoint,
    as `gemps server --partitions K` restarts a partition locally (on a fresh one where another
    process took one meanwhile; the driver announces it). The server never outlives its
    actor, nor the actor its raylet, and a restart stops an earlier life's server still running on
    its machine before it takes the folder (gemps_worker.on_ray.tether). When its node was lost, Ray
    restarts it on another node: there it starts on fresh ports from the newest checkpoint in
    --work-dir, which must then be storage every node sees (else it refuses to start from nothing).

    A replica (`replication`: the server's replica options, replica_index among them) needs no
    checkpoint to move: it joins as a backup, and the primary seeds it with its whole state.
    """

    def __init__(
        self,
        index: int,
        count: int,
        *,
        job: str,
        work_dir: str,
        host: str,
        server_options: Mapping[str, object],
        addresses: str = "",
        startup_timeout: float,
        replication: Mapping[str, object] | None = None,
        etcd_pems: Mapping[str, str] | None = None,
    ) -> None:
        configure_logging()
        self.index = index
        self._etcd_folder: Path | None = None  # the driver's etcd credentials, as files here
        self.replica = int(str(replication["replica_index"])) if replication else -1
        self.folder = partition_folder(work_dir, job, index, self.replica)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.job = job
        state = self._read_state()
        if not state and restarted() and self.replica < 0:
            raise RuntimeError(
                f"partition {index} restarted on node {node_id()[:12]} finds no record of job {job} in "
                f"{self.folder}: its checkpoints stayed on the node it left. Give --work-dir on storage "
                "every node sees so that a partition can move"
            )
        self.host = host or node_address()
        which = f"partition {index}" + (f" replica {self.replica}" if self.replica >= 0 else "")
        stop_earlier(state.get("server"), which)  # its ports and folder are then free
        earlier = state if state.get("node") == node_id() else {}  # another node: fresh ports
        ports = {key: earlier.get(key, 0) for key in ("port", "metrics_port")}
        partition: dict[str, object] = {}
        if count > 1:
            partition = {"partitions": count, "partition_index": index}
            if index == 0:
                partition["partition_addresses"] = f"@{self._addresses(addresses, again=bool(state))}"
        options: dict[str, Any] = {
            **server_options,
            **partition,
            # Others reach it at its node's address; a fresh replication port each start (its
            # address goes to etcd with its new incarnation).
            **(
                {**self._replication(replication), "advertise_host": self.host, "replication_port": 0}
                if replication
                else {}
            ),
            **self._etcd_access(etcd_pems),
            "host": self.host,
            "checkpoint_dir": str(self.folder),
        }
        self.starts = int(state.get("starts", 0)) + 1
        options["supervisor_pid"] = os.getpid()  # it dies with this actor
        self.tether = TetheredServer(lambda: self._start(options, ports, startup_timeout, which), which)
        self.server = self.tether.server
        self._write_state(self.server.port, self.server.metrics_port)
        self._observer: Client | None = None
        log.info("%s serving on %s:%d (start %d)", which, self.host, self.server.port, self.starts)

    def _replication(self, replication: Mapping[str, object]) -> dict[str, object]:
        """The replica options, the job's secret moved into a 0600 file (a flag's value is on the
        command line, which every local user reads)."""
        options = dict(replication)
        secret = options.pop("replication_secret", None)
        if secret:
            path = self.folder / "replication.secret"
            path.unlink(missing_ok=True)
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "w") as file:
                file.write(str(secret))
            options["replication_secret_file"] = str(path)
        return options

    def _start(
        self, options: Mapping[str, Any], ports: Mapping[str, int], startup_timeout: float, which: str
    ) -> ServerProcess:
        for attempt in range(1, START_ATTEMPTS + 1):
            chosen = earlier_ports(self.host, ports, which)  # each attempt: taken since the last one?
            server = ServerProcess(
                log_path=self.folder / SERVER_LOG, startup_timeout=startup_timeout, **{**options, **chosen}
            )
            try:
                return server.start()
            except RuntimeError:  # exited before serving: e.g. its port not yet released
                server.close()
                if attempt == START_ATTEMPTS:
                    raise
                log.warning("partition %d: server exited at start (attempt %d); retrying", self.index, attempt)
                time.sleep(START_RETRY_SECONDS)
        raise AssertionError("unreachable")

    def _etcd_access(self, pems: Mapping[str, str] | None) -> dict[str, str]:
        """The driver's etcd credentials as files of this node's (its private etcd admits only
        their holders), named by server options; removed when the actor stops."""
        if not pems:
            return {}
        self._etcd_folder, options = write_credentials(pems)
        return options

    def _read_state(self) -> dict[str, Any]:
        """This job's earlier start here ({} if none): its node, ports and starts."""
        try:
            state = json.loads((self.folder / STATE_FILE).read_text())
        except FileNotFoundError:
            return {}
        if state.get("job") != self.job:
            return {}
        numbers = {key: int(state[key]) for key in ("port", "metrics_port", "starts")}
        return {"node": str(state.get("node", "")), "server": state.get("server"), **numbers}

    def _write_state(self, port: int, metrics_port: int) -> None:
        state = {
            "job": self.job, "node": node_id(), "port": port, "metrics_port": metrics_port, "starts": self.starts,
            "server": life_of(self.server.pid),
        }  # fmt: skip
        tmp = self.folder / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(self.folder / STATE_FILE)

    def _addresses(self, addresses: str, *, again: bool) -> Path:
        """Partition 0's addresses file: the layout it was started with, or when it starts `again` in
        this job the newest one the driver announced (kept in the folder; the driver announces again
        when it sees this new life)."""
        path = self.folder / ADDRESSES_FILE
        if not (again and path.exists()):
            write_addresses(path, addresses)
        return path

    def announce(self, addresses: str) -> None:
        """Partition 0: announce this layout from now on (the driver's, when a partition moved).
        The actor runs one call at a time, so it is the file's only writer."""
        write_addresses(self.folder / ADDRESSES_FILE, addresses)
        log.info("partition 0 announces %s", addresses)

    def endpoint(self) -> PartitionEndpoint:
        return PartitionEndpoint(
            self.index,
            node_id(),
            self.host,
            self.server.port,
            self.server.metrics_port,
            self.server.pid,
            self.starts,
            str(self.folder),
            max(self.replica, 0),
        )

    def _client(self) -> Client:
        if self._observer is None:  # an observer: holds no lease
            self._observer = Client(f"{self.host}:{self.server.port}", timeout=10.0, retry=OBSERVER_RETRY)
        return self._observer

    def status(self) -> ServerStatus:
        return self._client().status()

    def export(self, target: str = "") -> ExportedModel:
        """θ and the buffers by name, as this server (partition 0: with the others') holds them now;
        `target`: partition 0's replicas ("A|B") instead, pulled from whichever is primary."""
        if target:
            # the whole call rides out a failover (NODE_LOSS_RETRY's attempts), each attempt 10 s
            with Client(target, timeout=120.0, attempt_timeout=10.0, retry=NODE_LOSS_RETRY) as client:
                central = client.pull()
        else:
            central = self._client().pull()
        return ExportedModel(central.version, {name: value.copy() for name, value in central.state_dict().items()})

    def stop(self) -> int | None:
        """A graceful shutdown (the final checkpoint); the server's exit status."""
        self.tether.stopping.set()
        if self._observer is not None:
            self._observer.close()
        code = self.server.stop(timeout=60.0)
        self.server.close()
        if self._etcd_folder is not None:
            shutil.rmtree(self._etcd_folder, ignore_errors=True)
        return code


class TrainingWorker:
    """A worker: the reference worker (`options`: gemps worker's WorkerOptions fields), or a
    user's training function given a WorkerContext. `stop()` and `node()` may be called while
    `train()` runs (the actor runs several calls at once). `target`: where partition 0 is now
    (default: `server` for good); its client retries long enough to ride out a partition's move.

    One training run per life: Ray retries `train()` when the actor stops answering, and when
    only the network did, the retry reaches this same life while its run goes on; it then waits
    for that run's outcome instead of training twice. A restarted life trains its budget again."""

    def __init__(
        self,
        index: int,
        count: int,
        server: str,
        *,
        options: Mapping[str, object] | None = None,
        train: TrainFunction | None = None,
        target: Resolver | None = None,
    ) -> None:
        configure_logging()
        exit_with_raylet(f"worker {index}")  # a life beside its restart would train twice
        self.index, self.count, self.server = index, count, server
        self.target = target or StaticAddress(server)
        self.options = dict(options or {})
        self.train_function = train
        self.metrics_port = -1
        self._metrics: Any = None
        if train is None:  # the reference worker's metrics; a user's function keeps its own
            from gemps_worker.metrics import WorkerMetrics

            self._metrics = WorkerMetrics()
            self.metrics_port = self._metrics.serve(0, host=node_address())
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._training = False
        self._outcome: Future[WorkerOutcome] = Future()
        self._first_commit = 0.0

    def node(self) -> ActorPlace:
        return this_life(self.metrics_port)

    def train(self) -> WorkerOutcome:
        with self._lock:
            again, self._training = self._training, True
        if again:
            return self._outcome.result()
        try:
            outcome = dataclasses.replace(self._train(), life=this_life(self.metrics_port))
        except BaseException as error:
            self._outcome.set_exception(error)
            raise
        self._outcome.set_result(outcome)
        return outcome

    def _train(self) -> WorkerOutcome:
        if self.train_function is not None:
            context = WorkerContext(self.server, self.index, self.count, node_id(), self._stop, self.target)
            value = self.train_function(context)
            return WorkerOutcome(self.index, node_id(), 0, 0, self._stop.is_set(), value=value)
        return self._reference_worker()

    def _reference_worker(self) -> WorkerOutcome:
        import torch

        from gemps_worker.training import StepRecord, WorkerHooks, WorkerOptions, run_worker

        options = WorkerOptions(
            **{"name": f"worker-{self.index}", "seed": self.index, **self.options, "server": self.server}  # type: ignore[arg-type]
        )
        torch.set_num_threads(options.threads)

        def first_commit(step: StepRecord) -> None:
            self._first_commit = self._first_commit or step.time

        hooks = WorkerHooks(on_step=first_commit)
        summary = run_worker(
            options, self._stop, hooks, metrics=self._metrics, target=self.target, retry=NODE_LOSS_RETRY
        )
        return WorkerOutcome(
            self.index,
            node_id(),
            summary.steps,
            summary.final_version,
            summary.stopped_early,
            summary.diverged,
            first_commit=self._first_commit,
        )

    def stop(self, timeout: float = 60.0) -> bool:
        """Ask the training loop to finish its step and leave; True once it has (or never ran)."""
        self._stop.set()
        with self._lock:
            if not self._training:
                return True
        wait([self._outcome], timeout)
        return self._outcome.done()


class HeldOutEvaluator:
    """`gemps evaluate` in an actor: evaluates θ every `interval` seconds (when the version moved),
    reports to the server, and keeps each result with its time for the driver. A restarted one
    (its node lost) starts its loop again from the θ of the moment. `target` as TrainingWorker's."""

    def __init__(self, options: Mapping[str, object], target: Resolver | None = None) -> None:
        from gemps_worker.evaluation_loop import EvaluatorOptions
        from gemps_worker.metrics import EvaluatorMetrics

        configure_logging()
        exit_with_raylet("evaluator")
        self.options = EvaluatorOptions(**options)  # type: ignore[arg-type]
        self.target = target or StaticAddress(self.options.server)
        self.metrics = EvaluatorMetrics()
        self.metrics_port = self.metrics.serve(0, host=node_address())
        self.results: list[TimedEvaluation] = []
        self.error = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="evaluator", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from gemps_worker.evaluation_loop import run_evaluator

        try:
            run_evaluator(
                self.options, self._stop, self._keep, metrics=self.metrics, target=self.target, retry=NODE_LOSS_RETRY
            )
        except Exception as error:  # reported to the driver, which goes on without figures
            self.error = f"{type(error).__name__}: {error}"
            log.exception("evaluator failed")

    def _keep(self, result: Any) -> None:
        self.results.append(TimedEvaluation(time.time(), result.version, result.loss, result.accuracy))

    def node(self) -> ActorPlace:
        return this_life(self.metrics_port)

    def since(self, after: float) -> tuple[list[TimedEvaluation], str]:
        """The evaluations made after unix time `after`, and the error that ended the loop ('' if
        none). The driver keeps them: a restarted evaluator starts with none, and each look sends
        only what is new."""
        return [result for result in self.results if result.time > after], self.error

    def final(self) -> TimedEvaluation | None:
        """Stop the periodic loop, then evaluate θ once more as it is now."""
        from dataclasses import replace

        from gemps_worker.evaluation_loop import run_evaluator

        self._stop.set()
        self._thread.join(timeout=60.0)
        before = len(self.results)
        once = replace(self.options, max_evaluations=1)
        run_evaluator(
            once, threading.Event(), self._keep, metrics=self.metrics, target=self.target, retry=NODE_LOSS_RETRY
        )
        return self.results[-1] if len(self.results) > before else None
