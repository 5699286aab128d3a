"""torchft (PyPI `torchft`, pinned in requirements-peers.txt) as three systems of the comparison:
fault-tolerant DDP (`torchft-ddp`), LocalSGD (`torchft-localsgd`) and DiLoCo (`torchft-diloco`).

Set up as torchft's own docs and examples do (README "Usage", train_ddp.py, train_diloco.py, the
local_sgd integration tests):

- the coordinator is the Lighthouse, the per-step quorum, with the README's flags (`torchft_lighthouse
  --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000`, run in-process as
  `LighthouseServer`) bound on `--coordinator`'s port;
- every worker is a replica group of one process (train_ddp.py's `--nproc_per_node 1`), with its own
  TCPStore (what torchrun would start for the group; the integration tests start it the same way),
  a `Manager` with train_ddp.py's settings (`min_replica_size=1`, `timeout=30 s`, ProcessGroupGloo
  with a 5 s timeout (`--pg-timeout-s`), live recovery from a peer over `PGTransport`), and a replica
  id ending in its rank.
  It advertises the address its route to the Lighthouse leaves from (`common.own_address`),
  as its host name too and with Gloo bound to that interface (`advertise_as_hostname`), so peers
  in other network namespaces reach its stores, manager and Gloo pairs;
- ddp: `torchft.DistributedDataParallel` + `torchft.Optimizer` around the manifest entry's local
  optimizer (`--optimizer`: the contract's SGD with momentum 0.9 for `torchft_ddp`, nanoGPT's AdamW
  for `torchft_ddp_adamw`), the Manager's asynchronous quorum (its default);
- localsgd: `LocalSGD(manager, model, SGD, sync_every=H)`; diloco: `DiLoCo(manager, [model], inner
  AdamW, outer SGD(lr=0.7, momentum=0.9, nesterov=True), sync_every=H)`, the outer optimizer of
  train_diloco.py; both with a synchronous quorum (`use_async_quorum=False`, required by DiLoCo).
  H = `--sync-every`, 20 by default: train_diloco.py's value (torchft documents no default).
  LocalSGD's optimizer is the contract's SGD; DiLoCo's inner one is train_diloco.py's AdamW
  (weight decay 0.1, betas 0.9/0.95) at `--lr` x 4e-4/0.05: the comparison's grid (gemps' 0.05
  x {1/2, 1, 2}) mapped onto the example's 4e-4, so DiLoCo gets the same tuning budget around its
  documented point. With the contract's SGD inside, the outer Nesterov step (0.7, momentum 0.9)
  multiplies the much larger inner changes and the digits CNN diverged to chance within a minute.
  DiLoCo stays on that mapped grid rather than the Adam-path systems' (systems/base.py,
  ADAMW_LEARNING_RATES): its recorded rates (learning_rates.json) keep their meaning, and its inner
  rate lives on another scale: the outer step (0.7, Nesterov) multiplies H = 20 inner steps' change,
  where an Adam-path worker's every AdamW step is applied as it is.

What the progress log counts as applied: a DDP step's samples once its `should_commit` said yes (the
Manager's step advanced); LocalSGD's and DiLoCo's local steps once the sync that ends their round
committed (a round whose sync failed is not counted). Rank 0 writes the snapshots: after a committed
step (DDP: every one; LocalSGD/DiLoCo: right after a sync, when its model is the averaged / outer
one), never before its first commit (a restarted rank 0 holds θ0 until it has healed from a peer).

A Lighthouse that is gone makes the Manager's quorum fail: `--quorum-retries` (torchft's
`quorum_retries`, default here 60) keeps a worker retrying while the rig restarts it.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import socket
import struct
from contextlib import ExitStack
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch._C._distributed_c10d import TCPStore

# torchft's Rust side logs every quorum and commit at INFO (~10 MB a minute a process at the digits'
# step rate, written from a worker's fifth of a core); its extension reads RUST_LOG as it loads, so
# before the import. Warnings and errors still show; a RUST_LOG the caller set wins.
os.environ.setdefault("RUST_LOG", "warn")

from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
from torchft._torchft import LighthouseServer
from torchft.checkpointing.pg_transport import PGTransport
from torchft.local_sgd import DiLoCo, LocalSGD

from gemps_bench.alternatives.contract import MOMENTUM, ProgressLog, WorkerArgs
from gemps_bench.alternatives.peers.common import (
    PeerWorker,
    coordinator_endpoint,
    deadline_monotonic,
    own_address,
    prepare_worker,
    run_program,
    wait_until,
)
from gemps_bench.alternatives.workloads import loss

ALGORITHMS = ("ddp", "localsgd", "diloco")
SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's address
#: torchft's README: `torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000`
LIGHTHOUSE_MIN_REPLICAS = 1
LIGHTHOUSE_QUORUM_TICK_MS = 100
LIGHTHOUSE_JOIN_TIMEOUT_MS = 10_000
#: train_ddp.py's timeouts: the Manager's operations, the process group's collectives, the recovery transport
MANAGER_TIMEOUT = timedelta(seconds=30)
PG_TIMEOUT_S = 5.0
TRANSPORT_TIMEOUT = timedelta(seconds=10)
#: DiLoCo's outer optimizer in train_diloco.py: Nesterov SGD
OUTER_LR = 0.7
#: DiLoCo's inner AdamW in train_diloco.py: its learning rate at the grid's centre (gemps' 0.05), its betas and decay
INNER_ADAMW_LR_PER_LR = 4e-4 / 0.05
INNER_ADAMW_BETAS = (0.9, 0.95)
INNER_ADAMW_WEIGHT_DECAY = 0.1
#: local steps between two syncs of LocalSGD and DiLoCo (train_diloco.py's sync_every)
SYNC_EVERY = 20


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pg-timeout-s", type=float, default=PG_TIMEOUT_S, help="the Gloo group's timeout")
    parser.add_argument("--sync-every", type=int, default=SYNC_EVERY, help="LocalSGD/DiLoCo: local steps per sync")
    parser.add_argument(
        "--quorum-retries", type=int, default=60, help="torchft's quorum_retries: quorum attempts before a worker fails"
    )


def lighthouse(args: WorkerArgs, flags: argparse.Namespace) -> None:
    """The Lighthouse on --coordinator's port, every address, until the deadline."""
    _, port = coordinator_endpoint(args)
    server = LighthouseServer(
        bind=f"[::]:{port}",
        min_replicas=LIGHTHOUSE_MIN_REPLICAS,
        join_timeout_ms=LIGHTHOUSE_JOIN_TIMEOUT_MS,
        quorum_tick_ms=LIGHTHOUSE_QUORUM_TICK_MS,
    )
    print(f"torchft lighthouse at {server.address()}", flush=True)
    try:
        wait_until(deadline_monotonic(args))
    finally:
        server.shutdown()


def advertise_as_hostname(address: str) -> None:
    """Make this process's host name its address, and Gloo's interface the one holding it. On a cluster
    each host's name resolves to that host; the rig's network namespaces share the machine's name,
    which resolves to 127.0.0.1, every namespace's own loopback. torchft's process group advertises
    the rendezvous store of each reconfiguration as `socket.gethostname():port` (process_group.py,
    `get_reconfigure_handle`): peers dialled themselves ("timed out ... trying to connect to (vm,
    37791)"). Gloo binds the address the host name resolves to unless GLOO_SOCKET_IFNAME names an
    interface (PyTorch's setting for hosts with several): "connectFullMesh failed ... Connection
    refused, remote=[127.0.0.1]". Either way no quorum's process group formed on the rig."""
    socket.gethostname = lambda: address
    os.environ.setdefault("GLOO_SOCKET_IFNAME", interface_of(address))


def interface_of(address: str) -> str:
    """The name of the network interface that holds IPv4 `address` (SIOCGIFADDR on each)."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                answer = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # an interface without an IPv4 address
        if socket.inet_ntoa(answer[20:24]) == address:
            return name
    raise ValueError(f"no network interface holds {address} (the route to the coordinator leaves from it)")


def train(args: WorkerArgs, algorithm: str, sync_every: int, quorum_retries: int, pg_timeout_s: float) -> None:
    """One replica group (this process) training until the deadline."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown torchft algorithm {algorithm!r}; choose from {', '.join(ALGORITHMS)}")
    if sync_every < 1:
        raise ValueError(f"--sync-every must be at least 1, got {sync_every}")
    if pg_timeout_s <= 0:
        raise ValueError(f"--pg-timeout-s must be positive, got {pg_timeout_s}")
    if algorithm == "diloco" and args.optimizer != "sgd":
        raise ValueError(f"--optimizer {args.optimizer}: DiLoCo's inner optimizer is train_diloco.py's AdamW already")
    peer = prepare_worker(args)
    host, port = coordinator_endpoint(args)
    address = own_address(host)
    advertise_as_hostname(address)
    model = peer.model
    inner: torch.optim.Optimizer = peer.local_optimizer()
    if algorithm == "diloco":
        inner = torch.optim.AdamW(
            model.parameters(),
            lr=args.lr * INNER_ADAMW_LR_PER_LR,
            betas=INNER_ADAMW_BETAS,
            weight_decay=INNER_ADAMW_WEIGHT_DECAY,
        )
    outer = torch.optim.SGD(model.parameters(), lr=OUTER_LR, momentum=MOMENTUM, nesterov=True)
    optimizers: dict[str, torch.optim.Optimizer] = {"optim": inner}
    if algorithm == "diloco":
        optimizers["outer_optim"] = outer

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), **{name: opt.state_dict() for name, opt in optimizers.items()}}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        for name, opt in optimizers.items():
            opt.load_state_dict(state[name])

    store = TCPStore(host_name=address, port=0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=pg_timeout_s))
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        use_async_quorum=algorithm == "ddp",
        timeout=MANAGER_TIMEOUT,
        rank=0,
        world_size=1,
        store_addr=address,
        store_port=store.port,
        lighthouse_addr=f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}",
        replica_id=f"torchft_{algorithm}_{args.rank}",
        hostname=address,
        checkpoint_transport=PGTransport(pg, timeout=TRANSPORT_TIMEOUT, device=torch.device("cpu")),
        quorum_retries=quorum_retries,
    )
    with ExitStack() as stack:
        stack.callback(lambda: manager.shutdown(wait=False))
        log = peer.start()  # set up: the first quorum comes with the first step
        stack.callback(log.close)
        if algorithm == "ddp":
            _loop(peer, log, manager, DistributedDataParallel(manager, model), Optimizer(manager, inner), every=1)
        elif algorithm == "localsgd":
            stack.enter_context(LocalSGD(manager, model, inner, sync_every=sync_every))
            _loop(peer, log, manager, model, inner, every=sync_every)
        else:
            stack.enter_context(
                DiLoCo(manager, [model], inner, outer, sync_every=sync_every, backup_device=torch.device("cpu"),
                       pin_memory=False)
            )  # fmt: skip
            _loop(peer, log, manager, model, inner, every=sync_every)


def _loop(
    peer: PeerWorker,
    log: ProgressLog,
    manager: Manager,
    forward: nn.Module,
    optimizer: torch.optim.Optimizer,
    every: int,
) -> None:
    """Steps until the deadline; samples count as applied once the step (DDP) or the sync ending their
    round (LocalSGD, DiLoCo: every `every` steps) committed."""
    batch = peer.workload.batch
    pending = 0  # samples computed since the last commit or failed sync
    committed_once = False
    steps = 0
    while peer.time_left():
        inputs, targets = next(peer.batches)
        optimizer.zero_grad()
        loss(forward, inputs, targets).backward()  # type: ignore[no-untyped-call]
        before = manager.current_step()
        optimizer.step()  # DDP: steps only when the quorum commits; LocalSGD/DiLoCo: syncs every `every`
        steps += 1
        pending += batch
        applied = 0
        if manager.current_step() > before:
            applied, pending, committed_once = pending, 0, True
        elif steps % every == 0:
            pending = 0  # this round's sync did not commit: its local steps are lost
        log.step(batch, applied)
        if applied and committed_once:
            peer.snapshot()


def main(algorithm: str, argv: list[str] | None = None) -> int:
    """The worker program of system torchft-<algorithm> (its coordinator: the Lighthouse)."""

    def worker(args: WorkerArgs, flags: argparse.Namespace) -> None:
        train(args, algorithm, flags.sync_every, flags.quorum_retries, flags.pg_timeout_s)

    return run_program(f"torchft-{algorithm}", lighthouse, worker, add_flags, argv)
