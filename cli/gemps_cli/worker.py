"""`gemps worker`: one reference worker, configured by flags or GEMPS_* variables; with
`--supervise on`, run under a supervisor that forks a new one at once when it dies
(gemps_worker.supervisor: the imports and the data paid once), every life under one name (the
worker's, else the supervisor's host and pid), so a new life supersedes the dead one's registration."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket

import torch

from gemps import options
from gemps.errors import GempsError
from gemps_cli import environment
from gemps_worker.datasets import Dataset, load_dataset
from gemps_worker.idx import DatasetError
from gemps_worker.signals import configure_logging, stop_on_signals
from gemps_worker.supervisor import RestartPolicy, SupervisorOptions, supervise
from gemps_worker.training import WorkerOptions, mean, run_worker

log = logging.getLogger("gemps.worker")

EXIT_OPTIONS = 2  # an option refused
EXIT_DIVERGED = 3  # the training loss became NaN/Inf
#: a supervised worker that ends with these is not restarted (another life would end the same)
FINAL_CODES = frozenset({EXIT_OPTIONS, EXIT_DIVERGED})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "Train on the shard the server assigns, commit every step, leave on SIGTERM."
    options.add_arguments(parser, WorkerOptions)
    options.add_arguments(parser, SupervisorOptions)
    environment.add_strict_flag(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    configure_logging()
    if not environment.screen("worker", args):
        return EXIT_OPTIONS
    try:
        worker_options = options.from_sources(WorkerOptions, args)
        supervised = options.from_sources(SupervisorOptions, args).supervise
        problems = worker_options.problems()
        if problems:  # refused before anything is loaded or registered
            raise ValueError("; ".join(problems))
    except ValueError as error:
        log.error("%s", error)
        return EXIT_OPTIONS
    if not supervised:
        return train(worker_options)
    if not worker_options.name:  # its lives are one worker: each takes the last one's place (DESIGN §3)
        worker_options = dataclasses.replace(worker_options, name=f"{socket.gethostname()}-{os.getpid()}")
        log.info("supervised worker named %s: a new life takes a dead one's place", worker_options.name)
    try:  # once, in the supervisor: each worker it forks starts with the data in memory
        data = load_dataset(worker_options.dataset, worker_options.data_dir, worker_options.download)
    except (ValueError, DatasetError) as error:
        log.error("worker failed: %s", error)
        return 1
    return supervise(lambda: train(worker_options, data), RestartPolicy(final_codes=FINAL_CODES))


def train(worker_options: WorkerOptions, data: Dataset | None = None) -> int:
    """One worker's life: train until done or stopped; its exit code."""
    torch.set_num_threads(worker_options.threads)
    try:
        summary = run_worker(worker_options, stop_on_signals(), data=data)
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
