"""Where the suite's CPU goes, test by test: a pytest plugin, loaded on demand.

    .venv/bin/python -m pytest -p tests.cpu_log --cpu-log /tmp/cpu.jsonl -n 2 --dist loadgroup ...
    .venv/bin/python -m tests.cpu_log /tmp/cpu.jsonl      # the modules that cost most, summed

Each test appends a line: its id, wall seconds, and the CPU seconds of the runner process and of
the children it reaped meanwhile (the servers, workers and CLIs a test starts and waits for). A
module-scoped fixture's processes are reaped at the module's last test, so read the sums per module.
Not counted: what no runner reaps (podman's containers, processes of other runners).
"""

from __future__ import annotations

import json
import resource
import sys
import time
from collections import defaultdict
from collections.abc import Generator
from pathlib import Path

import pytest


def _cpu_seconds() -> tuple[float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-log", required=True, help="append each test's CPU and wall seconds to this file")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    path = item.config.getoption("--cpu-log")
    (own_before, children_before), started = _cpu_seconds(), time.monotonic()
    yield
    (own_after, children_after), wall = _cpu_seconds(), time.monotonic() - started
    line = {
        "test": item.nodeid,
        "wall": wall,
        "own": own_after - own_before,
        "children": children_after - children_before,
    }
    with open(path, "a") as log:  # one short write a test: lines of the runners do not interleave
        log.write(json.dumps(line) + "\n")


def module_sums(lines: list[dict[str, float | str]]) -> list[tuple[str, float, float, int]]:
    """(module, CPU seconds, wall seconds, tests) per module, the costliest first."""
    cpu: dict[str, float] = defaultdict(float)
    wall: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for line in lines:
        module = str(line["test"]).split("::", 1)[0]
        cpu[module] += float(line["own"]) + float(line["children"])
        wall[module] += float(line["wall"])
        count[module] += 1
    return sorted(((m, cpu[m], wall[m], count[m]) for m in cpu), key=lambda row: -row[1])


if __name__ == "__main__":
    lines = [json.loads(text) for text in Path(sys.argv[1]).read_text().splitlines() if text.strip()]
    rows = module_sums(lines)
    total = sum(row[1] for row in rows)
    print(f"{len(lines)} tests, {total:.0f} CPU seconds counted")
    for module, cpu, wall, count in rows[: int(sys.argv[2]) if len(sys.argv) > 2 else 40]:
        print(f"{cpu:8.1f} s CPU {wall:8.1f} s wall {count:5d} tests  {module}")
