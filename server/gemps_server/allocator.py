"""glibc's allocator, set for a process that moves θ-sized buffers every commit.

Each commit allocates a few buffers of one float32 vector each (4P bytes: the request gRPC hands
over, the reply, gRPC's own copies) and frees them moments later. With glibc's defaults a
buffer of that size is either mmap()ed afresh every time (past its mmap threshold, which it
raises by itself only up to 32 MiB) or taken from the top of the heap, which is trimmed back as
soon as the commit frees it. Either way every commit maps fresh pages, and the kernel faults
and zeroes each one on first touch: copying 40 MB into new bytes took 34 ms here instead of 8.

`tune_for(4P)`, called once θ's size is known, keeps those buffers in the heap (mmap threshold
four vectors) and the memory they free mapped for the next commit (trim threshold four vectors
more), so the same pages serve commit after commit: no fault, no zeroing, no brk per commit.
That holds while four vectors fit in HEAP_BUFFERS_MAX (32 MiB: up to 2M parameters). Past it θ
travels by CommitStream, whose buffers are pooled and reused (buffers.py), and the θ-sized
arrays left are long-lived (θ, each worker's rule state): those are mmapped, so a worker that
leaves gives its memory back, and no freed buffer is stranded in the middle of the heap
(at 10M parameters with 8 clients that was 170 MB of resident free heap). A no-op where glibc
is not the C library.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from collections.abc import Callable

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_GLIBC_DEFAULT_MMAP_THRESHOLD = 128 << 10
_MIN_TRIM_THRESHOLD = 2 << 20
_ONE_GIB = 1 << 30
#: buffers per commit kept in the heap and kept mapped once freed
BUFFERS_KEPT = 4
#: the most those buffers may take together; past it θ-sized allocations are mmapped instead
HEAP_BUFFERS_MAX = 32 << 20
#: how often a server hands the heap's free pages back to the OS (trim())
TRIM_INTERVAL_SECONDS = 5.0
#: large models: every allocation from this size up is mmapped (θ-sized ones included)
_LARGE_MODEL_MMAP_THRESHOLD = 8 << 20


@functools.cache  # find_library runs ldconfig: once per process
def _glibc(function: str) -> Callable[[int], int] | Callable[[int, int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        found: Callable[..., int] = getattr(ctypes.CDLL(name), function)
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return None
    return found


def _mallopt() -> Callable[[int, int], int] | None:
    return _glibc("mallopt")  # type: ignore[return-value]


def thresholds_for(buffer_bytes: int) -> tuple[int, int]:
    """(mmap threshold, trim threshold) for recurring buffers of `buffer_bytes` each."""
    if BUFFERS_KEPT * buffer_bytes > HEAP_BUFFERS_MAX:
        return _LARGE_MODEL_MMAP_THRESHOLD, 2 * _LARGE_MODEL_MMAP_THRESHOLD
    mmap_threshold = max(BUFFERS_KEPT * buffer_bytes, _GLIBC_DEFAULT_MMAP_THRESHOLD)
    trim_threshold = max(2 * BUFFERS_KEPT * buffer_bytes, _MIN_TRIM_THRESHOLD)
    return mmap_threshold, trim_threshold


def tune_for(buffer_bytes: int) -> bool:
    """Keep recurring buffers of `buffer_bytes` in the heap and mapped; True when glibc took it.

    Also hands back the free memory the heap holds by then (trim()): the first worker's initial
    values, received in many small pieces (50M parameters in one message: 190 MB)."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    mmap_threshold, trim_threshold = thresholds_for(buffer_bytes)
    tuned = bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))
    trim()
    return tuned


def one_arena() -> bool:
    """Serve every thread's allocations from one arena; True when glibc took it. Call it before
    the process starts its threads: a thread that already has an arena keeps it. A
    MALLOC_ARENA_MAX in the environment is the operator's choice and is left as it is.

    glibc gives each new thread an arena of its own (up to 8 per core). gRPC's threads receive
    requests and the applier and the event loop free them, so the memory they leave is spread over
    several arenas, and trim() gets less of it back from a thread's arena than from the main one:
    after 16 refused requests of 40 MiB, 38-82 MiB stayed resident with glibc's arenas, -3 to 8
    MiB with one. It costs no throughput measurable here (8 clients committing 100K to 10M
    parameters, alternated) and lowers peak RSS by 2-13% (scripts/allocator_ab.py, removed;
    at commit 745f064; docs/RELIABILITY.md)."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    mallopt = _mallopt()
    return mallopt is not None and bool(mallopt(_M_ARENA_MAX, 1))


def trim() -> bool:
    """Hand every free page of the heap back to the OS; True when glibc did it.

    glibc's free() gives memory back only from the top of the heap. gRPC receives a large request
    in many small pieces spread through the heap, so once such requests are freed their pages
    stay resident, free but stranded between live allocations: 8 refused requests of 40 MiB left
    190 MiB so. A server calls this every TRIM_INTERVAL_SECONDS; the cost is a walk of the heap,
    and at most one commit per interval finds the pages of its buffers to map again."""
    malloc_trim = _glibc("malloc_trim")
    if malloc_trim is None:
        return False
    malloc_trim(0)  # type: ignore[call-arg]
    return True


def keep_large_allocations() -> bool:
    """The most a process can keep: every allocation up to 1 GiB in the heap, nothing trimmed
    (the benchmark's echo server and load generator, whose best case is the ceiling)."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _ONE_GIB)) and bool(mallopt(_M_TRIM_THRESHOLD, 2 * _ONE_GIB - 1))
