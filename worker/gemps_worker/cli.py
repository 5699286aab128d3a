"""`gemps worker`: one reference worker process, configured by flags or GEMPS_* variables."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from types import FrameType

from gemps.errors import GempsError
from gemps_proto import options
from gemps_worker.training import WorkerOptions, mean, run_worker

log = logging.getLogger("gemps.worker")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_arguments(parser, WorkerOptions)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        worker_options = options.from_sources(WorkerOptions, args)
    except ValueError as error:
        print(f"gemps worker: {error}")
        return 2
    stop = threading.Event()

    def request_stop(signum: int, frame: FrameType | None) -> None:
        log.info("signal %d: finishing the current step, then leaving", signum)
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    try:
        summary = run_worker(worker_options, stop)
    except GempsError as error:
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
