"""A gemps worker of the comparison (`python -m gemps_bench.alternatives.systems.gemps_program`):
the workload's model through the SDK's RemoteModel, trained by the reference worker's modes
(gemps_worker.modes: `gradient`, or `dynsgd` local steps), or `--mode local-steps`: the SDK's
`LocalSteps` (`--local-steps` a window, look_ahead=1) around the contract's `--optimizer`
(nanoGPT's AdamW for gemps-adam and gemps-adamw-windows), logged per the contract; and, with
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
from gemps.pytorch import LocalSteps, RemoteModel, load_central
from gemps_bench.alternatives.contract import (
    ProgressLog,
    Snapshots,
    WorkerArgs,
    local_optimizer,
    parse_worker_args,
    worker_parser,
)
from gemps_bench.alternatives.workloads import loss, workload
from gemps_worker.modes import LOCAL_OPTIMIZERS, MODES, LocalTraining, create_mode
from gemps_worker.signals import configure_logging
from gemps_worker.supervisor import supervise

#: the mode of the SDK's LocalSteps (beside gemps_worker.modes' MODES)
LOCAL_STEPS = "local-steps"


def train(args: WorkerArgs, mode_name: str, local: LocalTraining, compression: str) -> None:
    started = time.monotonic()
    chosen = replace(workload(args.workload), batch=args.batch)
    model = chosen.build_model()
    with RemoteModel(model, _client(args, compression), threads=1) as remote:
        mode = create_mode(mode_name, remote, remote.registration.config.learning_rate, local)
        log = ProgressLog(args.run_dir, args.rank)
        log.wait_for_go(args.run_dir)
        remote.pull()  # θ as it is at the start, not as it was at registration
        rounds = remote.registration.config.rule == "adamw"  # whose late gradients are dropped (π 0)
        pending = 0
        for inputs, targets in chosen.batches(args.rank, args.world, args.seed):
            if time.monotonic() - started >= args.deadline_s:
                break

            def batch_loss(x: torch.Tensor = inputs, y: torch.Tensor = targets) -> torch.Tensor:
                return loss(model, x, y)

            committed = mode.on_batch(batch_loss, len(inputs))
            pending += len(inputs)
            applied, pending = (pending, 0) if committed is not None else (0, pending)
            if rounds and committed is not None and committed.result.scaling_mean == 0.0:
                applied = 0  # a gradient its round had moved on from: dropped, not applied
            log.step(len(inputs), applied)
        log.close()


def _client(args: WorkerArgs, compression: str) -> Client:
    codes = None if compression == "none" else compression
    return Client(args.coordinator, name=f"w{args.rank}", compression=codes, reply_compression=codes)


def train_local_steps(args: WorkerArgs, compression: str, steps: int, beta1: float | None) -> None:
    """The SDK's recipe: `--optimizer` at `--lr` (AdamW's β1 `beta1` where given) wrapped in
    LocalSteps (`steps` a window, its other defaults), each window's update committed. No pull after
    the gate: registration loaded θ, and no worker commits before the gate opens (a worker started
    again after a kill registers at the newest θ)."""
    started = time.monotonic()
    chosen = replace(workload(args.workload), batch=args.batch)
    model = chosen.build_model()
    inner = local_optimizer(args.optimizer, model, args.lr, beta1)
    with LocalSteps(model, inner, _client(args, compression), steps=steps, threads=1) as optimizer:
        log = ProgressLog(args.run_dir, args.rank)
        log.wait_for_go(args.run_dir)
        pending = 0
        for inputs, targets in chosen.batches(args.rank, args.world, args.seed):
            if time.monotonic() - started >= args.deadline_s:
                break
            optimizer.zero_grad()
            batch_loss = loss(model, inputs, targets)
            batch_loss.backward()  # type: ignore[no-untyped-call]
            before = optimizer.last_result
            optimizer.step(loss=batch_loss.detach())
            pending += len(inputs)
            committed = optimizer.last_result is not before  # a window ended: its samples are applied
            applied, pending = (pending, 0) if committed else (0, pending)
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
    parser.add_argument("--mode", default="gradient", choices=(*MODES, LOCAL_STEPS))
    parser.add_argument(
        "--local-steps",
        type=int,
        help="dynsgd and local-steps: local steps per commit (4; local-steps: LocalSteps' 1); "
        "dylu: the fastest worker's (4)",
    )
    parser.add_argument("--outer-learning-rate", type=float, default=0.0, help="dynsgd: the update's factor")
    parser.add_argument("--compression", default="none", help="commits and replies in these codes (int8)")
    parser.add_argument("--local-optimizer", default="sgd", choices=tuple(LOCAL_OPTIMIZERS), help="of the local steps")
    parser.add_argument(
        "--local-learning-rate", type=float, default=0.0, help="of the local steps (0: sgd the server's eta)"
    )
    parser.add_argument("--beta1", type=float, help="local-steps with --optimizer adamw: AdamW's β1 (nanoGPT's 0.9)")
    parser.add_argument("--supervise", action="store_true", help="a worker under a supervisor that restarts it warm")
    args = parse_worker_args(parser)
    extra, _ = parser.parse_known_args()
    if extra.beta1 is not None and (extra.mode != LOCAL_STEPS or args.optimizer != "adamw" or not 0 <= extra.beta1 < 1):
        parser.error(f"--beta1 {extra.beta1:g}: AdamW's β1 in [0, 1), for --mode local-steps --optimizer adamw")
    torch.set_num_threads(1)
    if args.role == "coordinator":
        observe(args)
        return
    steps, rate = extra.local_steps, extra.local_learning_rate
    if steps is None:  # each mode's own default: LocalSteps' a step a commit, the reference modes' 4
        steps = 1 if extra.mode == LOCAL_STEPS else 4
    local = LocalTraining(dynsgd_steps=steps, dylu_steps=steps, outer_learning_rate=extra.outer_learning_rate,
                          optimizer=extra.local_optimizer, learning_rate=rate)  # fmt: skip

    def life() -> int:
        if extra.mode == LOCAL_STEPS:
            train_local_steps(args, extra.compression, steps, extra.beta1)
        else:
            train(args, extra.mode, local, extra.compression)
        return 0

    if not extra.supervise:
        life()
        return
    configure_logging()  # the supervisor's lines: each restart, and why
    workload(args.workload).data()  # loaded (and cached) once, before the forks
    sys.exit(supervise(life))


if __name__ == "__main__":
    main()
