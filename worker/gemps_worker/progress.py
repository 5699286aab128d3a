"""A one-line progress bar on a terminal; plain periodic lines when output is not a terminal."""

from __future__ import annotations

import sys
import time
from typing import TextIO

BAR_WIDTH = 24
# When not on a terminal (CI logs, pipes), print at most one line per this many seconds.
PLAIN_INTERVAL = 5.0


class ProgressLine:
    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self.total = max(total, 1)
        self.stream = stream or sys.stdout
        self.interactive = self.stream.isatty()
        self._last_plain = 0.0
        self._width = 0
        self._finished = False

    def update(self, done: int, fields: str) -> None:
        fraction = min(done / self.total, 1.0)
        filled = int(fraction * BAR_WIDTH)
        line = f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {fraction:4.0%} v{done:<6d} {fields}"
        if self.interactive:
            self.stream.write("\r" + line.ljust(self._width))
            self._width = len(line)
            self.stream.flush()
        elif time.monotonic() - self._last_plain >= PLAIN_INTERVAL or (done >= self.total and not self._finished):
            self._last_plain = time.monotonic()
            self._finished = done >= self.total
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self.interactive:
            self.stream.write("\n")
            self.stream.flush()
