"""`gemps evaluate`: measure the central variable on held-out data, periodically, and report it.

Pulls theta (read-only: holds no lease), evaluates held-out loss and accuracy whenever the
version moved, and reports the figures to the server (ReportEvaluation), which exposes them in
its metrics, logs and Status.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from gemps.client import Client
from gemps.errors import FailedPreconditionError, InvalidArgumentError, version_ahead
from gemps.pytorch import load_central, trained_parameters
from gemps.records import ParameterSpec
from gemps.resolver import Target
from gemps.retry import RetryPolicy
from gemps_worker.datasets import DATASETS, load_dataset
from gemps_worker.held_out import evaluate
from gemps_worker.metrics import EvaluatorMetrics
from gemps_worker.models import MODELS, build_model

log = logging.getLogger("gemps.evaluator")


@dataclass(frozen=True)
class EvaluatorOptions:
    server: str = field(default="127.0.0.1:50051", metadata={"help": "parameter server HOST:PORT"})
    dataset: str = field(default="digits", metadata={"help": "held-out data", "choices": DATASETS})
    data_dir: str = field(default="data", metadata={"help": "folder of IDX files for mnist / fashion-mnist"})
    download: bool = field(default=True, metadata={"help": "download missing IDX files (checksums verified)"})
    model: str = field(default="digits-cnn", metadata={"help": "the workers' model", "choices": tuple(MODELS)})
    interval: float = field(default=5.0, metadata={"help": "seconds between evaluations"})
    max_evaluations: int = field(default=0, metadata={"help": "stop after this many (0: until stopped)"})
    metrics_port: int = field(default=-1, metadata={"help": "serve the evaluator's /metrics here (-1: off)"})


@dataclass(frozen=True)
class EvaluationResult:
    version: int
    loss: float
    accuracy: float


def run_evaluator(
    options: EvaluatorOptions,
    stop: threading.Event | None = None,
    on_result: Callable[[EvaluationResult], None] | None = None,
    metrics: EvaluatorMetrics | None = None,
    *,
    target: Target | None = None,
    retry: RetryPolicy | None = None,
) -> list[EvaluationResult]:
    """Evaluate until `stop` is set (or `max_evaluations`); `metrics`: served by the caller
    (default: a new one, served on `options.metrics_port` unless -1). `target` and `retry` as
    run_worker's (gemps_worker.training)."""
    stop = stop or threading.Event()
    data = load_dataset(options.dataset, options.data_dir, options.download)
    model = build_model(options.model, data.input_shape, data.num_classes)
    expected = tuple(ParameterSpec(n, tuple(p.shape)) for n, p in trained_parameters(model))
    if metrics is None:
        metrics = EvaluatorMetrics()
        if options.metrics_port >= 0:
            log.info("evaluator metrics on port %d", metrics.serve(options.metrics_port))
    results: list[EvaluationResult] = []
    last_version = -1
    with Client(target or options.server, name="evaluator", stop=stop, retry=retry) as client:
        while not stop.is_set():
            try:
                central = client.pull()
            except FailedPreconditionError:  # no worker has registered yet
                stop.wait(options.interval)
                continue
            if central.spec != expected:
                raise ValueError(
                    f"the server's parameters do not fit model {options.model!r}: start the evaluator "
                    "with the workers' --model"
                )
            if central.version != last_version:
                load_central(model, central)
                loss, accuracy = evaluate(model, data.test_x, data.test_y)
                try:
                    client.report_evaluation(central.version, loss, accuracy, len(data.test_x), data.name)
                except InvalidArgumentError as error:
                    if not version_ahead(error):
                        raise
                    # The server went back while this θ was evaluated (a restart from an older
                    # checkpoint): its figures describe a θ no longer there. Evaluate θ as it is now.
                    log.warning("version %d is gone from the server (%s): evaluating θ again", central.version, error)
                    last_version = -1
                    continue
                result = EvaluationResult(central.version, loss, accuracy)
                results.append(result)
                last_version = central.version
                metrics.observe(result.version, result.loss, result.accuracy)
                log.info("version %d: held-out loss %.4f accuracy %.2f%%", central.version, loss, 100 * accuracy)
                if on_result is not None:
                    on_result(result)
                if options.max_evaluations and len(results) >= options.max_evaluations:
                    break
            stop.wait(options.interval)
    return results
