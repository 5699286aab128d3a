"""The demo's progress bar where output is not a terminal (CI logs, pipes): its lines follow the
run's progress, not the wall clock, so a host of any speed shows the same ones."""

from __future__ import annotations

import io
from collections.abc import Iterable

from gemps_worker.progress import ProgressLine


def printed_versions(total: int, looks: Iterable[int]) -> list[int]:
    stream = io.StringIO()  # not a terminal: plain lines
    progress = ProgressLine(total=total, stream=stream)
    for done in looks:  # one look after another, in no time at all: a host at any speed
        progress.update(done, "fields")
    progress.close()
    return [int(line.split(" v")[1].split()[0]) for line in stream.getvalue().splitlines()]


def test_a_plain_bar_prints_its_first_look_and_one_per_tenth_of_the_run_reached() -> None:
    # A line per 5 s showed a fast host's whole demo as its first and last lines (0 and 352 here),
    # so what the run's middle looked like depended on how fast the host was.
    assert printed_versions(352, range(0, 353, 8)) == [0, 40, 72, 112, 144, 176, 216, 248, 288, 320, 352]


def test_looks_that_skip_tenths_print_once_each_and_the_end_once() -> None:
    # The demo looks again at the end while its workers exit: the last version, a line once.
    assert printed_versions(352, [0, 100, 200, 300, 352, 352, 352]) == [0, 100, 200, 300, 352]
    assert printed_versions(352, range(5, 30, 5)) == [5]  # every look in the first tenth: its first only
