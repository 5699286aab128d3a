"""A torch.distributed.rpc parameter server, as PyTorch's own tutorials build one, doing gemps' work.

The structure of "Implementing a Parameter Server Using Distributed RPC Framework" and of the
batch-update server in "Implementing Batch RPC Processing Using Asynchronous Executions"
(https://pytorch.org/tutorials/intermediate/rpc_param_server_tutorial.html,
https://pytorch.org/tutorials/intermediate/rpc_async_execution.html), without the batching:

- rank 0, named "ps", owns a `RpcParameterServer` (the flat float32 central variable and gemps' GEM rule)
  behind an RRef, and starts every trainer's loop with `rpc_async(trainer, _run_trainer, (ps_rref, ...))`;
- one trainer process per client (ranks 1..n, "trainer0".."trainer{n-1}") commits in a closed loop with
  `rpc_sync(ps_rref.owner(), RpcParameterServer.update_and_fetch_model, args=(ps_rref, name, gradient))`;
- that static method resolves the RRef with `local_value()` and, under one lock, applies the commit at
  once (asynchronous SGD: no batching) and returns a copy of the new model with its version and the
  commit's staleness. The copy is taken under the lock because RPC serialises the reply after the
  method returns, while other commits already move theta.

TensorPipe backend, rendezvous on 127.0.0.1 (`MASTER_ADDR`/`MASTER_PORT`, a free port; between
simulated hosts, `PeerConfig.placement`, on the server's host address). On one host
TensorPipe picks its shared-memory transport for messages and its CMA channel (process_vm_readv, one
copy) for tensors, not TCP (seen with TP_VERBOSE_LOGGING=5): what a user running it on one host gets
(system `torch-rpc`). Between machines it has neither: `torch-rpc-tcp` restricts it to its `uv`
transport and `basic` channel, TCP through the kernel as gRPC's, which is the fair comparison for a
parameter server whose workers run elsewhere.

Staleness is not bounded by clients - 1: `threading.Lock` is not FIFO, so a client's commit can wait
while another client commits twice, and a client descheduled between two commits (more busy processes
than cores) lets the others commit many times.

Cost: clients + 1 processes, each with torch loaded (forked from a forkserver that imported torch once,
see `common`), TensorPipe's threads, and its own P-float buffers: the server holds theta, 2 GEM vectors
per client, and per commit in flight a received gradient and a reply copy. Measured here (2 cores,
shared): the server's peak RSS was ~0.6 GB at P = 1M with 8 clients, ~1.3-1.4 GB with 32, ~1.4 GB at
P = 10M with 8 (about twice the reference transport's: the in-flight buffers); a trainer's RSS is
~0.2 GB as counted, mostly torch pages shared with the forkserver, and the machine's used memory grew
by ~3.5 GB for 32 clients at P = 1M. All 32 requests are in flight at once, so the server's threads
and the trainers contend for the 2 cores: latency spread and staleness grow (max staleness ~65-120).
"""

from __future__ import annotations

import sys
import threading
import time
import warnings
from typing import Any

import torch
import torch.distributed.rpc as rpc

from gemps_bench.peers.common import (
    ChildSpec,
    ClientReport,
    PeerConfig,
    PeerState,
    ServerReport,
    Window,
    build_result,
    client_gradient,
    commit_loop,
    on_a_free_port,
    once_more_if_aborted,
    own_peak_rss,
    own_window_cpu,
    run_processes,
    set_rendezvous_env,
)
from gemps_bench.results import LoadResult

SYSTEM = "torch-rpc"
SYSTEM_TCP = "torch-rpc-tcp"
# TensorPipe restricted to TCP: what it does between machines (private options of the backend).
TCP_ONLY = {"_transports": ["uv"], "_channels": ["basic"]}
PS_NAME = "ps"
RPC_TIMEOUT_SECONDS = 60.0  # one commit round trip; far above any healthy one
# The common start, after the server has asked every trainer to run: time for them to connect.
START_MARGIN_SECONDS = 0.5
START_MARGIN_PER_CLIENT = 0.05
TRAINER_THREADS = 4  # a trainer serves one call (its loop); TensorPipe's default is 16


def trainer_name(client: int) -> str:
    return f"trainer{client}"


class RpcParameterServer:
    """The central variable behind the RRef; every commit goes through `update_and_fetch_model`."""

    def __init__(self, num_parameters: int, seed: int, clients: list[str]) -> None:
        self.central = PeerState(num_parameters, seed)
        for client in clients:
            self.central.add_client(client)
        self.lock = threading.Lock()

    @staticmethod
    def connect(ps_rref: rpc.RRef[RpcParameterServer]) -> int:
        """A no-op round trip: trainers open their connection to the server before the common start."""
        return int(ps_rref.local_value().central.version)

    @staticmethod
    def update_and_fetch_model(
        ps_rref: rpc.RRef[RpcParameterServer], client_id: str, gradient: torch.Tensor
    ) -> tuple[torch.Tensor, int, int]:
        """Apply one client's gradient now; return (the new model, its version, the commit's staleness)."""
        self = ps_rref.local_value()
        with self.lock:
            staleness = self.central.apply(client_id, gradient.numpy())  # the received tensor is ours: scratch
            return torch.from_numpy(self.central.theta.copy()), self.central.version, staleness


def _init_rpc(name: str, rank: int, world_size: int, threads: int, port: int, tcp: bool, address: str) -> None:
    set_rendezvous_env(port, address)
    torch.set_num_threads(1)
    # RPC's own rendezvous uses a deprecated torch.distributed path and warns about it in every process.
    warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)
    rpc.init_rpc(  # type: ignore[no-untyped-call]
        name, rank=rank, world_size=world_size, rpc_backend_options=_backend_options(threads, tcp)
    )


def _backend_options(threads: int, tcp: bool) -> rpc.TensorPipeRpcBackendOptions:
    return rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=threads,
        rpc_timeout=RPC_TIMEOUT_SECONDS,
        init_method="env://",
        **(TCP_ONLY if tcp else {}),  # type: ignore[arg-type]
    )


def _run_trainer(
    ps_rref: rpc.RRef[RpcParameterServer], client: int, config: PeerConfig, window: Window
) -> ClientReport:
    """A trainer's whole loop, run on the trainer by the server's rpc_async (the tutorials' pattern)."""
    name = trainer_name(client)
    gradient = torch.from_numpy(client_gradient(config.num_parameters, config.seed, client))
    owner = ps_rref.owner()
    rpc.rpc_sync(owner, RpcParameterServer.connect, args=(ps_rref,))
    latest: list[torch.Tensor] = []

    def commit() -> int:
        model, _version, staleness = rpc.rpc_sync(
            owner, RpcParameterServer.update_and_fetch_model, args=(ps_rref, name, gradient)
        )
        latest[:] = [model]
        return int(staleness)

    report = commit_loop(commit, window)
    if config.keep_final_theta and latest:
        report.final_theta = latest[0].numpy()
    return report


def _serve(config: PeerConfig, port: int, tcp: bool) -> tuple[ServerReport, list[ClientReport]]:
    """Rank 0: own the parameter server, start every trainer's loop, gather their reports."""
    # One RPC thread per trainer's commit in flight, plus a few for RRef bookkeeping.
    _init_rpc(PS_NAME, 0, config.clients + 1, config.clients + 8, port, tcp, config.placement.server_address)
    names = [trainer_name(client) for client in range(config.clients)]
    server = RpcParameterServer(config.num_parameters, config.seed, names)
    ps_rref = rpc.RRef(server)
    margin = START_MARGIN_SECONDS + START_MARGIN_PER_CLIENT * config.clients
    window = Window(time.monotonic() + margin, config.warmup, config.duration)
    cpu = own_window_cpu(window)
    futures = [
        rpc.rpc_async(name, _run_trainer, args=(ps_rref, client, config, window), timeout=config.deadline_seconds())
        for client, name in enumerate(names)
    ]
    reports: list[ClientReport] = [future.wait() for future in futures]
    rpc.shutdown(graceful=True, timeout=RPC_TIMEOUT_SECONDS)
    return ServerReport(own_peak_rss(), server.central.version, cpu.seconds, cpu.machine_busy), reports


def _trainer_process(client: int, config: PeerConfig, port: int, tcp: bool) -> None:
    """Ranks 1..n: join the RPC group and serve the server's call to `_run_trainer` until everyone is done."""
    rank, world = client + 1, config.clients + 1
    _init_rpc(trainer_name(client), rank, world, TRAINER_THREADS, port, tcp, config.placement.server_address)
    try:
        rpc.shutdown(graceful=True, timeout=config.deadline_seconds())
    except torch.distributed.DistNetworkError as error:
        # The trainer's figures reached the server as its loop's return value; a failed loop fails
        # the server's wait. What can still fail here is the goodbye: under load the server, done,
        # may close its end before this one's shutdown handshake ("Connection reset by peer").
        print(f"{trainer_name(client)}: rpc shutdown after the run: {error}", file=sys.stderr)


def measure(config: PeerConfig, tcp: bool = False) -> LoadResult:
    where = config.placement

    def on(port: int) -> dict[str, Any]:
        children = [ChildSpec(PS_NAME, _serve, (config, port, tcp), where.server_namespace)]
        children += [
            ChildSpec(trainer_name(c), _trainer_process, (c, config, port, tcp), where.clients_namespace)
            for c in range(config.clients)
        ]
        return run_processes(children, config.deadline_seconds(), preload=["torch", "torch.distributed.rpc", __name__])

    # TensorPipe aborts now and then (SIGABRT, its trainers then EPIPE; std::bad_alloc joining over
    # shared memory; once, under load, its server ended by another signal): 1 in about 6 full test
    # runs, in the peers' tests and `gemps bench --quick`.
    reports, aborted = once_more_if_aborted(lambda: on_a_free_port(on))
    server, clients = reports[PS_NAME]
    transport = "uv transport (TCP) and basic channel only" if tcp else "shm transport and CMA channel on one host"
    notes = (
        f"torch.distributed.rpc after PyTorch's parameter-server tutorials (TensorPipe: {transport}): "
        "one trainer process per client calls "
        "rpc_sync(RpcParameterServer.update_and_fetch_model); "
        "the server applies gemps' GEM rule under a threading.Lock (not FIFO; no batching) and replies with a copy "
        "of theta"
    )
    if aborted is not None:
        notes += f"; measured on a second run, its first having ended by a signal in torch's own code ({aborted})"
    return build_result(SYSTEM_TCP if tcp else SYSTEM, config, clients, server, notes)


def run(num_parameters: int, clients: int, duration: float, warmup: float = 1.0, seed: int = 0) -> LoadResult:
    """`clients` trainer processes committing P float32 gradients to a torch.distributed.rpc parameter server."""
    return measure(PeerConfig(num_parameters, clients, duration, warmup, seed))


def run_tcp(num_parameters: int, clients: int, duration: float, warmup: float = 1.0, seed: int = 0) -> LoadResult:
    """run(), with TensorPipe restricted to TCP, as between machines."""
    return measure(PeerConfig(num_parameters, clients, duration, warmup, seed), tcp=True)
