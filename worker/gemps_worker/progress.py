"""Progress as people see it: the demo's one-line bar on a terminal (a plain line per tenth of the
run when output is not a terminal), and the reference worker's periodic log line."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import TextIO

BAR_WIDTH = 24
# When not on a terminal (CI logs, pipes), a line at the first update and at each that reaches
# another tenth of the total: as many lines on a slow host as on a fast one (a line per 5 s of wall
# time showed a fast host's whole demo as its first and last lines).
PLAIN_STEPS = 10


class ProgressLine:
    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self.total = max(total, 1)
        self.stream = stream or sys.stdout
        self.interactive = self.stream.isatty()
        self._plain_step = -1  # the tenth of the total the last plain line was in (-1: none yet)
        self._width = 0

    def update(self, done: int, fields: str) -> None:
        fraction = min(done / self.total, 1.0)
        filled = int(fraction * BAR_WIDTH)
        line = f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {fraction:4.0%} v{done:<6d} {fields}"
        if self.interactive:
            self.stream.write("\r" + line.ljust(self._width))
            self._width = len(line)
            self.stream.flush()
        elif (step := int(fraction * PLAIN_STEPS)) > self._plain_step:
            self._plain_step = step
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self.interactive:
            self.stream.write("\n")
            self.stream.flush()


class WorkerProgress:
    """The reference worker's line every `every` seconds (0: none) while it trains: its commits,
    θ's version, the mean loss, samples per second and the staleness of its commits since the
    last line, so a long run says how it goes between `registered` and `done`."""

    def __init__(self, every: float, log: logging.Logger, clock: Callable[[], float] = time.monotonic) -> None:
        self.every = every
        self._log = log
        self._clock = clock
        self._since = clock()
        self._losses: list[float] = []
        self._staleness: list[int] = []
        self._samples = 0

    def trained(self, samples: int) -> None:
        """A mini-batch of `samples` went through the model (committed or not: local steps count)."""
        self._samples += samples

    def committed(self, steps: int, version: int, loss: float, staleness: int) -> None:
        """Commit number `steps` was acknowledged at `version`; a line when one is due."""
        self._losses.append(loss)
        self._staleness.append(staleness)
        now = self._clock()
        elapsed = now - self._since
        if self.every <= 0 or elapsed < self.every:
            return
        self._log.info(
            "progress: %d commits (%d in %.0f s), version %d, loss %.4f, %.1f samples/s, staleness mean %.1f max %d",
            steps,
            len(self._losses),
            elapsed,
            version,
            sum(self._losses) / len(self._losses),
            self._samples / elapsed if elapsed > 0 else 0.0,
            sum(self._staleness) / len(self._staleness),
            max(self._staleness),
        )
        self._since, self._losses, self._staleness, self._samples = now, [], [], 0
