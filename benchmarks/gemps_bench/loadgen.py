"""Closed-loop load: n clients, each committing a pre-made gradient as fast as replies come back.

Clients are threads spread over a few processes (one gRPC channel each, as separate workers
would have), so the client side gets every core the server does not use; the same driver runs
gemps and the echo ceilings, so their ratios compare servers, not client code. Processes are
started with `spawn`: gRPC does not survive fork.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Protocol

import numpy as np

from gemps_bench.procfs import WindowCpu, peak_rss, resident_bytes, tree_peak_rss
from gemps_bench.results import LoadResult, share_in_window
from gemps_server.allocator import keep_large_allocations

# Seconds a run may take beyond its warm-up and window before the driver gives up on it.
STRAGGLER_GRACE = 120.0


class CommitClient(Protocol):
    """One client of a system under test: a connection that commits and gets parameters back."""

    def commit(self, gradient: np.ndarray) -> int | None:
        """One round trip; returns the staleness the server reports (None where it has none)."""

    def close(self) -> None: ...


# Builds a connected client, given its index; must be picklable (a module-level callable).
ClientFactory = Callable[[int], CommitClient]


@dataclass(frozen=True)
class LoadPlan:
    num_parameters: int
    clients: int
    duration: float
    warmup: float
    processes: int = 0  # 0: one per core, at most one per client

    def process_count(self) -> int:
        wanted = self.processes or (os.cpu_count() or 1)
        return max(1, min(wanted, self.clients))


@dataclass
class _ClientRecord:
    index: int
    finished_at: list[float]
    latencies: list[float]
    staleness: list[int]
    error: str = ""
    # CPU seconds this record's client process used inside the window (all its client threads),
    # on one record per process: on 2 cores the clients share the machine with the server.
    process_cpu_seconds: float | None = None
    # On the same record: how far the process's resident memory rose over its clients' run (its
    # peak less what it held before making them), per client in it: a worker's own memory for a
    # model of this size (its gradient, θ's copy, codes and buffers), without the interpreter's.
    process_growth_bytes_per_client: int | None = None


def pre_made_gradient(num_parameters: int, seed: int) -> np.ndarray:
    """A small random gradient: GEM and SGD keep the central variable finite under it for hours."""
    return np.random.default_rng(seed).standard_normal(num_parameters, dtype=np.float32) * np.float32(1e-3)


def _client_thread(
    factory: ClientFactory, index: int, plan: LoadPlan, start: _Start, ready: threading.Barrier
) -> _ClientRecord:
    record = _ClientRecord(index, [], [], [])
    client: CommitClient | None = None
    try:
        gradient = pre_made_gradient(plan.num_parameters, seed=index)
        client = factory(index)
        ready.wait()  # the process's main thread then waits for every other process
        start_at = start.wait()
        time.sleep(max(0.0, start_at - time.monotonic()))
        end_at = start_at + plan.warmup + plan.duration
        while (began := time.monotonic()) < end_at:
            staleness = client.commit(gradient)
            done = time.monotonic()
            record.finished_at.append(done)
            record.latencies.append(done - began)
            if staleness is not None:
                record.staleness.append(staleness)
    except Exception as error:  # reported to the driver, which fails the run with it
        record.error = f"client {index}: {type(error).__name__}: {error}"
        ready.abort()
        start.go.set()  # nobody waits for a start that will not come
    finally:
        if client is not None:
            client.close()
    return record


class _Start:
    """The common start: every process reports its clients connected, then the driver sets the time."""

    def __init__(self, context: BaseContext, processes: int) -> None:
        self.connected = context.Barrier(processes + 1)  # every client process, and the driver
        self.at = context.Value("d", 0.0)
        self.go = context.Event()

    def wait(self) -> float:
        if not self.go.wait(STRAGGLER_GRACE):
            raise TimeoutError("the driver never started the run")
        return float(self.at.value)

    def release(self, delay: float = 0.2) -> None:
        self.at.value = time.monotonic() + delay
        self.go.set()


def _client_process(
    factory: ClientFactory, indices: list[int], plan: LoadPlan, start: _Start, out: mp.Queue[_ClientRecord]
) -> None:
    # The clients' best case, as the echo ceilings get it (gemps_server/allocator.py). An SDK worker
    # keeps its process's allocator; its connections keep the buffers its replies land in
    # (gemps/reply_buffers.py). A client thread's arena cannot hold a buffer past 64 MiB, so past
    # 16M float32s these threads too map such buffers afresh (docs/PERFORMANCE.md, "A reply into
    # pages kept").
    keep_large_allocations()
    before = resident_bytes(os.getpid())
    ready = threading.Barrier(len(indices) + 1)
    records: list[_ClientRecord] = []
    threads = [
        threading.Thread(target=lambda i=i: records.append(_client_thread(factory, i, plan, start, ready)))
        for i in indices
    ]
    for thread in threads:
        thread.start()
    window_cpu: float | None = None
    try:
        ready.wait(timeout=STRAGGLER_GRACE)
        start.connected.wait(timeout=STRAGGLER_GRACE)
        window_cpu = _cpu_in_window(start.wait() + plan.warmup, plan.duration)
    except (threading.BrokenBarrierError, TimeoutError):
        start.connected.abort()  # a client failed to connect: its record says why
    for thread in threads:
        thread.join()
    peak = peak_rss(os.getpid())
    growth = None if before is None or peak is None else (peak - before) // len(indices)
    for index, record in enumerate(records):
        record.process_cpu_seconds = window_cpu if index == 0 else None
        record.process_growth_bytes_per_client = growth if index == 0 else None
        out.put(record)


def _cpu_in_window(begin: float, duration: float) -> float:
    """This process's CPU seconds (user + system, every thread) from `begin` for `duration` seconds."""
    time.sleep(max(0.0, begin - time.monotonic()))
    before = os.times()
    time.sleep(max(0.0, begin + duration - time.monotonic()))
    after = os.times()
    return (after.user - before.user) + (after.system - before.system)


def run_load(system: str, factory: ClientFactory, plan: LoadPlan, server_pid: int | Sequence[int] | None) -> LoadResult:
    """Drive `plan.clients` clients from `factory` against a running server; count the window only.

    Every client connects (and registers) first; then a common start; commits completed in
    [start + warmup, start + warmup + duration] count. `server_pid` is the serving process, whose
    CPU time and memory are measured with its children's, or several separate processes (the
    partitions of θ on hosts of their own), each counted as one child.
    """

    context = mp.get_context("spawn")
    out: mp.Queue[_ClientRecord] = context.Queue()
    groups = [list(range(plan.clients))[p :: plan.process_count()] for p in range(plan.process_count())]
    start = _Start(context, len(groups))
    processes = [
        context.Process(target=_client_process, args=(factory, group, plan, start, out), daemon=True)
        for group in groups
    ]
    for process in processes:
        process.start()
    with contextlib.suppress(threading.BrokenBarrierError):  # a client failed: its record says why
        start.connected.wait(timeout=STRAGGLER_GRACE)
    start.release()
    start_at = start.at.value
    window = (start_at + plan.warmup, start_at + plan.warmup + plan.duration)
    servers = [server_pid] if isinstance(server_pid, int) else list(server_pid or ())
    cpus = [WindowCpu(pid, *window).start() for pid in servers]
    records = _collect(out, plan.clients, processes, deadline=start_at + plan.warmup + plan.duration + STRAGGLER_GRACE)
    for process in processes:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
    if errors := [r.error for r in records if r.error]:
        raise RuntimeError(f"{system}: {len(errors)} client(s) failed; first: {errors[0]}")
    peaks = [tree_peak_rss(pid) for pid in servers]
    result = _windowed(system, plan, records, window, sum(p or 0 for p in peaks) if peaks and all(peaks) else None)
    if cpus:
        result.machine_busy_fraction = cpus[0].machine_busy
    if len(cpus) == 1:
        result.server_cpu_seconds = cpus[0].seconds
        result.server_child_cpu_seconds = cpus[0].per_child
        result.server_shared_rss_bytes = cpus[0].shared_bytes
    elif cpus:
        each = [cpu.seconds for cpu in cpus]
        if all(seconds is not None for seconds in each):
            result.server_child_cpu_seconds = [float(seconds or 0.0) for seconds in each]
            result.server_cpu_seconds = sum(result.server_child_cpu_seconds)
        result.server_shared_rss_bytes = sum(cpu.shared_bytes or 0 for cpu in cpus)
    return result


def _collect(
    out: mp.Queue[_ClientRecord], expected: int, processes: Sequence[BaseProcess], deadline: float
) -> list[_ClientRecord]:
    records: list[_ClientRecord] = []
    while len(records) < expected:
        try:
            records.append(out.get(timeout=0.5))
        except queue.Empty:
            if not any(p.is_alive() for p in processes) and out.empty():
                codes = [p.exitcode for p in processes]
                raise RuntimeError(
                    f"client processes exited (codes {codes}) with {len(records)} of {expected} reports"
                ) from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(records)} of {expected} clients reported before the deadline") from None
    return sorted(records, key=lambda r: r.index)


def _windowed(
    system: str, plan: LoadPlan, records: list[_ClientRecord], window: tuple[float, float], rss: int | None
) -> LoadResult:
    begin, end = window
    latencies: list[float] = []
    staleness: list[int] = []
    counts: list[int] = []
    progress: list[float] = []
    for record in records:
        inside = [i for i, t in enumerate(record.finished_at) if begin <= t <= end]
        counts.append(len(inside))
        round_trips = zip(record.finished_at, record.latencies, strict=True)
        progress.append(sum(share_in_window(done - latency, done, begin, end) for done, latency in round_trips))
        latencies += [record.latencies[i] for i in inside]
        if record.staleness:
            staleness += [record.staleness[i] for i in inside]
    cpu = [r.process_cpu_seconds for r in records if r.process_cpu_seconds is not None]
    growth = [r.process_growth_bytes_per_client for r in records if r.process_growth_bytes_per_client is not None]
    return LoadResult(
        system=system,
        num_parameters=plan.num_parameters,
        clients=plan.clients,
        seconds=end - begin,
        latencies=latencies,
        per_client_commits=counts,
        per_client_progress=progress,
        server_peak_rss_bytes=rss,
        staleness=staleness or None,
        client_cpu_seconds=sum(cpu) if cpu else None,
        client_peak_growth_bytes=max(growth) if growth else None,
    )
