"""The memory-bandwidth ceiling: what a commit cannot beat even with free networking."""

from __future__ import annotations

import time

import numpy as np

# float32 vectors of P bytes a GEM commit must read or write at least once (each counted once):
# the payload into a buffer (2), GEM reading theta, m_i, s_i, Delta and writing theta, m_i, s_i
# (7), and the reply's copy of theta (2).
GEM_VECTORS_TOUCHED = 11


def memcpy_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Best observed copy bandwidth, bytes moved (read + written) per second."""
    source = np.ones(megabytes << 18, dtype=np.float32)  # MiB * 2**20 / 4 bytes
    target = np.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - started)
    return 2 * source.nbytes / best


def memory_ceiling(num_parameters: int, bandwidth: float) -> float:
    """Commits per second if a commit cost only its memory traffic at `bandwidth`."""
    return bandwidth / (GEM_VECTORS_TOUCHED * 4 * num_parameters)
