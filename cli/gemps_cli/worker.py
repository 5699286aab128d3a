"""`gemps worker`: one reference worker, configured by flags or GEMPS_* variables."""

from __future__ import annotations

import argparse
import logging

import torch

from gemps import options
from gemps.errors import GempsError
from gemps_cli import environment
from gemps_worker.idx import DatasetError
from gemps_worker.signals import configure_logging, stop_on_signals
from gemps_worker.training import WorkerOptions, mean, run_worker

log = logging.getLogger("gemps.worker")

EXIT_DIVERGED = 3  # the training loss became NaN/Inf


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "Train on the shard the server assigns, commit every step, leave on SIGTERM."
    options.add_arguments(parser, WorkerOptions)
    environment.add_strict_flag(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    configure_logging()
    if not environment.screen("worker", args):
        return 2
    try:
        worker_options = options.from_sources(WorkerOptions, args)
        problems = worker_options.problems()
        if problems:  # refused before anything is loaded or registered
            raise ValueError("; ".join(problems))
    except ValueError as error:
        log.error("%s", error)
        return 2
    torch.set_num_threads(worker_options.threads)
    try:
        summary = run_worker(worker_options, stop_on_signals())
    except (ValueError, DatasetError, GempsError) as error:
        log.error("worker failed: %s", error)
        return 1
    ending = " (stopped by signal)" if summary.stopped_early else " (diverged)" if summary.diverged else ""
    log.info(
        "done: %d commits, version %d, loss %.4f -> %.4f%s",
        summary.steps,
        summary.final_version,
        mean(summary.first_losses),
        mean(summary.last_losses),
        ending,
    )
    return EXIT_DIVERGED if summary.diverged else 0
