"""hivemind (PyPI `hivemind`, pinned in requirements-peers.txt, with the p2pd it ships) as system
`hivemind` of the comparison: `hivemind.Optimizer` with a target batch size.

Set up as hivemind's Quick Start ("Decentralized Training") does:

- the coordinator is the swarm's first peer, a DHT node listening on `--coordinator`'s port with a
  persistent identity (DIR/hivemind-coordinator.key: restarted after a kill it has the same peer id,
  so `initial_peers` stays valid); it writes its peer id to DIR/hivemind-coordinator.id, from which
  each worker builds its `initial_peers` (`/ip4/HOST/tcp/PORT/p2p/ID`, HOST as the worker reaches it);
- every worker is a peer with its own DHT (listening on every address, any port) and a
  `hivemind.Optimizer(dht, run_id, batch_size_per_step=--batch, target_batch_size=T,
  optimizer=<the manifest entry's --optimizer: the contract's SGD for `hivemind`, nanoGPT's
  AdamW for `hivemind_adamw`>, use_local_updates=True, matchmaking_time=3.0,
  averaging_timeout=10.0, verbose=True)`: the Quick Start's settings (local updates every step, the parameters
  averaged in the background once the swarm has processed T samples; "3-5 s for small local runs",
  the Optimizer's configuration guide says of matchmaking_time), its other options at their defaults;
- T = `--target-batch-size`, by default the Quick Start's 10,000 samples. Large on purpose, as the
  configuration guide advises: with local updates each step waits for the averaging round still
  under way (its delta rule needs it), and a round takes at least matchmaking_time, so an epoch
  must last well beyond that. At 20 local steps of every worker per epoch (1,920 samples for 3
  workers on the digits) the workers made one step per round, ~3 steps in 10 s, on this machine;
- a restarted worker first calls `opt.load_state_from_peers()` (the Quick Start's joining peer);
  a worker on its first start does not (the swarm starts from the same θ0).

What the progress log counts as applied: the samples of a worker's local steps once the global epoch
they were counted into completed (`opt.local_epoch` advanced by one); when it advanced by more (the
worker was behind and downloaded the swarm's state) its local steps since the last epoch are lost.
Rank 0 writes the snapshots, its model as it trains: with local updates no step holds the swarm's
average alone (averaging results are applied to the parameters as deltas, a step later), so a peer's
own model is what its user would evaluate.
"""

from __future__ import annotations

import argparse
import time
from contextlib import ExitStack
from pathlib import Path

import hivemind

from gemps_bench.alternatives.contract import ProgressLog, WorkerArgs
from gemps_bench.alternatives.peers.common import (
    PeerWorker,
    coordinator_endpoint,
    deadline_monotonic,
    prepare_worker,
    run_program,
    wait_until,
)
from gemps_bench.alternatives.workloads import loss

#: the Quick Start's Optimizer settings
TARGET_BATCH_SIZE = 10_000
MATCHMAKING_TIME_S = 3.0
AVERAGING_TIMEOUT_S = 10.0
#: how long a worker waits for the coordinator's peer id, and between two tries to join the swarm
JOIN_WAIT_S = 60.0
JOIN_RETRY_S = 2.0


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target-batch-size", type=int, default=TARGET_BATCH_SIZE, help="samples per global epoch")


def run_id(args: WorkerArgs) -> str:
    return f"gemps-alternatives-{args.workload}"


def _identity(run_dir: Path) -> tuple[Path, Path]:
    return run_dir / "hivemind-coordinator.key", run_dir / "hivemind-coordinator.id"


def first_peer(args: WorkerArgs, flags: argparse.Namespace) -> None:
    """The swarm's first peer on --coordinator's port until the deadline; its peer id to a file."""
    _, port = coordinator_endpoint(args)
    key, peer_id_file = _identity(args.run_dir)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    dht = hivemind.DHT(start=True, host_maddrs=[f"/ip4/0.0.0.0/tcp/{port}"], identity_path=str(key))
    try:
        partial = peer_id_file.with_suffix(".partial")
        partial.write_text(str(dht.peer_id))
        partial.replace(peer_id_file)
        print(f"hivemind first peer {dht.peer_id} on port {port}", flush=True)
        wait_until(deadline_monotonic(args))
    finally:
        dht.shutdown()


def join_swarm(args: WorkerArgs, peer: PeerWorker) -> hivemind.DHT:
    """This worker's DHT, bootstrapped from the first peer (retried while it is away: restarting)."""
    host, port = coordinator_endpoint(args)
    _, peer_id_file = _identity(args.run_dir)
    give_up = time.monotonic() + min(JOIN_WAIT_S, peer.seconds_left())
    while True:
        try:
            if not peer_id_file.exists():
                raise FileNotFoundError(f"{peer_id_file}: the first peer (--role coordinator) has not started")
            initial_peer = f"/ip4/{host}/tcp/{port}/p2p/{peer_id_file.read_text().strip()}"
            return hivemind.DHT(initial_peers=[initial_peer], host_maddrs=["/ip4/0.0.0.0/tcp/0"], start=True)
        except Exception:
            if time.monotonic() + JOIN_RETRY_S > give_up:
                raise
            time.sleep(JOIN_RETRY_S)


def train(args: WorkerArgs, flags: argparse.Namespace) -> None:
    """One peer training with hivemind.Optimizer until the deadline."""
    target = flags.target_batch_size
    if target < args.batch:
        raise ValueError(f"--target-batch-size {target} is below one worker's --batch {args.batch}")
    restarted = (args.run_dir / f"worker-{args.rank}.jsonl").exists()  # the log of an earlier life of this rank
    peer = prepare_worker(args)
    with ExitStack() as stack:
        dht = join_swarm(args, peer)
        stack.callback(dht.shutdown)
        optimizer = hivemind.Optimizer(
            dht=dht,
            run_id=run_id(args),
            batch_size_per_step=peer.workload.batch,
            target_batch_size=target,
            optimizer=peer.local_optimizer(),
            use_local_updates=True,
            matchmaking_time=MATCHMAKING_TIME_S,
            averaging_timeout=AVERAGING_TIMEOUT_S,
            verbose=True,  # the Quick Start's: its rounds and epochs in the worker's output
        )
        stack.callback(optimizer.shutdown)
        if restarted:
            optimizer.load_state_from_peers()
        log = peer.start()
        stack.callback(log.close)
        _loop(peer, log, optimizer)


def _loop(peer: PeerWorker, log: ProgressLog, optimizer: hivemind.Optimizer) -> None:
    batch = peer.workload.batch
    epoch = optimizer.local_epoch
    pending = 0  # samples of local steps not yet in a completed epoch
    while peer.time_left():
        inputs, targets = next(peer.batches)
        optimizer.zero_grad()
        loss(peer.model, inputs, targets).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        pending += batch
        applied, now = 0, optimizer.local_epoch
        if now == epoch + 1:
            applied, pending = pending, 0
        elif now > epoch + 1:
            pending = 0  # behind the swarm: its state was downloaded over these local steps
        epoch = now
        log.step(batch, applied)
        peer.snapshot()


def main(argv: list[str] | None = None) -> int:
    return run_program("hivemind", first_peer, train, add_flags, argv)


if __name__ == "__main__":
    raise SystemExit(main())
