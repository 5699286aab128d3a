"""`gemps worker` and `gemps evaluate`: configured by flags or GEMPS_* variables."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from types import FrameType

import torch

from gemps.errors import GempsError
from gemps_proto import options
from gemps_worker.evaluator import EvaluatorOptions, run_evaluator
from gemps_worker.idx import DatasetError
from gemps_worker.training import WorkerOptions, mean, run_worker

log = logging.getLogger("gemps.worker")

EXIT_DIVERGED = 3  # the training loss became NaN/Inf


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_arguments(parser, WorkerOptions)
    parser.set_defaults(run=run)


def add_evaluator_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_arguments(parser, EvaluatorOptions)
    parser.set_defaults(run=run_evaluate)


def _stop_on_signals() -> threading.Event:
    """SIGTERM/SIGINT set the returned event: the loop finishes its step, then leaves cleanly."""
    stop = threading.Event()

    def request_stop(signum: int, frame: FrameType | None) -> None:
        log.info("signal %d: finishing the current step, then leaving", signum)
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    return stop


def run_evaluate(args: argparse.Namespace) -> int:
    try:
        evaluator_options = options.from_sources(EvaluatorOptions, args)
        run_evaluator(evaluator_options, _stop_on_signals())
    except (ValueError, DatasetError, GempsError) as error:
        log.error("evaluator failed: %s", error)
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        worker_options = options.from_sources(WorkerOptions, args)
    except ValueError as error:
        log.error("%s", error)
        return 2
    torch.set_num_threads(worker_options.threads)
    try:
        summary = run_worker(worker_options, _stop_on_signals())
    except (ValueError, DatasetError, GempsError) as error:
        log.error("worker failed: %s", error)
        return 1
    log.info(
        "done: %d steps, version %d, loss %.4f -> %.4f%s",
        summary.steps,
        summary.final_version,
        mean(summary.first_losses),
        mean(summary.last_losses),
        " (stopped by signal)" if summary.stopped_early else "",
    )
    return 0
