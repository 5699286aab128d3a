"""The benchmark matrix: every system at every model size and client count, in one run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gemps_bench.ceilings import memcpy_bandwidth, memory_ceiling
from gemps_bench.echo import EchoClientFactory, EchoServer
from gemps_bench.echo_tcp import TcpEchoClientFactory, TcpEchoServer
from gemps_bench.gemps_load import GempsClientFactory
from gemps_bench.loadgen import LoadPlan, run_load
from gemps_bench.results import LoadResult
from gemps_bench.round_step import round_step_seconds
from gemps_proto import compiled_codes
from gemps_proto.grpc_framing import DEFAULT_CHUNK_BYTES
from gemps_worker.cluster import ServerProcess

CEILINGS = ("echo-unary", "echo-stream", "echo-tcp")
# gemps with the defaults, and each variant with what differs from them.
GEMPS_VARIANTS: dict[str, dict[str, str]] = {
    "gemps": {},
    "gemps-tcp": {"shared_memory": "off"},  # the data plane over TCP, as between machines
    "gemps-grpc": {"plane": "grpc"},  # commits and pulls through gRPC, not the data plane
    "gemps-bfloat16": {"wire": "bfloat16"},  # half the bytes on the wire
    "gemps-numpy": {"kernel": "numpy"},  # the fallback GEM kernel, without the compiled one
    "gemps-no-noise": {"noise_window": "1"},  # without the gradient noise scale's sums (its cost: the difference)
    "gemps-2p": {"partitions": "2"},  # θ split across 2 server processes
    "gemps-4p": {"partitions": "4"},  # and 4 (on this 2-core machine: oversubscribed)
    # What a big model meets (issue 79): GEM's compact state, the transformer recipe's rule, and
    # int8 codes both ways (the recipe's encoding), each alone against the defaults.
    "gemps-compact": {"gem_state": "compact"},
    "gemps-downpour": {"rule": "downpour"},
    "gemps-int8": {"compression": "int8"},
    "gemps-downpour-tcp": {"rule": "downpour", "shared_memory": "off"},
    "gemps-recipe-tcp": {"rule": "downpour", "compression": "int8", "shared_memory": "off"},  # between hosts
    # AdamW on the server, a round of the clients' gradients a step (the many-workers recipe)
    "gemps-adamw": {"rule": "adamw"},
    "gemps-adamw-tcp": {"rule": "adamw", "shared_memory": "off"},  # and between hosts
}
PARTITIONED = ("gemps-2p", "gemps-4p")
# The codec's passes this install runs (its server too, from the same tree): int8 codes cost 3-7x the
# CPU through numpy's (docs/PERFORMANCE.md, "`gemps plan` refitted"), so a run says which it ran.
CODES = "numpy" if compiled_codes.compiled is None else "compiled"
# torch-rpc: TensorPipe as it picks on one host (shared memory, cross-memory attach);
# torch-rpc-tcp: what it does between machines (its uv transport and basic channel).
PEERS = ("torch-rpc", "torch-rpc-tcp", "reference-p2p")
WORKER_COST = "worker-cost"
SYSTEMS = (*CEILINGS, *GEMPS_VARIANTS, *PEERS, WORKER_COST)


@dataclass(frozen=True)
class SuiteSpec:
    sizes: tuple[int, ...]
    clients: tuple[int, ...]
    peer_clients: tuple[int, ...]  # client counts the peers run at (a process per client)
    variant_clients: tuple[int, ...]  # client counts gemps' variants run at
    partition_clients: tuple[int, ...]  # client counts the partitioned variants (and K = 1) run at
    seconds: Callable[[int], tuple[float, float]]  # size -> (warm-up, window)
    worker_cost_repeats: int
    memory_fraction: float = 0.6  # skip cells estimated to need more of the available memory
    systems: tuple[str, ...] = SYSTEMS
    # The one cell (size, clients) every system but gemps itself runs at; none: as above, every size.
    others_at: tuple[int, int] | None = None

    def runs(self, system: str, clients: int, size: int) -> bool:
        if system not in self.systems:
            return False
        if self.others_at is not None and system != "gemps":
            return (size, clients) == self.others_at
        if system in PEERS:
            return clients in self.peer_clients
        if system in PARTITIONED:
            return clients in self.partition_clients
        if system in GEMPS_VARIANTS and system != "gemps":
            return clients in self.variant_clients
        return True


def select(
    spec: SuiteSpec,
    sizes: Sequence[int] | None = None,
    clients: Sequence[int] | None = None,
    systems: Sequence[str] | None = None,
) -> SuiteSpec:
    """`spec` narrowed to some cells (`gemps bench --sizes 1M --clients 8 --systems gemps,echo-unary`):
    chosen client counts apply to every chosen system, peers and variants included."""
    unknown = sorted(set(systems or ()) - set(SYSTEMS))
    if unknown:
        raise ValueError(f"unknown systems {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    chosen = tuple(systems) if systems else spec.systems
    counts = tuple(clients) if clients else None
    return replace(
        spec,
        sizes=tuple(sizes) if sizes else spec.sizes,
        clients=counts or spec.clients,
        peer_clients=counts or spec.peer_clients,
        variant_clients=counts or spec.variant_clients,
        partition_clients=counts or spec.partition_clients,
        systems=chosen,
        others_at=None if sizes or clients else spec.others_at,  # a chosen cell runs every chosen system
        worker_cost_repeats=spec.worker_cost_repeats if WORKER_COST in chosen else 0,
    )


def _full_seconds(size: int) -> tuple[float, float]:
    return (2.0, 6.0) if size <= 1_000_000 else (3.0, 10.0) if size <= 10_000_000 else (6.0, 20.0)


FULL = SuiteSpec(
    sizes=(100_000, 1_000_000, 10_000_000, 50_000_000),
    clients=(1, 8, 32, 100),
    peer_clients=(8,),
    variant_clients=(8,),
    partition_clients=(8, 32),
    seconds=_full_seconds,
    worker_cost_repeats=3,
)
# CI: every system and code path once, at sizes that take seconds; checks the harness, not the numbers.
# gemps at every size and client count; the ceilings, variants and peers once, at the last cell, where
# the report's tables compare them with gemps (each cell is a process start or two: about 2 s).
QUICK = SuiteSpec(
    sizes=(10_000, 300_000),
    clients=(1, 2),
    peer_clients=(2,),
    variant_clients=(2,),
    partition_clients=(2,),
    seconds=lambda size: (0.25, 0.75),  # enough for every cell to commit: the figures are the full suite's
    worker_cost_repeats=1,
    others_at=(300_000, 2),
)


def estimated_bytes(size: int, clients: int) -> int:
    """Memory a cell needs on this host: each client holds about four P-float buffers (gradient,
    serialized request, reply, decoded reply); the server (2n + 3) plus one per request in flight."""
    vector = 4 * size
    return clients * 4 * vector + (3 * clients + 3) * vector


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 8 << 30


def progress(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass
class SuiteResults:
    mode: str
    host: dict[str, Any]
    memcpy_bytes_per_second: float
    runs: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    worker_cost: dict[str, Any] = field(default_factory=dict)

    def add(self, result: LoadResult, **extra: Any) -> None:
        summary = result.summary() | extra
        summary["memory_ceiling_commits_per_second"] = memory_ceiling(
            result.num_parameters, self.memcpy_bytes_per_second
        )
        self.runs.append(summary)
        progress(
            f"{result.system:>14} P={result.num_parameters:>10,} n={result.clients:>3}: "
            f"{result.commits_per_second:8.2f} commits/s, p50 {summary['latency_p50_ms']:.0f} ms"
        )

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.__dict__, indent=1, default=float) + "\n")


def _gemps(system: str, clients: int, plan: LoadPlan, results: SuiteResults) -> None:
    """gemps with the gem rule (exact state, float32 both ways), as the variant `system` says."""
    variant = GEMPS_VARIANTS[system]
    wire, kernel = variant.get("wire", "float32"), variant.get("kernel", "auto")
    plane, partitions = variant.get("plane", "auto"), int(variant.get("partitions", "1"))
    shared_memory = variant.get("shared_memory", "on") == "on"
    noise_window = int(variant.get("noise_window", "0"))
    rule, gem_state = variant.get("rule", "gem"), variant.get("gem_state", "exact")
    compression = variant.get("compression", "none")  # the commit's codes and the reply's alike
    with ServerProcess(
        rule=rule,
        gem_kernel=kernel,
        gem_state=gem_state,
        noise_window=noise_window,
        metrics_port=-1,
        log_level="warning",
        max_workers=max(256, clients),
        partitions=partitions,
    ) as server:
        options: tuple[tuple[str, Any], ...] = (
            ("wire_dtype", wire),
            ("plane", plane),
            ("shared_memory", shared_memory),
        )
        if compression != "none":
            options += (("compression", compression), ("reply_compression", compression))
        result = run_load(system, GempsClientFactory(server.target, plan.num_parameters, options), plan, server.pid)
    # A round's step, told apart from its commits' own cost (`gemps plan` projects rounds of any size)
    share = plan.num_parameters // partitions  # each partition's rule steps its own slice
    rounds = {"round_step_ms": 1e3 * round_step_seconds(share)} if rule == "adamw" else {}
    results.add(
        result,
        wire_dtype=wire,
        gem_kernel=kernel,
        partitions=partitions,
        plane=plane,
        shared_memory=shared_memory,
        noise_window=noise_window,
        rule=rule,
        gem_state=gem_state,
        compression=compression,
        codes=CODES,
        **rounds,
    )


def _echo(plan: LoadPlan, results: SuiteResults, systems: Sequence[str]) -> None:
    grpc_echoes = [system for system in systems if system != "echo-tcp"]
    if grpc_echoes:
        with EchoServer() as echo:
            for system in grpc_echoes:
                factory = EchoClientFactory(echo.target, system == "echo-stream", DEFAULT_CHUNK_BYTES)
                results.add(run_load(system, factory, plan, echo.pid))
    if "echo-tcp" in systems:
        with TcpEchoServer() as tcp_echo:
            results.add(run_load("echo-tcp", TcpEchoClientFactory(tcp_echo.target), plan, tcp_echo.pid))


def _peer(name: str, size: int, clients: int, warmup: float, window: float, results: SuiteResults) -> None:
    from gemps_bench.peers import reference_p2p, torch_rpc

    runs: dict[str, Callable[..., LoadResult]] = {
        "torch-rpc": torch_rpc.run,
        "torch-rpc-tcp": torch_rpc.run_tcp,
        "reference-p2p": reference_p2p.run,
    }
    run = runs[name]
    try:
        results.add(run(size, clients, window, warmup))
    except Exception as error:  # a peer failing is a finding, not a reason to lose the run
        progress(f"{name} P={size:,} n={clients} failed: {error}")
        results.skipped.append({"system": name, "num_parameters": size, "clients": clients, "why": str(error)})


def run_suite(spec: SuiteSpec, mode: str, out: Path) -> SuiteResults:
    results = SuiteResults(
        mode=mode,
        host={"cpus": os.cpu_count(), "available_bytes": available_bytes(), "python": sys.version.split()[0]},
        memcpy_bytes_per_second=memcpy_bandwidth(),
    )
    progress(f"memcpy bandwidth {results.memcpy_bytes_per_second / 1e9:.1f} GB/s (read + write)")
    for size in spec.sizes:
        warmup, window = spec.seconds(size)
        for clients in spec.clients:
            need = estimated_bytes(size, clients)
            if need > spec.memory_fraction * results.host["available_bytes"]:
                why = f"needs ~{need / 2**30:.0f} GiB, {spec.memory_fraction:.0%} of available memory is the limit"
                results.skipped.append({"system": "all", "num_parameters": size, "clients": clients, "why": why})
                progress(f"skip P={size:,} n={clients}: {why}")
                continue
            plan = LoadPlan(size, clients, window, warmup)
            ceilings = [system for system in CEILINGS if spec.runs(system, clients, size)]
            if ceilings:
                _echo(plan, results, ceilings)
            for system in GEMPS_VARIANTS:
                if spec.runs(system, clients, size):
                    _gemps(system, clients, plan, results)
            for peer in PEERS:
                if spec.runs(peer, clients, size):
                    _peer(peer, size, clients, warmup, window, results)
            results.save(out)
    if spec.worker_cost_repeats:
        # In a fresh process: children forked from this one would count its buffers as theirs.
        command = [sys.executable, "-m", "gemps_bench.worker_cost", "--repeats", str(spec.worker_cost_repeats)]
        results.worker_cost = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    results.save(out)
    return results
