"""A ResNet with batch norm trained by several workers, exported, and reloaded strictly.

    .venv/bin/python scripts/resnet_batchnorm.py --workers 4 --epochs 8 --out runs/resnet-bn

Starts a `gemps server` with checkpoints, N `gemps worker --model resnet-bn` processes on
digits, and when they are done, the evaluator (`gemps evaluate`'s code) on the central variable.
Then stops the server (its final checkpoint), runs `gemps export` on the checkpoint, loads the
export into a fresh model with `load_state_dict(strict=True)`, and evaluates that. The two
accuracies must be equal: the exported running statistics are the server's, the ones the
evaluator used. For contrast it also evaluates the export's parameters with batch-norm
statistics left at their defaults, which is what exports held before buffers reached the server.
Writes OUT/result.json; exits 1 when the accuracies differ.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from gemps_worker.cluster import LocalCluster
from gemps_worker.datasets import load_dataset
from gemps_worker.evaluation_loop import EvaluatorOptions, run_evaluator
from gemps_worker.held_out import evaluate
from gemps_worker.models import build_model

MODEL = "resnet-bn"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4, help="worker processes")
    parser.add_argument("--epochs", type=int, default=8, help="epochs per worker")
    parser.add_argument("--out", type=Path, default=Path("runs/resnet-bn"), help="output folder")
    args = parser.parse_args()
    data = load_dataset("digits")
    checkpoints = args.out / "checkpoints"
    server_options = {"checkpoint_dir": checkpoints, "checkpoint_interval": 0}
    with LocalCluster(args.out, server=server_options) as cluster:
        for i in range(args.workers):
            cluster.start_worker(f"worker-{i}", dataset="digits", model=MODEL, epochs=args.epochs, seed=i)
        cluster.wait_processes()
        if failed := cluster.failed():
            print(f"{', '.join(failed)} failed; see {args.out}/worker-*.log", file=sys.stderr)
            return 1
        evaluator = EvaluatorOptions(server=cluster.target, model=MODEL, interval=0.1, max_evaluations=1)
        reported = run_evaluator(evaluator)[-1]
        print(f"evaluator: version {reported.version}, held-out accuracy {reported.accuracy:.2%}", flush=True)
        cluster.server.stop()  # SIGTERM: the final checkpoint holds this version
    export = args.out / "model.safetensors"
    subprocess.run([sys.executable, "-m", "gemps_cli", "export", str(checkpoints), "--out", str(export)], check=True)
    state = load_file(str(export))
    fresh = build_model(MODEL, data.input_shape, data.num_classes, seed=12345)  # other weights, default statistics
    fresh.load_state_dict(state, strict=True)
    _, reloaded = evaluate(fresh, data.test_x, data.test_y)
    without = build_model(MODEL, data.input_shape, data.num_classes, seed=12345)
    without.load_state_dict({k: v for k, v in state.items() if not _is_statistic(k)}, strict=False)
    _, default_statistics = evaluate(without, data.test_x, data.test_y)
    result = {
        "workers": args.workers,
        "epochs": args.epochs,
        "version": reported.version,
        "evaluator_accuracy": reported.accuracy,
        "reloaded_strict_accuracy": reloaded,
        "parameters_only_default_statistics_accuracy": default_statistics,
        "equal": reloaded == reported.accuracy,
    }
    (args.out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"reloaded with strict=True: {reloaded:.2%} ({'equal' if result['equal'] else 'DIFFERENT'}); "
        f"parameters only, default batch-norm statistics: {default_statistics:.2%}"
    )
    return 0 if result["equal"] else 1


def _is_statistic(name: str) -> bool:
    return name.endswith(("running_mean", "running_var", "num_batches_tracked"))


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
