"""The GEM reference code's transport: torch.distributed point-to-point messages to a master, one worker at a time.

Mirrors the structure of Joeri Hermans' reference implementation
(https://github.com/montefiore-institute/gradient-energy-matching, `code/gem.py` and `code/utils.py`):

- rank 0 is the parameter server ("master"); ranks 1..n are workers, one process each;
- the master sends the initial central variable to every worker with one `send` per worker (the
  reference's `utils.broadcast`, which avoids `dist.broadcast`), then all ranks meet in a barrier;
- the queue of ready workers is a UDP socket on the master: a worker that wants to commit sends its
  rank in a datagram (the reference's `queue_parameter_server`; its comment: "fixes PyTorch recv bug")
  and blocks on a `recv` from rank 0; the master takes ranks from the socket in arrival order
  (`next_in_queue`), so the socket buffer is the FIFO queue. An any-source `dist.recv(tensor, src=None)`
  would serve as well today; the UDP queue is kept because it is what the reference measured;
- for the worker at the head of the queue the master sends a small "your turn" tensor, then the
  commit's payload moves with `dist.send`/`dist.recv` (full tensors), and the master serves the next;
- at the end every rank meets in `dist.barrier()` (the reference's `cleanup`).

What differs, so that the master does gemps' work: the reference's workers computed GEM's pi themselves
from the central variable they pulled and sent a scaled update; here workers are stateless like
gemps' and the master applies gemps' GEM rule, so within a turn the order is gemps' (the worker's
gradient in, the rule applied, the new central variable out) instead of the reference's (central
variable out, update in). The turn tensor carries the version the commit will produce and its
staleness; the run is timed rather than a fixed update budget (a worker sends a "done" datagram when
its window has closed); the model is one flat float32 tensor; gloo backend, `env://` rendezvous on
127.0.0.1 (`MASTER_ADDR`/`MASTER_PORT`, a free port), UDP queue on a free port; between simulated
hosts (`PeerConfig.placement`) on the master's host address instead.

The master serves one worker at a time, in order of readiness, so every other worker commits at most
once between a worker's datagram and its turn. Staleness is still not bounded by clients - 1: it also
counts the commits between the master sending theta and the worker queueing again, and with more busy
processes than cores a worker can be descheduled there while the others commit many times.

Cost: clients + 1 processes, each with torch loaded (forked from a forkserver that imported torch once,
see `common`) and gloo's connections to every other rank; the master holds theta, 2 GEM vectors per
client and one gradient buffer, each worker a gradient and a theta. Startup sends theta to every worker
(clients * 4P bytes through loopback). Measured here (2 cores, shared): the master's peak RSS was
~0.3 GB at P = 1M with 8 clients, ~0.45-0.5 GB with 32, ~0.9-0.95 GB at P = 10M with 8; a worker's RSS
is ~0.2 GB as counted, mostly torch pages shared with the forkserver, so the machine's used memory
grew by only ~1-2 GB for 32 clients at P = 1M. Only the worker being served and the master are busy
at any moment, so 32 clients cost queueing latency (~32 turns), not CPU.
"""

from __future__ import annotations

import socket
import struct
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

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
    own_peak_rss,
    own_window_cpu,
    run_processes,
    set_rendezvous_env,
)
from gemps_bench.results import LoadResult

SYSTEM = "reference-p2p"
MASTER_RANK = 0
# A worker may wait for its turn behind every other worker: bounded, but far above any healthy wait.
OP_TIMEOUT_SECONDS = 60.0
# The common start, after the master has sent the timing to every worker.
START_MARGIN_SECONDS = 0.2
START_MARGIN_PER_CLIENT = 0.01
_DATAGRAM = struct.Struct("!i")  # a worker's rank: ready to commit; its negation: done


def worker_name(rank: int) -> str:
    return f"worker{rank}"


def _init_group(rank: int, world_size: int, port: int, address: str) -> None:
    set_rendezvous_env(port, address)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method="env://", rank=rank, world_size=world_size, timeout=timedelta(seconds=OP_TIMEOUT_SECONDS)
    )


def _open_queue(address: str) -> socket.socket:
    """The master's queue of ready workers (the reference's UDP socket; a free port instead of 8000)."""
    queue = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    queue.bind((address, 0))
    queue.settimeout(OP_TIMEOUT_SECONDS)
    return queue


def _next_in_queue(queue: socket.socket) -> int:
    data, _address = queue.recvfrom(_DATAGRAM.size)
    return int(_DATAGRAM.unpack(data)[0])


def _send_to_workers(tensor: torch.Tensor, workers: range) -> None:
    for rank in workers:
        dist.send(tensor, dst=rank)


def _serve_queue(central: PeerState, queue: socket.socket, clients: int) -> None:
    """Serve ready workers one at a time until each has said it is done."""
    theta = torch.from_numpy(central.theta)  # shares memory: sends always carry the current theta
    gradient = torch.empty(central.theta.size, dtype=torch.float32)
    turn = torch.zeros(2, dtype=torch.int64)
    done = 0
    while done < clients:
        rank = _next_in_queue(queue)
        if rank < 0:
            done += 1
            continue
        client_id = worker_name(rank)
        turn[0], turn[1] = central.version + 1, central.staleness(client_id)
        dist.send(turn, dst=rank)
        dist.recv(gradient, src=rank)
        central.apply(client_id, gradient.numpy())  # the receive buffer is scratch: refilled next turn
        dist.send(theta, dst=rank)


def _master(config: PeerConfig, port: int) -> ServerReport:
    """Rank 0: hold the central variable, serve the queue, report the peak RSS before exiting."""
    _init_group(MASTER_RANK, config.clients + 1, port, config.placement.server_address)
    workers = range(1, config.clients + 1)
    central = PeerState(config.num_parameters, config.seed)
    for rank in workers:
        central.add_client(worker_name(rank))
    _send_to_workers(torch.from_numpy(central.theta), workers)
    dist.barrier()
    with _open_queue(config.placement.server_address) as queue:
        margin = START_MARGIN_SECONDS + START_MARGIN_PER_CLIENT * config.clients
        timing = torch.tensor([time.monotonic() + margin, queue.getsockname()[1]], dtype=torch.float64)
        cpu = own_window_cpu(Window(float(timing[0]), config.warmup, config.duration))
        _send_to_workers(timing, workers)
        _serve_queue(central, queue, config.clients)
    dist.barrier()
    dist.destroy_process_group()
    return ServerReport(own_peak_rss(), central.version, cpu.seconds, cpu.machine_busy)


def _worker(rank: int, config: PeerConfig, port: int) -> ClientReport:
    """Ranks 1..n: queue up, commit the pre-made gradient, get the central variable back, repeat."""
    _init_group(rank, config.clients + 1, port, config.placement.server_address)
    theta = torch.empty(config.num_parameters, dtype=torch.float32)
    dist.recv(theta, src=MASTER_RANK)
    dist.barrier()
    timing = torch.empty(2, dtype=torch.float64)
    dist.recv(timing, src=MASTER_RANK)
    window = Window(float(timing[0]), config.warmup, config.duration)
    master = (config.placement.server_address, int(timing[1]))
    gradient = torch.from_numpy(client_gradient(config.num_parameters, config.seed, rank - 1))
    turn = torch.zeros(2, dtype=torch.int64)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as queue:

        def commit() -> int:
            queue.sendto(_DATAGRAM.pack(rank), master)
            dist.recv(turn, src=MASTER_RANK)
            dist.send(gradient, dst=MASTER_RANK)
            dist.recv(theta, src=MASTER_RANK)
            return int(turn[1])

        report = commit_loop(commit, window)
        queue.sendto(_DATAGRAM.pack(-rank), master)
    dist.barrier()
    dist.destroy_process_group()
    if config.keep_final_theta:
        report.final_theta = theta.numpy().copy()
    return report


def measure(config: PeerConfig) -> LoadResult:
    where = config.placement

    def on(port: int) -> dict[str, Any]:
        children = [ChildSpec("master", _master, (config, port), where.server_namespace)]
        children += [
            ChildSpec(worker_name(r), _worker, (r, config, port), where.clients_namespace)
            for r in range(1, config.clients + 1)
        ]
        return run_processes(children, config.deadline_seconds(), preload=["torch", "torch.distributed", __name__])

    reports = on_a_free_port(on)
    clients: list[ClientReport] = [reports[worker_name(r)] for r in range(1, config.clients + 1)]
    notes = (
        "GEM reference code's transport (github.com/montefiore-institute/gradient-energy-matching): gloo "
        "point-to-point send/recv, a UDP queue of ready workers on the master, one worker served at a time in "
        "arrival order; the master applies gemps' GEM rule (the reference computed pi on the workers)"
    )
    return build_result(SYSTEM, config, clients, reports["master"], notes)


def run(num_parameters: int, clients: int, duration: float, warmup: float = 1.0, seed: int = 0) -> LoadResult:
    """`clients` worker processes committing P float32 gradients to the GEM reference code's master."""
    return measure(PeerConfig(num_parameters, clients, duration, warmup, seed))
