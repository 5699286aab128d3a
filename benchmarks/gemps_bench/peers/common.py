"""What the peer parameter servers share: the per-commit work, the client loop, and process handling.

Both peers do exactly gemps' work per commit (gemps' own GEM rule on a flat float32 central variable,
`PeerState`), their clients run the same closed loop (`commit_loop`) with the load generator's
pre-made gradients, and their processes are run by `run_processes`: one result per process through a
queue, every wait bounded, every process killed on failure or when done.

Processes come from a forkserver that has imported torch once: each child then costs a fork (ms, and
torch's pages shared with the forkserver) instead of a fresh interpreter importing torch (~1-2 s of CPU
and ~250 MB each), which is what lets 32 clients start on 2 cores. A child's RSS still counts the
pages it shares with the forkserver, so the server's peak RSS reads as if it had imported torch itself.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import re
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any

import numpy as np

from gemps_bench.loadgen import pre_made_gradient
from gemps_bench.procfs import WindowCpu, peak_rss
from gemps_bench.results import LoadResult, share_in_window
from gemps_proto.schema import PayloadKind, TrainingConfig
from gemps_server.allocator import keep_large_allocations
from gemps_server.domain.rules import CommitRule, create_rule
from gemps_server.domain.rules.base import StepContext
from gemps_worker.cluster import free_port

LOCALHOST = "127.0.0.1"
# Seconds every process gets to start and rendezvous, on top of a per-client share (2 cores, 33 processes).
STARTUP_SECONDS = 60.0
STARTUP_SECONDS_PER_CLIENT = 2.0
# Seconds after the window for the last commits, the final reports and the process exits.
SHUTDOWN_SECONDS = 60.0
# How long a process may be gone without its report before the run is declared failed (queue latency).
REPORT_GRACE_SECONDS = 3.0


class PeerError(RuntimeError):
    """A peer run failed: a process raised, died, or missed the deadline."""


@dataclass(frozen=True)
class Placement:
    """Where a peer's processes run: all on this host over loopback (the default), or its server on
    one simulated host and its clients on another (network namespaces, gemps_worker.simulated_hosts),
    the server listening on its host's address."""

    server_address: str = LOCALHOST
    server_namespace: str | None = None
    clients_namespace: str | None = None


@dataclass(frozen=True)
class PeerConfig:
    num_parameters: int
    clients: int
    duration: float
    warmup: float = 1.0
    seed: int = 0
    keep_final_theta: bool = False  # tests: report each client's last central variable (P floats each)
    placement: Placement = Placement()

    def __post_init__(self) -> None:
        if self.num_parameters < 1 or self.clients < 1 or self.duration <= 0 or self.warmup < 0:
            raise ValueError(f"invalid peer configuration: {self}")

    def deadline_seconds(self) -> float:
        """The most a whole run may take, start to last exit."""
        startup = STARTUP_SECONDS + STARTUP_SECONDS_PER_CLIENT * self.clients
        return startup + self.warmup + self.duration + SHUTDOWN_SECONDS


def initial_theta(num_parameters: int, seed: int) -> np.ndarray:
    """The central variable every run starts from (deterministic, so tests can replay it)."""
    return np.random.default_rng((seed, 0xCE)).standard_normal(num_parameters, dtype=np.float32) * np.float32(0.1)


def client_gradient(num_parameters: int, seed: int, client: int) -> np.ndarray:
    """Client `client`'s pre-made gradient: the load generator's, so peers and gemps get the same payloads."""
    return pre_made_gradient(num_parameters, seed=seed + client)


class PeerState:
    """A peer's server side of one commit, the same as gemps': theta moved by gemps' GEM rule (with the
    default training config), one commit at a time.

    Not thread-safe: a peer serialises calls to `apply` its own way (a lock, a single serving loop).
    """

    def __init__(self, num_parameters: int, seed: int) -> None:
        training = TrainingConfig(rule="gem")
        self.theta = initial_theta(num_parameters, seed)
        self.version = 0
        self._rule: CommitRule = create_rule(training, num_parameters)
        self._scale = np.float32(-training.learning_rate)
        self._version_sent: dict[str, int] = {}  # the version of the theta each client holds

    def add_client(self, client_id: str) -> None:
        self._rule.add_worker(client_id, self.theta)
        self._version_sent[client_id] = self.version

    def staleness(self, client_id: str) -> int:
        """Commits applied since `client_id` got theta: what its next gradient is stale by."""
        return self.version - self._version_sent[client_id]

    def apply(self, client_id: str, gradient: np.ndarray) -> int:
        """Apply a client's gradient (overwritten: it is the update's scratch) and return its staleness.

        The caller must hand theta, now at `self.version`, back to that client before any other commit.
        """
        staleness = self.staleness(client_id)
        np.multiply(gradient, self._scale, out=gradient)  # in place: no P-sized copy per commit
        # In place, unless the update comes near float32's range (then a new array: see rules/base.py).
        self.theta, _ = self._rule.step(
            self.theta, gradient, StepContext(client_id, staleness, kind=PayloadKind.UPDATE)
        )  # scaled above
        self.version += 1
        self._version_sent[client_id] = self.version
        return staleness


@dataclass(frozen=True)
class Window:
    """A run's timeline on time.monotonic() (system-wide on Linux, so every process shares it)."""

    start: float  # the common start; clients wait for it
    warmup: float
    duration: float

    @property
    def measure_from(self) -> float:
        return self.start + self.warmup

    @property
    def measure_to(self) -> float:
        return self.measure_from + self.duration

    def contains(self, instant: float) -> bool:
        return self.measure_from <= instant <= self.measure_to


@dataclass
class ClientReport:
    """What one client measured: its commits that completed inside the window, and its totals."""

    latencies: list[float] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    total_commits: int = 0  # warm-up and late commits included
    progress: float = 0.0  # commits in the window, those at its edges by their share inside
    final_theta: np.ndarray | None = None


@dataclass
class ServerReport:
    peak_rss_bytes: int | None
    commits_applied: int
    cpu_seconds: float | None = None  # the server process's CPU time inside the window
    machine_busy: float | None = None  # the share of the machine's cores busy inside the window


def commit_loop(commit: Callable[[], int], window: Window) -> ClientReport:
    """Commit back to back from the common start until the window closes (the load generator's closed loop).

    `commit` is one round trip (send the gradient, get theta back) and returns the commit's staleness.
    """
    report = ClientReport()
    time.sleep(max(0.0, window.start - time.monotonic()))
    while (began := time.monotonic()) < window.measure_to:
        staleness = commit()
        done = time.monotonic()
        report.total_commits += 1
        report.progress += share_in_window(began, done, window.measure_from, window.measure_to)
        if window.contains(done):
            report.latencies.append(done - began)
            report.staleness.append(staleness)
    return report


def build_result(
    system: str, config: PeerConfig, clients: Sequence[ClientReport], server: ServerReport, notes: str
) -> LoadResult:
    extra: dict[str, Any] = {}
    if config.keep_final_theta:
        extra["total_commits"] = [c.total_commits for c in clients]
        extra["final_theta"] = [c.final_theta for c in clients]
    return LoadResult(
        system=system,
        num_parameters=config.num_parameters,
        clients=config.clients,
        seconds=config.duration,
        latencies=[latency for c in clients for latency in c.latencies],
        per_client_commits=[len(c.latencies) for c in clients],
        per_client_progress=[c.progress for c in clients],
        server_peak_rss_bytes=server.peak_rss_bytes,
        server_cpu_seconds=server.cpu_seconds,
        machine_busy_fraction=server.machine_busy,
        staleness=[s for c in clients for s in c.staleness],
        notes=notes,
        extra=extra,
    )


def own_peak_rss() -> int | None:
    return peak_rss(os.getpid())


def own_window_cpu(window: Window) -> WindowCpu:
    """This process's CPU time inside the window (the server side of a peer), sampled by a thread."""
    return WindowCpu(os.getpid(), window.measure_from, window.measure_to).start()


def set_rendezvous_env(port: int, address: str = LOCALHOST) -> None:
    """torch.distributed's env:// rendezvous (forkserver children do not inherit the parent's environment)."""
    os.environ["MASTER_ADDR"] = address
    os.environ["MASTER_PORT"] = str(port)


@dataclass(frozen=True)
class ChildSpec:
    """One process of a run: `target(*args)` is its whole life; what it returns is its report (picklable).
    With `namespace`, it runs inside that simulated host (see Placement)."""

    name: str
    target: Callable[..., Any]
    args: tuple[Any, ...]
    namespace: str | None = None


def _enter_host(namespace: str) -> None:
    from gemps_worker.simulated_hosts import INTERFACE, enter_namespace

    enter_namespace(namespace)  # first: the threads torch starts later inherit it
    # gloo and TensorPipe listen on the address the machine's hostname resolves to, which is not
    # in this host: name its interface instead.
    os.environ["GLOO_SOCKET_IFNAME"] = os.environ["TP_SOCKET_IFNAME"] = INTERFACE


def _child_entry(
    out: mp.Queue[tuple[str, str, Any]],
    name: str,
    target: Callable[..., Any],
    args: tuple[Any, ...],
    namespace: str | None,
) -> None:
    keep_large_allocations()  # the same allocator settings as gemps' processes get
    try:
        if namespace is not None:
            _enter_host(namespace)
        out.put(("ok", name, target(*args)))
    except BaseException:  # the parent fails the run with this traceback
        out.put(("error", name, traceback.format_exc()))
        raise


def _forkserver_context(preload: Sequence[str]) -> mp.context.ForkServerContext:
    context = mp.get_context("forkserver")
    # Only takes effect if this process's forkserver is not running yet; otherwise children import
    # what they need themselves (slower, same result).
    context.set_forkserver_preload(list(preload))
    return context


#: tries of a run whose rendezvous port was taken: picked free, it is bound a moment later by a
#: child process, and another program may be given it between (a loaded test suite's Ray did)
PORT_TRIES = 3
#: what a child's failure says when the run's processes never met, so nothing was measured: the
#: port taken, or torch RPC's start-up gather failing (once in a loaded suite, a trainer aborted
#: inside tensorpipe while joining, std::bad_alloc: possibly a stranger on the taken port)
NEVER_MET = ("EADDRINUSE", "Address already in use", "in _all_gather")


#: what a failure says when a signal ended one of the run's processes before the harness stopped
#: any (a negative exit code): the peer's own native code gave up. TensorPipe did now and then, on
#: TCP and over shared memory: SIGABRT mostly, and once in a loaded suite another signal.
ABORTED = re.compile(r"exited with code -\d+")


def once_more_if_aborted(run: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], str | None]:
    """`run()`'s reports, from a second run where a signal ended one of the first run's processes
    (ABORTED), with the first run's failure to note beside the result (None when it ran once). Any
    other failure, or a second such death, is raised."""
    try:
        return run(), None
    except PeerError as error:
        if ABORTED.search(str(error)) is None:
            raise
        print(f"gemps bench: a peer's process aborted, running it once more: {error}", file=sys.stderr)
        return run(), str(error).splitlines()[0]


def on_a_free_port(run: Callable[[int], dict[str, Any]]) -> dict[str, Any]:
    """`run(port)` on a port free when picked; on another, saying why, if its processes never met."""
    for _ in range(PORT_TRIES - 1):
        try:
            return run(free_port())
        except PeerError as error:
            if not any(sign in str(error) for sign in NEVER_MET):
                raise
            print(f"gemps bench: a peer's processes did not meet, trying another port: {error}", file=sys.stderr)
    return run(free_port())


def run_processes(children: Sequence[ChildSpec], timeout: float, preload: Sequence[str]) -> dict[str, Any]:
    """Run the processes together and return each one's report by name.

    Raises PeerError, after killing every process, if one raises, dies without reporting, or the
    reports are not all in within `timeout` seconds.
    """
    context = _forkserver_context(preload)
    out: mp.Queue[tuple[str, str, Any]] = context.Queue()
    processes: dict[str, BaseProcess] = {
        child.name: context.Process(
            target=_child_entry,
            args=(out, child.name, child.target, child.args, child.namespace),
            name=child.name,
            daemon=True,
        )
        for child in children
    }
    try:
        for process in processes.values():
            process.start()
        reports = _collect(out, processes, time.monotonic() + timeout)
        for process in processes.values():
            process.join(timeout=10.0)  # reported already: exits are cleanup, never worth failing the run
        return reports
    finally:
        _stop_all(processes.values())
        out.close()
        out.cancel_join_thread()


def _collect(out: mp.Queue[tuple[str, str, Any]], processes: dict[str, BaseProcess], deadline: float) -> dict[str, Any]:
    reports: dict[str, Any] = {}
    gone_since: dict[str, float] = {}
    while len(reports) < len(processes):
        now = time.monotonic()
        missing = [name for name in processes if name not in reports]
        if now > deadline:
            raise PeerError(f"timed out waiting for reports from {', '.join(missing)}")
        try:
            status, name, payload = out.get(timeout=min(0.5, deadline - now))
        except queue.Empty:
            _check_alive(processes, missing, gone_since)
            continue
        if status != "ok":
            raise PeerError(f"process {name} failed{_killed_beside(processes, name)}:\n{payload}")
        reports[name] = payload
    return reports


def _killed_beside(processes: dict[str, BaseProcess], failed: str, wait_s: float = 1.0) -> str:
    """The others of the run that a signal ended, named: a failure is often only the echo of one
    (a trainer's SIGABRT in TensorPipe reaches its server as an EOF), and the caller may judge by
    the cause. Each gets up to `wait_s` to be reaped: its death and the failure arrive together."""
    give_up = time.monotonic() + wait_s
    killed = []
    for other, process in processes.items():
        if other != failed:
            process.join(timeout=max(0.0, give_up - time.monotonic()))
            if process.exitcode is not None and process.exitcode < 0:
                killed.append(f"{other} exited with code {process.exitcode}")
    return f" ({', '.join(killed)} meanwhile)" if killed else ""


def _check_alive(processes: dict[str, BaseProcess], missing: list[str], gone_since: dict[str, float]) -> None:
    """Fail once a process has been gone a while without its report (killed, crashed in native code)."""
    now = time.monotonic()
    for name in missing:
        exitcode = processes[name].exitcode
        if exitcode is None:
            continue
        if now - gone_since.setdefault(name, now) > REPORT_GRACE_SECONDS:
            raise PeerError(f"process {name} exited with code {exitcode} without reporting")


def _stop_all(processes: Iterable[BaseProcess]) -> None:
    alive = [p for p in processes if p.is_alive()]
    for process in alive:
        process.terminate()
    for process in alive:
        process.join(timeout=5.0)
        if process.is_alive():
            process.kill()
            process.join(timeout=5.0)
