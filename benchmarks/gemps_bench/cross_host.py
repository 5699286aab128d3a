"""Between hosts: gemps, its bfloat16 wire, its compressed commits (int8, int4 codes up, float32
replies down, or difference replies in the same codes: "-both"; top-k up, int4 differences down:
"-topk-int4"), the socket ceiling and the TCP peers on simulated hosts
with real links (gemps_worker.simulated_hosts), gemps with K = 1, 2, 4 partitions on hosts of their own.

Hosts p0 .. p{K_max-1} hold the servers (one partition each; the other systems' server on p0),
their cables shaped to the link's rate. One host, "clients", holds every client: it stands for the
many worker machines of a real job, so its cable gets K_max times the rate, and the partitions'
links, not one shared client cable, are what is measured. The clients run inside their host, in a
load process (this module's `main`: loadgen's closed loop, as `gemps bench` drives it) that prints
its LoadResult as JSON; the peers' processes are placed in the hosts by `peers.common.Placement`.
Between hosts gemps' SDK takes the data plane over TCP on its own (its local socket is out of reach).

Every figure is a ratio within the run: the payload's share of the links' rate (one way:
commits/s x payload bytes per commit / (K x rate)), each system against echo-tcp between the same
hosts, and gemps with K partitions against one.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gemps_bench.echo_tcp import TcpEchoClientFactory, TcpEchoServer
from gemps_bench.gemps_load import GempsClientFactory
from gemps_bench.loadgen import STRAGGLER_GRACE, ClientFactory, LoadPlan, run_load
from gemps_bench.results import LoadResult
from gemps_bench.suite import CODES, FULL, QUICK, available_bytes, progress
from gemps_proto.tensor_codec import COMPRESSIONS, expected_payload_nbytes
from gemps_worker.cluster import ServerProcess
from gemps_worker.processes import GEMPS_COMMAND
from gemps_worker.simulated_hosts import Host, SimulatedNetwork, rate_bits_per_second

SYSTEMS = (
    *("echo-tcp", "gemps", "gemps-bfloat16", "gemps-int8", "gemps-int4", "gemps-int8-both", "gemps-int4-both"),
    *("gemps-topk-int4", "torch-rpc-tcp", "reference-p2p"),
)
#: run when asked (--systems), not by default: the adamw rule's rounds between hosts
OPTIONAL_SYSTEMS = ("gemps-adamw",)
#: gemps' variants as the clients' options (the gemps system: float32 both ways)
GEMPS_OPTIONS: dict[str, tuple[tuple[str, object], ...]] = {
    "gemps": (("wire_dtype", "float32"),),
    "gemps-bfloat16": (("wire_dtype", "bfloat16"),),
    "gemps-int8": (("wire_dtype", "float32"), ("compression", "int8")),
    "gemps-int4": (("wire_dtype", "float32"), ("compression", "int4")),
    "gemps-int8-both": (("wire_dtype", "float32"), ("compression", "int8"), ("reply_compression", "int8")),
    "gemps-int4-both": (("wire_dtype", "float32"), ("compression", "int4"), ("reply_compression", "int4")),
    "gemps-topk-int4": (("wire_dtype", "float32"), ("compression", "topk"), ("reply_compression", "int4")),
    "gemps-adamw": (("wire_dtype", "float32"),),
}
#: the server's rule where it is not GEM: AdamW on the server, a round of the clients' gradients a
#: step (a commit that joins a round is answered with no θ: its reply bytes are not θ's each commit)
RULES = {"gemps-adamw": "adamw"}
PEERS = ("torch-rpc-tcp", "reference-p2p")
PORT, DATA_PORT = 50051, 51051  # gemps' ports on each partition host
CLIENTS_HOST = "clients"
# Seconds a load process may take beyond its warm-up and window: start-up, registration, reports.
LOAD_GRACE = STRAGGLER_GRACE + 60.0


@dataclass(frozen=True)
class CrossHostSpec:
    rate: str = "1gbit"
    sizes: tuple[int, ...] = (100_000, 1_000_000, 10_000_000)
    clients: tuple[int, ...] = (8,)
    partitions: tuple[int, ...] = (1, 2, 4)  # gemps' K; the other systems run with one server
    systems: tuple[str, ...] = SYSTEMS
    quick: bool = False  # the quick suite's seconds per cell (CI), else the full suite's

    def __post_init__(self) -> None:
        rate_bits_per_second(self.rate)
        known = (*SYSTEMS, *OPTIONAL_SYSTEMS)
        unknown = sorted(set(self.systems) - set(known))
        if unknown:
            raise ValueError(f"not run between hosts: {', '.join(unknown)}; choose from {', '.join(known)}")
        if not self.partitions or min(self.partitions) < 1:
            raise ValueError(f"partition counts must be >= 1: {self.partitions}")

    def seconds(self, size: int) -> tuple[float, float]:
        """The suite's warm-up and window, the window three times as long from 10M up: 8 clients'
        round over one 1 Gbit/s link takes ~5 s there (they fall into step: all upload, then all
        download), and a 10 s window would count only two of them."""
        if self.quick:
            return QUICK.seconds(size)
        warmup, window = FULL.seconds(size)
        return (warmup, 3 * window if size >= 10_000_000 else window)

    def cells(self) -> list[tuple[str, int]]:
        """(system, K) in the order they run: the ceiling first, then gemps by K, then the rest."""
        found = [("echo-tcp", 1)] if "echo-tcp" in self.systems else []
        found += [("gemps", k) for k in self.partitions] if "gemps" in self.systems else []
        return found + [(system, 1) for system in self.systems if system not in ("echo-tcp", "gemps")]

    @property
    def hosts_needed(self) -> int:
        return max(k for _, k in self.cells()) if self.cells() else 1


def payload_bytes(system: str, num_parameters: int) -> tuple[int, int]:
    """Bytes of a commit's payload up and of θ in its reply down (a difference reply's, past the
    first reply's whole bfloat16 θ)."""
    options = dict(GEMPS_OPTIONS.get(system, ()))
    whole = num_parameters * (2 if options.get("wire_dtype") == "bfloat16" else 4)

    def coded(option: str) -> int:
        chosen = options.get(option)
        return whole if chosen is None else expected_payload_nbytes(COMPRESSIONS[str(chosen)], [num_parameters])

    return coded("compression"), coded("reply_compression")


def link_figures(system: str, partitions: int, result: LoadResult, rate: str) -> dict[str, Any]:
    """What a run reached of its links: payload MB/s the busier way (all links), and of the K links' rate."""
    up, down = payload_bytes(system, result.num_parameters)
    busier = result.commits_per_second * max(up, down)
    links = partitions * rate_bits_per_second(rate) / 8
    return {
        "partitions": partitions,
        "payload_bytes_per_commit": max(up, down),
        "commit_bytes_per_commit": up,
        "reply_bytes_per_commit": down,
        "payload_bytes_per_second_each_way": busier,
        "link_fraction": busier / links,
    }


def path_fields(system: str) -> dict[str, Any]:
    """What a gemps cell ran, as `gemps bench` records its cells (gemps_bench.capacity.path_of reads
    them): the rule, the wire, the codes each way, the data plane over TCP (between hosts)."""
    if system not in GEMPS_OPTIONS:
        return {}
    options = dict(GEMPS_OPTIONS[system])
    compression = str(options.get("compression", "none"))
    return {
        "rule": RULES.get(system, "gem"),
        "wire_dtype": options["wire_dtype"],
        "compression": compression,
        "reply_compression": str(options.get("reply_compression", "none")),
        "codes": CODES,
        "shared_memory": False,
    }


def _load_argv(system: str, target: str, plan: LoadPlan, server_pids: Sequence[int]) -> list[str]:
    return [
        *(sys.executable, "-m", "gemps_bench.cross_host", "--system", system, "--target", target),
        *("--size", str(plan.num_parameters), "--clients", str(plan.clients)),
        *("--warmup", str(plan.warmup), "--window", str(plan.duration)),
        *("--server-pids", ",".join(str(pid) for pid in server_pids)),
    ]


def _load(host: Host, system: str, target: str, plan: LoadPlan, server_pids: Sequence[int]) -> LoadResult:
    """Run one system's load inside `host` and read back its result."""
    done = subprocess.run(
        host.command(_load_argv(system, target, plan, server_pids)),
        capture_output=True,
        text=True,
        timeout=plan.warmup + plan.duration + LOAD_GRACE,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{system}'s load process exited with {done.returncode}: {done.stderr[-2000:]}")
    return LoadResult(**json.loads(done.stdout.splitlines()[-1]))


class CrossHostRun:
    """The simulated hosts of one run and the servers each cell starts on them."""

    def __init__(self, network: SimulatedNetwork, spec: CrossHostSpec, logs: Path) -> None:
        self.spec, self.logs = spec, logs
        self.servers = [network.add_host(f"p{i}") for i in range(spec.hosts_needed)]
        clients_rate = f"{spec.hosts_needed * rate_bits_per_second(spec.rate):.0f}bit"
        self.clients = network.add_host(CLIENTS_HOST, clients_rate)

    def measure(self, system: str, partitions: int, plan: LoadPlan) -> LoadResult:
        if system == "echo-tcp":
            host = self.servers[0]
            with TcpEchoServer(host.address, host.command([])) as echo:
                return _load(self.clients, system, echo.target, plan, [echo.pid])
        if system in PEERS:
            return self._peer(system, plan)
        with contextlib.ExitStack() as stack:
            servers = [stack.enter_context(self._partition(system, partitions, i, plan)) for i in range(partitions)]
            target = f"{self.servers[0].address}:{PORT}"
            return _load(self.clients, system, target, plan, [server.pid for server in servers])

    def _partition(self, system: str, partitions: int, index: int, plan: LoadPlan) -> ServerProcess:
        host = self.servers[index]
        options: dict[str, Any] = {
            "host": host.address, "port": PORT, "data_port": DATA_PORT, "rule": RULES.get(system, "gem"),
            "metrics_port": -1, "log_level": "warning", "max_workers": max(256, plan.clients),
        }  # fmt: skip
        if partitions > 1:
            addresses = ",".join(f"{h.address}:{PORT}" for h in self.servers[:partitions])
            options |= {"partitions": partitions, "partition_index": index, "partition_addresses": addresses}
            # The simulated hosts share this machine's memory: without a share the first partition's
            # budget claims all of it, and the others admit no worker at 100M (RESOURCE_EXHAUSTED).
            options |= {"memory_share": partitions}
        log = self.logs / f"{system}-k{partitions}-p{index}.log"
        return ServerProcess(log_path=log, command=host.command(GEMPS_COMMAND), **options)

    def _peer(self, system: str, plan: LoadPlan) -> LoadResult:
        from gemps_bench.peers import reference_p2p, torch_rpc
        from gemps_bench.peers.common import PeerConfig, Placement

        host = self.servers[0]
        placement = Placement(host.address, host.namespace, self.clients.namespace)
        config = PeerConfig(plan.num_parameters, plan.clients, plan.duration, plan.warmup, placement=placement)
        return torch_rpc.measure(config, tcp=True) if system == "torch-rpc-tcp" else reference_p2p.measure(config)


def run_cross_host(spec: CrossHostSpec, out: Path) -> dict[str, Any]:
    """Every cell of `spec` between simulated hosts; the results (also written to `out`, JSON)."""
    clients_rate = spec.hosts_needed * rate_bits_per_second(spec.rate)
    data: dict[str, Any] = {
        "mode": "cross-host" + (" quick" if spec.quick else ""),
        "rate": spec.rate,
        "link_bytes_per_second": rate_bits_per_second(spec.rate) / 8,
        "clients_link_bytes_per_second": clients_rate / 8,
        "host": {"cpus": os.cpu_count(), "available_bytes": available_bytes(), "python": sys.version.split()[0]},
        "runs": [],
        "skipped": [],
    }
    with SimulatedNetwork(spec.rate) as network, tempfile.TemporaryDirectory(prefix="gemps-cross-host-") as logs:
        run = CrossHostRun(network, spec, Path(logs))
        progress(f"{len(run.servers)} server hosts at {spec.rate}, the clients' host at {clients_rate / 1e9:g} Gbit/s")
        for size in spec.sizes:
            warmup, window = spec.seconds(size)
            for clients in spec.clients:
                plan = LoadPlan(size, clients, window, warmup)
                for system, partitions in spec.cells():
                    _cell(run, data, system, partitions, plan)
                    _save(data, out)
    _save(data, out)
    return data


def _cell(run: CrossHostRun, data: dict[str, Any], system: str, partitions: int, plan: LoadPlan) -> None:
    cell = {"system": system, "partitions": partitions, "num_parameters": plan.num_parameters, "clients": plan.clients}
    try:
        result = run.measure(system, partitions, plan)
    except Exception as error:  # a system failing is a finding, not a reason to lose the run
        progress(f"{system} K={partitions} P={plan.num_parameters:,} n={plan.clients} failed: {error}")
        data["skipped"].append(cell | {"why": str(error)})
        return
    summary = result.summary() | link_figures(system, partitions, result, run.spec.rate) | path_fields(system)
    data["runs"].append(summary)
    progress(
        f"{system:>14} K={partitions} P={plan.num_parameters:>10,} n={plan.clients}: "
        f"{summary['commits_per_second']:8.2f} commits/s, {summary['link_fraction']:.2f} of the links"
    )


def _save(data: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=float) + "\n")


def _factory(system: str, target: str, num_parameters: int) -> ClientFactory:
    if system == "echo-tcp":
        return TcpEchoClientFactory(target)
    return GempsClientFactory(target, num_parameters, GEMPS_OPTIONS[system])


def main(argv: Sequence[str] | None = None) -> None:
    """A load process inside the clients' host: one system's clients; its LoadResult as JSON on stdout."""
    parser = argparse.ArgumentParser(description="one cross-host load (run by gemps bench --link)")
    parser.add_argument("--system", choices=("echo-tcp", *GEMPS_OPTIONS), required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--clients", type=int, required=True)
    parser.add_argument("--warmup", type=float, required=True)
    parser.add_argument("--window", type=float, required=True)
    parser.add_argument("--server-pids", default="", help="the serving processes, comma-separated (their CPU)")
    args = parser.parse_args(argv)
    plan = LoadPlan(args.size, args.clients, args.window, args.warmup)
    pids = [int(pid) for pid in args.server_pids.split(",") if pid]
    result = run_load(args.system, _factory(args.system, args.target, args.size), plan, pids)
    print(json.dumps(dataclasses.asdict(result)))


if __name__ == "__main__":
    main()
