"""A gemps worker of the comparison (`python -m gemps_bench.alternatives.systems.gemps_program`):
the workload's model through the SDK's RemoteModel, trained by the reference worker's modes
(gemps_worker.modes: `gradient`, or `dynsgd` local steps), logged per the contract; and, with
`--role coordinator`, the observer that pulls θ every 2 s and writes it as a snapshot.

A commit's reply comes once the server applied it, so the samples a commit covers are counted
applied then; samples of local steps not yet committed when the process dies are lost.

With `--supervise`, a worker runs under gemps_worker.supervisor: this process imports torch and
loads the workload's data once, then forks the worker, and forks a new one at once when it is
killed (the rig kills the worker and spares the supervisor, as it spares DDP's elastic agent).
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace

import torch

from gemps.client import Client
from gemps.errors import GempsError
from gemps.pytorch import RemoteModel, load_central
from gemps_bench.alternatives.contract import (
    ProgressLog,
    Snapshots,
    WorkerArgs,
    parse_worker_args,
    worker_parser,
)
from gemps_bench.alternatives.workloads import loss, workload
from gemps_worker.modes import LOCAL_OPTIMIZERS, MODES, LocalTraining, create_mode
from gemps_worker.signals import configure_logging
from gemps_worker.supervisor import supervise


def train(args: WorkerArgs, mode_name: str, local: LocalTraining, compression: str) -> None:
    started = time.monotonic()
    chosen = replace(workload(args.workload), batch=args.batch)
    model = chosen.build_model()
    codes = None if compression == "none" else compression
    client = Client(args.coordinator, name=f"w{args.rank}", compression=codes, reply_compression=codes)
    with RemoteModel(model, client, threads=1) as remote:
        mode = create_mode(mode_name, remote, remote.registration.config.learning_rate, local)
        log = ProgressLog(args.run_dir, args.rank)
        log.wait_for_go(args.run_dir)
        remote.pull()  # θ as it is at the start, not as it was at registration
        pending = 0
        for inputs, targets in chosen.batches(args.rank, args.world, args.seed):
            if time.monotonic() - started >= args.deadline_s:
                break

            def batch_loss(x: torch.Tensor = inputs, y: torch.Tensor = targets) -> torch.Tensor:
                return loss(model, x, y)

            committed = mode.on_batch(batch_loss, len(inputs))
            pending += len(inputs)
            applied, pending = (pending, 0) if committed is not None else (0, pending)
            log.step(len(inputs), applied)
        log.close()


def observe(args: WorkerArgs) -> None:
    """Pull θ every --snapshot-every seconds and write it as the run's snapshot (holds no lease)."""
    started = time.monotonic()
    model = workload(args.workload).build_model()
    snapshots = Snapshots(args.run_dir, args.snapshot_every)
    with Client(args.coordinator, name="observer") as observer:
        while time.monotonic() - started < args.deadline_s:
            try:
                load_central(model, observer.pull())
                snapshots.write(model, force=True)
            except GempsError:
                pass  # the server is down (a coordinator kill) or not yet holding θ: try again
            time.sleep(args.snapshot_every)


def main() -> None:
    parser = worker_parser(__doc__ or "")
    parser.add_argument("--mode", default="gradient", choices=MODES)
    parser.add_argument(
        "--local-steps", type=int, default=4, help="dynsgd: local steps per commit; dylu: the fastest worker's"
    )
    parser.add_argument("--outer-learning-rate", type=float, default=0.0, help="dynsgd: the update's factor")
    parser.add_argument("--compression", default="none", help="commits and replies in these codes (int8)")
    parser.add_argument("--local-optimizer", default="sgd", choices=tuple(LOCAL_OPTIMIZERS), help="of the local steps")
    parser.add_argument(
        "--local-learning-rate", type=float, default=0.0, help="of the local steps (0: sgd the server's eta)"
    )
    parser.add_argument("--supervise", action="store_true", help="a worker under a supervisor that restarts it warm")
    args = parse_worker_args(parser)
    extra, _ = parser.parse_known_args()
    torch.set_num_threads(1)
    if args.role == "coordinator":
        observe(args)
        return
    steps, rate = extra.local_steps, extra.local_learning_rate
    local = LocalTraining(dynsgd_steps=steps, dylu_steps=steps, outer_learning_rate=extra.outer_learning_rate,
                          optimizer=extra.local_optimizer, learning_rate=rate)  # fmt: skip
    if not extra.supervise:
        train(args, extra.mode, local, extra.compression)
        return
    configure_logging()  # the supervisor's lines: each restart, and why
    workload(args.workload).data()  # loaded (and cached) once, before the forks

    def life() -> int:
        train(args, extra.mode, local, extra.compression)
        return 0

    sys.exit(supervise(life))


if __name__ == "__main__":
    main()
