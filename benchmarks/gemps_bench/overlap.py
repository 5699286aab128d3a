"""Workers that do not wait on the wire (issue 59, item 3): `gemps worker --overlap on` against the
waiting worker, across simulated 100 Mbit/s links, at an equal number of commits.

    python -m gemps_bench.overlap --rounds 3 --out docs/results/overlap.json   (as root)

A host "ps" holds `gemps server` (GEM), on a link of `--workers` x the workers' rate (it stands
for a server with the aggregate bandwidth: the workers' own links are what is measured); one host
per worker holds `gemps worker --model widest-mlp` (1,050,010 parameters on digits: 4.2 MB a
float32 commit and as much back, about 0.35 s each way at 100 Mbit/s) with `--max-steps` commits.
Each worker runs in a CPU quota of its own (`--worker-cpu` of a core, cgroup v1, as the
comparison's rig: gemps_bench.alternatives.cgroups), as a worker on a machine of its own would: on
this machine's shared cores a waiting worker's idle core is taken by the others, which hides the
round trip without any overlap. The batch sets a step's compute (timed alone in a worker's quota,
`compute_s`) against the round trip: at best a step costs max(compute, round trip) instead of
their sum. The quotas' period is 10 ms (`--cpu-period-ms`): with the kernel's 100 ms a worker back
from the wire runs its first 20 ms of reply handling at a whole core's speed, which a core a fifth
as fast would not. The two settings alternate, round after round, each on a fresh server; within
a round both have the same θ0 and data order, each round its own (worker seeds). Figures, each
from the run's own files: commits/s (each worker's commits over its span from its first commit's
reply to its last, summed), the held-out accuracy and loss of the final θ (pulled by an observer
on the server's host), and the staleness the server reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gemps_bench.alternatives.cgroups import CpuGroup, Groups
from gemps_bench.alternatives.cgroups import unavailable_reason as quotas_unavailable
from gemps_worker.cluster import ServerProcess
from gemps_worker.processes import GEMPS_COMMAND
from gemps_worker.simulated_hosts import SimulatedNetwork, rate_bits_per_second, unavailable_reason

PORT, DATA_PORT = 50051, 51051
MODEL = "widest-mlp"
SETTINGS = ("wait", "overlap")


def run_setting(
    network: SimulatedNetwork,
    quotas: list[CpuGroup],
    overlap: bool,
    round_number: int,
    args: argparse.Namespace,
    folder: Path,
) -> dict[str, Any]:
    """One run: a fresh server, the workers to --steps commits each (round r's data order: worker
    i's seed r x workers + i); its figures."""
    ps, workers = network.hosts[0], network.hosts[1:]
    options = {
        "host": ps.address, "port": PORT, "data_port": DATA_PORT, "rule": "gem", "metrics_port": -1,
        "learning_rate": args.learning_rate, "batch_size": args.batch, "log_level": "warning",
    }  # fmt: skip
    setting = "overlap" if overlap else "wait"
    with ServerProcess(log_path=folder / f"{setting}-server.log", command=ps.command(GEMPS_COMMAND), **options):
        processes = []
        for rank, host in enumerate(workers):
            report = folder / f"{setting}-worker-{rank}.jsonl"
            report.unlink(missing_ok=True)
            argv = [
                sys.executable, "-m", "gemps_cli", "worker", "--server", f"{ps.address}:{PORT}", "--model", MODEL,
                "--max-steps", str(args.steps), "--epochs", "1000", "--seed", str(round_number * len(workers) + rank),
                "--threads", "1",
                "--report-file", str(report), "--name", f"w{rank}", "--overlap", "on" if overlap else "off",
            ]  # fmt: skip
            processes.append(_start(quotas, rank, host.command(argv), folder / f"{setting}-worker-{rank}.log"))
        for process in processes:
            if process.wait(timeout=args.timeout) != 0:
                raise RuntimeError(f"a {setting} worker failed: see {folder}")
        held_out = _held_out(ps.command([sys.executable, "-m", "gemps_bench.overlap", "--evaluate"]), ps.address)
    records = [
        [json.loads(line) for line in (folder / f"{setting}-worker-{rank}.jsonl").read_text().splitlines()]
        for rank in range(len(workers))
    ]
    rates = [(len(r) - 1) / (r[-1]["time"] - r[0]["time"]) for r in records if len(r) > 1]
    return {
        "setting": setting,
        "commits": sum(len(r) for r in records),
        "commits_per_second": sum(rates),
        "held_out_accuracy": held_out["accuracy"],
        "held_out_loss": held_out["loss"],
        "staleness_mean": statistics.fmean(step["staleness"] for r in records for step in r),
    }


def _start(quotas: list[CpuGroup], rank: int, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    """`argv` in worker `rank`'s CPU quota when there are quotas (the group first: `ip netns exec`
    mounts a sysfs of the namespace's, without the cgroups)."""
    prefix = quotas[rank].enter_argv() if quotas else []
    with open(log, "ab") as output:
        return subprocess.Popen([*prefix, *argv], stdout=output, stderr=subprocess.STDOUT)


def _compute_seconds(quotas: list[CpuGroup], args: argparse.Namespace, folder: Path) -> float:
    """A step's forward and backward alone, in worker 0's quota (`time_compute`)."""
    command = [sys.executable, "-m", "gemps_bench.overlap", "--time-compute", "--batch", str(args.batch)]
    log = folder / "compute.log"
    log.unlink(missing_ok=True)
    if _start(quotas, 0, command, log).wait(timeout=args.timeout) != 0:
        raise RuntimeError(f"timing the compute failed: see {log}")
    return float(json.loads(log.read_text().splitlines()[-1])["compute_s"])


def time_compute(batch: int, repeats: int = 12) -> None:
    """Inside a worker's quota: the median seconds of one forward and backward, of `repeats` after
    two warm-ups (JSON)."""
    import torch
    import torch.nn.functional as F

    from gemps_worker.datasets import load_digits
    from gemps_worker.models import build_model

    torch.set_num_threads(1)
    data = load_digits()
    model = build_model(MODEL, data.input_shape, data.num_classes)
    x, y = torch.from_numpy(data.train_x[:batch]), torch.from_numpy(data.train_y[:batch])
    seconds = []
    for _ in range(repeats + 2):
        started = time.perf_counter()
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
        seconds.append(time.perf_counter() - started)
    print(json.dumps({"compute_s": statistics.median(seconds[2:])}))


def _held_out(command: list[str], address: str) -> dict[str, float]:
    done = subprocess.run([*command, f"{address}:{PORT}"], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"the observer failed: {done.stderr[-2000:]}")
    found: dict[str, float] = json.loads(done.stdout)
    return found


def evaluate(target: str) -> None:
    """Inside the server's host: pull θ and print its held-out accuracy on digits (JSON)."""
    from gemps.client import Client
    from gemps_worker.datasets import load_digits
    from gemps_worker.held_out import evaluate_central
    from gemps_worker.models import build_model

    data = load_digits()
    model = build_model(MODEL, data.input_shape, data.num_classes)
    with Client(target, name="observer") as observer:
        found = evaluate_central(observer, model, data)
    if found is None:
        raise SystemExit("no central variable to evaluate")
    version, loss, accuracy = found
    print(json.dumps({"version": version, "loss": loss, "accuracy": accuracy}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gemps_bench.overlap", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--evaluate", metavar="TARGET", help=argparse.SUPPRESS)
    parser.add_argument("--time-compute", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rate", default="100mbit", help="each worker's link (tc tbf)")
    parser.add_argument("--steps", type=int, default=100, help="commits per worker per run")
    parser.add_argument(
        "--batch", type=int, default=640, help="samples per step (640: 0.5 s of compute at a fifth of a core)"
    )
    parser.add_argument("--worker-cpu", type=float, default=0.2,
                        help="each worker's CPU quota, in cores (0: none, the machine's cores shared)")  # fmt: skip
    parser.add_argument(
        "--cpu-period-ms",
        type=float,
        default=10.0,
        help="the quotas' period (cgroup v1 cpu.cfs_period_us; 10: a fifth of every 10 ms, near a slower core)",
    )
    parser.add_argument("--learning-rate", type=float, default=0.05)
    parser.add_argument(
        "--rounds", type=int, default=3, help="runs of each setting, alternated (each round its own data order)"
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a run may take")
    parser.add_argument("--out", type=Path, default=Path("docs/results/overlap.json"))
    parser.add_argument("--logs", type=Path, default=Path("runs/overlap"), help="the runs' logs and reports")
    args = parser.parse_args(argv)
    if args.evaluate:
        evaluate(args.evaluate)
        return 0
    if args.time_compute:
        time_compute(args.batch)
        return 0
    reason = unavailable_reason() or (quotas_unavailable() if args.worker_cpu else None)
    if reason is not None:
        print(f"overlap: {reason}", file=sys.stderr)
        return 2
    server_rate = f"{int(args.workers * rate_bits_per_second(args.rate))}bit"
    runs: list[dict[str, Any]] = []
    args.logs.mkdir(parents=True, exist_ok=True)
    groups = Groups("overlap") if args.worker_cpu else None
    try:
        period_us = round(args.cpu_period_ms * 1000)
        quotas = [groups.add(f"w{rank}", args.worker_cpu, period_us) for rank in range(args.workers)] if groups else []
        compute_s = _compute_seconds(quotas, args, args.logs)
        print(json.dumps({"compute_s": compute_s}), flush=True)
        with SimulatedNetwork(args.rate) as network:
            network.add_host("ps", rate=server_rate)
            for rank in range(args.workers):
                network.add_host(f"w{rank}")
            for round_number in range(args.rounds):
                for overlap in (False, True):
                    started = time.monotonic()
                    run = run_setting(network, quotas, overlap, round_number, args, args.logs)
                    run |= {"round": round_number, "wall_s": time.monotonic() - started}
                    print(json.dumps(run), flush=True)
                    runs.append(run)
    finally:
        if groups is not None:
            groups.close()
    summary = {
        setting: {
            "commits_per_second": statistics.median(r["commits_per_second"] for r in runs if r["setting"] == setting),
            "held_out_accuracy": statistics.fmean(r["held_out_accuracy"] for r in runs if r["setting"] == setting),
            "held_out_loss": statistics.fmean(r["held_out_loss"] for r in runs if r["setting"] == setting),
        }
        for setting in SETTINGS
    }
    ratio = summary["overlap"]["commits_per_second"] / summary["wait"]["commits_per_second"]
    # a waiting worker's step is compute + the rest (the round trip, encoding, the server's turn);
    # hiding one behind the other gives at best their sum over the larger
    step_s = args.workers / summary["wait"]["commits_per_second"]
    rest_s = max(step_s - compute_s, 0.0)
    result = {
        "workers": args.workers, "rate": args.rate, "server_rate": server_rate, "model": MODEL,
        "steps": args.steps, "batch": args.batch, "worker_cpu": args.worker_cpu,
        "cpu_period_ms": args.cpu_period_ms, "compute_s": compute_s,
        "waiting_step_s": step_s, "at_best": step_s / max(compute_s, rest_s), "runs": runs, "summary": summary,
        "speedup": ratio,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"overlap: {ratio:.2f}x the waiting worker's commits/s (at best {result['at_best']:.2f}x: compute "
          f"{compute_s:.3f} s, the waiting step {step_s:.3f} s); results: {args.out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
