"""Workers that do not wait on the wire (issue 59, item 3): `gemps worker --overlap on` against the
waiting worker, across simulated 100 Mbit/s links, at an equal number of commits.

    python -m gemps_bench.overlap --rounds 2 --steps 60 --out docs/results/overlap.json   (as root)

A host "ps" holds `gemps server` (GEM), on a link of `--workers` x the workers' rate (it stands
for a server with the aggregate bandwidth: the workers' own links are what is measured); one host
per worker holds `gemps worker --model widest-mlp` (1,050,010 parameters on digits: 4.2 MB a
float32 commit and as much back, about 0.35 s each way at 100 Mbit/s) with `--max-steps` commits,
the batch chosen so that a step's compute is of the order of the round trip (where overlap can
help most: at best a step costs max(compute, round trip) instead of their sum). The two settings
alternate, round after round, each on a fresh server from the same θ0 and data order. Figures,
each from the run's own files: commits/s (each worker's commits over its span from its first
commit's reply to its last, summed), the held-out accuracy of the final θ (pulled by an observer on
the server's host), and the staleness the server reported.
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

from gemps_worker.cluster import ServerProcess
from gemps_worker.processes import GEMPS_COMMAND
from gemps_worker.simulated_hosts import SimulatedNetwork, rate_bits_per_second, unavailable_reason

PORT, DATA_PORT = 50051, 51051
MODEL = "widest-mlp"
SETTINGS = ("wait", "overlap")


def run_setting(network: SimulatedNetwork, overlap: bool, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """One run: a fresh server, the workers to --steps commits each; its figures."""
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
                "--max-steps", str(args.steps), "--epochs", "1000", "--seed", str(rank), "--threads", "1",
                "--report-file", str(report), "--name", f"w{rank}", "--overlap", "on" if overlap else "off",
            ]  # fmt: skip
            processes.append(host.start(argv, log_path=folder / f"{setting}-worker-{rank}.log"))
        for process in processes:
            if process.wait(timeout=args.timeout) != 0:
                raise RuntimeError(f"a {setting} worker failed: see {folder}")
        accuracy = _held_out(ps.command([sys.executable, "-m", "gemps_bench.overlap", "--evaluate"]), ps.address)
    records = [
        [json.loads(line) for line in (folder / f"{setting}-worker-{rank}.jsonl").read_text().splitlines()]
        for rank in range(len(workers))
    ]
    rates = [(len(r) - 1) / (r[-1]["time"] - r[0]["time"]) for r in records if len(r) > 1]
    return {
        "setting": setting,
        "commits": sum(len(r) for r in records),
        "commits_per_second": sum(rates),
        "held_out_accuracy": accuracy,
        "staleness_mean": statistics.fmean(step["staleness"] for r in records for step in r),
    }


def _held_out(command: list[str], address: str) -> float:
    done = subprocess.run([*command, f"{address}:{PORT}"], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"the observer failed: {done.stderr[-2000:]}")
    return float(json.loads(done.stdout)["accuracy"])


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
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rate", default="100mbit", help="each worker's link (tc tbf)")
    parser.add_argument("--steps", type=int, default=60, help="commits per worker per run")
    parser.add_argument("--batch", type=int, default=512, help="samples per step")
    parser.add_argument("--learning-rate", type=float, default=0.05)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each setting, alternated")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a run may take")
    parser.add_argument("--out", type=Path, default=Path("docs/results/overlap.json"))
    parser.add_argument("--logs", type=Path, default=Path("runs/overlap"), help="the runs' logs and reports")
    args = parser.parse_args(argv)
    if args.evaluate:
        evaluate(args.evaluate)
        return 0
    reason = unavailable_reason()
    if reason is not None:
        print(f"overlap: {reason}", file=sys.stderr)
        return 2
    server_rate = f"{int(args.workers * rate_bits_per_second(args.rate))}bit"
    runs: list[dict[str, Any]] = []
    args.logs.mkdir(parents=True, exist_ok=True)
    with SimulatedNetwork(args.rate) as network:
        network.add_host("ps", rate=server_rate)
        for rank in range(args.workers):
            network.add_host(f"w{rank}")
        for round_number in range(args.rounds):
            for overlap in (False, True):
                started = time.monotonic()
                run = run_setting(network, overlap, args, args.logs)
                run |= {"round": round_number, "wall_s": time.monotonic() - started}
                print(json.dumps(run), flush=True)
                runs.append(run)
    summary = {
        setting: {
            "commits_per_second": statistics.median(r["commits_per_second"] for r in runs if r["setting"] == setting),
            "held_out_accuracy": statistics.fmean(r["held_out_accuracy"] for r in runs if r["setting"] == setting),
        }
        for setting in SETTINGS
    }
    ratio = summary["overlap"]["commits_per_second"] / summary["wait"]["commits_per_second"]
    result = {
        "workers": args.workers, "rate": args.rate, "server_rate": server_rate, "model": MODEL,
        "steps": args.steps, "batch": args.batch, "runs": runs, "summary": summary, "speedup": ratio,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"overlap: {ratio:.2f}x the waiting worker's commits/s; results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
