"""Held-out accuracy of a server's central variable, printed as one JSON line, for tests that run
reference workers on simulated hosts (and so must measure from inside a host's network).

    python -m tests.held_out_accuracy --target 10.231.0.1:50051 [--model digits-cnn] [--dataset digits]
"""

from __future__ import annotations

import argparse
import json

import gemps
from gemps_worker.datasets import load_dataset
from gemps_worker.held_out import evaluate_central
from gemps_worker.models import build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--model", default="digits-cnn")
    parser.add_argument("--dataset", default="digits")
    args = parser.parse_args()
    data = load_dataset(args.dataset)
    model = build_model(args.model, data.input_shape, data.num_classes)
    with gemps.Client(args.target, timeout=30) as observer:
        measured = evaluate_central(observer, model, data)
    assert measured is not None, f"{args.target} holds no central variable"
    version, loss, accuracy = measured
    print(json.dumps({"version": version, "loss": loss, "accuracy": accuracy}))


if __name__ == "__main__":
    main()
