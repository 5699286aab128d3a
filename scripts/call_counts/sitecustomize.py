"""Counts the calls the data plane's thread makes, for `scripts/profile_server.py --count-calls`.

Python imports this at start-up when its folder is on PYTHONPATH (`sitecustomize`). It acts only
in a process started with GEMPS_COUNT_CALLS set. It does nothing until a thread named
gemps-data-plane starts. That thread gets a profile hook that counts each Python function called
(and each object made by a dataclass's `__init__`, by its class) and each C function. At exit the
counts go to `$GEMPS_COUNT_CALLS.<pid>`, one `count<TAB>file<TAB>name` line each, most first."""

from __future__ import annotations

import atexit
import collections
import os
import sys
import threading
from types import FrameType
from typing import Any

THREAD = "gemps-data-plane"


def _install(path: str) -> None:
    counts: collections.Counter[tuple[str, str]] = collections.Counter()

    def count(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            code, name = frame.f_code, frame.f_code.co_name
            if code.co_filename == "<string>" and "self" in frame.f_locals:  # a dataclass's __init__
                name += ":" + type(frame.f_locals["self"]).__name__
            counts[code.co_filename.rpartition("site-packages/")[2], name] += 1
        elif event == "c_call":
            counts["C", getattr(arg, "__qualname__", repr(arg))] += 1

    run = threading.Thread.run

    def counted_run(self: threading.Thread) -> None:
        if self.name == THREAD:
            sys.setprofile(count)
        run(self)

    threading.Thread.run = counted_run  # type: ignore[method-assign]

    def write() -> None:
        if counts:
            with open(f"{path}.{os.getpid()}", "w") as out:
                out.writelines(f"{n}\t{where}\t{name}\n" for (where, name), n in counts.most_common())

    atexit.register(write)


if os.environ.get("GEMPS_COUNT_CALLS"):
    _install(os.environ["GEMPS_COUNT_CALLS"])
